"""The stock GPU paths: DIFF attention composed from ``jax.nn.dot_product_attention`` calls.

The peers the fused kernels must beat, as the authors' code runs on stock kernels (cuDNN
flash attention when it accepts a call, XLA otherwise): one call for the baseline, four
for DIFF V1, one over the 2H query heads for DIFF V2. Grouped differential attention runs
the H signal heads in one call (per value chunk) and the N noise heads in one, so each
noise map is computed once per group and its output repeated over the group's r signal
heads. Why four, and the masks: docs/kernels_gpu.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from diffjax.core import validation as _v

_IMPLEMENTATIONS = (None, "cudnn", "xla")


def _mask(b: int, t: int, s: int, *, causal: bool, q_seg, kv_seg):
  """(mask [B, 1, T, S] or None, is_causal) for jax.nn.dot_product_attention."""
  if q_seg is None and (not causal or t == s):
    return None, causal
  mask = jnp.ones((1, 1, t, s), jnp.bool_)
  if causal:
    mask = (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + (s - t))[None, None]
  if q_seg is not None:
    mask = jnp.logical_and(mask, (q_seg[:, :, None] == kv_seg[:, None, :])[:, None])
  return jnp.broadcast_to(mask, (b, 1, t, s)), False


def _options(q, k, causal, q_seg, kv_seg, scale, implementation) -> dict:
  """The keywords of :func:`_attend` (and :func:`_chunked`) for queries ``q`` against keys
  ``k``: the mask, whether the call is causal, the scale for q's head dim."""
  b, t, _, d = q.shape
  mask, is_causal = _mask(b, t, k.shape[1], causal=causal, q_seg=q_seg, kv_seg=kv_seg)
  scale = _v.default_scale(scale, d)
  return dict(mask=mask, is_causal=is_causal, scale=scale, implementation=implementation)


def pick_implementation(q, k, v, mask=None, is_causal=False) -> str:
  """ "cudnn" when on a GPU and cuDNN accepts this call at trace time, else "xla"."""
  if jax.default_backend() != "gpu" or q.dtype not in (jnp.bfloat16, jnp.float16):
    return "xla"
  try:
    jax.eval_shape(
      lambda q, k, v, m: jax.nn.dot_product_attention(
        q, k, v, mask=m, is_causal=is_causal, implementation="cudnn"
      ),
      q,
      k,
      v,
      mask,
    )
  except (ValueError, NotImplementedError, TypeError, RuntimeError):
    return "xla"
  return "cudnn"


def _attend(q, k, v, *, mask, is_causal, scale, implementation):
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r} is not one of {_IMPLEMENTATIONS}.")
  impl = implementation or pick_implementation(q, k, v, mask, is_causal)
  out = jax.nn.dot_product_attention(
    q, k, v, mask=mask, scale=scale, is_causal=is_causal, implementation=impl
  )
  if mask is not None:  # rows with no visible key are zero, as in the reference
    any_visible_Bx1xTx1 = jnp.any(mask, axis=-1, keepdims=True)
    out = jnp.where(jnp.transpose(any_visible_Bx1xTx1, (0, 2, 1, 3)), out, 0)
  return out


def mha_stock_gpu(
  q_BxTxHxD,
  k_BxSxKxD,
  v_BxSxKxD,
  *,
  causal: bool = True,
  q_segment_ids=None,
  kv_segment_ids=None,
  scale: float | None = None,
  block_sizes=None,
  interpret: bool = False,
  implementation: str | None = None,
) -> jax.Array:
  """Baseline attention, one ``jax.nn.dot_product_attention`` call. Returns [B, T, H, D]."""
  del block_sizes, interpret
  _v.check_mha(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD)
  opts = _options(
    q_BxTxHxD, k_BxSxKxD, causal, q_segment_ids, kv_segment_ids, scale, implementation
  )
  return _attend(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, **opts)


def diff_v1_stock_gpu(
  q1_BxTxHxD,
  q2_BxTxHxD,
  k1_BxSxKxD,
  k2_BxSxKxD,
  v_BxSxKxDv,
  lam_H,
  *,
  causal: bool = True,
  q_segment_ids=None,
  kv_segment_ids=None,
  scale: float | None = None,
  block_sizes=None,
  interpret: bool = False,
  implementation: str | None = None,
) -> jax.Array:
  """DIFF V1 with stock calls: 2 maps x (Dv / D) value chunks (4 calls for Dv = 2D).

  Returns [B, T, H, Dv] in the dtype of q1.
  """
  del block_sizes, interpret
  lam_H = jnp.asarray(lam_H)
  _v.check_diff_v1(q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H)
  opts = _options(
    q1_BxTxHxD, k1_BxSxKxD, causal, q_segment_ids, kv_segment_ids, scale, implementation
  )
  maps = [
    _chunked(q, k, v_BxSxKxDv, **opts)
    for q, k in ((q1_BxTxHxD, k1_BxSxKxD), (q2_BxTxHxD, k2_BxSxKxD))
  ]
  lam = jnp.broadcast_to(lam_H.astype(jnp.float32), (q1_BxTxHxD.shape[2],))[None, None, :, None]
  return (maps[0] - lam * maps[1]).astype(q1_BxTxHxD.dtype)


