"""The CPU settings the trainer applies, and :func:`cpu_setup` for a training loop of your own.

Call :func:`cpu_setup` before JAX first touches a device, or pass :func:`cpu_compiler_options` to
``jax.jit``; neither setting changes what a step computes (docs/kernels_tpu.md#the-cpu-path).
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
import warnings
from typing import Any

ENV_VAR = "DIFFJAX_KEEP_FREED_MEMORY"
# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 1 << 30

# XLA options for steps that run on CPU devices (`benchmarks/cpu_vs_torch.py` measures the
# whole step with and without them).
CPU_XLA_OPTIONS: dict[str, Any] = {"xla_cpu_experimental_ynn_fusion_type": ""}


def keep_freed_memory() -> bool:
  """Raises glibc's mmap and trim thresholds to 1 GiB; returns whether it did.

  Nothing is changed on other C libraries or systems, or when ``DIFFJAX_KEEP_FREED_MEMORY``
  is ``0``.
  """
  if os.environ.get(ENV_VAR, "1") == "0" or not sys.platform.startswith("linux"):
    return False
  try:
    libc = ctypes.CDLL(None)
    _ = libc.gnu_get_libc_version  # glibc only: raises AttributeError elsewhere
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  return bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(
    mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES)
  )


@functools.cache
def cpu_compiler_options() -> dict[str, Any]:
  """The entries of :data:`CPU_XLA_OPTIONS` that this jaxlib's CPU compiler accepts.

  Each option is tried once on a one-line program; a jaxlib that does not know an option
  (a newer or older release) simply runs without it. Pass the result as
  ``compiler_options=`` to ``jax.jit`` for functions that run on a CPU (``nnx.jit`` takes no
  compiler options: ``jax.jit`` a function of the ``nnx.split`` state instead).
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  cpu = jax.devices("cpu")[0]
  accepted = {}
  for name, value in CPU_XLA_OPTIONS.items():
    try:
      jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(
        jax.ShapeDtypeStruct((), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(cpu))
      ).compile()
    except Exception:  # pylint: disable=broad-except
      continue
    accepted[name] = value
  return accepted


def _flag(name: str, value: Any) -> str:
  if isinstance(value, bool):
    value = str(value).lower()
  return f"--{name}={value}"


def backends_started() -> bool:
  if "jax" not in sys.modules:
    return False
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel

  started = getattr(xla_bridge, "backends_are_initialized", None)
  return bool(started()) if started is not None else bool(getattr(xla_bridge, "_backends", {}))


@functools.cache
def _flags_accepted(flags: tuple[str, ...]) -> bool:
  """Whether a fresh process with ``flags`` in ``XLA_FLAGS`` compiles a CPU program.

  XLA aborts a process whose ``XLA_FLAGS`` name a flag it does not know, so the flags are
  tried in a child process (about two seconds, once per process) before this one takes them.
  """
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip(),
  )
  probe = "import jax; jax.block_until_ready(jax.jit(lambda x: x + 1)(1.0))"
  try:
    done = subprocess.run(
      [sys.executable, "-c", probe], env=env, capture_output=True, timeout=120, check=False
    )
  except (OSError, subprocess.SubprocessError):
    return False
  return done.returncode == 0


def cpu_setup(*, keep_freed_memory: bool = True, xla_flags: bool = True) -> dict[str, Any]:  # pylint: disable=redefined-outer-name
  """Gives a training loop of your own the CPU settings the trainer uses.

  Call it at the top of your script, before the first JAX computation.

  Args:
    keep_freed_memory: make glibc's ``malloc`` keep freed memory for the next step
      (:func:`keep_freed_memory`; ``DIFFJAX_KEEP_FREED_MEMORY=0`` overrides it).
    xla_flags: add :data:`CPU_XLA_OPTIONS` to ``XLA_FLAGS``, so every CPU compile in this
      process gets them. Flags this jaxlib does not know are left out (tried in a child
      process first). XLA reads ``XLA_FLAGS`` when JAX starts its backends: called later,
      this warns and changes nothing; pass :func:`cpu_compiler_options` to ``jax.jit``
      then. Options already named in ``XLA_FLAGS`` are left as the user set them.

  Returns:
    ``{"keep_freed_memory": bool, "xla_flags": [flags added]}``.
  """
  kept = globals()["keep_freed_memory"]() if keep_freed_memory else False
  added: list[str] = []
  if xla_flags:
    current = os.environ.get("XLA_FLAGS", "")
    wanted = tuple(
      _flag(name, value) for name, value in CPU_XLA_OPTIONS.items() if f"--{name}" not in current
    )
    if wanted and backends_started():
      warnings.warn(
        "diffjax.cpu_setup(): JAX has already started its backends, so XLA_FLAGS can no "
        "longer change; call cpu_setup() before the first JAX computation, or pass "
        "compiler_options=diffjax.cpu_compiler_options() to jax.jit (nnx.jit takes none).",
        stacklevel=2,
      )
    elif wanted:
      accepted = tuple(flag for flag in wanted if _flags_accepted((flag,)))
      if accepted:
        os.environ["XLA_FLAGS"] = " ".join([current, *accepted]).strip()
        added = list(accepted)
  return {"keep_freed_memory": kept, "xla_flags": added}
