"""User-facing errors: one base class, and the guard that turns them into one line.

This module imports nothing from diffjax, so every layer may raise :class:`UserError`
(or a subclass) for a mistake the user can fix: a bad config value, a missing path, a
checkpoint that does not fit the run. Command-line entry points wrap their work in
:func:`run_guarded`, which prints such an error as a single ``error: ...`` line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class UserError(Exception):
  """A problem the user must act on; its message says what was seen and what to do."""


def user_errors() -> tuple[type[BaseException], ...]:
  """The exception types printed as one ``error:`` line instead of a traceback."""
  return (UserError, ValueError, FileNotFoundError, NotADirectoryError, KeyError)


def run_guarded(fn: Callable[[], Any]) -> int:
  """Runs ``fn``; a user error prints ``error: ...`` on stderr and returns 2, else 0."""
  try:
    fn()
  except user_errors() as e:
    msg = str(e).strip() or type(e).__name__
    if isinstance(e, KeyError):
      msg = f"unknown or missing config key {msg}"
    print(f"error: {msg}", file=sys.stderr)
    return 2
  return 0
