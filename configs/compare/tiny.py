"""Tiny matched comparison: 3 arms x 2 seeds on the standard-library corpus, CPU end to end.

  python -m diffjax.compare --config=configs/compare/tiny.py --workdir=runs/compare_tiny

Budget: 6 runs of 500 steps x 16 x 128 byte tokens (1M tokens, 0.47M-parameter models), each
followed by the quick eval suite; about 25 minutes in total on a busy 2-core CPU (about 3 minutes
of training and under a minute of evaluation per run). The numbers are a smoke test of the whole
pipeline, not evidence about the arms: models this small do not retrieve needles.
"""

from diffjax.compare import comparison_config
from diffjax.presets import arm_model, base_config


def get_config():
  base = base_config()
  base.model.update(arm_model("tiny", "transformer"))
  base.seq_len = 128
  base.global_batch_size = 16
  base.num_steps = 500
  base.optim.update(dict(warmup_steps=50, decay_steps=500))
  base.log_every = 50
  base.eval_every = 100
  base.checkpoint.every = 250
  c = comparison_config(base, seeds=(0, 1))
  c.eval.mode = "quick"
  c.report.title = "Tiny matched comparison (CPU smoke test)"
  return c
