"""Helpers shared by the kernel test files: tolerances, error measures, one-jit vjp, packed
segment ids and slow cases."""

import contextlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Relative max error of a kernel against the float32 reference on the same inputs:
# float32 to rounding; bfloat16 at the size of the reference's own bfloat16 error
# (about 5e-3) with margin; float16 (8 more mantissa bits: errors of at most 6.5e-4
# measured in the Mosaic GPU interpreter cases) with the same margin.
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 2.5e-3}
# The same measured row by row (each row against its own largest value, see
# rel_err_rows): a row holds fewer values than the whole array, so its largest value
# is a smaller yardstick; twice the array tolerance.
ROW_TOL = {dtype: 2 * tol for dtype, tol in TOL.items()}


# A reference row this small against the array's largest value is zero up to rounding.
ZERO_ROW = 1e-4


def tolerance(dtype, rows: bool = False) -> float:
  return (ROW_TOL if rows else TOL)[jnp.dtype(dtype).type]


def normal(key, shape, dtype=jnp.float32):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def rel_err(x, y) -> float:
  """max |x - y| / max |y|, in float64."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  return float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30))


def rel_err_rows(x, y, floor: float = 0.1) -> float:
  """The worst row of ``max_row |x - y| / max_row |y|`` over the last axis, float64.

  A row is judged against its own largest value, so an error confined to rows of
  small values shows (the whole-array measure lets a row at a tenth of the largest
  value be 20% off at the bfloat16 tolerance). Rows below ``floor`` times the array's
  largest value are judged against that floor. Rows whose true value is zero (up to the
  reference's own rounding: at most ``ZERO_ROW`` times the largest value) are judged
  against the largest value, as in :func:`rel_err`: a query that sees one key has a zero
  dQ, and a key only it sees a zero dK, which the kernel computes as the difference of two
  rounded terms of the size of the row's dP; in bfloat16 that rounding reaches the
  whole-array error (measured: 0.0084 of the largest dQ1 of a DIFF V1 case with a
  one-token document), ten times the floor's yardstick.
  """
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if x.ndim == 0:
    return rel_err(x, y)
  x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
  largest = max(np.max(np.abs(y)), 1e-30)
  row_max = np.max(np.abs(y), axis=1)
  scale = np.where(row_max <= ZERO_ROW * largest, largest, np.maximum(row_max, floor * largest))
  return float(np.max(np.max(np.abs(x - y), axis=1) / scale))


def errors(x, y) -> tuple[float, float]:
  """(rel_err, rel_err_rows) of ``x`` against ``y``."""
  return rel_err(x, y), rel_err_rows(x, y)


def value_and_vjp(fn, args, ct):
  """(fn(*args), vjp of ct) under one jit, so each case compiles once."""

  def run(args, ct):
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(ct)

  return jax.jit(run)(tuple(args), ct)


def assert_like_inputs(out, grads, args, out_shape, dtype):
  """A kernel's output has ``out_shape`` and ``dtype``; each gradient the shape and dtype of
  its input; all of them are finite."""
  chex.assert_shape(out, tuple(out_shape))
  chex.assert_type(out, dtype)
  chex.assert_trees_all_equal_shapes_and_dtypes(tuple(grads), tuple(args))
  chex.assert_tree_all_finite((out, tuple(grads)))


def check(triples, dtype, rows: bool = False, tol: float | None = None, row_wants=None):
  """Asserts each (name, kernel, reference) is within tolerance; names every failure.

  ``rows``: also measure each row against its own scale (:func:`rel_err_rows`). ``tol``: the
  whole-array tolerance instead of the dtype's. ``row_wants``: name -> what the row measure
  compares that array with, where it is not the reference.
  """
  tol = tolerance(dtype) if tol is None else tol
  row_tol = tolerance(dtype, rows=True)
  errs = {name: rel_err(a, b) for name, a, b in triples}
  bad = {n: f"{e:.2e}" for n, e in errs.items() if not e <= tol}
  if rows:
    row_wants = row_wants or {}
    row_errs = {name: rel_err_rows(a, row_wants.get(name, b)) for name, a, b in triples}
    bad.update({f"{n} (rows)": f"{e:.2e}" for n, e in row_errs.items() if not e <= row_tol})
  assert not bad, (
    f"outside tolerance {tol}: {bad}; all: { {n: f'{e:.1e}' for n, e in errs.items()} }"
  )


def abstract_hopper():
  """An abstract H100 to lower GPU code for on a CPU (jax 0.11 asks for one)."""
  if not hasattr(jax.sharding, "AbstractDevice"):
    return contextlib.nullcontext()
  device = jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132
  )
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


def packed_segment_ids(b, t, s, *, unmatched_row: bool = False):
  """Three packed documents of uneven length per batch row (each row's rolled 11 positions
  further than the one before); queries are the last T keys.

  With ``unmatched_row`` query 0 of batch 0 carries an id no key has (a row that
  sees nothing: zero output, zero gradient).
  """
  pos = jnp.arange(s)
  kv = (pos >= s // 4).astype(jnp.int32) + (pos >= (3 * s) // 5 + 3).astype(jnp.int32)
  kv = jnp.stack([jnp.roll(kv, 11 * i) for i in range(b)]) + 1
  q = kv[:, s - t :]
  if unmatched_row:
    q = q.at[0, 0].set(-7)
  return q, kv


def slow_case(*case):
  """A parametrized case marked ``slow`` (one whose coverage the default cases repeat); it runs
  with ``-m slow``."""
  return pytest.param(*case, marks=pytest.mark.slow)
