"""Tiny matched comparison: 3 arms x 2 seeds on the embedded corpus, CPU end to end.

  python -m diffjax.compare --config=configs/compare/tiny.py --workdir=runs/compare_tiny

Every arm trains configs/tiny.py (matched to the Transformer of size "tiny"; DIFF V2 by
parameters) from the same seeds and data order. Budget: 6 runs of 500 steps x 16 x 128 byte
tokens (1M tokens, 0.47M-parameter models), each followed by the quick eval suite; about 25
minutes in total on a busy 2-core CPU. The numbers are a smoke test of the whole pipeline, not
evidence about the arms: models this small do not retrieve needles.
"""

import os

from diffjax.compare import comparison_config
from diffjax.presets import load_config

_CONFIGS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_config():
  base = load_config(os.path.join(_CONFIGS, "tiny.py"))
  base.model.v2_match = "params"
  c = comparison_config(base, seeds=(0, 1))
  c.eval.mode = "quick"
  c.report.title = "Tiny matched comparison (CPU smoke test)"
  return c
