"""Running a test file again in a child pytest with several fake CPU devices.

The device count must be set before JAX starts its backend, which another test file of
the same process may already have done; so a parent test reruns the file in a child
process whose environment sets it (and a flag the file reads to know it is the child).
"""

from __future__ import annotations

import os
import subprocess
import sys


def with_xla_flags(base: str, *flags: str) -> str:
  """``base`` (an XLA_FLAGS value) with each of ``flags`` set, replacing earlier values."""
  parts = base.split()
  for flag in flags:
    name = flag.split("=", 1)[0]
    parts = [p for p in parts if p.split("=", 1)[0] != name] + [flag]
  return " ".join(parts)


# The flags of the session (tests/conftest.py), 8 CPU devices, and a longer wait in
# collectives: the CPU runtime aborts one whose participants wait more than 40 s for each
# other by default, and interpreted kernels on one device can hold the others that long.
XLA_FLAGS = with_xla_flags(
  os.environ.get("XLA_FLAGS", ""),
  "--xla_force_host_platform_device_count=8",
  "--xla_cpu_collective_call_terminate_timeout_seconds=1200",
)


def run_in_child(test_file: str, child_env: str, markexpr: str, timeout: int = 1800) -> None:
  """Runs ``test_file`` in a child pytest with 8 CPU devices and ``child_env=1``, selecting
  ``markexpr``; fails with the child's output unless it passed at least one test."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {
    k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT_TEST"))
  }
  env.update({child_env: "1", "XLA_FLAGS": XLA_FLAGS, "JAX_PLATFORMS": "cpu"})
  env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
  cmd = [
    sys.executable,
    "-m",
    "pytest",
    "-q",
    "-p",
    "no:cacheprovider",
    "-m",
    markexpr,
    os.path.abspath(test_file),
  ]
  proc = subprocess.run(
    cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout, check=False
  )
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
  assert " passed" in proc.stdout, proc.stdout[-3000:]


def eight_device_drivers(test_file: str, child_env: str, timeout: int):
  """The two parent-process tests of a file whose tests run in an 8-device child: the
  default one (the child runs the file's default tests) and the ``slow`` one (its slow
  tests). Assign them to module-level ``test_`` names; both skip inside the child."""
  import pytest  # pylint: disable=import-outside-toplevel

  in_child = pytest.mark.skipif(
    os.environ.get(child_env) == "1", reason="the driver runs in the parent process"
  )

  @in_child
  @pytest.mark.integration
  def test_on_eight_devices():
    run_in_child(test_file, child_env, "not slow and not gpu and not tpu", timeout=timeout)

  @in_child
  @pytest.mark.slow
  def test_on_eight_devices_slow():
    run_in_child(test_file, child_env, "slow", timeout=timeout)

  return test_on_eight_devices, test_on_eight_devices_slow
