"""Associative recall among near-duplicate keys: 3 arms x 3 seeds that learn to retrieve on a CPU.

  python -m diffjax.compare --config=configs/compare/retrieval_cpu.py --workdir=runs/retrieval

Every arm is trained from scratch on one retrieval setting alone, scored on its answers: two
key-value pairs, 2-letter keys, 1-digit values, no separator ("ab3 cd5 \\nab3"), one key
queried per example. Answering a query then needs the key matched (a value picked without it
is right half the time), and on this setting 134K-parameter models can form the matching
(induction) circuit within a few hundred steps. The evaluation asks what the paper asks of
attention noise on a grid the models never trained on: more pairs (longer contexts, up to 8x
the trained one) and near-duplicate distractor keys that differ from the queried key in one
letter and carry another value. DIFF V2 is matched to the Transformer by parameters.

Budget: 9 runs of 800 steps x 64 x 128 tokens, each followed by the evaluation, three runs at
a time (``workers=3``: a model this small keeps XLA on about one core, so three processes on 2
cores train about 1.3x faster in total than one, and the 9 runs make 3 even rounds): about 40
minutes on 2 cores for training, evaluation and report. With an accelerator, set
--config.workers=1.
"""

from diffjax.compare import comparison_config
from diffjax.presets import base_config

_TASK = dict(key_len=2, value_len=1, separator="")
# Pairs x near-duplicate distractors per queried key; (2, 0) is the trained setting.
_GRID = ((2, 0), (2, 1), (2, 2), (4, 0), (4, 1), (8, 0), (8, 1), (16, 0), (16, 2))


def get_config():
  run = base_config()
  run.model.arm = "transformer"
  run.model.size = "micro"
  run.model.v2_match = "params"
  run.seq_len, run.global_batch_size = 128, 64
  run.num_steps = 800
  # Warm-up, then a learning rate that stays near its peak for the whole run (the cosine
  # reaches min_lr only at step 3,000): the matching circuit forms late in a short run, after
  # a plateau at the guessing loss (ln 2) whose length varies with the seed (450-750 steps
  # for the Transformer in trial runs).
  run.optim.update(dict(lr=2e-3, min_lr=1e-4, warmup_steps=100, decay_steps=3000))
  run.log_every, run.eval_every = 100, run.num_steps
  run.checkpoint.every = run.num_steps
  run.data.val_fraction = 0.05
  run.task_mix.update(
    dict(
      task="associative_recall",
      fraction=1.0,
      num_examples=20_000,
      loss="answers",
      num_pairs=2,
      num_queries=1,
      distractors_per_query=0,
      grid=(),
      **_TASK,
    )
  )
  c = comparison_config(run, seeds=(0, 1, 2))
  c.workers = 3
  c.eval.mode = "quick"
  c.eval.overrides.mqar = dict(num_pairs=2, num_queries=1, distractors_per_query=1, **_TASK)
  c.eval.overrides.mqar_grid = tuple(
    dict(num_pairs=p, num_queries=1, distractors_per_query=d) for p, d in _GRID
  )
  c.eval.overrides.mqar_examples = 128
  c.eval.overrides.probe_task = "mqar"
  # "text" runs on the run's own validation examples: the A1/A2 map-correlation probe, outliers
  # and lambda; "probes" is the clamp probe.
  c.eval.overrides.sections = (
    "validation",
    "mqar",
    "mqar_grid",
    "allocation",
    "text",
    "lowbit",
    "probes",
  )
  c.report.title = "Associative recall among near-duplicate keys (CPU)"
  # Guessing between the two values in context costs ln 2 = 0.69 per answer; runs that match
  # keys end near 0.15. A 25-step mean below 0.35 marks the step a run learned to retrieve.
  c.report.learned_below = 0.35
  return c