def _chunked(q, k, v, **opts):
  """Attention with a value wider than the head dim: one call per D-wide value chunk
  (cuDNN takes equal q, k and v widths); ``opts`` are :func:`_attend`'s keywords.
  Returns [B, T, heads of q, Dv] in float32."""
  d, dv = q.shape[3], v.shape[3]
  chunks = -(-dv // d)
  v_pad = jnp.pad(v, [(0, 0)] * 3 + [(0, chunks * d - dv)])
  parts = [_attend(q, k, v_pad[..., i * d : (i + 1) * d], **opts) for i in range(chunks)]
  return jnp.concatenate(parts, axis=-1)[..., :dv].astype(jnp.float32)


def _grouped_combine(o1_BxTxHxDv, o2_BxTxNxDv, lam_BxTxH, dtype):
  """o1 - lam * o2 with each noise head's output repeated over its r signal heads."""
  b, t, h, dv = o1_BxTxHxDv.shape
  n = o2_BxTxNxDv.shape[2]
  o1_BxTxNxRxDv = o1_BxTxHxDv.reshape(b, t, n, h // n, dv)
  lam = lam_BxTxH.astype(jnp.float32).reshape(lam_BxTxH.shape[:2] + (n, h // n, 1))
  out = o1_BxTxNxRxDv - lam * o2_BxTxNxDv[:, :, :, None, :]
  return out.reshape(b, t, h, dv).astype(dtype)


def diff_v2_stock_gpu(
  q_BxTxQxD,
  k_BxSxKxD,
  v_BxSxKxD,
  lam_BxTxH,
  *,
  causal: bool = True,
  q_segment_ids=None,
  kv_segment_ids=None,
  scale: float | None = None,
  block_sizes=None,
  interpret: bool = False,
  implementation: str | None = None,
) -> jax.Array:
  """DIFF V2 with one stock call over 2H heads, then the pair combination.

  Returns [B, T, H, D] in the dtype of q.
  """
  del block_sizes, interpret
  _v.check_diff_v2(q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
  opts = _options(
    q_BxTxQxD, k_BxSxKxD, causal, q_segment_ids, kv_segment_ids, scale, implementation
  )
  o = _attend(q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, **opts)
  b, t, qh, _ = q_BxTxQxD.shape
  o_BxTxHx2xD = o.reshape(b, t, qh // 2, 2, -1).astype(jnp.float32)
  lam = lam_BxTxH.astype(jnp.float32)[..., None]
  return (o_BxTxHx2xD[..., 0, :] - lam * o_BxTxHx2xD[..., 1, :]).astype(q_BxTxQxD.dtype)


def gda_v1_stock_gpu(
  q1_BxTxHxD,
  q2_BxTxNxD,
  k1_BxSxKxD,
  k2_BxSxKxD,
  v_BxSxKxDv,
  lam_H,
  *,
  causal: bool = True,
  q_segment_ids=None,
  kv_segment_ids=None,
  scale: float | None = None,
  block_sizes=None,
  interpret: bool = False,
  implementation: str | None = None,
) -> jax.Array:
  """Grouped differential attention (V1 style) with stock calls.

  The H signal heads (q1 against k1) and the N = H / r noise heads (q2 against k2) each
  take one call per D-wide chunk of the value: the noise maps once per group, their
  outputs repeated over each group's r signal heads, ``o = o1 - lam * o2``. Gradients
  are autodiff's through those calls (the repeat sums the noise heads' over the group).
  Returns [B, T, H, Dv] in the dtype of q1.
  """
  del block_sizes, interpret
  lam_H = jnp.asarray(lam_H)
  _v.check_gda_v1(q1_BxTxHxD, q2_BxTxNxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H)
  opts = _options(
    q1_BxTxHxD, k1_BxSxKxD, causal, q_segment_ids, kv_segment_ids, scale, implementation
  )
  o1 = _chunked(q1_BxTxHxD, k1_BxSxKxD, v_BxSxKxDv, **opts)
  o2 = _chunked(q2_BxTxNxD, k2_BxSxKxD, v_BxSxKxDv, **opts)
  lam_1x1xH = jnp.broadcast_to(lam_H.astype(jnp.float32), (q1_BxTxHxD.shape[2],))[None, None, :]
  return _grouped_combine(o1, o2, lam_1x1xH, q1_BxTxHxD.dtype)


def gda_v2_stock_gpu(
  q1_BxTxHxD,
  q2_BxTxNxD,
  k_BxSxKxD,
  v_BxSxKxD,
  lam_BxTxH,
  *,
  causal: bool = True,
  q_segment_ids=None,
  kv_segment_ids=None,
  scale: float | None = None,
  block_sizes=None,
  interpret: bool = False,
  implementation: str | None = None,
) -> jax.Array:
  """Grouped differential attention (V2 style) with stock calls: one over the H signal
  heads, one over the N noise heads (each noise map once per group), then
  ``o = o1 - lam * o2`` with o2 repeated over each group. Returns [B, T, H, D] in the
  dtype of q1.
  """
  del block_sizes, interpret
  _v.check_gda_v2(q1_BxTxHxD, q2_BxTxNxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
  opts = _options(
    q1_BxTxHxD, k_BxSxKxD, causal, q_segment_ids, kv_segment_ids, scale, implementation
  )
  o1 = _attend(q1_BxTxHxD, k_BxSxKxD, v_BxSxKxD, **opts).astype(jnp.float32)
  o2 = _attend(q2_BxTxNxD, k_BxSxKxD, v_BxSxKxD, **opts).astype(jnp.float32)
  return _grouped_combine(o1, o2, lam_BxTxH, q1_BxTxHxD.dtype)
