"""Attention for the CPU: the reference's math laid out for a CPU's caches.

A few batch rows at a time (one step's scores within :data:`SCORE_BYTES_PER_STEP`),
head-major, the query heads of a kv group stacked as the rows of one matmul; causal rows
in query blocks (:data:`Q_BLOCK`); DIFF's two maps in one pass; a hand-written backward
from the saved log-sum-exps. Numerics and timings: docs/kernels_tpu.md (the CPU path).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from diffjax.core import validation as _v
from diffjax.core.dtypes import accumulation_dtype
from diffjax.core.reference import build_mask, split_pairs


def _to_rows(q_BxTxHxD: jax.Array, kv_heads: int) -> jax.Array:
  """[B, T, H, D] -> [B, K, G*T, D]: the G query heads of kv group k stacked as rows."""
  b, t, h, d = q_BxTxHxD.shape
  g = h // kv_heads
  return (
    q_BxTxHxD.reshape(b, t, kv_heads, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, d)
  )


def _from_rows(o_BxKxRxD: jax.Array, t: int) -> jax.Array:
  b, k, r, d = o_BxKxRxD.shape
  g = r // t
  return o_BxKxRxD.reshape(b, k, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, k * g, d)


def _head_major(x_BxSxKxD: jax.Array) -> jax.Array:
  return x_BxSxKxD.transpose(0, 2, 1, 3)


# Causal attention computes query rows in blocks of at least Q_BLOCK positions (at most
# MAX_Q_BLOCKS blocks, which the program unrolls), each against the keys it can see (up to
# the block's last row): at T = S = 256, four blocks compute 640 of the 1024 key columns a
# full-width pass would, the rest being masked anyway.
Q_BLOCK = 64
MAX_Q_BLOCKS = 8


def _query_blocks(t: int, s: int, causal: bool) -> list[tuple[int, int, int]]:
  """Static ``(t0, t1, e)``: query positions [t0, t1) see at most the keys [0, e).

  ``e`` is at least 1: rows that see no key at all (T > S) run against one masked key.
  """
  if not causal or t <= Q_BLOCK:
    return [(0, t, s)]
  n = min(-(-t // Q_BLOCK), MAX_Q_BLOCKS)
  size = -(-t // n)
  offset = s - t  # queries are the last t of s positions
  return [
    (t0, min(t, t0 + size), max(1, min(s, min(t, t0 + size) + offset))) for t0 in range(0, t, size)
  ]


def _visible(t: int, s: int, causal: bool, q_seg_T, kv_seg_S):
  """Boolean [T, S] for one batch row (None: everything visible): the reference's mask."""
  m = build_mask(
    1,
    t,
    s,
    causal=causal,
    q_segment_ids_BxT=None if q_seg_T is None else q_seg_T[None],
    kv_segment_ids_BxS=None if kv_seg_S is None else kv_seg_S[None],
    mask=None,
  )
  return None if m is None else jnp.broadcast_to(m, (1, 1, t, s))[0, 0]


def _block(x_KxRx_, t: int, g: int, t0: int, t1: int):
  """Rows of query positions [t0, t1) for every stacked head: [K, G*(t1-t0), ...]."""
  if (t0, t1) == (0, t):
    return x_KxRx_
  k = x_KxRx_.shape[0]
  x = x_KxRx_.reshape(k, g, t, *x_KxRx_.shape[2:])[:, :, t0:t1]
  return x.reshape(k, g * (t1 - t0), *x_KxRx_.shape[2:])


def _unblock(parts, t: int, g: int):
  """Inverse of :func:`_block` over all blocks: [K, G*T, ...]."""
  if len(parts) == 1:
    return parts[0]
  k = parts[0].shape[0]
  x = jnp.concatenate([p.reshape(k, g, -1, *p.shape[2:]) for p in parts], axis=2)
  return x.reshape(k, g * t, *x.shape[3:])


def _block_visible(visible_TxS, g: int, t0: int, t1: int, e: int):
  if visible_TxS is None:
    return None
  return jnp.tile(visible_TxS[t0:t1, :e], (g, 1))


