"""Tiny diff_v1 arm of the matched comparison (CPU, a couple of minutes).

  python train.py --config=configs/tiny_diff_v1.py --workdir=runs/tiny_diff_v1
"""

from diffjax.presets import tiny


def get_config():
  return tiny("diff_v1")
