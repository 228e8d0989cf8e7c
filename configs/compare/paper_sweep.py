"""The paper's scaling sweep (830M, 1.4B, 2.8B, 6.8B, 13.1B) at one size, as one matched comparison.

Every arm trains `diffjax.presets.paper_sweep(size, arm)` (sequence 2048, 0.25M-token batches,
40K steps, AdamW 0.9/0.98) from the same seed and data order. As for configs/compare/paper_3b.py:
train on a pod with evaluation off, then rerun the same command on one host to evaluate and report.

  python -m diffjax.compare --config=configs/compare/paper_sweep.py:1.4b \
      --workdir=gs://BUCKET/compare_1.4b \
      --config.base.data.paths="('gs://BUCKET/data/prepared',)" \
      --config.base.data.tokenizer=/path/to/tokenizer.json --config.eval.mode=none
"""

from diffjax.compare import comparison_config
from diffjax.presets import paper_sweep


def get_config(size: str = "1.4b"):
  base = paper_sweep(size, "transformer")
  c = comparison_config(base, seeds=(0,))
  c.eval.mode = "full"
  c.report.title = f"Paper sweep {size} matched comparison"
  return c