def _blocked(fn, rows, keys, visible_TxS, *, t: int, causal: bool):
  """Runs ``fn(rows, keys, visible) -> (row_outputs, key_outputs)`` per query block.

  ``rows`` are [K, G*T, ...] arrays, ``keys`` [K, S, ...]; each block gets its rows and the
  keys it can see. Row outputs are reassembled; key outputs ([K, e, ...], float32 sums) are
  added up over the blocks.
  """
  s = keys[0].shape[1]
  g = rows[0].shape[1] // t
  row_parts, key_sums = [], None
  # The last block sees every key (e == s): it starts the key sums, the others add to
  # their prefix.
  for t0, t1, e in reversed(_query_blocks(t, s, causal)):
    row_out, key_out = fn(
      tuple(_block(x, t, g, t0, t1) for x in rows),
      tuple(x if e == s else x[:, :e] for x in keys),
      _block_visible(visible_TxS, g, t0, t1, e),
    )
    row_parts.append(row_out)
    if key_sums is None:
      key_sums = key_out
    else:
      key_sums = tuple(a.at[:, :e].add(b) for a, b in zip(key_sums, key_out))
  row_parts.reverse()
  return tuple(
    _unblock([p[i] for p in row_parts], t, g) for i in range(len(row_parts[0]))
  ), key_sums


def _scores(q_KxRxD, k_KxSxD, visible, scale):
  acc = accumulation_dtype(q_KxRxD.dtype)
  s_KxRxS = jnp.einsum("krd,ksd->krs", q_KxRxD, k_KxSxD, preferred_element_type=acc)
  s_KxRxS = s_KxRxS * jnp.asarray(scale, acc)
  if visible is not None:
    s_KxRxS = jnp.where(visible[None], s_KxRxS, -jnp.inf)
  return s_KxRxS


def _probs(q_KxRxD, k_KxSxD, visible, scale):
  """Softmax probabilities [K, R, S] and the row log-sum-exps [K, R] (+inf: no key)."""
  s_KxRxS = _scores(q_KxRxD, k_KxSxD, visible, scale)
  m_KxR = jnp.max(s_KxRxS, axis=-1)
  m_KxR = jnp.where(jnp.isfinite(m_KxR), m_KxR, 0.0)
  e_KxRxS = jnp.exp(s_KxRxS - m_KxR[..., None])
  l_KxR = jnp.sum(e_KxRxS, axis=-1)
  p_KxRxS = e_KxRxS / jnp.where(l_KxR > 0, l_KxR, 1.0)[..., None]
  # Rows with no visible key: lse = +inf, so recomputed probabilities are exp(-inf) = 0.
  lse_KxR = jnp.where(l_KxR > 0, m_KxR + jnp.log(jnp.where(l_KxR > 0, l_KxR, 1.0)), jnp.inf)
  return p_KxRxS, lse_KxR


def _apply(p_KxRxS, v_KxSxDv):
  return jnp.einsum(
    "krs,ksd->krd", p_KxRxS.astype(v_KxSxDv.dtype), v_KxSxDv, preferred_element_type=p_KxRxS.dtype
  )


def _grad_matmuls(ds_KxRxS, q_KxRxD, k_KxSxD):
  """dQ = dS K and dK = dS^T Q, float32 (float64)."""
  acc = ds_KxRxS.dtype
  dq = jnp.einsum(
    "krs,ksd->krd", ds_KxRxS.astype(k_KxSxD.dtype), k_KxSxD, preferred_element_type=acc
  )
  dk = jnp.einsum(
    "krs,krd->ksd", ds_KxRxS.astype(q_KxRxD.dtype), q_KxRxD, preferred_element_type=acc
  )
  return dq, dk


# --- One softmax map (the baseline): rows (q,), keys (k, v).


def _single_forward(rows, keys, visible, *, scale):
  (q,), (k, v) = rows, keys
  p, lse = _probs(q, k, visible, scale)
  return (_apply(p, v).astype(q.dtype), lse), ()


