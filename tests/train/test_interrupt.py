"""Ctrl-C (SIGINT) or SIGTERM at each phase of train.py (preparing data, compiling, training,
saving): exit status 75, no traceback, and the next run resumes from the newest complete
checkpoint. Each signal is sent when the child prints the line that opens the phase (read from
its pipe, never after a sleep), and the child is started with SIGINT ignored, as a job started in
the background of a script is: train.py must answer Ctrl-C even then."""

import json
import os
import signal
import subprocess
import sys

import pytest
from helpers import REPO, WAIT_LIMIT_S, own_stderr  # noqa: E402

pytestmark = pytest.mark.integration

EXIT_PREEMPTED = 75
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
  "--config.checkpoint.every=2",
]
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def _ignore_sigint():
  signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start(args, cwd, env=None):
  return subprocess.Popen(
    [sys.executable, os.path.join(REPO, "train.py"), *SMALL_RUN, *args],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=env or ENV,
    cwd=cwd,
    preexec_fn=_ignore_sigint,  # as a background job inherits it
  )


def _signal_when(line_start, args, cwd, signum=signal.SIGINT, *, on_stderr=False, env=None):
  """Starts train.py with ``args``, sends ``signum`` when a line of its stdout (or stderr)
  starts with ``line_start``; returns (status, stdout, stderr)."""
  proc = _start(args, cwd, env)
  seen = []
  for line in proc.stderr if on_stderr else proc.stdout:
    seen.append(line)
    if line.startswith(line_start):
      proc.send_signal(signum)
      break
  out, err = proc.communicate(timeout=WAIT_LIMIT_S)
  if on_stderr:
    return proc.returncode, out, "".join(seen) + err
  return proc.returncode, "".join(seen) + out, err


def _train(args, cwd):
  return subprocess.run(
    [sys.executable, os.path.join(REPO, "train.py"), *SMALL_RUN, *args],
    capture_output=True,
    text=True,
    env=ENV,
    cwd=cwd,
    timeout=WAIT_LIMIT_S,
  )


def _one_line(err):
  lines = [line for line in own_stderr(err) if line.strip()]
  assert "Traceback" not in err, err[-3000:]
  assert len(lines) == 1 and "rerun the same command" in lines[0], err[-3000:]
  return lines[0]


def _saved_step(out):
  """The step the trainer's stop line says it saved."""
  (line,) = [ln for ln in out.splitlines() if ln.startswith("Signal ")]
  assert "rerun the same command" in line, line
  return int(line.split("saved step ")[1].split(";")[0])


def test_ctrl_c_while_the_data_are_prepared_is_status_75_and_the_rerun_trains(tmp_path):
  # A corpus of text files prepared into an empty data cache: the run says so on stderr
  # before it prepares them, and is stopped there.
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(120):
    (corpus / f"doc{i:03d}.py").write_text(f"def f{i}(x):\n  return x + {i}\n" * 40)
  env = dict(ENV, DIFFJAX_DATA_CACHE=str(tmp_path / "cache"))
  wd = tmp_path / "run"
  args = [f"--workdir={wd}", "--config.data.kind=text", f"--config.data.paths=('{corpus}',)"]
  status, out, err = _signal_when(
    "diffjax: preparing", [*args, "--config.num_steps=300"], tmp_path, on_stderr=True, env=env
  )
  assert status == EXIT_PREEMPTED, (status, err[-3000:])
  if "Signal 2: saved step" not in out:  # stopped before its first step (else the loop saved)
    assert "signal 2" in _one_line(err.split("(once)\n", 1)[1])  # the line after the notice
    assert not (wd / "checkpoints").exists() or not os.listdir(wd / "checkpoints")
  # The rerun finishes the preparation and trains.
  again = subprocess.run(
    [sys.executable, os.path.join(REPO, "train.py"), *SMALL_RUN, *args, "--config.num_steps=3"],
    capture_output=True,
    text=True,
    env=env,
    cwd=tmp_path,
    timeout=WAIT_LIMIT_S,
  )
  assert again.returncode == 0, again.stderr[-3000:]
  assert (wd / "DONE").read_text().strip() == "3"


@pytest.mark.slow  # four short runs of train.py one after the other
def test_ctrl_c_while_compiling_training_and_saving_is_status_75_and_each_rerun_resumes(tmp_path):
  wd = tmp_path / "run"
  args = [f"--workdir={wd}", "--config.log_every=1", "--config.eval_batches=4"]
  # Compiling: the line before the first step's compile. The step runs, is saved, and the run
  # stops (or, reached before the training loop, it stops at once with one line).
  status, out, err = _signal_when("diffjax: arm=", [*args, "--config.num_steps=300"], tmp_path)
  assert status == EXIT_PREEMPTED, (status, err[-3000:])
  assert "Traceback" not in err, err[-3000:]
  first = _saved_step(out) if "Signal 2: saved step" in out else 0
  if not first:
    assert "signal 2" in _one_line(err)
  # Training: a few steps further, stopped at a step's line; it saves that step.
  status, out, err = _signal_when(f"step {first + 2}/", [*args, "--config.num_steps=300"], tmp_path)
  assert status == EXIT_PREEMPTED, (status, err[-3000:])
  assert "Traceback" not in err, err[-3000:]
  if first:
    assert f"Resumed from step {first}" in out, out[-2000:]
  second = _saved_step(out)
  assert second >= first + 2
  # Saving: at the last step's line the run saves it (and would evaluate and finish).
  last = second + 3 + second % 2  # odd, not a multiple of checkpoint.every: the final save
  status, out, err = _signal_when(f"step {last}/", [*args, f"--config.num_steps={last}"], tmp_path)
  assert status == EXIT_PREEMPTED, (status, err[-3000:])
  assert "Traceback" not in err, err[-3000:]
  assert f"Resumed from step {second}" in out and _saved_step(out) == last, out[-2000:]
  assert not (wd / "DONE").exists() and not (wd / "final_metrics.json").exists()
  # The rerun restores the last step, trains nothing, evaluates and finishes.
  done = _train([*args, f"--config.num_steps={last}"], tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  assert f"Resumed from step {last}" in done.stdout, done.stdout[-2000:]
  assert (wd / "DONE").read_text().strip() == str(last)
  steps = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
  trained = [r["step"] for r in steps if "train/loss" in r]
  assert trained == list(range(1, last + 1)), trained  # each step once


def test_sigterm_after_the_restore_is_status_75_and_the_next_run_resumes(tmp_path):
  wd = f"--workdir={tmp_path / 'run'}"
  first = _train([wd, "--config.num_steps=3"], tmp_path)
  assert first.returncode == 0, first.stderr[-3000:]
  # Extending the run: stopped while it restores step 3 and compiles.
  status, out, err = _signal_when(
    "Resumed from step 3", [wd, "--config.num_steps=300"], tmp_path, signal.SIGTERM
  )
  assert status == EXIT_PREEMPTED, (status, err[-3000:])
  if "saved step" not in out:  # it stopped before its first step (else the loop saved it)
    assert "signal 15" in _one_line(err)
  again = _train([wd, "--config.num_steps=5"], tmp_path)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "Resumed from step" in again.stdout, again.stdout[-2000:]
  assert (tmp_path / "run" / "DONE").read_text().strip() == "5"
