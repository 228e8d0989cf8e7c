"""Shared pytest setup: the CPU backend and strict rank promotion.

Only settings every test file can live with belong here; a file that needs more
(e.g. several CPU devices for mesh tests) sets it itself before its first JAX call.
"""

import os
import sys
import tempfile

# The tools beside the package (tools/ at the repository root, not installed) import as
# `tools` in the tests, however pytest was started.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.append(_REPO)

# libtpu may be installed; without this, JAX start-up probes for a TPU first.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Ahead-of-time TPU compiles load libtpu; let them do so while another process
# (a parallel test run, an AOT job) holds its lock file.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# Many tests compile the same small programs, often in fresh train.py processes (which
# inherit this environment): a compilation cache shared by the test processes turns each
# repeat into a read. Every program is written, the quick ones too: the many small ones the
# train.py processes compile cost more together than the writes (docs/results/suite_timing.md).
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
# them, and LLVM at -O0 compiles them faster (docs/results/suite_timing.md). It changes no
# float32 result that a test checks (XLA's fast-math stays off).
# Fresh processes the tests start inherit it; set XLA_FLAGS yourself to override.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
    f for f in (os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0") if f
  )

import jax  # noqa: E402  (must follow the environment setting)

# Broadcasting between arrays of different ranks must be spelled out in the library.
jax.config.update("jax_numpy_rank_promotion", "raise")
