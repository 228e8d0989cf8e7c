"""One workdir, one training: a finished run is left as it is when rerun, a resumed one loads
the programs it compiled from the workdir, a second trainer is refused while the first writes,
and a lock left by a killed process does not block."""

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import REPO, WAIT_LIMIT_S, own_stderr  # noqa: E402

from diffjax.train.workdir import WorkdirBusy, WorkdirLock

pytestmark = pytest.mark.integration

# A one-layer model on 40 documents: starts, trains and stops within a test.
SMALL_RUN = [
  "--config=" + os.path.join(REPO, "configs/tiny.py"),
  "--config.model.num_layers=1",
  "--config.model.d_model=64",
  "--config.model.mlp_dim=128",
  "--config.seq_len=32",
  "--config.global_batch_size=2",
  "--config.data.max_documents=40",
  "--config.eval_every=0",
  "--config.eval_batches=1",
  "--config.tensorboard=False",
  "--config.log_every=1",
]
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def _train(workdir, *args, timeout=WAIT_LIMIT_S, env=None):
  return subprocess.run(
    [sys.executable, os.path.join(REPO, "train.py"), f"--workdir={workdir}", *SMALL_RUN, *args],
    capture_output=True,
    text=True,
    env=ENV if env is None else env,
    cwd=REPO,
    timeout=timeout,
  )


def _start(workdir, *args):
  return subprocess.Popen(
    [sys.executable, os.path.join(REPO, "train.py"), f"--workdir={workdir}", *SMALL_RUN, *args],
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    text=True,
    env=ENV,
    cwd=REPO,
  )


def _hashes(workdir):
  out = {}
  for root, _, files in os.walk(workdir):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, workdir)] = hashlib.sha256(f.read()).hexdigest()
  return out


def _wait_for_steps(proc, n, timeout=WAIT_LIMIT_S):
  """Reads ``proc``'s stdout until its progress line reaches step ``n``."""
  deadline = time.time() + timeout
  for line in proc.stdout:
    if line.startswith("step ") and int(line.split()[1].split("/")[0]) >= n:
      return
    assert time.time() < deadline, "the run did not reach its steps in time"
  raise AssertionError(f"the run ended before step {n} (status {proc.wait()})")


def test_rerunning_a_finished_run_leaves_every_file_unchanged(tmp_path):
  wd = tmp_path / "run"
  first = _train(wd, "--config.num_steps=3", "--config.checkpoint.every=2")
  assert first.returncode == 0, first.stderr[-3000:]
  before = _hashes(wd)
  assert "final_metrics.json" in before and "DONE" in before
  first_metrics = (wd / "metrics.jsonl").read_text()

  again = _train(wd, "--config.num_steps=3", "--config.checkpoint.every=2")
  assert again.returncode == 0, again.stderr[-3000:]
  assert _hashes(wd) == before
  said = [line for line in again.stdout.splitlines() if "already finished" in line]
  assert len(said) == 1 and "step 3" in said[0], again.stdout[-2000:]
  assert "final:" not in again.stdout  # nothing was evaluated again

  # A larger num_steps extends the run: steps 4 and 5 are trained, the earlier records kept.
  more = _train(wd, "--config.num_steps=5", "--config.checkpoint.every=2")
  assert more.returncode == 0, more.stderr[-3000:]
  assert "Resumed from step 3" in more.stdout, more.stdout[-2000:]
  assert (wd / "DONE").read_text().strip() == "5"
  # Every line of the finished run is still there, before the new steps' lines.
  assert (wd / "metrics.jsonl").read_text().startswith(first_metrics)


def test_a_resumed_run_loads_the_programs_it_compiled_from_the_workdir(tmp_path):
  wd = tmp_path / "run"
  own_cache = {k: v for k, v in ENV.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  # Every program is kept, however quickly it compiled (a CPU compiles these in under 1 s).
  own_cache["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  first = _train(wd, "--config.num_steps=2", "--config.checkpoint.every=2", env=own_cache)
  assert first.returncode == 0, first.stderr[-3000:]
  assert os.listdir(wd / "compile_cache")
  # JAX logs each program its persistent cache gave at WARNING with JAX_LOG_COMPILES.
  more = _train(
    wd,
    "--config.num_steps=4",
    "--config.checkpoint.every=2",
    env=dict(own_cache, JAX_LOG_COMPILES="1"),
  )
  assert more.returncode == 0, more.stderr[-3000:]
  assert "Resumed from step 2" in more.stdout, more.stdout[-2000:]
  hits = [line for line in more.stderr.splitlines() if "Persistent compilation cache hit" in line]
  assert hits, more.stderr[-3000:]

  # JAX_COMPILATION_CACHE_DIR names another place: the workdir gets no cache.
  elsewhere = tmp_path / "elsewhere"
  other = _train(
    tmp_path / "run2",
    "--config.num_steps=1",
    env=dict(own_cache, JAX_COMPILATION_CACHE_DIR=str(elsewhere)),
  )
  assert other.returncode == 0, other.stderr[-3000:]
  assert not (tmp_path / "run2" / "compile_cache").exists() and os.listdir(elsewhere)


def test_a_second_trainer_in_the_same_workdir_is_refused(tmp_path):
  wd = tmp_path / "run"
  first = _start(wd, "--config.num_steps=100000", "--config.checkpoint.every=1000000")
  try:
    _wait_for_steps(first, 2)
    second = _train(wd, "--config.num_steps=100000", timeout=WAIT_LIMIT_S)
    errors = [line for line in own_stderr(second.stderr) if line.startswith("error:")]
    assert second.returncode == 2 and len(errors) == 1, (second.returncode, second.stderr[-2000:])
    assert f"pid {first.pid}" in errors[0] and socket.gethostname() in errors[0], errors[0]
    assert first.poll() is None  # the first one goes on training
    _wait_for_steps(first, 4)
  finally:
    first.send_signal(signal.SIGTERM)
    out, _ = first.communicate(timeout=WAIT_LIMIT_S)
  assert first.returncode == 75, out[-2000:]
  assert "saved step" in out


def test_a_lock_left_by_a_killed_process_does_not_block(tmp_path):
  wd = tmp_path / "run"
  first = _start(wd, "--config.num_steps=100000", "--config.checkpoint.every=1")
  _wait_for_steps(first, 2)
  first.send_signal(signal.SIGKILL)
  first.wait()
  assert (wd / ".lock").read_text().split()[0] == str(first.pid)  # left behind, but not held
  r = _train(wd, "--config.num_steps=3")
  assert r.returncode == 0, r.stderr[-3000:]
  assert (wd / "DONE").read_text().strip() == "3"


def test_the_lock_is_exclusive_and_released(tmp_path):
  holder = WorkdirLock(str(tmp_path))
  holder.acquire()
  # flock locks belong to the open file: a second open in this process contends like another
  # process would.
  try:
    WorkdirLock(str(tmp_path)).acquire()
    raise AssertionError("a second lock was granted")
  except WorkdirBusy as e:
    assert f"pid {os.getpid()}" in str(e)
  holder.release()
  again = WorkdirLock(str(tmp_path))
  again.acquire()
  again.release()
  assert WorkdirLock("gs://bucket/run").enabled is False
