"""Ctrl-C (SIGINT) or SIGTERM outside a run's training stops `python -m diffjax.compare` and
`python -m diffjax.eval` with one line and status 130, also when the command was started with
SIGINT ignored, as a job started in the background of a script is. Each signal is sent when the
command prints the line that opens the phase (read from its pipe, never after a sleep)."""

import os
import signal
import subprocess
import sys

import pytest
from helpers import REPO, WAIT_LIMIT_S, own_stderr, tiny_config

pytestmark = pytest.mark.integration

EXIT_INTERRUPTED = 130
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")

# One arm, one seed, two steps and a small evaluation: the signal comes while it evaluates.
CONFIG = """
from diffjax.compare import comparison_config
from diffjax.presets import base_config


def get_config():
  base = base_config()
  base.model.update(dict(arm="transformer", size="tiny", d_model=32, num_layers=1, mlp_dim=64,
                         head_dim=16))
  base.seq_len, base.global_batch_size, base.num_steps = 32, 2, 2
  base.log_every, base.eval_every, base.eval_batches = 1, 0, 1
  base.tensorboard = False
  base.data.max_documents = 40
  base.optim.update(dict(warmup_steps=1, decay_steps=2))
  base.checkpoint.update(dict(every=2, keep=1, async_save=False))
  c = comparison_config(base, seeds=(0,), arms=("transformer",))
  c.eval.overrides = dict(context_len=128, heatmap_lengths=(128,), heatmap_needles=(1, 1),
                          val_batches=1, sections=("validation", "retrieval", "heatmap"))
  return c
"""


# Starts the command with SIGINT ignored, as a background job inherits it (exec keeps it so).
IGNORING_SIGINT = [
  sys.executable,
  "-c",
  "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
  "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])",
]


def _signal_when(argv, line_part, signum, cwd):
  """Runs ``argv`` with SIGINT ignored, sends ``signum`` when a line of its output (stdout and
  stderr together) holds ``line_part``; returns (status, output)."""
  proc = subprocess.Popen(
    [*IGNORING_SIGINT, *argv],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=ENV,
    cwd=cwd,
  )
  seen = []
  for line in proc.stdout:
    seen.append(line)
    if line_part in line:
      proc.send_signal(signum)
      break
  out, _ = proc.communicate(timeout=WAIT_LIMIT_S)
  return proc.returncode, "".join(seen) + out


def _last_line(output):
  lines = [line for line in own_stderr(output) if line.strip()]
  assert "Traceback" not in output, output[-3000:]
  return lines[-1]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_comparison_evaluates_is_one_line_and_status_130(tmp_path, signum):
  config = tmp_path / "mini.py"
  config.write_text(CONFIG)
  argv = ["-m", "diffjax.compare", f"--config={config}", f"--workdir={tmp_path}/w"]
  status, out = _signal_when(argv, "evaluating (", signum, REPO)
  assert status == EXIT_INTERRUPTED, (status, out[-3000:])
  last = _last_line(out)
  assert last.startswith(f"stopped: interrupted by signal {int(signum)}"), last
  assert "rerun the same command" in last, last
  assert not (tmp_path / "w" / "report.md").exists()
  if signum == signal.SIGINT:  # the rerun keeps the trained run and finishes the comparison
    again = subprocess.run(
      [sys.executable, *argv],
      capture_output=True,
      text=True,
      env=ENV,
      cwd=REPO,
      timeout=WAIT_LIMIT_S,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "finished earlier at step 2: skipping training" in again.stdout, again.stdout[-2000:]
    assert (tmp_path / "w" / "report.md").exists()


def test_a_signal_while_a_run_is_evaluated_is_one_line_and_status_130(tmp_path):
  from diffjax.train import train_and_evaluate  # pylint: disable=import-outside-toplevel

  wd = tmp_path / "run"
  train_and_evaluate(tiny_config(steps=2), str(wd))
  argv = ["-m", "diffjax.eval", f"--workdir={wd}", "--quick"]
  status, out = _signal_when(argv, "] validation: ", signal.SIGINT, REPO)
  assert status == EXIT_INTERRUPTED, (status, out[-3000:])
  last = _last_line(out)
  assert last == "stopped: interrupted by signal 2; nothing was written.", last
  assert not (wd / "eval.json").exists()
