"""train.py as a thin supervisor of its training process, when it is one of several.

Losing process 0 makes the runtime abort every other process before Python can say why, so
train.py trains in a child and reports such an abort itself: one line, the runtime's message in
``<workdir>/runtime_abort.process<N>.txt``, exit status 75 (docs/training.md, "A lost host").
An abort that says the group never formed (the coordinator not reached in time, its port
taken) or that a process joined it twice is one ``error:`` line and status 2 instead: a relaunch
of the same command would fail the same way. A stop signal that ends the child before it took
it (during its start-up) is train.py's own line, ``diffjax: stopped by signal N; ...``, and 75.
"""

from __future__ import annotations

import ctypes
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from diffjax.train import cluster
from diffjax.train.sections import DistributedConfig

ENV = "DIFFJAX_SUPERVISED"
# How long the runtime's log lines are held before they are printed (an abort follows its
# first line within milliseconds).
HOLD_S = 2.0
EXIT_PREEMPTED = 75
EXIT_USER_ERROR = 2
_FATAL = "JAX distributed service detected fatal errors"
# The runtime's words for: the group did not form in time (every process's RegisterTask waits
# for all of them); a process id registered a second time; the coordinator's port was taken.
_JOIN_TIMEOUT = ("DEADLINE_EXCEEDED", "RegisterTask")
_TWICE = re.compile(r"(?:task:)?(\d+) unexpectedly tried to connect with a different incarnation")
_PORT_TAKEN = "Failed to add port to server"
# How Python reports the KeyboardInterrupt of a stop signal that came before train.py's handler
# (during the interpreter's own start-up, the second).
_INTERRUPTED = ("Traceback (most recent call last):", "Fatal Python error:")
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


def child_command(script: str, args: Sequence[str]) -> list[str]:
  """The supervised child's command: this interpreter with the options it was started with
  (``-X``, ``-W``, ``-O``, ``-B``, ..., and ``-u``, which only shows in stdout's buffering),
  then ``script`` and ``args``."""
  flags = subprocess._args_from_interpreter_flags()  # pylint: disable=protected-access
  if isinstance(getattr(sys.__stdout__, "buffer", None), io.FileIO) and "-u" not in flags:
    flags.append("-u")  # unbuffered (-u or PYTHONUNBUFFERED): stdout has no buffer of its own
  return [sys.executable, *flags, script, *args]


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
  """Copies the child's stderr to ``out``, holding the runtime's log lines for a while (and,
  once ``stopping`` is set, a traceback or fatal error: the child's KeyboardInterrupt)."""

  def __init__(self, pipe, out: TextIO, hold_s: float, stopping: threading.Event):
    self.pipe, self.out, self.hold_s, self.stopping = pipe, out, hold_s, stopping
    self.lock = threading.Lock()
    self.held: list[str] = []
    self.held_at = 0.0  # when the last runtime line (or the held traceback) arrived
    self.fatal = False
    self.port_taken = False
    self.thread = threading.Thread(target=self._run, name="diffjax-stderr-relay", daemon=True)
    self.thread.start()

  def _run(self) -> None:
    for line in iter(self.pipe.readline, ""):
      with self.lock:
        if _RUNTIME_LINE.match(line):
          self.held_at = time.monotonic()
          self.fatal = self.fatal or _FATAL in line
          self.port_taken = self.port_taken or _PORT_TAKEN in line
          self.held.append(line)
        elif self.held:
          self.held.append(line)
        elif self.stopping.is_set() and line.startswith(_INTERRUPTED):
          self.held_at = time.monotonic()
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


def _group() -> cluster.ProcessGroup | None:
  try:
    return cluster.process_group()
  except ValueError:  # the child said so
    return None


def _count() -> int | None:
  """How many processes the group has: the one train.py forms (DIFFJAX_*, a Kubernetes
  Indexed Job, SLURM), else JAX's (TPU_WORKER_HOSTNAMES, JAX_NUM_PROCESSES); None: unknown."""
  group = _group()
  if group is not None:
    return group.num_processes
  hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
  if hosts:
    return len(hosts)
  count = os.environ.get("JAX_NUM_PROCESSES", "").strip()
  return int(count) if count.isdigit() else None


def _me() -> int | None:
  """This process's id, as :func:`_count` finds the group; None: unknown."""
  group = _group()
  if group is not None:
    return group.process_id
  for key in ("TPU_WORKER_ID", "JAX_PROCESS_ID"):
    if os.environ.get(key, "").strip().isdigit():
      return int(os.environ[key])
  return None


def lost_process(text: str, me: int | None) -> int | None:
  """Which process the runtime's abort message blames: 0 when the coordination service (which
  process 0 runs) cannot be reached, else a task it names other than this one."""
  if any(s in text for s in _LEADER_GONE):
    return 0
  others = [int(t) for t in _TASK.findall(text) if me is None or int(t) != me]
  return others[0] if others else None


def _join_timeout_s() -> int:
  try:
    return cluster.join_timeout_s()
  except ValueError:  # the child said so
    return cluster.JOIN_TIMEOUT_S


