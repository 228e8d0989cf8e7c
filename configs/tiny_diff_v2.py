"""Tiny diff_v2 arm of the matched comparison (CPU, a couple of minutes).

  python train.py --config=configs/tiny_diff_v2.py --workdir=runs/tiny_diff_v2
"""

from diffjax.presets import tiny


def get_config():
  return tiny("diff_v2")
