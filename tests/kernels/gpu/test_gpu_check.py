"""The one-command GPU check runs end to end as a dry run on this machine.

On an H100/H200 ``python benchmarks/gpu_check.py`` runs the gpu-marked tests, the
attention and decode benchmarks and train steps of the three arms at real sizes; here
``--dry-run`` runs the same sequence at toy sizes (tests only collected), so a broken
step shows before someone has a GPU for an hour (``pytest -m slow``; run it before a GPU
session).
"""

import os
import subprocess
import sys

import pytest
from helpers import REPO, WAIT_LIMIT_S  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = REPO


# The dry run goes through every check of the script at toy sizes (the kernels and train steps
# it times have their own default tests), so it runs with -m slow.
@pytest.mark.slow
def test_gpu_check_dry_run_writes_one_table(tmp_path):
  out = tmp_path / "gpu_check.md"
  proc = subprocess.run(
    [sys.executable, "benchmarks/gpu_check.py", "--dry-run", f"--out={out}"],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=900,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  text = out.read_text()
  assert "DRY RUN" in text.splitlines()[0]
  rows = [l for l in text.splitlines() if l.startswith("| ") and not l.startswith("| check")]
  checks = [r.split(" | ")[0].strip("| ") for r in rows]
  assert checks[0] == "gpu-marked tests" and "collected" in rows[0]
  # The gpu-marked tests exist: the Mosaic GPU kernels' and the stock paths'.
  assert int(rows[0].split(" | ")[2].split("/")[0]) >= 8, rows[0]
  assert checks.count("attention") >= 3 and checks.count("decode") == 2
  assert checks.count("train step") == 3
  assert not [r for r in rows if "error" in r], rows
  assert text.strip().endswith("|") and text.strip() in proc.stdout


def test_gpu_check_refuses_a_real_run_without_a_gpu():
  proc = subprocess.run(
    [sys.executable, "benchmarks/gpu_check.py"],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=WAIT_LIMIT_S,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert proc.returncode == 2 and "--dry-run" in proc.stderr.splitlines()[-1]
