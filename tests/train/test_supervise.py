"""train.py's supervisor of its training child (diffjax/train/supervise.py), with stand-in
children that print what the distributed runtime prints; the real two-process case is the slow
lost-host test in test_perf.py."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
from helpers import wait_until, write_atomically

from diffjax.train import supervise

pytestmark = pytest.mark.integration

# The lines jaxlib 0.10.2 prints when the coordination service (in process 0) is gone, then
# its check-failure stack; the stand-in child aborts after them as the runtime does.
_ABORT = textwrap.dedent("""\
  W1203 12:58:23.004166   25947 preemption_sync_manager.cc:147] Failed to retrieve preemption notice from coordination service: UNAVAILABLE: Socket closed
  Additional GRPC error information from remote target coordination_service while calling /xla.coordination.CoordinationService/GetKeyValue:
  E1203 12:58:23.004226   25947 coordination_service_agent.cc:289] Polled an error from coordination service (this can be an error from this or another task).
  F1203 12:58:23.004232   25947 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died. absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was preempted/died/restarted unexpectedly or this task is experiencing network issues.
  *** Check failure stack trace: ***
      @     0x7f5695c40634  absl::log_internal::LogMessage::SendToLog()
  """)


def _child(body: str) -> list[str]:
  return [sys.executable, "-c", textwrap.dedent(body)]


def _run(body: str, workdir: str, **kw) -> tuple[int, str]:
  err = io.StringIO()
  status = supervise.run(_child(body), workdir, err=err, **kw)
  return status, err.getvalue()


def test_the_runtime_abort_becomes_one_line_and_the_relaunch_status(tmp_path, monkeypatch):
  monkeypatch.setenv("DIFFJAX_PROCESS_ID", "1")
  monkeypatch.setenv("DIFFJAX_NUM_PROCESSES", "2")
  for step in (4, 8):  # two finished checkpoints and one save that never finished
    (tmp_path / "checkpoints" / str(step)).mkdir(parents=True)
  (tmp_path / "checkpoints" / "12.orbax-checkpoint-tmp-1").mkdir()
  status, err = _run(
    f"""
      import os, sys
      print("step 10: loss 2.5", file=sys.stderr, flush=True)
      sys.stderr.write({_ABORT!r}); sys.stderr.flush()
      os.abort()""",
    str(tmp_path),
  )
  assert status == 75, err
  lines = err.splitlines()
  assert lines[0] == "step 10: loss 2.5", lines
  assert len(lines) == 2, lines
  assert lines[1].startswith("error: process 0 of 2 stopped answering"), lines
  assert "step 8 was the last one written" in lines[1], lines
  log = tmp_path / "runtime_abort.process1.txt"
  assert str(log) in lines[1]
  assert "Check failure stack trace" in log.read_text()
  assert "Check failure" not in err


def test_runtime_warnings_that_no_abort_follows_are_printed(tmp_path):
  status, err = _run(
    """
      import sys, time
      print("W1203 12:58:23.004166   25947 coordination_service_agent.cc:10] a passing warning",
            file=sys.stderr, flush=True)
      print("its second line", file=sys.stderr, flush=True)
      time.sleep(1.0)
      print("later", file=sys.stderr, flush=True)
      time.sleep(1.0)
      sys.exit(3)""",
    str(tmp_path),
    hold_s=0.3,
  )
  assert status == 3
  assert err.splitlines() == [
    "W1203 12:58:23.004166   25947 coordination_service_agent.cc:10] a passing warning",
    "its second line",
    "later",
  ], err


def test_a_child_that_aborts_for_another_reason_keeps_its_message_and_status(tmp_path):
  status, err = _run(
    """
      import os, sys
      print("F1203 12:58:23.004232   25947 some_kernel.cc:80] Check failed: x == y",
            file=sys.stderr, flush=True)
      os.abort()""",
    str(tmp_path),
  )
  assert status == 128 + signal.SIGABRT
  assert "Check failed: x == y" in err and "error:" not in err
  assert not list(tmp_path.iterdir())


def test_sigterm_to_the_supervisor_reaches_the_child(tmp_path):
  ready = tmp_path / "ready"
  body = f"""
      import signal, sys, time, pathlib
      got = []
      signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
      pathlib.Path({str(ready)!r}).write_text("")
      while not got:
        time.sleep(0.05)
      print("saved; stopping", file=sys.stderr, flush=True)
      sys.exit(75)"""

  def terminate_when_ready():
    try:
      wait_until(ready.exists, "the child's ready file")
    finally:  # the supervisor must end either way; a missing file fails the status check
      os.kill(os.getpid(), signal.SIGTERM)

  before = signal.getsignal(signal.SIGTERM)
  killer = threading.Thread(target=terminate_when_ready)
  killer.start()
  status, err = _run(body, str(tmp_path))
  killer.join()
  assert (status, err) == (75, "saved; stopping\n")
  assert signal.getsignal(signal.SIGTERM) is before  # the supervisor's handler is gone


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def test_killing_the_supervisor_kills_the_child(tmp_path):
  pid_file = tmp_path / "child.pid"
  # The child writes its process id whole (a rename), then sleeps far longer than any wait
  # here, so only its supervisor's death can end it.
  grandchild = (
    "from diffjax.train import supervise; supervise.follow_parent(); import os, time; "
    + write_atomically(str(pid_file), "str(os.getpid())")
    + "; time.sleep(3600)"
  )
  parent = subprocess.Popen(
    [
      sys.executable,
      "-c",
      textwrap.dedent(f"""
      import sys
      from diffjax.train import supervise
      sys.exit(supervise.run([sys.executable, "-c", {grandchild!r}], {str(tmp_path)!r}))"""),
    ]
  )
  try:
    wait_until(pid_file.exists, "the supervised child's process id", procs=[parent])
  finally:
    if not pid_file.exists():
      parent.kill()
      parent.wait()
  child = int(pid_file.read_text())
  parent.kill()
  parent.wait()
  try:
    wait_until(lambda: not _alive(child), "the child's end after its supervisor was killed")
  finally:
    if _alive(child):
      os.kill(child, signal.SIGKILL)


def test_which_process_the_runtime_blames():
  assert supervise.lost_process(_ABORT, me=1) == 0
  assert (
    supervise.lost_process(
      "task /job:jax_worker/replica:0/task:2 is unhealthy; /job:jax_worker/replica:0/task:1", me=1
    )
    == 2
  )
  assert supervise.lost_process("something else", me=1) is None


def test_supervision_is_wanted_only_for_several_processes(monkeypatch):
  from diffjax.train.sections import DistributedConfig  # pylint: disable=import-outside-toplevel

  c = DistributedConfig()
  for key in (
    "DIFFJAX_COORDINATOR",
    "JAX_COORDINATOR_ADDRESS",
    "SLURM_NTASKS",
    "TPU_WORKER_HOSTNAMES",
    "MEGASCALE_COORDINATOR_ADDRESS",
    supervise.ENV,
  ):
    monkeypatch.delenv(key, raising=False)
  monkeypatch.setattr("diffjax.train.distributed.detected", lambda: False)
  assert not supervise.wanted(c)
  monkeypatch.setattr("diffjax.train.distributed.detected", lambda: True)
  assert supervise.wanted(c)
  assert not supervise.wanted(DistributedConfig(supervise=False))
  monkeypatch.setenv(supervise.ENV, "1")  # the child itself
  assert not supervise.wanted(c)


@pytest.mark.parametrize(
  "peer, beat, want", [(60.0, None, 180), (10.0, None, 100), (10.0, 20.5, 21), (5.0, 30.0, 30)]
)
def test_the_runtime_gets_the_run_heartbeat_timeout(monkeypatch, peer, beat, want):
  from diffjax.train import distributed  # pylint: disable=import-outside-toplevel
  from diffjax.train.sections import DistributedConfig  # pylint: disable=import-outside-toplevel

  calls = []
  monkeypatch.setattr(distributed, "_DONE", False)
  monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kw: calls.append(kw))
  monkeypatch.setenv("DIFFJAX_COORDINATOR", "127.0.0.1:1")
  monkeypatch.setenv("DIFFJAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("DIFFJAX_PROCESS_ID", "0")
  section = DistributedConfig(initialize=True, peer_timeout_s=peer, heartbeat_timeout_s=beat)
  assert distributed.maybe_initialize(section)
  (kw,) = calls
  assert kw["heartbeat_timeout_seconds"] == want and kw["num_processes"] == 2
