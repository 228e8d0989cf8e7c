"""What the Mosaic GPU pair kernels and their wrappers share, with no kernel backend imported.

Constants of the masking and log-sum-exp conventions, the softmax-backward row terms
and the wrappers' padding and segment-id checks. Importing this module imports no
Pallas backend.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

LOG2E = math.log2(math.e)
# Score given to a masked (query, key) pair: finite, so max/exp2 arithmetic stays NaN-free.
NEG = -0.7 * float(np.finfo(np.float32).max)
# Log-sum-exp stored for a row that sees no key: exp2(score - EMPTY_LSE) == 0.
EMPTY_LSE = 1e30


class PairGeometry:
  """What the kernels' static configs derive from their fields.

  A mixin for frozen dataclasses with ``variant``, ``q_len``, ``kv_len``, ``causal``
  and ``segments``.
  """

  @property
  def offset(self) -> int:
    """Queries are the last ``q_len`` of ``kv_len`` positions."""
    return self.kv_len - self.q_len

  @property
  def shared_k(self) -> bool:
    """V2's pair reads one key array; V1 reads K1 and K2."""
    return self.variant == "v2"


def kv_blocks(cfg: PairGeometry, q_start, bq: int, bk: int):
  """Key blocks a query block visits: [0, n_full) need no mask, [n_full, n_end) do."""
  s = cfg.kv_len
  if cfg.causal:
    end_pos = jnp.clip(q_start + bq + cfg.offset, 0, s)  # one past the last visible key
    n_end = lax.div(end_pos + bk - 1, bk)
    full_pos = jnp.clip(q_start + cfg.offset + 1, 0, s)  # keys every row of the block sees
    n_full = lax.div(full_pos, bk)
  else:
    n_end = jnp.int32(-(-s // bk))
    n_full = jnp.int32(s // bk)
  if cfg.segments:
    n_full = jnp.int32(0)
  return n_full, n_end


def q_blocks(cfg: PairGeometry, kv_start, bq: int, bk: int):
  """Query blocks that see a key block: [i_start, i_full) need a mask, [i_full, n_q) not.

  The mirror of :func:`kv_blocks` for the key-major backward loops. Query blocks made
  only of padding are not visited.
  """
  n_q = -(-cfg.q_len // bq)
  if cfg.causal:
    i_start = lax.div(jnp.maximum(kv_start - cfg.offset, 0), bq)
    i_full = lax.div(jnp.maximum(kv_start + bk - 1 - cfg.offset, 0) + bq - 1, bq)
  else:
    i_start = jnp.int32(0)
    i_full = jnp.int32(0)
  if cfg.segments:
    i_full = jnp.int32(n_q)
  i_full = jnp.where(kv_start + bk > cfg.kv_len, n_q, i_full)  # block holds padded keys
  i_start = jnp.where(kv_start >= cfg.kv_len, n_q, i_start)  # block is all padding
  i_start = jnp.minimum(i_start, n_q)
  i_full = jnp.clip(i_full, i_start, n_q)
  return i_start, i_full, n_q


def row_terms(do, o, o2, lam_BxHxT):
  """Softmax-backward row terms (d_a, d_b), float32 [B, H, T].

  ``d_b = rowsum(dO * O2)`` and ``d_a = rowsum(dO * O1) = rowsum(dO * O) + lam d_b``.
  """
  do32 = do.astype(jnp.float32)
  d_o = jnp.einsum("bthd,bthd->bht", do32, o.astype(jnp.float32))
  d_b = jnp.einsum("bthd,bthd->bht", do32, o2.astype(jnp.float32))
  return d_o + lam_BxHxT * d_b, d_b


# ----------------------------------------------------------------------------------
# Wrapper helpers shared by the V1 and V2 entry points.


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def pad_axis(x, axis: int, size: int, value=0):
  """Pads ``x`` at the end of ``axis`` to ``size`` (a no-op when already that size)."""
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def check_segment_ids(q_segment_ids, kv_segment_ids, batch: int, q_len: int, kv_len: int):
  """Both or neither; returns int32 arrays [B, T] and [B, S] (or Nones)."""
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError(
      "Pass both q_segment_ids [batch, q_len] and kv_segment_ids "
      "[batch, kv_len], or neither; got only "
      f"{'q' if kv_segment_ids is None else 'kv'}_segment_ids."
    )
  if q_segment_ids is None:
    return None, None
  if tuple(q_segment_ids.shape) != (batch, q_len):
    raise ValueError(
      f"q_segment_ids must have shape {(batch, q_len)}; got {tuple(q_segment_ids.shape)}."
    )
  if tuple(kv_segment_ids.shape) != (batch, kv_len):
    raise ValueError(
      f"kv_segment_ids must have shape {(batch, kv_len)}; got {tuple(kv_segment_ids.shape)}."
    )
  return q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)


def pad_segment_ids(q_seg, kv_seg, q_len: int, kv_len: int):
  # Padded positions get ids no real token has; padded keys are masked by length anyway.
  if q_seg is None:
    return None, None
  return pad_axis(q_seg, 1, q_len, -1), pad_axis(kv_seg, 1, kv_len, -2)


def pad_inputs(tp: int, sp: int, qs, ks, v, lam_BxHxT, q_seg, kv_seg):
  """The kernels' inputs with the query length padded to ``tp`` and the key length to
  ``sp`` (lambda cast to float32), in the order they came."""
  q_seg, kv_seg = pad_segment_ids(q_seg, kv_seg, tp, sp)
  return (
    tuple(pad_axis(q, 1, tp) for q in qs),
    tuple(pad_axis(k, 1, sp) for k in ks),
    pad_axis(v, 1, sp),
    pad_axis(lam_BxHxT.astype(jnp.float32), 2, tp),
    q_seg,
    kv_seg,
  )