def _coordinator(group: cluster.ProcessGroup | None) -> str:
  if group is not None:
    return group.where()
  address = os.environ.get("JAX_COORDINATOR_ADDRESS", "").strip()
  return f"{address} (JAX_COORDINATOR_ADDRESS)" if address else "the coordinator JAX detected"


def startup_failure(
  text: str, me: int | None, count: int | None, group: cluster.ProcessGroup | None, step: int
) -> str | None:
  """The ``error:`` line for a runtime abort whose message (``text``) says that the process
  group could not form, or that a process joined it twice; None for any other abort. Either
  is the user's to fix (exit status 2): a relaunch of the same command fails the same way."""
  of = f" of {count}" if count else ""
  twice = _TWICE.search(text)
  if twice:
    ids = group.id_variable if group else "process id"
    each = f" in 0..{count - 1}" if count else ""
    resume = "the newest checkpoint" + (
      f" (step {step} was the last one written)" if step >= 0 else ""
    )
    return (
      f"error: process {twice.group(1)}{of} joined the process group twice (a duplicate "
      f"{ids}, or an old process still running), and the runtime ended the group: stop the "
      f"extra process and give every process its own {ids}{each}, then rerun the same command "
      f"on every host to resume from {resume}."
    )
  if all(s in text for s in _JOIN_TIMEOUT):
    where, waited = _coordinator(group), _join_timeout_s()
    if me == 0:
      return (
        f"error: the process group did not form within {waited} s: process 0{of} serves the "
        f"coordinator at {where}, but not every other process joined it: start all of them "
        "and check that they reach this host at that address, then rerun the same command."
      )
    who = f"process {me}{of}" if me is not None else "this process"
    return (
      f"error: {who} could not join the coordinator at {where} within {waited} s: start "
      "process 0 (it serves the coordinator) and every other process, and check that this "
      "host reaches that address, then rerun the same command."
    )
  return None


def _stopped_by(forwarded: list[int], status: int, held: list[str]) -> int | None:
  """The stop signal the child ended of before it could say so itself (it had no handler yet:
  it died of the signal, or of Python's KeyboardInterrupt); None otherwise."""
  if not forwarded or status in (0, EXIT_PREEMPTED):
    return None
  if -status in forwarded:
    return -status
  last = next((line.strip() for line in reversed(held) if line.strip()), "")
  if signal.SIGINT in forwarded and last.startswith("KeyboardInterrupt"):
    return signal.SIGINT
  return None


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
  forwarded: list[int] = []  # the stop signals passed on (or to pass on: the child not started)
  stopping = threading.Event()

  def forward(signum, frame):
    del frame
    forwarded.append(signum)
    stopping.set()
    if children and children[0].poll() is None:
      children[0].send_signal(signum)

  # Until this returns, a stop signal is forwarded: never a KeyboardInterrupt here.
  old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    return _supervise(command, workdir, hold_s, err, env, children, forwarded, stopping)
  finally:
    for s, h in old.items():
      signal.signal(s, h)


def _supervise(command, workdir, hold_s, err, env, children, forwarded, stopping) -> int:
  child = subprocess.Popen(
    list(command), env=env, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1
  )
  children.append(child)
  for signum in list(forwarded):  # came while the child was being started
    child.send_signal(signum)
  relay = _Relay(child.stderr, err, hold_s, stopping)
  while True:
    try:
      status = child.wait(timeout=0.25)
      break
    except subprocess.TimeoutExpired:
      relay.release_stale()
  fatal, held = relay.finish()

  def say(line: str) -> None:
    err.write(line + "\n")
    err.flush()

  signum = _stopped_by(forwarded, status, held)
  if signum is not None:
    # The child had no handler yet (start-up): the line train.py prints, and its status.
    cut = next((i for i, line in enumerate(held) if line.startswith(_INTERRUPTED)), len(held))
    if cut:
      err.write("".join(held[:cut]))
    say(
      f"diffjax: stopped by signal {int(signum)}; rerun the same command to resume from the "
      "newest complete checkpoint."
    )
    return EXIT_PREEMPTED
  me, count, group = _me(), _count(), _group()
  if relay.port_taken and status != 0:
    if status == EXIT_USER_ERROR:  # the child named the port itself
      held = [line for line in held if _PORT_TAKEN not in line]
    else:  # the runtime crashed on it
      coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS")
      log = _keep_log(workdir, me, held)
      say(f"error: {cluster.port_in_use(group, coordinator)} The runtime's message: {log}")
      return EXIT_USER_ERROR
  if status == -signal.SIGABRT and fatal:
    from diffjax.train.distributed import lost_peer_line  # pylint: disable=import-outside-toplevel

    text = "".join(held)
    log = _keep_log(workdir, me, held)
    step = newest_checkpoint(workdir)
    line = startup_failure(text, me, count, group, step)
    if line is not None:
      say(f"{line} The runtime's message: {log}")
      return EXIT_USER_ERROR
    line = lost_peer_line(
      lost_process(text, me), count, "the distributed runtime ended this process", step
    )
    say(f"{line} The runtime's message: {log}")
    return EXIT_PREEMPTED
  if held:
    err.write("".join(held))
    err.flush()
  return 128 - status if status < 0 else status
