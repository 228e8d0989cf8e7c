"""Attention for the CPU: the same math as the reference, laid out for a CPU's caches.

The reference (:mod:`diffjax.core.reference`) computes scores for the whole batch as
[B, H, T, S] tensors in token-major einsums and lets autodiff differentiate its masked
softmax. On a CPU that costs several passes over tensors far larger than the caches: at
B = 8, T = 256, 8 heads of 32, one layer's forward and backward took 137 ms, against 28 ms
for PyTorch's CPU flash attention.

Here ``lax.map`` walks the batch a few rows at a time (as many as keep one step's scores,
[rows, K, G*T, S], within `SCORE_BYTES_PER_STEP`), queries are head-major with the G query
heads of a kv group stacked as rows of one matmul, the forward keeps only the output and the
row log-sum-exp, and the backward is written out (scores recomputed from the saved
log-sum-exp, ``delta = rowsum(dO * O)``): 55 ms instead of 137 ms at the shape above.

DIFF V1 and V2 are two such attentions on the same values combined with λ:
``A(q1, k1, V) - λ A(q2, k2, V)`` equals the reference's ``(P1 - λ P2) V`` up to float32
rounding; the gradient of λ comes from autodiff of that combination.

Numerics as the reference: scores and softmax in float32 (float64 for float64 inputs), the
probabilities cast to the value dtype for the PV matmul, rows with no visible key give zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from diffjax.core import validation as _v
from diffjax.core.dtypes import accumulation_dtype
from diffjax.core.reference import build_mask


def _to_rows(q_BxTxHxD: jax.Array, kv_heads: int) -> jax.Array:
  """[B, T, H, D] -> [B, K, G*T, D]: the G query heads of kv group k stacked as rows."""
  b, t, h, d = q_BxTxHxD.shape
  g = h // kv_heads
  return q_BxTxHxD.reshape(b, t, kv_heads, g, d).transpose(0, 2, 3, 1, 4).reshape(
      b, kv_heads, g * t, d)


def _from_rows(o_BxKxRxD: jax.Array, t: int) -> jax.Array:
  b, k, r, d = o_BxKxRxD.shape
  g = r // t
  return o_BxKxRxD.reshape(b, k, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, k * g, d)


def _head_major(x_BxSxKxD: jax.Array) -> jax.Array:
  return x_BxSxKxD.transpose(0, 2, 1, 3)


# Causal attention computes query rows in blocks of at least Q_BLOCK positions (at most
# MAX_Q_BLOCKS blocks, which the program unrolls), each against the keys it can see (up to
# the block's last row): at T = S = 256, four blocks compute 640 of the 1024 key columns a
# full-width pass would, the rest being masked anyway. In the 4-layer benchmark model's
# forward and backward: 714 ms against 740 ms (Transformer), 773 against 801 ms (DIFF V1).
Q_BLOCK = 64
MAX_Q_BLOCKS = 8


def _query_blocks(t: int, s: int, causal: bool) -> list[tuple[int, int, int]]:
  """Static ``(t0, t1, e)``: query positions [t0, t1) see at most the keys [0, e)."""
  if not causal or t <= Q_BLOCK:
    return [(0, t, s)]
  n = min(-(-t // Q_BLOCK), MAX_Q_BLOCKS)
  size = -(-t // n)
  offset = s - t  # queries are the last t of s positions
  return [(t0, min(t, t0 + size), max(0, min(s, min(t, t0 + size) + offset)))
          for t0 in range(0, t, size)]


def _visible(t: int, s: int, causal: bool, q_seg_T, kv_seg_S):
  """Boolean [T, S] for one batch row (None: everything visible): the reference's mask."""
  m = build_mask(1, t, s, causal=causal,
                 q_segment_ids_BxT=None if q_seg_T is None else q_seg_T[None],
                 kv_segment_ids_BxS=None if kv_seg_S is None else kv_seg_S[None], mask=None)
  return None if m is None else jnp.broadcast_to(m, (1, 1, t, s))[0, 0]


