"""tpu_setup/ scripts: syntax, shellcheck (when installed) and the offline self-test."""

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import REPO, WAIT_LIMIT_S, wait_until  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = REPO
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "tpu_setup", "*.sh")))


def test_scripts_exist():
  names = {os.path.basename(s) for s in SCRIPTS}
  assert {"create.sh", "bootstrap.sh", "run.sh", "babysit.sh", "teardown.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_bash_syntax(script):
  r = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_clean():
  r = subprocess.run(["shellcheck", *SCRIPTS], capture_output=True, text=True, cwd=ROOT)
  assert r.returncode == 0, r.stdout[-4000:]


@pytest.mark.slow  # about 90 s on 2 cores; test_shellcheck_clean and the unit checks run by default
def test_selftest_dry_runs():
  r = subprocess.run(
    ["bash", os.path.join(ROOT, "tpu_setup", "selftest.sh")],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=WAIT_LIMIT_S,
    env={**os.environ, "SELFTEST_BOOTSTRAP": "0"},
  )
  assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
  summary = re.findall(r"^(\d+) checks, (\d+) failed$", r.stdout, re.M)
  assert len(summary) == 1, r.stdout[-2000:]
  checks, failed = map(int, summary[0])
  assert failed == 0 and checks > 0, r.stdout[-2000:]


def _babysit_dry(tmp_path, exits):
  """One dry-run check of a READY TPU whose train.py is not running and last exited
  with status ``exits``."""
  env = {
    **os.environ,
    "DRY_RUN_STATE": "READY",
    "DRY_RUN_TRAINING": "NONE",
    "DRY_RUN_EXITS": exits,
    "TMPDIR": str(tmp_path),
  }
  return subprocess.run(
    [
      "bash",
      os.path.join(ROOT, "tpu_setup", "babysit.sh"),
      "--dry-run",
      "--zone=us-west4-a",
      "--name=my-v5e",
      "--config=configs/default.py",
      "--workdir=gs://b/t",
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=WAIT_LIMIT_S,
    env=env,
  )


def test_babysit_relaunches_a_preempted_run_and_gives_up_on_a_user_error(tmp_path):
  # 75: stopped by SIGTERM after saving; relaunched at once to resume.
  r = _babysit_dry(tmp_path, "75")
  out = r.stdout + r.stderr
  assert r.returncode == 0, out[-3000:]
  assert "status 75" in out and "recovery 1/20: relaunch" in out, out[-3000:]
  assert "giving up" not in out
  # 2: a config, flag or data mistake; a relaunch would fail the same way.
  r = _babysit_dry(tmp_path, "2")
  out = r.stdout + r.stderr
  assert r.returncode == 1, out[-3000:]
  assert "giving up: train.py exited with status 2" in out, out[-3000:]
  assert "recovery" not in out


def test_launch_appends_the_trainer_exit_status_to_the_log(tmp_path):
  """run.sh's worker script, run here with a stand-in trainer that exits with 75."""
  record_dir = tmp_path / "rec"
  record_dir.mkdir()
  trainer = "diffjax_exit_status_trainer.py"  # unique, so no real run can match
  r = subprocess.run(
    [
      "bash",
      os.path.join(ROOT, "tpu_setup", "run.sh"),
      "--dry-run",
      "--zone=us-west4-a",
      "--name=my-v5e",
      f"--train-script={trainer}",
      "--config=configs/default.py",
      "--workdir=gs://b/exit",
      "--grace-seconds=5",
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=WAIT_LIMIT_S,
    env={**os.environ, "DRY_RUN_RECORD_DIR": str(record_dir)},
  )
  assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
  script = None
  for rec in record_dir.iterdir():
    for arg in rec.read_bytes().split(b"\0"):
      if arg.startswith(b"--command="):
        script = arg[len(b"--command=") :].decode()
  assert script is not None
  home, fakebin = tmp_path / "home", tmp_path / "bin"
  (home / "diffjax").mkdir(parents=True)
  (home / "diffjax-venv" / "bin").mkdir(parents=True)
  fakebin.mkdir()
  os.symlink(os.path.realpath(sys.executable), home / "diffjax-venv" / "bin" / "python")
  (home / "diffjax" / trainer).write_text(
    "import sys, time\nprint('stand-in trainer', flush=True)\ntime.sleep(4)\nsys.exit(75)\n"
  )
  # The worker's tools that differ here: sudo runs the command, no metadata server.
  (fakebin / "sudo").write_text('#!/bin/sh\n[ "$1" = -n ] && shift\nexec "$@"\n')
  (fakebin / "curl").write_text("#!/bin/sh\nexit 22\n")
  for f in fakebin.iterdir():
    f.chmod(0o755)
  env = {**os.environ, "HOME": str(home), "PATH": f"{fakebin}:{os.environ['PATH']}"}
  r = subprocess.run(
    ["bash", "-c", script], capture_output=True, text=True, env=env, timeout=WAIT_LIMIT_S
  )
  assert r.returncode == 0 and "started" in r.stdout, (r.stdout + r.stderr)[-3000:]
  logs = list((home / "diffjax-logs").glob("exit-host*.log"))
  assert len(logs) == 1
  wait_until(lambda: " exit " in logs[0].read_text(), "the exit line in the host's log")
  lines = logs[0].read_text().splitlines()
  assert "stand-in trainer" in lines and lines[-1].startswith("=== "), lines
  assert lines[-1].endswith(" exit 75"), lines
