"""Tiny CPU run: 0.47M parameters with byte tokens on the embedded corpus; a couple of
minutes on 2 cores.

  python train.py --config=configs/tiny.py --workdir=runs/tiny_diff_v1
  python train.py --config=configs/tiny.py --config.model.arm=transformer --workdir=runs/tiny_transformer

Every arm is matched to the Transformer of size "tiny" (128 wide, 2 layers, 4 heads of 32).
"""

from diffjax.presets import base_config


def get_config():
  c = base_config()
  c.model.arm = "diff_v1"
  c.model.size = "tiny"
  c.model.v2_match = "params"
  c.data.kind = "stdlib"
  c.seq_len = 128
  c.global_batch_size = 16
  c.num_steps = 500
  c.optim.update(dict(lr=3e-3, min_lr=3e-4, warmup_steps=50, schedule="cosine", decay_steps=500))
  c.log_every = 50
  c.eval_every = 100
  c.checkpoint.every = 250
  return c