def _block(x_KxRx_, t: int, g: int, t0: int, t1: int):
  """Rows of query positions [t0, t1) for every stacked head: [K, G*(t1-t0), ...]."""
  k = x_KxRx_.shape[0]
  x = x_KxRx_.reshape(k, g, t, *x_KxRx_.shape[2:])[:, :, t0:t1]
  return x.reshape(k, g * (t1 - t0), *x_KxRx_.shape[2:])


def _unblock(parts, t: int, g: int):
  """Inverse of :func:`_block` over all blocks: [K, G*T, ...]."""
  k = parts[0].shape[0]
  xs = [p.reshape(k, g, -1, *p.shape[2:]) for p in parts]
  x = xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=2)
  return x.reshape(k, g * t, *x.shape[3:])


def _block_visible(visible_TxS, g: int, t0: int, t1: int, e: int):
  if visible_TxS is None:
    return None
  return jnp.tile(visible_TxS[t0:t1, :e], (g, 1))


def _scores(q_KxRxD, k_KxSxD, visible, scale):
  acc = accumulation_dtype(q_KxRxD.dtype)
  s_KxRxS = jnp.einsum("krd,ksd->krs", q_KxRxD, k_KxSxD, preferred_element_type=acc)
  s_KxRxS = s_KxRxS * jnp.asarray(scale, acc)
  if visible is not None:
    s_KxRxS = jnp.where(visible[None], s_KxRxS, -jnp.inf)
  return s_KxRxS


def _forward_rows(q_KxRxD, k_KxSxD, v_KxSxDv, visible, scale):
  s_KxRxS = _scores(q_KxRxD, k_KxSxD, visible, scale)
  m_KxR = jnp.max(s_KxRxS, axis=-1)
  m_KxR = jnp.where(jnp.isfinite(m_KxR), m_KxR, 0.0)
  e_KxRxS = jnp.exp(s_KxRxS - m_KxR[..., None])
  l_KxR = jnp.sum(e_KxRxS, axis=-1)
  p_KxRxS = e_KxRxS / jnp.where(l_KxR > 0, l_KxR, 1.0)[..., None]
  o_KxRxDv = jnp.einsum("krs,ksd->krd", p_KxRxS.astype(v_KxSxDv.dtype), v_KxSxDv,
                        preferred_element_type=p_KxRxS.dtype)
  # Rows with no visible key: lse = +inf, so recomputed probabilities are exp(-inf) = 0.
  lse_KxR = jnp.where(l_KxR > 0, m_KxR + jnp.log(jnp.where(l_KxR > 0, l_KxR, 1.0)), jnp.inf)
  return o_KxRxDv.astype(q_KxRxD.dtype), lse_KxR


def _row_forward(q_KxRxD, k_KxSxD, v_KxSxDv, q_seg_T, kv_seg_S, *, t, causal, scale):
  s = k_KxSxD.shape[1]
  g = q_KxRxD.shape[1] // t
  visible = _visible(t, s, causal, q_seg_T, kv_seg_S)
  blocks = _query_blocks(t, s, causal)
  if len(blocks) == 1:
    return _forward_rows(q_KxRxD, k_KxSxD, v_KxSxDv,
                         None if visible is None else jnp.tile(visible, (g, 1)), scale)
  outs, lses = [], []
  acc = accumulation_dtype(q_KxRxD.dtype)
  for t0, t1, e in blocks:
    q = _block(q_KxRxD, t, g, t0, t1)
    if e == 0:  # these queries see no key at all
      outs.append(jnp.zeros((*q.shape[:2], v_KxSxDv.shape[2]), q_KxRxD.dtype))
      lses.append(jnp.full(q.shape[:2], jnp.inf, acc))
      continue
    o, lse = _forward_rows(q, k_KxSxD[:, :e], v_KxSxDv[:, :e],
                           _block_visible(visible, g, t0, t1, e), scale)
    outs.append(o)
    lses.append(lse)
  return _unblock(outs, t, g), _unblock(lses, t, g)


