"""Default run: a DIFF V1 LM (1.4M parameters) on the embedded corpus, for a laptop CPU.

The corpus is the Python standard library's own source (present wherever Python is,
so nothing is downloaded; real, varied text with long-range structure such as
indentation, names defined far above their use, and docstrings), byte-level tokens.
1000 steps of 16 x 128 tokens take 3-7 minutes on 2 CPU cores (README: Measured results).

  python train.py --config=configs/default.py --workdir=runs/default
"""

from diffjax.presets import arm_model, base_config


def get_config():
  c = base_config()
  c.model.update(arm_model("default", "diff_v1"))
  c.seq_len = 128
  c.global_batch_size = 16
  c.num_steps = 1000
  c.optim.update(dict(lr=3e-3, min_lr=3e-4, warmup_steps=50, decay_steps=1000))
  c.log_every = 50
  c.eval_every = 250
  c.checkpoint.every = 500
  return c
