"""Shared pytest setup: the CPU backend and strict rank promotion.

Only settings every test file can live with belong here; a file that needs more
(e.g. several CPU devices for mesh tests) sets it itself before its first JAX call.
"""

import os

# libtpu may be installed; without this, JAX start-up probes for a TPU first.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Ahead-of-time TPU compiles load libtpu; let them do so while another process
# (a parallel test run, an AOT job) holds its lock file.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402  (must follow the environment setting)

# Broadcasting between arrays of different ranks must be spelled out in the library.
jax.config.update("jax_numpy_rank_promotion", "raise")