def _backward_rows(q_KxRxD, k_KxSxD, v_KxSxDv, visible, o_KxRxDv, lse_KxR, do_KxRxDv, scale):
  """Float32 (float64) dQ, dK, dV of one set of query rows against the keys given."""
  s_KxRxS = _scores(q_KxRxD, k_KxSxD, visible, scale)
  acc = s_KxRxS.dtype
  p_KxRxS = jnp.exp(s_KxRxS - lse_KxR[..., None])
  do = do_KxRxDv.astype(acc)
  delta_KxR = jnp.sum(do * o_KxRxDv.astype(acc), axis=-1)
  dp_KxRxS = jnp.einsum("krd,ksd->krs", do_KxRxDv, v_KxSxDv, preferred_element_type=acc)
  ds_KxRxS = p_KxRxS * (dp_KxRxS - delta_KxR[..., None]) * jnp.asarray(scale, acc)
  dq = jnp.einsum("krs,ksd->krd", ds_KxRxS.astype(k_KxSxD.dtype), k_KxSxD,
                  preferred_element_type=acc)
  dk = jnp.einsum("krs,krd->ksd", ds_KxRxS.astype(q_KxRxD.dtype), q_KxRxD,
                  preferred_element_type=acc)
  dv = jnp.einsum("krs,krd->ksd", p_KxRxS.astype(do_KxRxDv.dtype), do_KxRxDv,
                  preferred_element_type=acc)
  return dq, dk, dv


def _row_backward(q_KxRxD, k_KxSxD, v_KxSxDv, q_seg_T, kv_seg_S, o_KxRxDv, lse_KxR, do_KxRxDv,
                  *, t, causal, scale):
  s = k_KxSxD.shape[1]
  g = q_KxRxD.shape[1] // t
  visible = _visible(t, s, causal, q_seg_T, kv_seg_S)
  blocks = _query_blocks(t, s, causal)
  if len(blocks) == 1:
    dq, dk, dv = _backward_rows(q_KxRxD, k_KxSxD, v_KxSxDv,
                                None if visible is None else jnp.tile(visible, (g, 1)),
                                o_KxRxDv, lse_KxR, do_KxRxDv, scale)
  else:
    acc = accumulation_dtype(q_KxRxD.dtype)
    dqs = []
    dk = jnp.zeros(k_KxSxD.shape, acc)
    dv = jnp.zeros(v_KxSxDv.shape, acc)
    for t0, t1, e in blocks:
      cut = lambda x: _block(x, t, g, t0, t1)
      if e == 0:
        dqs.append(jnp.zeros(cut(q_KxRxD).shape, acc))
        continue
      dq_b, dk_b, dv_b = _backward_rows(
          cut(q_KxRxD), k_KxSxD[:, :e], v_KxSxDv[:, :e], _block_visible(visible, g, t0, t1, e),
          cut(o_KxRxDv), cut(lse_KxR), cut(do_KxRxDv), scale)
      dqs.append(dq_b)
      dk = dk.at[:, :e].add(dk_b)
      dv = dv.at[:, :e].add(dv_b)
    dq = _unblock(dqs, t, g)
  return dq.astype(q_KxRxD.dtype), dk.astype(k_KxSxD.dtype), dv.astype(v_KxSxDv.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attend(q_BxKxRxD, k_BxKxSxD, v_BxKxSxDv, q_seg_BxT, kv_seg_BxS, t, causal, scale):
  return _attend_fwd(q_BxKxRxD, k_BxKxSxD, v_BxKxSxDv, q_seg_BxT, kv_seg_BxS, t, causal,
                     scale)[0]


# Batch rows per lax.map iteration: as many as keep one iteration's float32 scores within
# this many bytes (few rows of long sequences; the whole batch when it is small, where the
# loop's per-iteration cost would dominate).
SCORE_BYTES_PER_STEP = 4 << 20


def _rows_per_step(q_BxKxRxD, k_BxKxSxD) -> int:
  _, kv, r, _ = q_BxKxRxD.shape
  return max(1, SCORE_BYTES_PER_STEP // (4 * kv * r * k_BxKxSxD.shape[2]))


def _attend_fwd(q, k, v, q_seg, kv_seg, t, causal, scale):
  fwd = functools.partial(_row_forward, t=t, causal=causal, scale=scale)
  n = _rows_per_step(q, k)
  if q_seg is None:
    o, lse = jax.lax.map(lambda a: fwd(*a, None, None), (q, k, v), batch_size=n)
  else:
    o, lse = jax.lax.map(lambda a: fwd(*a), (q, k, v, q_seg, kv_seg), batch_size=n)
  return o, (q, k, v, q_seg, kv_seg, o, lse)


def _attend_bwd(t, causal, scale, res, do):
  q, k, v, q_seg, kv_seg, o, lse = res
  bwd = functools.partial(_row_backward, t=t, causal=causal, scale=scale)
  n = _rows_per_step(q, k)
  if q_seg is None:
    dq, dk, dv = jax.lax.map(lambda a: bwd(a[0], a[1], a[2], None, None, *a[3:]),
                             (q, k, v, o, lse, do), batch_size=n)
  else:
    dq, dk, dv = jax.lax.map(lambda a: bwd(*a), (q, k, v, q_seg, kv_seg, o, lse, do),
                             batch_size=n)
  return dq, dk, dv, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxDv, *, causal, q_segment_ids, kv_segment_ids,
               scale) -> jax.Array:
  """softmax(q k^T scale) V for each query head and its kv group: [B, T, H, Dv]."""
  t, kv = q_BxTxHxD.shape[1], k_BxSxKxD.shape[2]
  o = _attend(_to_rows(q_BxTxHxD, kv), _head_major(k_BxSxKxD), _head_major(v_BxSxKxDv),
              q_segment_ids, kv_segment_ids, t, bool(causal), float(scale))
  return _from_rows(o, t)


def _combine(o1, o2, lam):
  """``o1 - lam * o2`` in the accumulation dtype, returned in the dtype of ``o1``."""
  acc = accumulation_dtype(o1.dtype)
  return (o1.astype(acc) - lam.astype(acc) * o2.astype(acc)).astype(o1.dtype)


def mha_cpu(q_BxTxHxD, k_BxSxKxD, v_BxSxKxDv, *, causal=True, q_segment_ids=None,
            kv_segment_ids=None, scale=None, block_sizes=None, interpret=False) -> jax.Array:
  """Baseline attention; arguments as :func:`diffjax.ops.dot_product_attention`'s kernels."""
  del block_sizes, interpret
  _v.check_mha(q_BxTxHxD, k_BxSxKxD, v_BxSxKxDv)
  scale = _v.default_scale(scale, q_BxTxHxD.shape[-1])
  return _attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxDv, causal=causal,
                    q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, scale=scale)


