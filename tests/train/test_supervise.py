"""train.py's supervisor of its training child (diffjax/train/supervise.py), with stand-in
children that print what the distributed runtime prints; the real two-process case is the slow
lost-host test in test_perf.py."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading

import pytest
from helpers import (
  REPO,
  WAIT_LIMIT_S,
  finish_processes,
  free_port,
  own_stderr,
  wait_until,
  write_atomically,
)

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


# What jaxlib 0.10.2 prints when the group does not form within the join timeout (every
# process's RegisterTask waits for all of them; process 1 of 2 without a process 0 here).
_JOIN_ABORT = textwrap.dedent("""\
  F1207 14:19:23.691876   31353 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded

  RPC: /xla.coordination.CoordinationService/RegisterTask
  *** Check failure stack trace: ***
      @     0x7f893f940634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
  """)

# ... and in process 0 of a training group when a second process 1 joins it (the healthy
# process 1 polls the same error).
_TWICE_ABORT = textwrap.dedent("""\
  E1207 14:39:02.286812   23576 coordination_service.cc:518] [11497419961456852104] 1 unexpectedly tried to connect with a different incarnation. It has likely restarted.
  E1207 14:39:02.287177   23584 coordination_service_agent.cc:289] Polled an error from coordination service (this can be an error from this or another task).
  F1207 14:39:02.287315   23584 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: ABORTED: 1 unexpectedly tried to connect with a different incarnation. It has likely restarted.
  *** Check failure stack trace: ***
  """)

# ... when process 0 cannot serve the coordinator on its port; then it crashes (or raises).
_PORT_LINE = (
  "E1207 14:14:18.938227   31399 add_port.cc:83] Failed to add port to server: No address "
  "added out of total 1 resolved for '[::]:23462'\n"
)


def _group_env(monkeypatch, process: int, count: int = 2, id_name="DIFFJAX_PROCESS_ID"):
  for key in list(os.environ):
    if (
      key.startswith(("SLURM_", "DIFFJAX_", "TPU_WORKER", "JAX_")) or key == "JOB_COMPLETION_INDEX"
    ):
      monkeypatch.delenv(key)
  monkeypatch.setenv("DIFFJAX_COORDINATOR", "127.0.0.1:23462")
  monkeypatch.setenv("DIFFJAX_NUM_PROCESSES", str(count))
  monkeypatch.setenv(id_name, str(process))


def _aborting(text: str) -> str:
  return f"""
      import os, sys
      sys.stderr.write({text!r}); sys.stderr.flush()
      os.abort()"""


def _child(body: str) -> list[str]:
  return [sys.executable, "-c", textwrap.dedent(body)]


def _run(body: str, workdir: str, **kw) -> tuple[int, str]:
  err = io.StringIO()
  status = supervise.run(_child(body), workdir, err=err, **kw)
  return status, err.getvalue()


def test_the_runtime_abort_becomes_one_line_and_the_relaunch_status(tmp_path, monkeypatch):
  _group_env(monkeypatch, 1)
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


@pytest.mark.parametrize(
  "process, says",
  [
    (
      1,
      "error: process 1 of 2 could not join the coordinator at 127.0.0.1:23462 "
      "(DIFFJAX_COORDINATOR) within 300 s: start process 0",
    ),
    (
      0,
      "error: the process group did not form within 300 s: process 0 of 2 serves the "
      "coordinator at 127.0.0.1:23462 (DIFFJAX_COORDINATOR), but not every other process",
    ),
  ],
)
def test_a_group_that_never_formed_is_one_line_and_status_2(tmp_path, monkeypatch, process, says):
  # Not a lost peer (status 75, which tpu_setup/babysit.sh and the SLURM script relaunch on):
  # the same command would wait the same way.
  _group_env(monkeypatch, process)
  status, err = _run(_aborting(_JOIN_ABORT), str(tmp_path))
  assert status == 2, err
  (line,) = err.splitlines()
  assert line.startswith(says), line
  assert "stopped answering" not in line
  log = tmp_path / f"runtime_abort.process{process}.txt"
  assert line.endswith(f"The runtime's message: {log}") and "RegisterTask" in log.read_text()


def test_the_join_timeout_named_is_the_one_set(tmp_path, monkeypatch):
  _group_env(monkeypatch, 1)
  monkeypatch.setenv("DIFFJAX_JOIN_TIMEOUT_S", "20")
  status, err = _run(_aborting(_JOIN_ABORT), str(tmp_path))
  assert status == 2 and "(DIFFJAX_COORDINATOR) within 20 s" in err, err


def test_a_process_that_joined_twice_is_one_line_and_status_2(tmp_path, monkeypatch):
  # The healthy process 0 (and 1) of a group that a second process 1 joined: a relaunch of
  # everything on 75 would start the duplicate again, so status 2, naming it.
  _group_env(monkeypatch, 0)
  (tmp_path / "checkpoints" / "40").mkdir(parents=True)
  status, err = _run(_aborting(_TWICE_ABORT), str(tmp_path))
  assert status == 2, err
  (line,) = err.splitlines()
  assert line.startswith(
    "error: process 1 of 2 joined the process group twice (a duplicate DIFFJAX_PROCESS_ID, or "
    "an old process still running)"
  ), line
  assert "own DIFFJAX_PROCESS_ID in 0..1" in line and "step 40 was the last one written" in line
  assert "stopped answering" not in line


def test_the_abort_log_of_a_kubernetes_pod_is_named_after_its_index(tmp_path, monkeypatch):
  # Every pod is pid 1 in its container: a log named after the pid would be overwritten.
  _group_env(monkeypatch, 1, id_name="JOB_COMPLETION_INDEX")
  status, err = _run(_aborting(_ABORT), str(tmp_path))
  assert status == 75, err
  assert err.startswith("error: process 0 of 2 stopped answering"), err
  assert [p.name for p in tmp_path.iterdir()] == ["runtime_abort.process1.txt"]
  assert str(tmp_path / "runtime_abort.process1.txt") in err


def test_a_port_the_runtime_could_not_serve_on_is_one_line_and_status_2(tmp_path, monkeypatch):
  _group_env(monkeypatch, 0)
  crash = f"""
      import os, resource, signal, sys
      resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
      sys.stderr.write({_PORT_LINE!r}); sys.stderr.flush()
      signal.signal(signal.SIGSEGV, signal.SIG_DFL)
      os.kill(os.getpid(), signal.SIGSEGV)"""
  status, err = _run(crash, str(tmp_path))
  assert status == 2, err
  (line,) = err.splitlines()
  assert line.startswith(
    "error: port 23462 of DIFFJAX_COORDINATOR=127.0.0.1:23462 is already in use on this host"
  ), line
  # When the child names the port itself (the runtime raised), only its line is left.
  named = f"""
      import sys
      sys.stderr.write({_PORT_LINE!r})
      print("error: port 23462 of DIFFJAX_COORDINATOR=... is already in use", file=sys.stderr)
      sys.exit(2)"""
  status, err = _run(named, str(tmp_path))
  assert (status, err) == (2, "error: port 23462 of DIFFJAX_COORDINATOR=... is already in use\n")


def _signal_when_ready(ready, signum):
  def send():
    try:
      wait_until(ready.exists, "the child's ready file")
    finally:  # the supervisor must end either way; a missing file fails the status check
      os.kill(os.getpid(), signum)

  thread = threading.Thread(target=send)
  thread.start()
  return thread


_WITHOUT_HANDLERS = {
  # Killed by the signal: the child had not set its handlers yet.
  "sigterm": (signal.SIGTERM, "signal.signal(signal.SIGTERM, signal.SIG_DFL)"),
  # Python's own KeyboardInterrupt, its traceback and status 1 (an interrupt in the
  # interpreter's start-up, "Fatal Python error: init_import_site", ends the same way).
  "sigint": (signal.SIGINT, "signal.signal(signal.SIGINT, signal.default_int_handler)"),
}


@pytest.mark.parametrize("which", list(_WITHOUT_HANDLERS))
def test_a_stop_signal_before_the_child_took_it_is_the_one_line_and_75(tmp_path, which):
  signum, handler = _WITHOUT_HANDLERS[which]
  ready = tmp_path / "ready"
  body = f"""
      import pathlib, signal, sys, time
      {handler}
      pathlib.Path({str(ready)!r}).write_text("")
      try:
        time.sleep(60)
      except KeyboardInterrupt:
        print("Fatal Python error: init_import_site: Failed to import the site module",
              file=sys.stderr, flush=True)
        raise"""
  thread = _signal_when_ready(ready, signum)
  status, err = _run(body, str(tmp_path))
  thread.join()
  assert status == 75, err
  assert err == (
    f"diffjax: stopped by signal {int(signum)}; rerun the same command to resume from the "
    "newest complete checkpoint.\n"
  )


def test_a_child_killed_by_a_signal_the_supervisor_did_not_pass_keeps_its_status(tmp_path):
  status, err = _run("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", str(tmp_path))
  assert (status, err) == (128 + signal.SIGTERM, "")


def test_the_child_is_started_with_the_interpreters_options(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
  code = "from diffjax.train import supervise; print(supervise.child_command('t.py', ['--a']))"
  for flags, want, unwanted in [
    (["-u", "-X", "dev", "-W", "ignore::UserWarning"], ["-u", "-X", "dev"], []),
    ([], [], ["-u", "dev"]),
  ]:
    out = subprocess.run(
      [sys.executable, *flags, "-c", code],
      capture_output=True,
      text=True,
      check=True,
      env=env,
      cwd=REPO,
      timeout=WAIT_LIMIT_S,
    ).stdout
    command = eval(out.strip().splitlines()[-1])  # pylint: disable=eval-used
    assert command[0] == sys.executable and command[-2:] == ["t.py", "--a"], command
    assert all(f in command for f in want), command
    assert not any(f in command for f in unwanted), command
    assert ("-Wignore::UserWarning" in command) == bool(flags), command


# ---- train.py itself, supervised -----------------------------------------------------------------


def _train_py(wd, **env_extra) -> subprocess.Popen:
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
  for key in list(env):
    if key.startswith(("SLURM_", "DIFFJAX_", "TPU_WORKER", "JAX_COORDINATOR")):
      env.pop(key)
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO, **env_extra)
  return subprocess.Popen(
    [
      sys.executable,
      "train.py",
      "--config=configs/tiny.py",
      f"--workdir={wd}",
      "--config.log_every=1",
      "--config.eval_every=0",
      "--config.global_batch_size=4",
      "--config.seq_len=32",
      "--config.num_steps=100000",
      "--config.checkpoint.every=4",
    ],
    cwd=REPO,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def test_a_taken_coordinator_port_is_one_line_at_once(tmp_path):
  with socket.socket() as held:
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    proc = _train_py(
      str(tmp_path / "wd"),
      DIFFJAX_COORDINATOR=f"127.0.0.1:{port}",
      DIFFJAX_NUM_PROCESSES="2",
      DIFFJAX_PROCESS_ID="0",
    )
    ((_, err),) = finish_processes([proc])
  assert proc.returncode == 2, err[-3000:]
  assert own_stderr(err) == [
    f"error: port {port} of DIFFJAX_COORDINATOR=127.0.0.1:{port} is already in use on this "
    "host (another run's coordinator, or an old process still holding it), so process 0 "
    f"cannot serve the coordinator 127.0.0.1:{port} there: stop that process, or give every "
    "process another port in DIFFJAX_COORDINATOR."
  ], err[-3000:]


def _children(pid: int) -> list[int]:
  try:
    with open(f"/proc/{pid}/task/{pid}/children", encoding="utf-8") as f:
      return [int(c) for c in f.read().split()]
  except OSError:
    return []


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")
def test_sigterm_as_the_supervisor_starts_its_child_is_the_one_line_and_75(tmp_path):
  # One process of a group of one: supervised all the same, no peer to wait for.
  proc = _train_py(
    str(tmp_path / "wd"),
    DIFFJAX_COORDINATOR="127.0.0.1:1",
    DIFFJAX_NUM_PROCESSES="1",
    DIFFJAX_PROCESS_ID="0",
  )
  try:
    wait_until(lambda: _children(proc.pid), "the supervised child", procs=[proc], poll_s=0.005)
  finally:
    proc.send_signal(signal.SIGTERM)
  ((_, err),) = finish_processes([proc])
  assert proc.returncode == 75, err[-3000:]
  assert own_stderr(err) == [
    "diffjax: stopped by signal 15; rerun the same command to resume from the newest complete "
    "checkpoint."
  ], err[-3000:]


def test_a_process_whose_coordinator_never_answers_says_so_and_exits_2(tmp_path):
  # Process 1 of 2 alone, with a join timeout of 5 s instead of 300.
  port = free_port()
  wd = tmp_path / "wd"
  proc = _train_py(
    str(wd),
    DIFFJAX_COORDINATOR=f"127.0.0.1:{port}",
    DIFFJAX_NUM_PROCESSES="2",
    DIFFJAX_PROCESS_ID="1",
    DIFFJAX_JOIN_TIMEOUT_S="5",
  )
  ((out, err),) = finish_processes([proc])
  assert proc.returncode == 2, err[-3000:]
  assert (
    f"diffjax: waiting for the coordinator at 127.0.0.1:{port} (process 1 of 2; up to 5 s)" in out
  )
  lines = own_stderr(err)
  assert len(lines) == 1 and lines[0].startswith(
    f"error: process 1 of 2 could not join the coordinator at 127.0.0.1:{port} "
    "(DIFFJAX_COORDINATOR) within 5 s"
  ), err[-3000:]
  assert (wd / "runtime_abort.process1.txt").exists()


# A group of two to its first checkpoint, then a third process with a duplicate id: a minute
# and a half on 2 cores.
@pytest.mark.slow
def test_a_duplicate_process_id_stops_the_group_with_status_2(tmp_path):
  port = free_port()
  wd = tmp_path / "wd"
  group = dict(
    DIFFJAX_COORDINATOR=f"127.0.0.1:{port}", DIFFJAX_NUM_PROCESSES="2", DIFFJAX_JOIN_TIMEOUT_S="20"
  )
  procs = [_train_py(str(wd), **group, DIFFJAX_PROCESS_ID=str(i)) for i in range(2)]
  try:
    wait_until(lambda: (wd / "checkpoints" / "4").exists(), "a checkpoint", procs=procs)
    procs.append(_train_py(str(wd), **group, DIFFJAX_PROCESS_ID="1"))
    results = finish_processes(procs)
  finally:
    finish_processes(procs, timeout=1)
  assert [p.returncode for p in procs] == [2, 2, 2], [e[-2000:] for _, e in results]
  for _, err in results[:2]:
    (line,) = [l for l in own_stderr(err) if l.startswith("error:")]
    assert line.startswith("error: process 1 of 2 joined the process group twice"), line
  # The duplicate itself never joined: it waited its join timeout.
  (line,) = [l for l in own_stderr(results[2][1]) if l.startswith("error:")]
  assert "could not join the coordinator" in line or "joined the process group twice" in line
  assert "stopped answering" not in "".join(e for _, e in results)
