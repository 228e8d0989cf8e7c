"""The attention ops written out in NumPy float64 from the definitions (brief section 2), not
from diffjax.ops.reference: explicit loops over batch, head, query and key, the mask decided key
by key, and a softmax per row; with the random inputs and the float32-against-float64 check the
op tests (tests/ops) and the reference tests (tests/core) share.
"""

from __future__ import annotations

import math

import chex
import numpy as np

# float32 JAX against float64 NumPy.
ATOL = 2e-5
RTOL = 2e-5


# --------------------------------------------------------------------------------------
# NumPy float64 definitions.
# --------------------------------------------------------------------------------------


def np_probs(
  q_BxTxHxD,
  k_BxSxKxD,
  kv_group,
  *,
  causal,
  q_seg_BxT=None,
  kv_seg_BxS=None,
  mask_BxHxTxS=None,
  scale=None,
):
  """Attention probabilities [B, H, T, S] in float64, one row at a time.

  ``kv_group(h)`` names the kv head that query head h reads. Query i sits at absolute
  position i + S - T. A row with no allowed key stays all zero.
  """
  q = np.asarray(q_BxTxHxD, np.float64)
  k = np.asarray(k_BxSxKxD, np.float64)
  b_len, t_len, h_len, d = q.shape
  s_len = k.shape[1]
  scale = 1.0 / math.sqrt(d) if scale is None else scale
  probs = np.zeros((b_len, h_len, t_len, s_len))
  for b in range(b_len):
    for h in range(h_len):
      g = kv_group(h)
      for i in range(t_len):
        pos_i = i + s_len - t_len
        keys = []
        for j in range(s_len):
          if causal and j > pos_i:
            continue
          if q_seg_BxT is not None and q_seg_BxT[b, i] != kv_seg_BxS[b, j]:
            continue
          if mask_BxHxTxS is not None and not mask_BxHxTxS[b, h, i, j]:
            continue
          keys.append(j)
        if not keys:
          continue
        scores = np.array([scale * float(np.dot(q[b, i, h], k[b, j, g])) for j in keys])
        e = np.exp(scores - scores.max())
        probs[b, h, i, keys] = e / e.sum()
  return probs


def np_apply(probs_BxHxTxS, v_BxSxKxDv, kv_group):
  """out[b, i, h] = sum_j probs[b, h, i, j] v[b, j, kv_group(h)], float64 [B, T, H, Dv]."""
  v = np.asarray(v_BxSxKxDv, np.float64)
  b_len, h_len, t_len, _ = probs_BxHxTxS.shape
  out = np.zeros((b_len, t_len, h_len, v.shape[-1]))
  for b in range(b_len):
    for h in range(h_len):
      g = kv_group(h)
      for i in range(t_len):
        out[b, i, h] = probs_BxHxTxS[b, h, i] @ v[b, :, g]
  return out


def np_mha(q, k, v, **mask_kw):
  g = q.shape[2] // k.shape[2]
  group = lambda h: h // g
  return np_apply(np_probs(q, k, group, **mask_kw), v, group)


def np_diff_v1(q1, q2, k1, k2, v, lam, **mask_kw):
  """(A1 - lam_h A2) V per DIFF head h; lam a scalar or one per head."""
  h_len = q1.shape[2]
  g = h_len // k1.shape[2]
  group = lambda h: h // g
  lam_H = np.broadcast_to(np.asarray(lam, np.float64), (h_len,))
  p1 = np_probs(q1, k1, group, **mask_kw)
  p2 = np_probs(q2, k2, group, **mask_kw)
  p = np.zeros_like(p1)
  for h in range(h_len):
    p[:, h] = p1[:, h] - lam_H[h] * p2[:, h]
  return np_apply(p, v, group)


def np_diff_v2(q_BxTxQxD, k, v, lam_BxTxH, **mask_kw):
  """Pair i: softmax(q_2i K) V - lam_i softmax(q_2i+1 K) V, kv head i // (h / h_kv)."""
  q = np.asarray(q_BxTxQxD, np.float64)
  pairs = q.shape[2] // 2
  per_group = pairs // k.shape[2]
  group = lambda i: i // per_group
  q_first = np.stack([q[:, :, 2 * i] for i in range(pairs)], axis=2)
  q_second = np.stack([q[:, :, 2 * i + 1] for i in range(pairs)], axis=2)
  p1 = np_probs(q_first, k, group, **mask_kw)
  p2 = np_probs(q_second, k, group, **mask_kw)
  lam = np.asarray(lam_BxTxH, np.float64)
  p = np.zeros_like(p1)
  for b in range(p.shape[0]):
    for i in range(pairs):
      for t in range(p.shape[2]):
        p[b, i, t] = p1[b, i, t] - lam[b, t, i] * p2[b, i, t]
  return np_apply(p, v, group)


# --------------------------------------------------------------------------------------
# Inputs.
# --------------------------------------------------------------------------------------


def normal(rng, shape, dtype=np.float32):
  return rng.standard_normal(shape).astype(dtype)


def mha_inputs(rng, b, t, s, h, kv, d, dv=None):
  return (normal(rng, (b, t, h, d)), normal(rng, (b, s, kv, d)), normal(rng, (b, s, kv, dv or d)))


def v1_inputs(rng, b, t, s, h, kv, d):
  return (
    normal(rng, (b, t, h, d)),
    normal(rng, (b, t, h, d)),
    normal(rng, (b, s, kv, d)),
    normal(rng, (b, s, kv, d)),
    normal(rng, (b, s, kv, 2 * d)),
  )


def v2_inputs(rng, b, t, s, pairs, kv, d):
  lam = rng.uniform(0.05, 0.95, (b, t, pairs)).astype(np.float32)
  return (
    normal(rng, (b, t, 2 * pairs, d)),
    normal(rng, (b, s, kv, d)),
    normal(rng, (b, s, kv, d)),
    lam,
  )


def packed_segments(rng, b, length, docs=3):
  """Sorted segment ids [B, L] with up to ``docs`` documents per row."""
  seg = np.zeros((b, length), np.int32)
  for row in range(b):
    cuts = (
      np.sort(
        rng.choice(np.arange(1, max(length, 2)), size=min(docs - 1, length - 1), replace=False)
      )
      if length > 1
      else []
    )
    for c in cuts:
      seg[row, c:] += 1
  return seg


def check(actual, expected, atol=ATOL, rtol=RTOL):
  """``actual`` against the float64 ``expected``, by default to float32 rounding."""
  chex.assert_trees_all_close(np.asarray(actual, np.float64), expected, atol=atol, rtol=rtol)