def _single_backward(rows, keys, visible, *, scale):
  (q, o, lse, do), (k, v) = rows, keys
  s = _scores(q, k, visible, scale)
  acc = s.dtype
  p = jnp.exp(s - lse[..., None])
  delta = jnp.sum(do.astype(acc) * o.astype(acc), axis=-1)
  dp = jnp.einsum("krd,ksd->krs", do, v, preferred_element_type=acc)
  dq, dk = _grad_matmuls(p * (dp - delta[..., None]) * jnp.asarray(scale, acc), q, k)
  dv = jnp.einsum("krs,krd->ksd", p.astype(do.dtype), do, preferred_element_type=acc)
  return (dq,), (dk, dv)


# --- A pair of maps on one value (DIFF V1 and V2): rows (q1, q2, lam), keys (k1, k2, v).
# One PV matmul on P1 - lam P2 (as the reference); in the backward one dP = dO V^T and one
# dV = (P1 - lam P2)^T dO serve both maps, and D_m = rowsum(P_m * dP) = rowsum(dO * O_m).


def _pair_forward(rows, keys, visible, *, scale):
  (q1, q2, lam), (k1, k2, v) = rows, keys
  p1, lse1 = _probs(q1, k1, visible, scale)
  p2, lse2 = _probs(q2, k2, visible, scale)
  p = p1 - lam.astype(p1.dtype)[..., None] * p2
  return (_apply(p, v).astype(q1.dtype), lse1, lse2), ()


def _pair_backward(rows, keys, visible, *, scale):
  (q1, q2, lam, lse1, lse2, do), (k1, k2, v) = rows, keys
  s1 = _scores(q1, k1, visible, scale)
  acc = s1.dtype
  p1 = jnp.exp(s1 - lse1[..., None])
  p2 = jnp.exp(_scores(q2, k2, visible, scale) - lse2[..., None])
  dp = jnp.einsum("krd,ksd->krs", do, v, preferred_element_type=acc)
  d1 = jnp.sum(p1 * dp, axis=-1)
  d2 = jnp.sum(p2 * dp, axis=-1)
  lam = lam.astype(acc)[..., None]
  c = jnp.asarray(scale, acc)
  dq1, dk1 = _grad_matmuls(p1 * (dp - d1[..., None]) * c, q1, k1)
  dq2, dk2 = _grad_matmuls(-lam * p2 * (dp - d2[..., None]) * c, q2, k2)
  dv = jnp.einsum("krs,krd->ksd", (p1 - lam * p2).astype(do.dtype), do, preferred_element_type=acc)
  return (dq1, dq2, -d2), (dk1, dk2, dv)


# Batch rows per lax.map iteration: as many as keep one iteration's float32 scores within
# this many bytes (few rows of long sequences; the whole batch when it is small, where the
# loop's per-iteration cost would dominate).
SCORE_BYTES_PER_STEP = 4 << 20


