"""Helpers shared by the kernel test files: tolerances, error measure, one-jit vjp."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

# Relative max error of a kernel against the float32 reference on the same inputs:
# float32 to rounding; bfloat16 at the size of the reference's own bfloat16 error
# (about 5e-3) with margin.
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def normal(key, shape, dtype=jnp.float32):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def rel_err(x, y) -> float:
  """max |x - y| / max |y|, in float64."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  return float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30))


def value_and_vjp(fn, args, ct):
  """(fn(*args), vjp of ct) under one jit, so each case compiles once."""
  def run(args, ct):
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(ct)
  return jax.jit(run)(tuple(args), ct)


def check(triples, dtype):
  """Asserts each (name, kernel, reference) is within tolerance; names every failure."""
  tol = TOL[dtype]
  errs = {name: rel_err(a, b) for name, a, b in triples}
  bad = {n: f"{e:.2e}" for n, e in errs.items() if not e <= tol}
  assert not bad, f"outside tolerance {tol}: {bad}; all: { {n: f'{e:.1e}' for n, e in errs.items()} }"


def abstract_hopper():
  """An abstract H100 to lower GPU code for on a CPU (jax 0.11 asks for one)."""
  if not hasattr(jax.sharding, "AbstractDevice"):
    return contextlib.nullcontext()
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3",
                                       platform="gpu", num_cores=132)
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((), (), abstract_device=device))
