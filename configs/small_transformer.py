"""Small transformer arm (3.3M parameters with byte tokens; CPU in tens of minutes).

  python train.py --config=configs/small_transformer.py --workdir=runs/small_transformer
"""

from diffjax.presets import small


def get_config():
  return small("transformer")
