"""Dense projections for CPUs: the same product as ``einsum``, with hand-written 2-D gradients.

:func:`project`, which :func:`diffjax.nn.layers.matmul` calls for float32 and float64 on a CPU.
Design: docs/kernels_tpu.md, "The CPU path".
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax


def _mm(a, b, contract_a: int, contract_b: int):
  return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rows_matmul(x_NxC, w, w_transposed: bool):
  """``x [N, C] @ w`` with ``w`` [C, O] (or [O, C] when ``w_transposed``)."""
  return _mm(x_NxC, w, 1, 1 if w_transposed else 0)


def _rows_matmul_fwd(x_NxC, w, w_transposed):
  return _rows_matmul(x_NxC, w, w_transposed), (x_NxC, w)


def _rows_matmul_bwd(w_transposed, res, dy_NxO):
  x_NxC, w = res
  dx = _mm(dy_NxO, w, 1, 0 if w_transposed else 1)  # [N, C]
  dw = _mm(dy_NxO, x_NxC, 0, 0) if w_transposed else _mm(x_NxC, dy_NxO, 0, 0)
  return dx.astype(x_NxC.dtype), dw.astype(w.dtype)


_rows_matmul.defvjp(_rows_matmul_fwd, _rows_matmul_bwd)


def project(
  x: jax.Array, w: jax.Array, n_contract: int, *, w_transposed: bool = False
) -> jax.Array:
  """``y[..., O...] = sum_C x[..., C...] w[C..., O...]`` through row-major 2-D matmuls.

  Args:
    x: [..., C...]; its last ``n_contract`` axes are contracted.
    w: [C..., O...] (or, with ``w_transposed``, a 2-D [O, C], as a tied embedding table).
    n_contract: how many trailing axes of ``x`` are contracted.
  Returns:
    [..., O...] in the result dtype of ``x @ w``.
  """
  if x.dtype != w.dtype:
    raise ValueError(f"project needs one dtype; got x {x.dtype} and w {w.dtype}.")
  lead, contracted = x.shape[: x.ndim - n_contract], x.shape[x.ndim - n_contract :]
  c = math.prod(contracted)
  if w_transposed:
    if w.ndim != 2 or n_contract != 1 or w.shape[1] != c:
      raise ValueError(f"A transposed w must be [O, {c}]; got {w.shape}.")
    out, w2 = (w.shape[0],), w
  else:
    if tuple(w.shape[:n_contract]) != tuple(contracted):
      raise ValueError(f"w {w.shape} must start with x's contracted axes {contracted}.")
    out = w.shape[n_contract:]
    w2 = w.reshape(c, math.prod(out))
  y = _rows_matmul(x.reshape(math.prod(lead), c), w2, w_transposed)
  return y.reshape(*lead, *out)
