"""Multi-process start-up for TPU pods and multi-node GPU jobs, and the lost-host watchdog.

How the process group is found: docs/scaling.md#tpu-pods, docs/gpu_clusters.md; the watchdog
(:func:`watch_peers`, exit status 75): docs/training.md, "A lost host".
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

import jax

from diffjax.train import cluster
from diffjax.train.sections import DistributedConfig

_DONE = False
_PRESET_DONE = False
EXIT_PREEMPTED = 75
_HEARTBEAT_KEY = "diffjax/heartbeat/"


def _on_tpu_vm() -> bool:
  return cluster.on_tpu_vm()


def detected() -> bool:
  """Whether the environment says this is one of several processes (docs/scaling.md)."""
  # On TPU VMs jax.distributed.initialize() finds the workers from the VM metadata
  # and also works on a single-host slice, so it is always safe to call there.
  if _on_tpu_vm():
    return True
  # DIFFJAX_COORDINATOR (by hand, or a Kubernetes Indexed Job), a SLURM step of several tasks;
  # several TPU_WORKER_HOSTNAMES, MEGASCALE_COORDINATOR_ADDRESS, JAX_COORDINATOR_ADDRESS.
  return cluster.group_wanted() or cluster.jax_group(os.environ, tpu_vm=False) is not None


def apply_preset(section: DistributedConfig) -> str | None:
  """Applies the run's ``distributed.xla_preset`` to this process's environment once, before
  JAX starts its backends (after that XLA and NCCL no longer read it, and nothing is changed);
  prints its one line on process 0 and returns it."""
  global _PRESET_DONE
  if _PRESET_DONE or section.xla_preset == "none":
    return None
  _PRESET_DONE = True
  from diffjax.cpu import backends_started  # pylint: disable=import-outside-toplevel

  if backends_started():
    line = (
      f"diffjax: {cluster.PRESET_KEY}={section.xla_preset} was not applied: JAX had already "
      "started its backends in this process; set its variables before starting Python "
      "(python -m diffjax.train.launch --dry-run env lists them)."
    )
  else:
    line = cluster.apply_preset(section.xla_preset)
  try:
    group = cluster.process_group()
  except ValueError:
    group = None  # said by maybe_initialize
  if line and (group is None or group.process_id == 0):
    print(line, flush=True)
  return line


def maybe_initialize(section: DistributedConfig | None = None) -> bool:
  """Initialises the distributed runtime once if needed (``section.initialize``, or as
  :func:`detected` says when that is None); returns whether it did."""
  global _DONE
  if _DONE:
    return True
  section = section or DistributedConfig()
  apply_preset(section)
  wanted = section.initialize
  if wanted is None:
    wanted = detected()
  if not wanted:
    return False
  # DIFFJAX_COORDINATOR or SLURM: the group diffjax reads (a malformed value raises
  # ValueError, one ``error:`` line); otherwise JAX detects it (TPU VMs, JAX_COORDINATOR_ADDRESS).
  group = cluster.process_group()
  kwargs = group.initialize_kwargs() if group else {}
  # The runtime aborts the survivors of a lost peer after its own heartbeat timeout, which is
  # kept above the watchdog's (distributed.heartbeat_timeout_s), so the watchdog's one line and
  # exit status come first.
  kwargs["heartbeat_timeout_seconds"] = section.runtime_heartbeat_s()
  # Every process waits this long for all to join, then the runtime aborts it; the supervisor
  # names the coordinator and the timeout then (diffjax/train/supervise.py).
  kwargs["initialization_timeout"] = cluster.join_timeout_s()
  if group is not None:
    # A port already taken on process 0 would crash it (or raise deep in the runtime), with
    # every other process waiting for it until the timeout: one error line instead.
    cluster.check_coordinator_port(group)
  print(_joining_line(group), flush=True)
  try:
    jax.distributed.initialize(**kwargs)
  except Exception as e:  # pylint: disable=broad-except
    if "Failed to start RPC server" not in str(e):
      raise
    coordinator = group.coordinator if group else os.environ.get("JAX_COORDINATOR_ADDRESS")
    raise ValueError(cluster.port_in_use(group, coordinator)) from None
  _DONE = True
  source = f"{group.source}, coordinator {group.coordinator}" if group else "detected by JAX"
  print(
    f"diffjax: process {jax.process_index()} of {jax.process_count()} ({source}): "
    f"{jax.local_device_count()} of {jax.device_count()} {jax.default_backend()} devices here",
    flush=True,
  )
  return True


def _joining_line(group: cluster.ProcessGroup | None) -> str:
  """The line each process prints before it joins the group (which waits for all of them)."""
  wait = f"up to {cluster.join_timeout_s()} s"
  if group is None:
    return f"diffjax: joining the process group JAX detected ({wait} for every process)"
  place = f"process {group.process_id} of {group.num_processes}"
  if group.process_id == 0:
    return (
      f"diffjax: serving the coordinator at {group.coordinator} ({place}); waiting {wait} "
      "for the other processes to join"
    )
  return f"diffjax: waiting for the coordinator at {group.coordinator} ({place}; {wait})"


_RESUME_STEP: Callable[[], int] = lambda: -1


def lost_peer_line(process: int | None, count: int | None, why: str, step: int) -> str:
  """The one line a process prints when a peer (``process``, None: not known) of ``count``
  processes stopped answering; ``step`` is the newest checkpoint written (-1: none)."""
  who = "a peer process" if process is None else f"process {process}"
  if count:
    who += f" of {count}"
  resume = (
    f"to resume from the newest checkpoint (step {step} was the last one written)"
    if step >= 0
    else "to resume from the newest checkpoint"
  )
  return (
    f"error: {who} stopped answering ({why}); this process stops too. Rerun the same "
    f"command on every host {resume} (exit status {EXIT_PREEMPTED})."
  )


class _Watchdog:
  def __init__(
    self, resume_step: Callable[[], int], message: Callable[[str], None], timeout_s: float
  ):
    from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel

    self.client = jax_distributed.global_state.client
    self.me, self.n = jax.process_index(), jax.process_count()
    self.resume_step, self.message, self.timeout = resume_step, message, timeout_s
    self.stop = threading.Event()
    self.thread = threading.Thread(target=self._run, name="diffjax-peer-watchdog", daemon=True)
    self.thread.start()

  def _lost(self, process: int, why: str) -> None:
    self.message(lost_peer_line(process, self.n, why, _RESUME_STEP()))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_PREEMPTED)  # pylint: disable=protected-access

  def _run(self) -> None:
    interval = max(0.2, min(2.0, self.timeout / 10))
    beats, seen = 0, {}
    contact = time.monotonic()  # the last time the coordinator answered
    while not self.stop.is_set():
      now = time.monotonic()
      try:
        beats += 1
        self.client.key_value_set(f"{_HEARTBEAT_KEY}{self.me}", str(beats), allow_overwrite=True)
        for p in range(self.n):
          if p == self.me:
            continue
          try:
            value = self.client.key_value_try_get(f"{_HEARTBEAT_KEY}{p}")
          except Exception:  # pylint: disable=broad-except  # not written yet
            value = None
          if p not in seen or seen[p][0] != value:
            seen[p] = (value, now)
          elif now - seen[p][1] > self.timeout:
            self._lost(p, f"no heartbeat for {now - seen[p][1]:.0f} s")
        contact = now
      except Exception:  # pylint: disable=broad-except  # the coordinator is unreachable
        if self.me != 0 and now - contact > self.timeout:
          self._lost(0, f"its coordinator did not answer for {now - contact:.0f} s")
      self.stop.wait(interval)


_WATCHDOG: _Watchdog | None = None


def watch_peers(
  resume_step: Callable[[], int], message: Callable[[str], None], timeout_s: float
) -> None:
  """Starts the lost-host watchdog (see the module docstring) when this is one of several
  processes; ``resume_step()`` names the newest checkpoint the line points to, and a peer
  silent for ``timeout_s`` seconds is lost."""
  global _WATCHDOG, _RESUME_STEP
  _RESUME_STEP = resume_step
  if _WATCHDOG is not None or not _DONE or jax.process_count() == 1:
    return
  _WATCHDOG = _Watchdog(resume_step, message, timeout_s)


# What a failed collective, barrier or key-value call says when a peer or the coordinator is
# gone (gRPC's status codes, the CPU collectives' transport), for errors that wrap one.
_RUNTIME_FAILURE_TEXT = (
  "DEADLINE_EXCEEDED",
  "UNAVAILABLE",
  "coordination service",
  "Connection reset",
  "Connection closed",
  "Socket closed",
  "gloo",
  "NCCL",
  "barrier",
)


def _chain(error: BaseException) -> list[BaseException]:
  seen: list[BaseException] = []
  while error is not None and all(error is not e for e in seen):
    seen.append(error)
    error = error.__cause__ or error.__context__
  return seen


def may_be_a_lost_peer(error: BaseException) -> bool:
  """Whether ``error``, raised in the training loop of one of several processes, may come from
  a lost peer: a runtime error (``JaxRuntimeError``) anywhere in its chain; else, unless it is
  diffjax's own ``UserError`` (too many non-finite updates, a bad value), an error whose chain
  mentions the runtime or the network, or any other RuntimeError or OSError. Another user
  error (ValueError, FileNotFoundError, ...) or a mistake of the code (TypeError, ...) is not."""
  from diffjax.errors import UserError, user_errors  # pylint: disable=import-outside-toplevel

  runtime = tuple(
    t for t in (getattr(jax.errors, n, None) for n in ("JaxRuntimeError", "XlaRuntimeError")) if t
  )
  chain = _chain(error)
  if any(isinstance(e, runtime) for e in chain):
    return True
  if isinstance(error, UserError):
    return False
  if any(marker in str(e) for e in chain for marker in _RUNTIME_FAILURE_TEXT):
    return True
  if isinstance(error, user_errors()):
    return False
  return isinstance(error, (RuntimeError, OSError))


def wait_for_lost_peer(error: BaseException | None = None) -> None:
  """After the training loop failed with ``error``: when a watchdog runs and the error may
  come from a lost peer (:func:`may_be_a_lost_peer`; None: always), give the watchdog the time
  to decide whether a peer was lost (a collective with a dead peer fails before the
  heartbeats go stale). It exits the process if so; otherwise this returns and the caller
  raises its own error (at once for any other error)."""
  if _WATCHDOG is None:
    return
  if error is not None and not may_be_a_lost_peer(error):
    return
  _WATCHDOG.thread.join(timeout=_WATCHDOG.timeout + 5)


def stop_watching() -> None:
  """Stops the watchdog (the run is finishing: peers may stop at slightly different times)."""
  global _WATCHDOG
  if _WATCHDOG is not None:
    _WATCHDOG.stop.set()
    _WATCHDOG.thread.join(timeout=10)
    _WATCHDOG = None
