"""train.py as a thin supervisor of its training process, when it is one of several.

Losing process 0 makes the runtime abort every other process before Python can say why, so
train.py trains in a child and reports such an abort itself: one line, the runtime's message in
``<workdir>/runtime_abort.process<N>.txt``, exit status 75 (docs/training.md, "A lost host").
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from diffjax.train.sections import DistributedConfig

ENV = "DIFFJAX_SUPERVISED"
# How long the runtime's log lines are held before they are printed (an abort follows its
# first line within milliseconds).
HOLD_S = 2.0
EXIT_PREEMPTED = 75
_FATAL = "JAX distributed service detected fatal errors"
# absl/glog's prefix: severity, MMDD, time, thread id, file:line.
_RUNTIME_LINE = re.compile(r"^[WEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [\w.\-/]+:\d+\] ")
_LEADER_GONE = ("Failed to send RPC to coordination service", "leader task")
_TASK = re.compile(r"/task:(\d+)")


def wanted(section: DistributedConfig) -> bool:
  """Whether train.py should supervise its training (see the module docstring), by the run's
  ``distributed`` section."""
  if os.environ.get(ENV):
    return False
  if not section.supervise:
    return False
  initialize = section.initialize
  if initialize is None:
    from diffjax.train import distributed  # pylint: disable=import-outside-toplevel

    initialize = distributed.detected()
  return bool(initialize)


def follow_parent() -> None:
  """In the supervised child: be killed when the supervisor dies (Linux; a no-op elsewhere).

  Called by train.py first thing, rather than between fork and exec, which is unsafe in a
  process that already runs threads. ``DIFFJAX_SUPERVISED`` holds the supervisor's pid; if
  it died before this ran, the child exits at once.
  """
  parent = os.environ.get(ENV, "")
  if not parent.isdigit() or int(parent) <= 1:
    return  # set by the user to turn supervision off: nothing to follow
  try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):  # not Linux: the child outlives a killed parent
    return
  if os.getppid() != int(parent):
    os._exit(128 + signal.SIGKILL)  # the supervisor is already gone


class _Relay:
  """Copies the child's stderr to ``out``, holding the runtime's log lines for a while."""

  def __init__(self, pipe, out: TextIO, hold_s: float):
    self.pipe, self.out, self.hold_s = pipe, out, hold_s
    self.lock = threading.Lock()
    self.held: list[str] = []
    self.held_at = 0.0  # when the last runtime line arrived
    self.fatal = False
    self.thread = threading.Thread(target=self._run, name="diffjax-stderr-relay", daemon=True)
    self.thread.start()

  def _run(self) -> None:
    for line in iter(self.pipe.readline, ""):
      with self.lock:
        if _RUNTIME_LINE.match(line):
          self.held_at = time.monotonic()
          self.fatal = self.fatal or _FATAL in line
          self.held.append(line)
        elif self.held:
          self.held.append(line)
        else:
          self._write([line])
    self.pipe.close()

  def _write(self, lines: list[str]) -> None:
    self.out.write("".join(lines))
    self.out.flush()

  def release_stale(self) -> None:
    """Prints the held lines when no abort followed them within ``hold_s``."""
    with self.lock:
      if self.held and not self.fatal and time.monotonic() - self.held_at > self.hold_s:
        self._write(self.held)
        self.held = []

  def finish(self) -> tuple[bool, list[str]]:
    """After the child exited: (whether the runtime said it was ending it, the held lines)."""
    self.thread.join(timeout=10)
    with self.lock:
      held, self.held = self.held, []
      return self.fatal, held


def _count() -> int | None:
  for key in ("DIFFJAX_NUM_PROCESSES", "SLURM_NTASKS"):
    if os.environ.get(key, "").isdigit():
      return int(os.environ[key])
  hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
  return len(hosts) or None


def _me() -> int | None:
  for key in ("DIFFJAX_PROCESS_ID", "SLURM_PROCID", "TPU_WORKER_ID"):
    if os.environ.get(key, "").isdigit():
      return int(os.environ[key])
  return None


def lost_process(text: str, me: int | None) -> int | None:
  """Which process the runtime's abort message blames: 0 when the coordination service (which
  process 0 runs) cannot be reached, else a task it names other than this one."""
  if any(s in text for s in _LEADER_GONE):
    return 0
  others = [int(t) for t in _TASK.findall(text) if me is None or int(t) != me]
  return others[0] if others else None


def newest_checkpoint(workdir: str) -> int:
  """The newest finished checkpoint step under ``<workdir>/checkpoints`` (-1: none)."""
  from diffjax.train import checkpoint  # pylint: disable=import-outside-toplevel

  return checkpoint.newest_finished_step(
    os.path.join(workdir, "checkpoints") if "://" not in workdir else f"{workdir}/checkpoints"
  )


def _keep_log(workdir: str, me: int | None, lines: list[str]) -> str:
  name = f"runtime_abort.process{me if me is not None else os.getpid()}.txt"
  text = "".join(lines)
  try:
    from etils import epath  # pylint: disable=import-outside-toplevel

    path = epath.Path(workdir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return os.fspath(path)
  except Exception:  # pylint: disable=broad-except  # the workdir cannot be written: use /tmp
    import tempfile  # pylint: disable=import-outside-toplevel

    path = os.path.join(tempfile.gettempdir(), name)
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)
    return path


def run(
  command: Sequence[str], workdir: str, *, hold_s: float = HOLD_S, err: TextIO | None = None
) -> int:
  """Runs the training ``command`` as a child (see the module docstring); its exit status."""
  err = err or sys.stderr
  env = {**os.environ, ENV: str(os.getpid())}
  children: list[subprocess.Popen] = []
  pending: list[int] = []  # signals that came before the child started

  def forward(signum, frame):
    del frame
    if not children:
      pending.append(signum)
    elif children[0].poll() is None:
      children[0].send_signal(signum)

  old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    child = subprocess.Popen(
      list(command), env=env, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1
    )
  except BaseException:
    for s, h in old.items():
      signal.signal(s, h)
    raise
  children.append(child)
  for signum in pending:
    child.send_signal(signum)
  relay = _Relay(child.stderr, err, hold_s)
  try:
    while True:
      try:
        status = child.wait(timeout=0.25)
        break
      except subprocess.TimeoutExpired:
        relay.release_stale()
  finally:
    for s, h in old.items():
      signal.signal(s, h)
  fatal, held = relay.finish()
  if status == -signal.SIGABRT and fatal:
    me = _me()
    from diffjax.train.distributed import lost_peer_line  # pylint: disable=import-outside-toplevel

    log = _keep_log(workdir, me, held)
    line = lost_peer_line(
      lost_process("".join(held), me),
      _count(),
      "the distributed runtime ended this process",
      newest_checkpoint(workdir),
    )
    err.write(f"{line} The runtime's message: {log}\n")
    err.flush()
    return EXIT_PREEMPTED
  if held:
    err.write("".join(held))
    err.flush()
  return 128 - status if status < 0 else status
