"""Small CPU run: 3.3M parameters with byte tokens on the embedded corpus; tens of minutes
on 2 cores.

  python train.py --config=configs/small.py --workdir=runs/small_diff_v1
  python train.py --config=configs/small.py --config.model.arm=diff_v2 --workdir=runs/small_diff_v2

Every arm is matched to the Transformer of size "small" (256 wide, 4 layers, 8 heads of 32).
"""

from diffjax.presets import base_config


def get_config():
  c = base_config()
  c.model.arm = "diff_v1"
  c.model.size = "small"
  c.model.v2_match = "params"
  c.data.kind = "stdlib"
  c.seq_len = 256
  c.global_batch_size = 16
  c.num_steps = 2000
  c.optim.update(dict(lr=3e-3, min_lr=3e-4, warmup_steps=50, schedule="cosine", decay_steps=2000))
  return c
