"""Command-line helpers: turn user mistakes into one clear error line."""

from __future__ import annotations

import sys
from typing import Any, Callable


def user_errors() -> tuple[type[BaseException], ...]:
  from diffjax.train.checkpoint import CheckpointError  # pylint: disable=import-outside-toplevel
  from diffjax.train.trainer import TrainingError  # pylint: disable=import-outside-toplevel
  return (ValueError, FileNotFoundError, NotADirectoryError, KeyError, CheckpointError,
          TrainingError)


def run_guarded(fn: Callable[[], Any]) -> int:
  """Runs ``fn``; a user error prints ``error: ...`` on stderr and returns 2."""
  try:
    fn()
  except user_errors() as e:
    msg = str(e).strip() or type(e).__name__
    if isinstance(e, KeyError):
      msg = f"unknown or missing config key {msg}"
    print(f"error: {msg}", file=sys.stderr)
    return 2
  return 0
