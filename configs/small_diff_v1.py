"""Small diff_v1 arm (3.3M parameters with byte tokens; CPU in tens of minutes).

  python train.py --config=configs/small_diff_v1.py --workdir=runs/small_diff_v1
"""

from diffjax.presets import small


def get_config():
  return small("diff_v1")
