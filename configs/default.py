"""Default run: a small DIFF V1 LM on the embedded corpus, sized for a laptop CPU.

The corpus is the Python standard library's own source (present wherever Python is,
so nothing is downloaded), byte-level tokens.

  python train.py --config=configs/default.py --workdir=runs/default
"""

from diffjax.presets import base_config


def get_config():
  c = base_config()
  return c
