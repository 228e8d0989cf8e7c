"""Who may write a run's workdir (an advisory lock on ``<workdir>/.lock``), and whether the run in
it has finished (its ``DONE`` marker): docs/training.md#checkpoints-and-resume.
"""

from __future__ import annotations

import json
import math
import os
import socket
from typing import IO, Any

from etils import epath

from diffjax.errors import UserError

LOCK_FILE = ".lock"
DONE_FILE = "DONE"


class WorkdirBusy(UserError):
  """Another process is training in the workdir."""


def done_step(workdir: str) -> int | None:
  """The step in ``workdir``'s DONE marker, or None when the run has not finished."""
  path = epath.Path(workdir) / DONE_FILE
  try:
    return int(path.read_text().strip())
  except (FileNotFoundError, ValueError):
    return None


def finished_result(workdir: str) -> dict[str, Any]:
  """The final metrics a finished run recorded (``{"step"}`` at least)."""
  path = epath.Path(workdir) / "final_metrics.json"
  result: dict[str, Any] = {}
  if path.exists():
    try:
      result = json.loads(path.read_text())
    except ValueError:
      result = {}
  result.setdefault("step", done_step(workdir))
  result.setdefault("train/loss", math.nan)
  return result


class WorkdirLock:
  """An exclusive advisory lock on ``<workdir>/.lock``, taken by :meth:`acquire` and released by
  :meth:`release` (or by the kernel when the process ends).

  Args:
    workdir: the run's directory; created if missing. A cloud URI is not locked.
    enabled: False for the processes that do not write the run's records (all but process 0).
  """

  def __init__(self, workdir: str, *, enabled: bool = True):
    self.path = os.path.join(workdir, LOCK_FILE)
    self.enabled = enabled and "://" not in workdir
    self._file: IO[str] | None = None

  def acquire(self) -> None:
    """Takes the lock; raises :class:`WorkdirBusy` naming the holder when another process has it."""
    if not self.enabled or self._file is not None:
      return
    import fcntl  # pylint: disable=import-outside-toplevel  # POSIX only

    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    # "a+": opening must not wipe the holder's pid before we know that we hold the lock.
    f = open(self.path, "a+", encoding="utf-8")  # pylint: disable=consider-using-with
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      f.seek(0)
      holder = f.read().split()
      f.close()
      who = f"pid {holder[0]} on host {holder[1]}" if len(holder) >= 2 else "another process"
      raise WorkdirBusy(
        f"another training ({who}) is writing to {os.path.dirname(self.path)}; wait for it to "
        "finish or stop it, or train into another --workdir."
      ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()} {socket.gethostname()}\n")
    f.flush()
    self._file = f

  def release(self) -> None:
    if self._file is not None:
      self._file.close()  # closing the file drops the flock
      self._file = None

  def __enter__(self) -> WorkdirLock:
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()
