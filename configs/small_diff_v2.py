"""Small diff_v2 arm (3.3M parameters with byte tokens; CPU in tens of minutes).

  python train.py --config=configs/small_diff_v2.py --workdir=runs/small_diff_v2
"""

from diffjax.presets import small


def get_config():
  return small("diff_v2")
