"""Tiny matched comparison: 3 arms x 2 seeds on the standard-library corpus, CPU end to end.

  python -m diffjax.compare --config=configs/compare/tiny.py --workdir=runs/compare_tiny

Budget: 6 runs of 500 steps x 16 x 128 byte tokens (1M tokens, 0.47M-parameter models), each
followed by the quick eval suite; about 25 minutes in total on a busy 2-core CPU (about 3 minutes
of training and under a minute of evaluation per run). The numbers are a smoke test of the whole
pipeline, not evidence about the arms: models this small do not retrieve needles.
"""

from diffjax.compare import comparison_config
from diffjax.presets import tiny


def get_config():
  # The arms are derived from the Transformer spec; every other setting is shared.
  # DIFF V2 keeps the baseline's widths here ("heads"), as when the README's table for this
  # config was measured; new comparisons match it by parameters (the default, "params").
  c = comparison_config(tiny("transformer"), seeds=(0, 1), v2_match="heads")
  c.eval.mode = "quick"
  c.report.title = "Tiny matched comparison (CPU smoke test)"
  return c
