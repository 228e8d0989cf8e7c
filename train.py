"""Trains a diffjax language model.

  python train.py --config=configs/default.py --workdir=runs/default \
      [--config.model.num_layers=6 --config.num_steps=2000 ...]

Rerunning the same command resumes from the latest checkpoint in --workdir.
Mistakes in flags, configs or data paths print one ``error:`` line and exit with 2.
"""

import sys

from absl import flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")


def main(argv) -> int:
  try:
    rest = flags.FLAGS(argv)
  except Exception as e:  # absl and ml_collections raise several types for bad flags
    print(f"error: invalid command line: {e}", file=sys.stderr)
    return 2
  try:
    config = _CONFIG.value
    _ = config is not None and "model" in config  # loading errors surface on first access
  except Exception as e:  # a config file that is missing or fails to import
    detail = str(e).splitlines()[-1].strip()
    print(f"error: cannot load --config={flags.FLAGS['config'].serialize().split('=', 1)[-1]}: "
          f"{detail}", file=sys.stderr)
    return 2
  if len(rest) > 1 or _WORKDIR.value is None or config is None:
    print("error: usage: python train.py --config=configs/<file>.py --workdir=<dir> "
          "[--config.<key>=<value> ...]" + (f" (unexpected arguments {rest[1:]})"
                                           if len(rest) > 1 else ""), file=sys.stderr)
    return 2
  # Orbax and grain log every checkpoint step at INFO; keep the terminal for progress.
  logging.set_verbosity(logging.WARNING)
  from diffjax.cli import run_guarded  # pylint: disable=import-outside-toplevel
  from diffjax.train import train_and_evaluate  # pylint: disable=import-outside-toplevel
  return run_guarded(lambda: train_and_evaluate(config, _WORKDIR.value))


if __name__ == "__main__":
  sys.exit(main(sys.argv))
