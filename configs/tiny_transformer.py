"""Tiny transformer arm of the matched comparison (CPU, a couple of minutes).

  python train.py --config=configs/tiny_transformer.py --workdir=runs/tiny_transformer
"""

from diffjax.presets import tiny


def get_config():
  return tiny("transformer")