def _rows_per_step(q_BxKxRxD, k_BxKxSxD, maps: int = 1) -> int:
  _, kv, r, _ = q_BxKxRxD.shape
  return max(1, SCORE_BYTES_PER_STEP // max(1, 4 * maps * kv * r * k_BxKxSxD.shape[2]))


def _over_batch(fn, maps, rows, keys, q_seg, kv_seg, t, causal, scale):
  """``_blocked`` of ``fn`` at ``scale`` for every batch row, a few rows per ``lax.map``
  iteration (as many as :func:`_rows_per_step` allows for ``maps`` softmax maps)."""
  fn = functools.partial(fn, scale=scale)
  n = _rows_per_step(rows[0], keys[0], maps)
  nr, nk = len(rows), len(keys)

  def one(a):
    r, k, seg = a[:nr], a[nr : nr + nk], a[nr + nk :]
    visible = _visible(t, k[0].shape[1], causal, *(seg if seg else (None, None)))
    return _blocked(fn, r, k, visible, t=t, causal=causal)

  segs = () if q_seg is None else (q_seg, kv_seg)
  return jax.lax.map(one, (*rows, *keys, *segs), batch_size=n)


def _cast_like(grads, like):
  return tuple(g.astype(x.dtype) for g, x in zip(grads, like))


# (forward, backward, maps, the first row output the backward reads) of one map or a pair.
_KINDS = {
  "single": (_single_forward, _single_backward, 1, 0),
  "pair": (_pair_forward, _pair_backward, 2, 1),
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5, 6, 7))
def _attend(kind: str, rows, keys, q_seg_BxT, kv_seg_BxS, t, causal, scale):
  """Attention of ``kind`` over [B, K, G*T, ...] rows (single: q; pair: q1, q2, lam) and
  [B, K, S, ...] keys (single: k, v; pair: k1, k2, v); returns [B, K, G*T, Dv]."""
  return _attend_fwd(kind, rows, keys, q_seg_BxT, kv_seg_BxS, t, causal, scale)[0]


def _attend_fwd(kind, rows, keys, q_seg, kv_seg, t, causal, scale):
  forward, _, maps, saved = _KINDS[kind]
  outs, _ = _over_batch(forward, maps, rows, keys, q_seg, kv_seg, t, causal, scale)
  return outs[0], (rows, keys, q_seg, kv_seg, outs[saved:])


def _attend_bwd(kind, t, causal, scale, res, do):
  rows, keys, q_seg, kv_seg, saved = res
  _, backward, maps, _ = _KINDS[kind]
  row_grads, key_grads = _over_batch(
    backward, maps, (*rows, *saved, do), keys, q_seg, kv_seg, t, causal, scale
  )
  return _cast_like(row_grads, rows), _cast_like(key_grads, keys), None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _attention(
  queries, keys, lam_BxTxH=None, *, causal, q_segment_ids, kv_segment_ids, scale
) -> jax.Array:
  """Per query head and its kv group, [B, T, H, Dv]: ``softmax(q k^T s) V`` for queries
  ``(q,)`` [B, T, H, D] and keys ``(k, v)`` [B, S, K, ...]; with ``lam_BxTxH``,
  ``(softmax(q1 k1^T s) - lam softmax(q2 k2^T s)) V`` for ``(q1, q2)`` and ``(k1, k2, v)``.
  ``scale`` None is 1 / sqrt(D)."""
  b, t, h, _ = queries[0].shape
  kv, s = keys[0].shape[2], keys[0].shape[1]
  if 0 in (b, t, s):  # no query row, or no key (every row sees none: zero, as masked rows)
    return jnp.zeros((b, t, h, keys[-1].shape[-1]), queries[0].dtype)
  rows = ()
  if lam_BxTxH is not None:
    acc = accumulation_dtype(queries[0].dtype)
    rows = (_to_rows(lam_BxTxH.astype(acc)[..., None], kv)[..., 0],)  # [B, K, G*T]
  o = _attend(
    "single" if lam_BxTxH is None else "pair",
    (*(_to_rows(q, kv) for q in queries), *rows),
    tuple(_head_major(x) for x in keys),
    q_segment_ids,
    kv_segment_ids,
    t,
    bool(causal),
    float(_v.default_scale(scale, queries[0].shape[-1])),
  )
  return _from_rows(o, t)


def mha_xla_cpu(
  q_BxTxHxD,
  k_BxSxKxD,
  v_BxSxKxDv,
  *,
  causal=True,
  q_segment_ids=None,
  kv_segment_ids=None,
  scale=None,
  block_sizes=None,
  interpret=False,
) -> jax.Array:
  """Baseline attention; arguments as :func:`diffjax.ops.dot_product_attention`'s kernels."""
  del block_sizes, interpret
  _v.check_mha(q_BxTxHxD, k_BxSxKxD, v_BxSxKxDv)
  return _attention(
    (q_BxTxHxD,),
    (k_BxSxKxD, v_BxSxKxDv),
    causal=causal,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    scale=scale,
  )


