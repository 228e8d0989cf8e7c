"""Document sources: random-access sequences of tokenized documents, and where files are.

A `DocumentSource` (docs/data.md) can be trained or evaluated on like any corpus. Here too:
`resolve_paths` (files, directories, globs) and `stdlib_files` (the default corpus's files).
"""

from __future__ import annotations

import glob
import os
import sysconfig
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

_GLOB_CHARS = frozenset("*?[")


@runtime_checkable
class DocumentSource(Protocol):
  """A random-access sequence of documents, each a (N,) int32 array of token ids."""

  name: str

  def __len__(self) -> int:
    """Number of documents."""
    ...

  def __getitem__(self, index: int) -> np.ndarray:
    """Returns document `index` as a (N,) int32 array (N may be 0)."""
    ...


def _walk_sorted(directory: str) -> list[str]:
  """All regular files under `directory`, recursively, sorted; hidden files and dirs skipped."""
  found = []
  for root, dirs, files in os.walk(directory):
    dirs[:] = [d for d in dirs if not d.startswith(".")]
    found.extend(os.path.join(root, f) for f in files if not f.startswith("."))
  return sorted(found)


def refuse_cloud_path(path: str) -> None:
  """Raises ValueError for a cloud URI (``gs://...``): the pipeline reads documents at random
  through the local file system, so a bucket is read through a mount or a copy."""
  if "://" in str(path):
    raise ValueError(
      f"data.paths entry {str(path)!r} is a cloud URI, but the data is read through the local "
      "file system (documents at random): mount the bucket on every worker (e.g. with Cloud "
      "Storage FUSE, gcsfuse; tpu_setup/README.md) or copy the directory to each worker's "
      "disk, and pass that path."
    )


def resolve_paths(patterns: Sequence[str] | str) -> list[str]:
  """Expands files, directories and globs into a deterministic list of absolute files.

  Each pattern is one of: a file; a directory (every non-hidden file below it, recursively;
  symlinked directories are not followed); a glob (`*`, `?`, `[...]`, and `**` for any depth;
  one that matches nothing names the file or directory of that name, if there is one; pass
  `glob.escape(path)` to name one that a glob would not). Each pattern's matches are sorted,
  patterns keep their given order, and a file matched twice (under any spelling of its path, or
  through a symlink) is kept at its first position.

  Raises:
    FileNotFoundError: a pattern names nothing, or matches no file.
  """
  if isinstance(patterns, (str, os.PathLike)):
    patterns = [patterns]
  patterns = [os.fspath(p) for p in patterns]
  if not patterns:
    raise ValueError("No paths given. Pass files, directories or globs, e.g. ('data/*.txt',).")
  accepted = (
    "Accepted: an existing file, a directory (read recursively) or a glob such as 'data/**/*.txt'."
  )
  files: dict[str, str] = {}  # the file itself (symlinks resolved) -> its path as first found
  for pattern in patterns:
    refuse_cloud_path(pattern)
    expanded = os.path.abspath(os.path.expanduser(pattern))
    is_glob = bool(_GLOB_CHARS & set(expanded))
    matches = []
    if is_glob:
      matches = sorted(m for m in glob.glob(expanded, recursive=True) if os.path.isfile(m))
    if not matches and os.path.isdir(expanded):
      matches = _walk_sorted(expanded)
      if not matches:
        raise FileNotFoundError(f"Directory {pattern!r} contains no files. {accepted}")
    if not matches:
      if not os.path.isfile(expanded):
        what = "matched no files" if is_glob else "does not exist"
        raise FileNotFoundError(f"{'Glob' if is_glob else 'Path'} {pattern!r} {what}. {accepted}")
      matches = [expanded]
    for m in matches:
      files.setdefault(os.path.realpath(m), m)
  return list(files.values())


# Directories of the standard library left out of the default corpus. `test`, `tests` and
# `idle_test` hold CPython's own test suites: many distributions ship them separately or not at
# all (so the corpus would differ between machines), they are dominated by repetitive
# assertion code, and they include deliberately broken inputs (files in legacy encodings, Python 2
# syntax under lib2to3's test data). `site-packages` is third-party code that depends on what
# happens to be installed. `__pycache__` holds no sources.
_STDLIB_EXCLUDED_DIRS = frozenset(
  {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


def stdlib_files(root: str | None = None) -> list[str]:
  """Sorted `.py` files of the standard library at `root` (default: the running Python's).

  Excludes the directories in `_STDLIB_EXCLUDED_DIRS` (test suites, installed packages) and the
  `_sysconfigdata_*` modules, which record how this particular interpreter was built.
  """
  root = root or sysconfig.get_paths()["stdlib"]
  found = []
  for dirpath, dirs, files in os.walk(root):
    dirs[:] = [d for d in dirs if d not in _STDLIB_EXCLUDED_DIRS and not d.startswith(".")]
    found.extend(
      os.path.join(dirpath, f)
      for f in files
      if f.endswith(".py") and not f.startswith("_sysconfigdata")
    )
  return sorted(found)


__all__ = ["DocumentSource", "resolve_paths", "stdlib_files"]
