"""The paper's scaling sweep (830M, 1.4B, 2.8B, 6.8B, 13.1B), transformer arm.

  python train.py --config=configs/paper_sweep_transformer.py:1.4b --workdir=gs://BUCKET/1.4b_transformer
"""

from diffjax.presets import paper_sweep


def get_config(size: str = "1.4b"):
  return paper_sweep(size, "transformer")
