"""The matched comparison: every arm x seed trained, evaluated and reported in one command.

    python -m diffjax.compare --config=configs/compare/tiny.py --workdir=runs/compare_tiny

The config, the workdir's layout and the report: docs/evaluation.md, "Matched comparisons".
"""

from diffjax.compare.command import main
from diffjax.compare.comparison import run_comparison
from diffjax.compare.config import (
  ComparisonConfig,
  arm_names,
  check_comparison_config,
  comparison_config,
  run_config,
  run_name,
)
from diffjax.compare.datacheck import batch_hashes, check_batches
from diffjax.compare.outputs import SCHEMA, write_outputs
from diffjax.compare.runs import ComparisonStopped, done_step
from diffjax.compare.sections import EVAL_MODES, eval_config
from diffjax.model import ARMS

__all__ = [
  "ARMS",
  "EVAL_MODES",
  "SCHEMA",
  "ComparisonConfig",
  "ComparisonStopped",
  "arm_names",
  "batch_hashes",
  "check_batches",
  "check_comparison_config",
  "comparison_config",
  "done_step",
  "eval_config",
  "main",
  "run_comparison",
  "run_config",
  "run_name",
  "write_outputs",
]
