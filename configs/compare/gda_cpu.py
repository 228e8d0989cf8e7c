"""Grouped differential attention against DIFF V1, V2 and the Transformer: associative recall on a CPU.

  python -m diffjax.compare --config=configs/compare/gda_cpu.py --workdir=runs/gda

Six arms x 3 seeds, parameter-matched to one Transformer: DIFF V1, V1-style grouped
attention (GDA, Motif-2's form) with 3 and 4 signal heads per noise head, DIFF V2 and
grouped V2 with 4 per noise head. The GDA paper reports that a moderate imbalance (3:1 to
4:1) beats balanced DIFF V1 at the same parameters; this asks the question at CPU scale on
the retrieval task of configs/compare/retrieval_cpu.py (two key-value pairs, 2-letter keys,
1-digit values, one key queried, only the answer scored), scored on a grid of harder
settings the models never trained on (more pairs, near-duplicate distractor keys).

The baseline has 20 query heads of width 8 and 2 kv heads, the smallest head count every
arm can be matched to: V1-style GDA splits the 20 heads 15 : 5 (r = 3) or 16 : 4 (r = 4),
DIFF V1 10 : 10, grouped V2 keeps the 20 as signal heads with 5 noise heads; the SwiGLU
width pays for the differences (python -m diffjax.compare --config=... --dry_run lists each
arm's widths and parameters).

Budget: 18 runs of 800 steps x 32 x 64 tokens, each followed by the evaluation, three at a
time (``workers=3``): 59 minutes on a shared 2-core CPU, where 17 of the 18 runs did not learn
to retrieve (docs/results/compare_gda.md); --config.base.global_batch_size=64 (the retrieval
comparison's) is the next step. With an accelerator, set --config.workers=1.
"""

from diffjax.compare import comparison_config
from diffjax.presets import base_config

_TASK = dict(key_len=2, value_len=1, separator="")
# Pairs x near-duplicate distractors per queried key; (2, 0) is the trained setting. A pair
# is 4 characters, so 8 pairs and the query fit the 64-token window.
_GRID = ((2, 0), (2, 1), (2, 2), (4, 0), (4, 1), (8, 0), (8, 1))
# The signal heads per noise head of each grouped variant.
_VARIANTS = {"gda_v1_r3": ("gda_v1", 3), "gda_v1_r4": ("gda_v1", 4), "gda_v2_r4": ("gda_v2", 4)}


def get_config():
  run = base_config()
  run.model.arm = "transformer"
  run.model.size = "custom"
  run.model.update(
    dict(d_model=64, num_layers=2, num_heads=20, num_kv_heads=2, head_dim=8, mlp_dim=176)
  )
  run.model.v2_match = "params"
  run.seq_len, run.global_batch_size = 64, 32
  run.num_steps = 800
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
  arms = ("transformer", "diff_v1", "gda_v1_r3", "gda_v1_r4", "diff_v2", "gda_v2_r4")
  c = comparison_config(run, seeds=(0, 1, 2), arms=arms)
  for name, (arm, ratio) in _VARIANTS.items():
    c.variants[name] = dict(arm=arm, model=dict(gda_ratio=ratio))
  c.workers = 3
  c.eval.mode = "quick"
  c.eval.overrides.mqar = dict(num_pairs=2, num_queries=1, distractors_per_query=1, **_TASK)
  c.eval.overrides.mqar_grid = tuple(
    dict(num_pairs=p, num_queries=1, distractors_per_query=d) for p, d in _GRID
  )
  c.eval.overrides.mqar_examples = 128
  c.eval.overrides.probe_task = "mqar"
  c.eval.overrides.sections = ("validation", "mqar", "mqar_grid", "text", "probes")
  c.report.title = (
    "Grouped differential attention: associative recall among near-duplicate keys (CPU)"
  )
  c.report.learned_below = 0.35
  return c
