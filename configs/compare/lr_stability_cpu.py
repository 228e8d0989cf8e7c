"""Learning-rate stability: the Transformer, DIFF V1, DIFF V2 and two V2 ablations across peak
learning rates, 3 seeds each, on the embedded corpus.

  python -m diffjax.compare --config=configs/compare/lr_stability_cpu.py --workdir=runs/lr_stability

The question the DIFF V2 write-up answers yes to: does V2 train stably at learning rates where
DIFF V1 (whose per-head RMSNorm magnifies small context vectors) and the Transformer do not? And
do its two ablations (query pairs taken across GQA groups; lambda without the sigmoid) lose what
V2 gains? Five arms, parameter-matched (the ablations have exactly V2's parameters), at six peak
learning rates from 3e-3 to 1.0 (the cosine floor stays at 1/10 of the peak), 3 seeds per arm
and rate, every run on the same batches per seed. The range came from single-seed trial runs of
300 steps: at 3e-3 every arm trains; the Transformer and DIFF V1 degrade from 1e-1 on and end
near the unigram baseline at 3e-1; at 1.0 every arm is near or above it. Updates the trainer
finds non-finite are skipped and counted (up to 50 per run, then the run stops and is
recorded as diverged). The evaluation is the validation loss and the mechanism measures
(attention-sink mass, context RMS, DIFF V1's norm magnification of values and gradients).

Model: 64 wide, 2 layers, Transformer of 4 heads of 16 with 2 kv heads (grouped-query, so a
V2 pair can be taken across groups), SwiGLU 176. Budget: 90 runs of 400 steps x 16 x 128 byte
tokens, three at a time (see configs/compare/retrieval_cpu.py for why three), about 16
minutes on 2 cores for training, evaluation and report (docs/results/lr_stability_cpu.md).
With an accelerator, set --config.workers=1.
"""

from diffjax.compare import comparison_config
from diffjax.presets import base_config

LEARNING_RATES = (3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)


def get_config():
  run = base_config()
  run.model.arm = "transformer"
  run.model.size = "custom"
  run.model.update(
    dict(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=176)
  )
  run.model.v2_match = "params"
  run.seq_len, run.global_batch_size = 128, 16
  run.num_steps = 400
  run.optim.update(dict(lr=3e-3, min_lr=3e-4, warmup_steps=40, decay_steps=400))
  run.log_every, run.eval_every = 50, 0
  run.checkpoint.every = run.num_steps
  run.max_skipped_updates = 50
  run.tensorboard = False
  c = comparison_config(
    run,
    seeds=(0, 1, 2),
    arms=("transformer", "diff_v1", "diff_v2", "diff_v2_cross_group", "diff_v2_no_sigmoid"),
  )
  c.variants.diff_v2_cross_group = dict(arm="diff_v2", model=dict(v2_pairing="across_groups"))
  c.variants.diff_v2_no_sigmoid = dict(arm="diff_v2", model=dict(v2_lambda="identity"))
  c.allow_divergence = True
  c.sweep.update(dict(key="optim.lr", values=LEARNING_RATES, scaled=("optim.min_lr",)))
  c.workers = 3
  c.eval.mode = "quick"
  c.eval.overrides.sections = ("validation", "mechanisms")
  c.eval.overrides.val_batches = 4
  c.report.title = "Learning-rate stability (CPU)"
  c.report.also_against = ("diff_v2",)  # the ablations are read against V2 itself
  c.report.spike_factor = 3.0
  c.report.spike_window = 50
  c.report.divergence_window = 20
  return c
