"""Small matched arm for a CPU (3.3M parameters with byte tokens; tens of minutes on 2 cores).

  python train.py --config=configs/small.py:transformer --workdir=runs/small_transformer
  python train.py --config=configs/small.py:diff_v1 --workdir=runs/small_diff_v1
  python train.py --config=configs/small.py:diff_v2 --workdir=runs/small_diff_v2
"""

from diffjax.presets import config_args, small


def get_config(arg: str = "diff_v1"):
  arm, _ = config_args(arg, default_arm="diff_v1")
  return small(arm)
