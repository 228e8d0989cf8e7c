"""Trains a diffjax language model.

  python train.py --config=configs/default.py --workdir=runs/default \
      [--config.model.num_layers=6 --config.num_steps=2000 ...]

Rerunning the same command resumes from the latest checkpoint in --workdir.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  # Orbax and grain log every checkpoint step at INFO; keep the terminal for progress.
  logging.set_verbosity(logging.WARNING)
  from diffjax.cli import run_guarded  # pylint: disable=import-outside-toplevel
  from diffjax.train import train_and_evaluate  # pylint: disable=import-outside-toplevel
  sys.exit(run_guarded(lambda: train_and_evaluate(_CONFIG.value, _WORKDIR.value)))


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu" if os.environ.get("DIFFJAX_CPU") else "")
  if not os.environ["JAX_PLATFORMS"]:
    del os.environ["JAX_PLATFORMS"]
  app.run(main)
