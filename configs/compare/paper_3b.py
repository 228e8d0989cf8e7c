"""The paper's 3B setup (arXiv 2410.05258 section 3) for each arm, as one matched comparison.

Every arm trains configs/paper_3b.py (sequence 4096, 4M-token batches, 240K steps, AdamW
0.9/0.95, lr 3.2e-4 with 1000 warm-up steps and linear decay; DIFF V2 matched by parameters)
from the same seed and data order; one seed by default, as in the paper (a second seed
doubles a budget of thousands of TPU-chip-days per run). Train on a pod with data from
`python -m diffjax.data.prepare` (see tpu_setup/README.md), evaluation off, every host running
the same command:

  python -m diffjax.compare --config=configs/compare/paper_3b.py --workdir=gs://BUCKET/compare_3b \
      --config.base.data.paths="('/mnt/data/prepared',)" \
      --config.base.data.tokenizer=/path/to/tokenizer.json --config.eval.mode=none

then evaluate and write the report from one host: the same command with --config.eval.mode=full
skips the finished runs (their DONE markers) and evaluates each checkpoint. The eval suite's
retrieval tasks are built with byte tokens; with a subword tokenizer read only its validation
loss, or pass a task set in that tokenizer through `diffjax.eval`.
"""

import os

from diffjax.compare import comparison_config
from diffjax.presets import load_config

_CONFIGS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_config():
  base = load_config(os.path.join(_CONFIGS, "paper_3b.py"))
  base.model.v2_match = "params"
  c = comparison_config(base, seeds=(0,))
  c.eval.mode = "full"
  c.report.title = "Paper 3B matched comparison"
  return c