def diff_v1_cpu(q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H, *,
                causal=True, q_segment_ids=None, kv_segment_ids=None, scale=None,
                block_sizes=None, interpret=False) -> jax.Array:
  """DIFF V1 core ``A(q1, k1, V) - λ_h A(q2, k2, V)``, before the per-head norm."""
  del block_sizes, interpret
  _v.check_diff_v1(q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H)
  scale = _v.default_scale(scale, q1_BxTxHxD.shape[-1])
  kw = dict(causal=causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
            scale=scale)
  o1 = _attention(q1_BxTxHxD, k1_BxSxKxD, v_BxSxKxDv, **kw)
  o2 = _attention(q2_BxTxHxD, k2_BxSxKxD, v_BxSxKxDv, **kw)
  lam_H = jnp.broadcast_to(jnp.asarray(lam_H), (q1_BxTxHxD.shape[2],))
  return _combine(o1, o2, lam_H[None, None, :, None])


def diff_v2_cpu(q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH, *, causal=True,
                q_segment_ids=None, kv_segment_ids=None, scale=None, block_sizes=None,
                interpret=False) -> jax.Array:
  """DIFF V2 core on paired query heads: ``A(q_2i) - λ_i A(q_2i+1)``."""
  del block_sizes, interpret
  _v.check_diff_v2(q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
  b, t, q_heads, d = q_BxTxQxD.shape
  scale = _v.default_scale(scale, d)
  q_BxTxHx2xD = q_BxTxQxD.reshape(b, t, q_heads // 2, 2, d)
  kw = dict(causal=causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
            scale=scale)
  o1 = _attention(q_BxTxHx2xD[:, :, :, 0], k_BxSxKxD, v_BxSxKxD, **kw)
  o2 = _attention(q_BxTxHx2xD[:, :, :, 1], k_BxSxKxD, v_BxSxKxD, **kw)
  return _combine(o1, o2, lam_BxTxH[..., None])
