"""The command line of the matched comparison (`python -m diffjax.compare`).

Its exit statuses (0, 1, 2, 75, 130) and signals: docs/evaluation.md#matched-comparisons.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from diffjax.compare.comparison import run_comparison
from diffjax.compare.config import ComparisonConfig, describe_comparison
from diffjax.compare.runs import ComparisonStopped

# As train.py: a scheduler can tell "preempted, rerun to continue" from "finished" (0) and
# from "fix the config" (2).
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it
USAGE = (
  "usage: python -m diffjax.compare --config=configs/compare/<file>.py[:ARG] "
  "--workdir=<dir> [--config.<key>=<value> ...] [--dry_run]"
)
SUMMARY = """\
Trains every arm x seed of a comparison config (each arm is base with model.arm set, so every
arm is matched to the same Transformer), evaluates each run, checks that the arms saw the same
batches, and writes report.md, plots and results.json into the workdir. Keys of the runs are
under --config.base.<key> (e.g. --config.base.num_steps=2000), the arms and seeds are
--config.arms and --config.seeds."""
OVERRIDE_HELP = """\
Overrides: --config.<key>=<value> sets any key of the comparison config (values are Python
literals); the runs' keys are under base:
  --config.arms="('transformer','diff_v2')"  the arms compared (each matched to base's
                                             Transformer)
  --config.seeds="(0,1,2)"                   the seeds every arm trains with
  --config.base.model.size=small             the Transformer size every arm is matched to
  --config.base.model.v2_match=heads         how DIFF V2 is matched: params (default) or heads
  --config.base.num_steps=2000 --config.base.optim.decay_steps=2000 --config.eval.mode=quick
"""


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command on ``argv`` (default ``sys.argv``; argv[0] is the program name) and
  returns its exit status; SIGINT and SIGTERM outside a run's training return
  `EXIT_INTERRUPTED` with one line."""
  from diffjax import cli  # pylint: disable=import-outside-toplevel

  with cli.stop_signals_raise():
    try:
      return _main(argv)
    except KeyboardInterrupt as e:
      print(
        f"stopped: interrupted by signal {cli.interrupt_signal(e)}; rerun the same command to "
        "continue.",
        file=sys.stderr,
        flush=True,
      )
      return EXIT_INTERRUPTED


def _main(argv: Sequence[str] | None) -> int:
  from absl import logging  # pylint: disable=import-outside-toplevel

  from diffjax import cli  # pylint: disable=import-outside-toplevel
  from diffjax.train.config_utils import RENAMED_KEYS  # pylint: disable=import-outside-toplevel

  argv = list(sys.argv if argv is None else argv)
  parsed = cli.parse(
    argv,
    usage=USAGE,
    summary=SUMMARY,
    overrides_help=OVERRIDE_HELP,
    renamed=RENAMED_KEYS,
    subdir="compare",
    describe=describe_comparison,
    flags=(cli.Flag("workdir", None, "directory for the runs and the report (required)"),),
  )
  if isinstance(parsed, int):
    return parsed
  config, values, _ = parsed
  from diffjax.errors import run_guarded  # pylint: disable=import-outside-toplevel

  if values["workdir"] is None:
    print(f"error: --workdir is required; {USAGE}", file=sys.stderr)
    return 2
  workdir = values["workdir"]
  logging.set_verbosity(logging.WARNING)
  # The seeds of one arm compile the same steps: every run after the first reuses them.
  cli.use_compile_cache(os.path.join(workdir, "compile_cache"))
  outcome = {}

  def go():
    # The config is resolved (and checked) here, once; nothing is written before that.
    resolved = ComparisonConfig.from_config(config)
    try:
      outcome["results"] = run_comparison(resolved, workdir)
    except KeyError as e:
      # run_guarded reads a KeyError as a config key the command line named; once the config
      # is resolved one is a bug, and its traceback says where.
      raise RuntimeError(f"the comparison failed on a missing key {e}; this is a bug") from e

  try:
    code = run_guarded(go)
  except ComparisonStopped as e:
    print(f"stopped: {e}; rerun the same command to continue.", file=sys.stderr)
    return EXIT_PREEMPTED
  if code == 0 and not outcome["results"]["data_check"]["ok"]:
    print(
      "error: the arms did not see the same batches; see the warning in report.md.", file=sys.stderr
    )
    return 1
  return code
