"""tpu_setup/ scripts: syntax, shellcheck (when installed) and the offline self-test."""

import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def test_selftest_dry_runs():
  r = subprocess.run(["bash", os.path.join(ROOT, "tpu_setup", "selftest.sh")],
                     capture_output=True, text=True, cwd=ROOT, timeout=600,
                     env={**os.environ, "SELFTEST_BOOTSTRAP": "0"})
  assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
  assert " 0 failed" in r.stdout or "0 failed" in r.stdout, r.stdout[-2000:]