def diff_v1_xla_cpu(
  q1_BxTxHxD,
  q2_BxTxHxD,
  k1_BxSxKxD,
  k2_BxSxKxD,
  v_BxSxKxDv,
  lam_H,
  *,
  causal=True,
  q_segment_ids=None,
  kv_segment_ids=None,
  scale=None,
  block_sizes=None,
  interpret=False,
) -> jax.Array:
  """DIFF V1 core ``(A(q1, k1) - λ_h A(q2, k2)) V``, before the per-head norm."""
  del block_sizes, interpret
  _v.check_diff_v1(q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H)
  return _attention(
    (q1_BxTxHxD, q2_BxTxHxD),
    (k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv),
    jnp.broadcast_to(jnp.asarray(lam_H), q1_BxTxHxD.shape[:3]),  # [B, T, H]
    causal=causal,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    scale=scale,
  )


def diff_v2_xla_cpu(
  q_BxTxQxD,
  k_BxSxKxD,
  v_BxSxKxD,
  lam_BxTxH,
  *,
  causal=True,
  q_segment_ids=None,
  kv_segment_ids=None,
  scale=None,
  block_sizes=None,
  interpret=False,
) -> jax.Array:
  """DIFF V2 core on paired query heads: ``(A(q_2i) - λ_i A(q_2i+1)) V``."""
  del block_sizes, interpret
  _v.check_diff_v2(q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
  return _attention(
    split_pairs(q_BxTxQxD),
    (k_BxSxKxD, k_BxSxKxD, v_BxSxKxD),
    lam_BxTxH,
    causal=causal,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    scale=scale,
  )


def _repeat_noise(q1_BxTxHxD, q2_BxTxNxD):
  """The noise heads repeated over their groups of r signal heads (r = 1: unchanged); the
  gradient of the repeat sums each group's."""
  r = q1_BxTxHxD.shape[2] // q2_BxTxNxD.shape[2]
  return q2_BxTxNxD if r == 1 else jnp.repeat(q2_BxTxNxD, r, axis=2)


def gda_v1_xla_cpu(
  q1_BxTxHxD,
  q2_BxTxNxD,
  k1_BxSxKxD,
  k2_BxSxKxD,
  v_BxSxKxDv,
  lam_H,
  *,
  causal=True,
  q_segment_ids=None,
  kv_segment_ids=None,
  scale=None,
  block_sizes=None,
  interpret=False,
) -> jax.Array:
  """Grouped differential attention (V1 style) as DIFF V1 on the repeated noise heads;
  r = 1 is :func:`diff_v1_xla_cpu` exactly."""
  del block_sizes, interpret
  _v.check_gda_v1(q1_BxTxHxD, q2_BxTxNxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H)
  return _attention(
    (q1_BxTxHxD, _repeat_noise(q1_BxTxHxD, q2_BxTxNxD)),
    (k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv),
    jnp.broadcast_to(jnp.asarray(lam_H), q1_BxTxHxD.shape[:3]),  # [B, T, H]
    causal=causal,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    scale=scale,
  )


def gda_v2_xla_cpu(
  q1_BxTxHxD,
  q2_BxTxNxD,
  k_BxSxKxD,
  v_BxSxKxD,
  lam_BxTxH,
  *,
  causal=True,
  q_segment_ids=None,
  kv_segment_ids=None,
  scale=None,
  block_sizes=None,
  interpret=False,
) -> jax.Array:
  """Grouped DIFF V2 on the repeated noise heads; r = 1 computes as :func:`diff_v2_xla_cpu`."""
  del block_sizes, interpret
  _v.check_gda_v2(q1_BxTxHxD, q2_BxTxNxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
  return _attention(
    (q1_BxTxHxD, _repeat_noise(q1_BxTxHxD, q2_BxTxNxD)),
    (k_BxSxKxD, k_BxSxKxD, v_BxSxKxD),
    lam_BxTxH,
    causal=causal,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    scale=scale,
  )
