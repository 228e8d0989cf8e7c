r"""The matched comparison: every arm x seed trained, evaluated and reported in one command.

    python -m diffjax.compare --config=configs/compare/tiny.py --workdir=runs/compare_tiny \
        [--config.seeds="(0, 1, 2)" --config.base.num_steps=2000 --config.eval.mode=full ...]

A compare config (see `comparison_config` and `configs/compare/*.py`) holds `arms`, `seeds`, one
`base` run config whose `model` is the Transformer spec the arms are matched to
(`diffjax.model.matched_configs`), and `eval` / `report` settings. Every arm shares every other
setting of `base`; run (arm, seed k) trains with `seed = k`, which seeds both the initialisation
and the data order, so the arms at seed k see identical batches. The command checks that from the
batch hashes the trainer logs and says so loudly when it does not hold.

Layout of --workdir:
    runs/<arm>_seed<k>/   one train.py workdir per run (checkpoints, metrics.jsonl, DONE,
                          final_metrics.json) plus the eval suite's eval.json
    report.md, *.png      `diffjax.eval.report` over all runs, with the comparison summary first
    results.json          every number: per-run training and eval results, the aggregates, the
                          data check
    compare_config.json   the config of the latest invocation
    runs/<run>/output.log the run's trainer and eval output when ``workers`` > 1 (the runs then
                          train side by side, each in its own process)
    compile_cache/        JAX's persistent compilation cache (command line only): the seeds of
                          one arm compile the same steps, so runs after the first reuse them

Rerunning the command continues where it stopped: finished runs (a DONE marker at the requested
step) are skipped, unfinished runs resume from their checkpoints, and a run's eval.json is reused
while its step and eval settings are unchanged. Mistakes in the config print one ``error:`` line
and exit with 2.

Modules: `config` (the compare config, its checks, each run's train and eval config), `runs`
(train, evaluate and collect one run), `datacheck` (batch hashes compared across arms),
`summary` (the comparison's table at the top of report.md), `outputs` (report.md, PNGs,
results.json), `comparison` (`run_comparison`, the loop over arms x seeds), `parallel` (several
runs at once in worker processes, ``workers`` > 1, CPU only), `command` (the command line).
"""

from diffjax.compare.command import main
from diffjax.compare.comparison import run_comparison
from diffjax.compare.config import (
  EVAL_MODES,
  arm_names,
  check_comparison_config,
  comparison_config,
  eval_config,
  run_config,
  run_name,
)
from diffjax.compare.datacheck import batch_hashes, check_batches
from diffjax.compare.outputs import SCHEMA, write_outputs
from diffjax.compare.runs import ComparisonStopped, done_step
from diffjax.model import ARMS

__all__ = [
  "ARMS",
  "EVAL_MODES",
  "SCHEMA",
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
