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
XLA_FLAGS = with_xla_flags(os.environ.get("XLA_FLAGS", ""),
                           "--xla_force_host_platform_device_count=8",
                           "--xla_cpu_collective_call_terminate_timeout_seconds=1200")


def run_in_child(test_file: str, child_env: str, markexpr: str, timeout: int = 1800) -> None:
  """Runs ``test_file`` in a child pytest with 8 CPU devices and ``child_env=1``, selecting
  ``markexpr``; fails with the child's output unless it passed at least one test."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT_TEST"))}
  env.update({child_env: "1", "XLA_FLAGS": XLA_FLAGS, "JAX_PLATFORMS": "cpu"})
  env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", markexpr,
         os.path.abspath(test_file)]
  proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout,
                        check=False)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
  assert " passed" in proc.stdout, proc.stdout[-3000:]
