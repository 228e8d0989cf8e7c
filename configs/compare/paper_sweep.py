"""The paper's scaling sweep (830M, 1.4B, 2.8B, 6.8B, 13.1B) at one size, as one matched
comparison. The argument names the size (default 1.4b).

Every arm trains configs/paper_sweep.py at that size (sequence 2048, 0.25M-token batches, 40K
steps, AdamW 0.9/0.98; DIFF V2 matched by parameters) from the same seed and data order. As for
configs/compare/paper_3b.py: train on a pod with evaluation off, then rerun the same command on
one host to evaluate and report.

  python -m diffjax.compare --config=configs/compare/paper_sweep.py:1.4b \
      --workdir=gs://BUCKET/compare_1.4b \
      --config.base.data.paths="('/mnt/data/prepared',)" \
      --config.base.data.tokenizer=/path/to/tokenizer.json --config.eval.mode=none
"""

import os

from diffjax.compare import comparison_config
from diffjax.presets import load_config

_CONFIGS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_config(size: str = "1.4b"):
  base = load_config(os.path.join(_CONFIGS, "paper_sweep.py"), size)
  base.model.v2_match = "params"
  c = comparison_config(base, seeds=(0,))
  c.eval.mode = "full"
  c.report.title = f"Paper sweep {size} matched comparison"
  return c
