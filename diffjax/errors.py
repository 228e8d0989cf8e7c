"""User-facing errors: one base class, and the guard that turns them into one line.

Any layer may raise :class:`UserError` for a mistake the user can fix (this module imports nothing
from diffjax); commands wrap their work in :func:`run_guarded`, which prints one ``error:`` line.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


class UserError(Exception):
  """A problem the user must act on; its message says what was seen and what to do."""


class MissingExtra(UserError, ImportError):
  """An optional package that one of diffjax's extras installs is not installed."""


# The package etils.epath reads a cloud scheme through, and the extra that installs it.
_CLOUD_PACKAGES = {"gs": ("gcsfs", "gcs")}


def require_filesystem(path: str, what: str) -> None:
  """:class:`MissingExtra` when ``path`` is a cloud URI (``gs://...``) whose file-system package
  is not installed (without it, the first read fails deep inside the checkpoint library).

  Args:
    path: a local path or a cloud URI.
    what: the setting that names it (``"--workdir"``), the start of the message.
  """
  scheme, sep, _ = str(path).partition("://")
  if sep and scheme in _CLOUD_PACKAGES:
    module, extra = _CLOUD_PACKAGES[scheme]
    import_extra(module, extra, f"{what}={path!r}, on Cloud Storage,")


def import_extra(module: str, extra: str, needed_for: str):
  """``import module``, or :class:`MissingExtra` naming the extra to install when it is absent.

  Args:
    module: the optional package (``"tokenizers"``).
    extra: the diffjax extra that installs it (``"tokenizers"``: ``pip install -e '.[tokenizers]'``).
    needed_for: what needs it, the start of the message (``"reading the HF tokenizer x.json"``).
  """
  try:
    return importlib.import_module(module)
  except ImportError as e:
    if getattr(e, "name", None) not in (module, module.split(".")[0]):
      raise  # the package is there but broken: its own error says more
    raise MissingExtra(
      f"{needed_for} needs the {module.split('.')[0]!r} package, which is not installed; "
      f"install diffjax's [{extra}] extra: pip install -e '.[{extra}]'."
    ) from None


def user_errors() -> tuple[type[BaseException], ...]:
  """The exception types printed as one ``error:`` line instead of a traceback (a path that
  cannot be written is the user's to change, as one that does not exist)."""
  return (UserError, ValueError, FileNotFoundError, NotADirectoryError, PermissionError, KeyError)


def run_guarded(fn: Callable[[], Any]) -> int:
  """Runs ``fn``; a user error prints ``error: ...`` on stderr and returns 2, else 0."""
  try:
    fn()
  except user_errors() as e:
    msg = str(e).strip() or type(e).__name__
    if isinstance(e, PermissionError):
      msg += ": choose a directory this user can write"
    if isinstance(e, KeyError):
      msg = f"unknown or missing config key {msg}"
    print(f"error: {msg}", file=sys.stderr)
    return 2
  return 0
