"""Tiny matched arm for a CPU (0.47M parameters with byte tokens; a couple of minutes on 2 cores).

The argument after the colon picks the arm (default diff_v1):

  python train.py --config=configs/tiny.py:transformer --workdir=runs/tiny_transformer
  python train.py --config=configs/tiny.py:diff_v1 --workdir=runs/tiny_diff_v1
  python train.py --config=configs/tiny.py:diff_v2 --workdir=runs/tiny_diff_v2
"""

from diffjax.presets import config_args, tiny


def get_config(arg: str = "diff_v1"):
  arm, _ = config_args(arg, default_arm="diff_v1")
  return tiny(arm)
