"""The stock GPU paths: DIFF attention composed from ``jax.nn.dot_product_attention`` calls.

The peers the fused kernels must beat, as the authors' code runs on stock kernels (cuDNN
flash attention when it accepts a call, XLA otherwise): one call for the baseline, four
for DIFF V1, one over the 2H query heads for DIFF V2. Why four, and the masks:
docs/kernels_gpu.md.
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
  b, t, _, d = q_BxTxHxD.shape
  mask, is_causal = _mask(
    b, t, k_BxSxKxD.shape[1], causal=causal, q_seg=q_segment_ids, kv_seg=kv_segment_ids
  )
  return _attend(
    q_BxTxHxD,
    k_BxSxKxD,
    v_BxSxKxD,
    mask=mask,
    is_causal=is_causal,
    scale=_v.default_scale(scale, d),
    implementation=implementation,
  )


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
  b, t, h, d = q1_BxTxHxD.shape
  s, dv = k1_BxSxKxD.shape[1], v_BxSxKxDv.shape[3]
  mask, is_causal = _mask(b, t, s, causal=causal, q_seg=q_segment_ids, kv_seg=kv_segment_ids)
  scale = _v.default_scale(scale, d)
  chunks = -(-dv // d)
  v_pad = jnp.pad(v_BxSxKxDv, [(0, 0)] * 3 + [(0, chunks * d - dv)])
  maps = []
  for q, k in ((q1_BxTxHxD, k1_BxSxKxD), (q2_BxTxHxD, k2_BxSxKxD)):
    parts = [
      _attend(
        q,
        k,
        v_pad[..., i * d : (i + 1) * d],
        mask=mask,
        is_causal=is_causal,
        scale=scale,
        implementation=implementation,
      )
      for i in range(chunks)
    ]
    maps.append(jnp.concatenate(parts, axis=-1)[..., :dv].astype(jnp.float32))
  lam = jnp.broadcast_to(lam_H.astype(jnp.float32), (h,))[None, None, :, None]
  return (maps[0] - lam * maps[1]).astype(q1_BxTxHxD.dtype)


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
  b, t, qh, d = q_BxTxQxD.shape
  mask, is_causal = _mask(
    b, t, k_BxSxKxD.shape[1], causal=causal, q_seg=q_segment_ids, kv_seg=kv_segment_ids
  )
  o = _attend(
    q_BxTxQxD,
    k_BxSxKxD,
    v_BxSxKxD,
    mask=mask,
    is_causal=is_causal,
    scale=_v.default_scale(scale, d),
    implementation=implementation,
  )
  o_BxTxHx2xD = o.reshape(b, t, qh // 2, 2, -1).astype(jnp.float32)
  lam = lam_BxTxH.astype(jnp.float32)[..., None]
  return (o_BxTxHx2xD[..., 0, :] - lam * o_BxTxHx2xD[..., 1, :]).astype(q_BxTxQxD.dtype)
