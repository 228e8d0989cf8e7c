"""Trains a diffjax language model.

  python train.py                                # configs/default.py into runs/default
  python train.py --config=configs/default.py --workdir=runs/default \
      [--config.model.num_layers=6 --config.num_steps=2000 ...]

Without --config the default config (configs/default.py) is trained; without
--workdir the run writes to runs/<config name>[_<config argument>] under the current
directory (runs/default, runs/tiny_diff_v2 for --config=configs/tiny.py:diff_v2).
Rerunning the same command resumes from the latest checkpoint in the workdir.

Exit status:
  0   the run finished (the workdir holds a DONE marker);
  2   a mistake in the flags, the config or the data, or a non-finite loss: one
      ``error:`` line says what to change (rerunning unchanged will not help);
  75  (EXIT_PREEMPTED, sysexits' EX_TEMPFAIL) stopped by SIGTERM or SIGINT after
      saving a checkpoint: rerun the same command to resume. tpu_setup/babysit.sh
      relaunches on it.
"""

import os
import sys

from absl import flags, logging
from ml_collections import config_flags

EXIT_PREEMPTED = 75
REPO_ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join("configs", "default.py")

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file "
                                          "[default: configs/default.py].", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics "
                               "[default: runs/<config name>].")


def _one_line(e: BaseException) -> str:
  return " ".join(line.strip() for line in str(e).splitlines() if line.strip())


def _config_arg(argv) -> str | None:
  """The value of --config in ``argv`` (``--config=X`` or ``--config X``), or None."""
  for i, a in enumerate(argv):
    if a.startswith("--config="):
      return a.split("=", 1)[1]
    if a == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def default_workdir(config_arg: str) -> str:
  """runs/<file stem>[_<argument>] for ``--config=<path>[:<argument>]``."""
  path, _, arg = config_arg.partition(":")
  name = os.path.splitext(os.path.basename(path))[0] + (f"_{arg}" if arg else "")
  return os.path.join("runs", "".join(c if c.isalnum() or c in "._-" else "_" for c in name))


def main(argv) -> int:
  argv = list(argv)
  config_arg = _config_arg(argv[1:])
  if config_arg is None:
    config_arg = DEFAULT_CONFIG
    argv.insert(1, "--config=" + os.path.join(REPO_ROOT, DEFAULT_CONFIG))
  try:
    rest = flags.FLAGS(argv)
  except Exception as e:  # absl and ml_collections raise several types for bad flags
    from diffjax.train.config_utils import explain_flag_error  # pylint: disable=import-outside-toplevel
    print(f"error: {explain_flag_error(argv) or 'invalid command line: ' + _one_line(e)}",
          file=sys.stderr)
    return 2
  try:
    config = _CONFIG.value
    _ = config is not None and "model" in config  # loading errors surface on first access
  except Exception as e:  # a config file that is missing or fails to import
    detail = str(e).splitlines()[-1].strip()
    print(f"error: cannot load --config={config_arg}: {detail}", file=sys.stderr)
    return 2
  if len(rest) > 1 or config is None:
    print("error: usage: python train.py [--config=configs/<file>.py] [--workdir=<dir>] "
          "[--config.<key>=<value> ...]" + (f" (unexpected arguments {rest[1:]})"
                                           if len(rest) > 1 else ""), file=sys.stderr)
    return 2
  workdir = _WORKDIR.value
  if workdir is None:
    workdir = default_workdir(config_arg)
    print(f"diffjax: training {config_arg} into {workdir} (choose with --config=... and "
          "--workdir=...)", flush=True)
  # Orbax and grain log every checkpoint step at INFO; keep the terminal for progress.
  logging.set_verbosity(logging.WARNING)
  from diffjax.errors import run_guarded  # pylint: disable=import-outside-toplevel
  from diffjax.train import train_and_evaluate  # pylint: disable=import-outside-toplevel
  result = {}
  status = run_guarded(lambda: result.update(train_and_evaluate(config, workdir)))
  if status == 0 and result.get("stopped"):
    return EXIT_PREEMPTED
  return status


if __name__ == "__main__":
  sys.exit(main(sys.argv))
