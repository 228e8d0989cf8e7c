"""Shared pytest setup: the CPU backend with 8 devices, and strict rank promotion.

Only settings every test file can live with belong here. Every test process has 8 CPU
devices (set before JAX starts its backend), so mesh and multi-device tests run in-process;
code that asks for no mesh runs on the first device, as on a one-device machine, and the
tests' training runs take one device (``mesh.num_devices=1``, ``helpers.tiny_config``).
Processes the tests start do not inherit the device count.
"""

import os
import sys
import tempfile

# The tools beside the package (tools/ at the repository root, not installed) import as
# `tools` in the tests, however pytest was started.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.append(_REPO)


def _jaxlib_release() -> tuple[int, int]:
  """jaxlib's (major, minor) version (0.10.2 -> (0, 10)), read without starting JAX."""
  from importlib.metadata import version  # pylint: disable=import-outside-toplevel

  major, minor = version("jaxlib").split(".")[:2]
  return int(major), int(minor)


# libtpu may be installed; without this, JAX start-up probes for a TPU first.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Ahead-of-time TPU compiles load libtpu; let them do so while another process
# (a parallel test run, an AOT job) holds its lock file.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# Many tests compile the same small programs, often in fresh train.py processes (which
# inherit this environment): a compilation cache shared by the test processes turns each
# repeat into a read. Every program is written, the quick ones too: the many small ones the
# train.py processes compile cost more together than the writes.
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR",
  os.path.join(tempfile.gettempdir(), f"diffjax-tests-jax-cache-{os.getuid()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The embedded corpus is prepared once for all test processes, away from the user's cache.
os.environ.setdefault(
  "DIFFJAX_DATA_CACHE", os.path.join(tempfile.gettempdir(), f"diffjax-tests-data-{os.getuid()}")
)
# The test programs are small, so compiling them takes most of the suite's time, not running
# them, and LLVM at -O0 compiles them faster. It changes no
# float32 result that a test checks (XLA's fast-math stays off).
# Fresh processes the tests start inherit it; set XLA_FLAGS yourself to override.
# Collectives on the CPU devices wait up to an hour for each other (the runtime's default
# is 40 s, which an interpreted kernel on one device can hold the others for on a busy machine).
_FLAGS = [
  "--xla_backend_optimization_level=0",
  "--xla_cpu_collective_call_terminate_timeout_seconds=3600",
]
# jaxlib 0.10's CPU compiler can still emit fusions without its MLIR fusion emitters, which
# halves the unit tier's compile time there. The flag is gone from 0.11 on, and an unknown
# flag aborts the process, so it is set for 0.10 only; the newer tested sets compile with
# the emitters, so the default path is tested too.
if _jaxlib_release() == (0, 10):
  _FLAGS.append("--xla_cpu_use_fusion_emitters=false")
for _flag in _FLAGS:
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS"), _flag) if f)

import jax  # noqa: E402  (must follow the environment setting)

TEST_DEVICES = 8
jax.config.update("jax_num_cpu_devices", TEST_DEVICES)

# Broadcasting between arrays of different ranks must be spelled out in the library.
jax.config.update("jax_numpy_rank_promotion", "raise")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
  """``trained_run(arm="diff_v1", steps=2, small=False)``: the workdir of a tiny trained run
  (``helpers.tiny_config``; ``small`` narrows it further, ``helpers.small_run_config``),
  trained once per test process for each set of arguments and shared by the tests that read
  one (evaluation, the harness, conversion). Its files are made read-only: a test that
  writes into a run copies it first."""
  from helpers import small_run_config, tiny_config  # pylint: disable=import-outside-toplevel

  from diffjax.train import train_and_evaluate  # pylint: disable=import-outside-toplevel

  runs = {}

  def get(arm: str = "diff_v1", steps: int = 2, small: bool = False) -> str:
    key = (arm, steps, small)
    if key not in runs:
      config = (small_run_config if small else tiny_config)(arm, steps=steps)
      workdir = str(tmp_path_factory.mktemp(f"run-{arm}-{steps}{'-small' if small else ''}"))
      train_and_evaluate(config, workdir)
      for root, dirs, files in os.walk(workdir):
        for name in files + dirs:
          path = os.path.join(root, name)
          os.chmod(path, os.stat(path).st_mode & ~0o222)
      runs[key] = workdir
    return runs[key]

  return get
