"""The command line of the matched comparison.

  python -m diffjax.compare --config=configs/compare/tiny.py --workdir=runs/compare_tiny
      [--config.seeds="(0, 1, 2)" --config.base.num_steps=2000 --config.eval.mode=full ...]

Trains every arm x seed of the config (runs/<arm>_seed<k> in the workdir; finished runs are
skipped, unfinished ones resume), evaluates each run, checks from the logged batch hashes that
the arms at each seed saw the same batches, and writes report.md, PNG plots and results.json
into the workdir. --config.<key>=<value> sets any key the config file defines.

Exit status: 0 done; 1 the arms did not see the same batches (the report says so at the top);
2 a mistake in the command line or the config (one `error:` line, nothing written); 75 (as
train.py) SIGTERM or SIGINT stopped a run after it saved a checkpoint: rerun the same command to
continue; 130 interrupted outside a run's training.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from diffjax.compare.comparison import run_comparison
from diffjax.compare.runs import ComparisonStopped

# As train.py: a scheduler can tell "preempted, rerun to continue" from "finished" (0) and
# from "fix the config" (2).
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130
USAGE = ("usage: python -m diffjax.compare --config=configs/compare/<file>.py --workdir=<dir> "
         "[--config.<key>=<value> ...]")


def _enable_compile_cache(workdir: str) -> None:
  """Points JAX's persistent compilation cache into the workdir unless the user chose one: the
  seeds of one arm compile the same steps, so every run after the first reuses them."""
  import jax  # pylint: disable=import-outside-toplevel
  if not jax.config.jax_compilation_cache_dir:  # JAX_COMPILATION_CACHE_DIR wins
    jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "compile_cache"))


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command on ``argv`` (default ``sys.argv``; argv[0] is the program name) and
  returns its exit status."""
  from absl import flags, logging  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  argv = list(sys.argv if argv is None else argv)
  if any(a in ("-h", "--help", "--helpfull") for a in argv[1:]):
    print(USAGE + "\n\n" + __doc__)
    return 0
  # Own flag registry: importing this module (e.g. in tests) registers no global flags.
  fv = flags.FlagValues()
  config_flag = config_flags.DEFINE_config_file("config", None, "Path to a configs/compare/*.py "
                                                "file.", flag_values=fv, lock_config=True,
                                                sys_argv=argv)
  workdir_flag = flags.DEFINE_string("workdir", None, "Directory for the runs and the report.",
                                     flag_values=fv)
  try:
    rest = fv(argv)
  except Exception as e:  # absl and ml_collections raise several types for bad flags
    detail = str(e).strip('"')
    if isinstance(e, (KeyError, AttributeError)):
      detail = f"unknown config key {detail}"
    if "config key" in detail or "flag 'config." in detail:
      detail += " (--config.<key>=<value> can only set keys the config file defines)"
    print(f"error: invalid command line: {detail}", file=sys.stderr)
    return 2
  try:
    config = config_flag.value
    _ = config is not None and "arms" in config  # loading errors surface on first access
  except Exception as e:  # a config file that is missing or fails to import
    detail = str(e).splitlines()[-1].strip() if str(e).strip() else type(e).__name__
    print(f"error: cannot load --config: {detail}", file=sys.stderr)
    return 2
  if len(rest) > 1 or workdir_flag.value is None or config is None:
    print(f"error: {USAGE}" + (f" (unexpected arguments {rest[1:]})" if len(rest) > 1 else ""),
          file=sys.stderr)
    return 2
  logging.set_verbosity(logging.WARNING)
  _enable_compile_cache(workdir_flag.value)
  from diffjax.errors import run_guarded  # pylint: disable=import-outside-toplevel
  outcome = {}

  def go():
    outcome["results"] = run_comparison(config, workdir_flag.value)

  try:
    code = run_guarded(go)
  except ComparisonStopped as e:
    print(f"stopped: {e}; rerun the same command to continue.", file=sys.stderr)
    return EXIT_PREEMPTED
  except KeyboardInterrupt:
    print("stopped: interrupted; rerun the same command to continue.", file=sys.stderr)
    return EXIT_INTERRUPTED
  if code == 0 and not outcome["results"]["data_check"]["ok"]:
    print("error: the arms did not see the same batches; see the warning in report.md.",
          file=sys.stderr)
    return 1
  return code
