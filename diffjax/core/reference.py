"""Plain-JAX reference math for baseline, DIFF V1, DIFF V2 and grouped differential attention (public as
:mod:`diffjax.ops.reference`): the single source of truth every fast path is tested against.

Shapes are in the names (B batch, T queries, S keys, H query heads, K kv heads, G = H // K,
D head dim, Dv value dim); query head h reads kv group h // G. Scores and softmax run in float32
(float64 for float64 inputs); causal queries are the last T of the S positions; a row that sees
no key gives zeros. docs/model.md#functional-ops has the conventions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from diffjax.core import validation as _v
from diffjax.core.dtypes import accumulation_dtype

_NEG_INF = float(jnp.finfo(jnp.float32).min) * 0.5


def build_mask(
  batch: int,
  q_len: int,
  kv_len: int,
  *,
  causal: bool,
  q_segment_ids_BxT: jax.Array | None,
  kv_segment_ids_BxS: jax.Array | None,
  mask: jax.Array | None,
) -> jax.Array | None:
  """Returns a boolean mask broadcastable to [B, 1, T, S] (True = attend), or None."""
  out = None
  if causal:
    q_pos = jnp.arange(q_len)[:, None] + (kv_len - q_len)
    k_pos = jnp.arange(kv_len)[None, :]
    out = (k_pos <= q_pos)[None, None]
  if q_segment_ids_BxT is not None:
    seg = q_segment_ids_BxT[:, None, :, None] == kv_segment_ids_BxS[:, None, None, :]
    out = seg if out is None else jnp.logical_and(out, seg)
  if mask is not None:
    m = jnp.asarray(mask).astype(jnp.bool_)
    if m.ndim > 4:
      raise ValueError(f"mask must be broadcastable to [batch, heads, T, S]; got shape {m.shape}.")
    m = m.reshape((1,) * (4 - m.ndim) + m.shape)
    out = m if out is None else jnp.logical_and(out, m)
  del batch
  return out


def _grouped_logits(q_BxTxHxD, k_BxSxKxD, scale: float) -> jax.Array:
  """Scaled scores in float32 (float64 for float64 inputs), shape [B, H, T, S]."""
  b, t, h, d = q_BxTxHxD.shape
  kv = k_BxSxKxD.shape[2]
  g = h // kv
  acc = accumulation_dtype(q_BxTxHxD.dtype)
  q_BxTxKxGxD = q_BxTxHxD.reshape(b, t, kv, g, d)
  logits_BxKxGxTxS = jnp.einsum(
    "btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxSxKxD, preferred_element_type=acc
  )
  return logits_BxKxGxTxS.reshape(b, h, t, k_BxSxKxD.shape[1]) * jnp.asarray(scale, acc)


def masked_softmax(logits_BxHxTxS: jax.Array, mask) -> jax.Array:
  """Float32 (float64 for float64 logits) softmax over the last axis.

  Fully masked rows give all-zero rows.
  """
  logits = logits_BxHxTxS.astype(accumulation_dtype(logits_BxHxTxS.dtype))
  if mask is None:
    return jax.nn.softmax(logits, axis=-1)
  logits = jnp.where(mask, logits, _NEG_INF)
  probs = jax.nn.softmax(logits, axis=-1)
  any_valid = jnp.any(mask, axis=-1, keepdims=True)
  return jnp.where(jnp.logical_and(mask, any_valid), probs, 0.0)


def merge_partials(parts, log_mass, axis: int) -> jax.Array:
  """Attention over a key range split in pieces, from the pieces' results.

  ``parts`` [..., Dv]: each piece's own softmax-normalised output, the pieces along
  ``axis``; ``log_mass`` (``parts`` without its last axis): the natural log of each
  piece's softmax mass (its log-sum-exp), ``-inf`` for a piece that saw no key. Rows no
  piece saw come out 0. The split-KV decoding kernels merge their splits with this.
  """
  top = jnp.max(log_mass, axis=axis, keepdims=True)
  w = jnp.exp(log_mass - jnp.where(jnp.isfinite(top), top, 0.0))
  total = jnp.sum(w, axis=axis)
  out = jnp.sum(w[..., None] * parts, axis=axis)
  return out / jnp.where(total == 0.0, 1.0, total)[..., None]


def attention_probs(
  q_BxTxHxD, k_BxSxKxD, *, scale: float, mask, logits_fn=None
) -> tuple[jax.Array, jax.Array]:
  """Returns (logits, probabilities), both float32 [B, H, T, S] (float64 for float64 q).

  ``logits_fn`` (analysis only) transforms the scaled float32 scores before the
  softmax, e.g. to quantize them; the returned logits are the transformed ones.
  """
  logits_BxHxTxS = _grouped_logits(q_BxTxHxD, k_BxSxKxD, scale)
  if logits_fn is not None:
    logits_BxHxTxS = logits_fn(logits_BxHxTxS).astype(logits_BxHxTxS.dtype)
  return logits_BxHxTxS, masked_softmax(logits_BxHxTxS, mask)


def _apply_probs(probs_BxHxTxS, v_BxSxKxDv, out_dtype) -> jax.Array:
  """(probs @ V) per head with GQA, returns [B, T, H, Dv] in out_dtype."""
  b, h, t, s = probs_BxHxTxS.shape
  kv = v_BxSxKxDv.shape[2]
  g = h // kv
  p_BxKxGxTxS = probs_BxHxTxS.reshape(b, kv, g, t, s).astype(v_BxSxKxDv.dtype)
  out_BxTxKxGxDv = jnp.einsum(
    "bkgts,bskd->btkgd",
    p_BxKxGxTxS,
    v_BxSxKxDv,
    preferred_element_type=accumulation_dtype(v_BxSxKxDv.dtype),
  )
  return out_BxTxKxGxDv.reshape(b, t, h, v_BxSxKxDv.shape[3]).astype(out_dtype)


def _mask_and_scale(q_BxTxHxD, k_BxSxKxD, causal, segment_ids, mask, scale):
  """The visibility mask (broadcastable to [B, 1, T, S], or None) and the score scale."""
  b, t, _, d = q_BxTxHxD.shape
  s = k_BxSxKxD.shape[1]
  q_seg, kv_seg = _v.split_segment_ids(segment_ids, b, t, s)
  m = build_mask(
    b, t, s, causal=causal, q_segment_ids_BxT=q_seg, kv_segment_ids_BxS=kv_seg, mask=mask
  )
  return m, _v.default_scale(scale, d)


def mha_reference(
  q_BxTxHxD,
  k_BxSxKxD,
  v_BxSxKxDv,
  *,
  causal=True,
  segment_ids=None,
  mask=None,
  scale=None,
  return_aux=False,
  logits_fn=None,
  probs_fn=None,
):
  """Baseline multi-head / grouped-query attention.

  Returns out [B, T, H, Dv] (dtype of q); with ``return_aux`` also a dict with
  float32 ``logits`` and ``probs`` of shape [B, H, T, S].
  """
  _v.check_mha(q_BxTxHxD, k_BxSxKxD, v_BxSxKxDv)
  m, scale = _mask_and_scale(q_BxTxHxD, k_BxSxKxD, causal, segment_ids, mask, scale)
  logits_BxHxTxS, probs_BxHxTxS = attention_probs(
    q_BxTxHxD, k_BxSxKxD, scale=scale, mask=m, logits_fn=logits_fn
  )
  if probs_fn is not None:
    probs_BxHxTxS = probs_fn(probs_BxHxTxS)
  out_BxTxHxDv = _apply_probs(probs_BxHxTxS, v_BxSxKxDv, q_BxTxHxD.dtype)
  if return_aux:
    return out_BxTxHxDv, {"logits": logits_BxHxTxS, "probs": probs_BxHxTxS}
  return out_BxTxHxDv


def _differential(
  q1_BxTxHxD,
  q2_BxTxHxD,
  k1_BxSxKxD,
  k2_BxSxKxD,
  v_BxSxKxDv,
  lam_BxHxT,
  *,
  causal,
  segment_ids,
  mask,
  scale,
  return_aux,
  logits_fn,
  probs_fn,
):
  """(softmax(q1 k1^T s) - lam * softmax(q2 k2^T s)) V, the math V1 and V2 share.

  ``lam_BxHxT`` broadcasts to [B, H, T] (a scalar, per head, or per token and head). ``q2``
  may have fewer heads than ``q1`` (grouped differential attention): its H / H2 maps are
  each repeated over a group of H2 consecutive ``q1`` heads, like GQA repeats keys.
  """
  m, scale = _mask_and_scale(q1_BxTxHxD, k1_BxSxKxD, causal, segment_ids, mask, scale)
  logits1_BxHxTxS, p1_BxHxTxS = attention_probs(
    q1_BxTxHxD, k1_BxSxKxD, scale=scale, mask=m, logits_fn=logits_fn
  )
  logits2_BxHxTxS, p2_BxHxTxS = attention_probs(
    q2_BxTxHxD, k2_BxSxKxD, scale=scale, mask=m, logits_fn=logits_fn
  )
  group = q1_BxTxHxD.shape[2] // q2_BxTxHxD.shape[2]
  if group > 1:  # each noise map once, then repeated over its signal heads
    logits2_BxHxTxS = jnp.repeat(logits2_BxHxTxS, group, axis=1)
    p2_BxHxTxS = jnp.repeat(p2_BxHxTxS, group, axis=1)
  # One matmul with V on the combined (signed) probabilities.
  p_BxHxTxS = p1_BxHxTxS - lam_BxHxT[..., None] * p2_BxHxTxS
  if probs_fn is not None:
    p_BxHxTxS = probs_fn(p_BxHxTxS)
  out_BxTxHxDv = _apply_probs(p_BxHxTxS, v_BxSxKxDv, q1_BxTxHxD.dtype)
  if return_aux:
    return out_BxTxHxDv, {
      "logits1": logits1_BxHxTxS,
      "logits2": logits2_BxHxTxS,
      "probs1": p1_BxHxTxS,
      "probs2": p2_BxHxTxS,
    }
  return out_BxTxHxDv


def _per_head_lambda(q1, q2, k1, k2, v, lam, **kw):
  """DIFF V1's form (and its grouped one): lam a scalar or [H], in the accumulation dtype."""
  acc = accumulation_dtype(q1.dtype)
  lam_BxHxT = jnp.broadcast_to(jnp.asarray(lam, acc), (q1.shape[2],))[None, :, None]
  return _differential(q1, q2, k1, k2, v, lam_BxHxT, **kw)


def _per_token_lambda(q1, q2, k, v, lam_BxTxH, **kw):
  """DIFF V2's form (and its grouped one): one key array, lam [B, T, H]."""
  lam_BxHxT = jnp.transpose(lam_BxTxH.astype(accumulation_dtype(q1.dtype)), (0, 2, 1))
  return _differential(q1, q2, k, k, v, lam_BxHxT, **kw)


def split_pairs(q_BxTxQxD) -> tuple[jax.Array, jax.Array]:
  """DIFF V2's paired query heads -> (heads 2i [B, T, H, D], heads 2i+1 [B, T, H, D])."""
  b, t, q_heads, d = q_BxTxQxD.shape
  q_BxTxHx2xD = q_BxTxQxD.reshape(b, t, q_heads // 2, 2, d)
  return q_BxTxHx2xD[:, :, :, 0], q_BxTxHx2xD[:, :, :, 1]


def diff_v1_reference(
  q1_BxTxHxD,
  q2_BxTxHxD,
  k1_BxSxKxD,
  k2_BxSxKxD,
  v_BxSxKxDv,
  lam,
  *,
  causal=True,
  segment_ids=None,
  mask=None,
  scale=None,
  return_aux=False,
  logits_fn=None,
  probs_fn=None,
):
  """DIFF V1 core: ``(softmax(q1 k1^T s) - lam * softmax(q2 k2^T s)) V``.

  Args:
    q1_BxTxHxD, q2_BxTxHxD: the two query components of each DIFF head.
    k1_BxSxKxD, k2_BxSxKxD: the two key components of each kv group.
    v_BxSxKxDv: one value per kv group, usually Dv = 2 D.
    lam: scalar (one lambda for the layer) or [H] (one per head), any float dtype;
      used in float32 (float64 for float64 inputs).
  Returns:
    [B, T, H, Dv] in the dtype of q1, before the per-head norm. With ``return_aux``
    also ``logits1``, ``logits2``, ``probs1``, ``probs2`` (float32 [B, H, T, S]).
  """
  _v.check_diff_v1(q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam)
  return _per_head_lambda(
    q1_BxTxHxD,
    q2_BxTxHxD,
    k1_BxSxKxD,
    k2_BxSxKxD,
    v_BxSxKxDv,
    lam,
    causal=causal,
    segment_ids=segment_ids,
    mask=mask,
    scale=scale,
    return_aux=return_aux,
    logits_fn=logits_fn,
    probs_fn=probs_fn,
  )


def diff_v2_reference(
  q_BxTxQxD,
  k_BxSxKxD,
  v_BxSxKxD,
  lam_BxTxH,
  *,
  causal=True,
  segment_ids=None,
  mask=None,
  scale=None,
  return_aux=False,
  logits_fn=None,
  probs_fn=None,
):
  """DIFF V2 core on paired query heads.

  Args:
    q_BxTxQxD: Q = 2H query heads; heads 2i and 2i+1 form pair i, and both read
      kv group i // (H // K), so a pair never straddles two GQA groups.
    k_BxSxKxD, v_BxSxKxD: the baseline's keys and values (unchanged by V2).
    lam_BxTxH: per-token, per-pair lambda, already squashed (sigmoid) by the caller.
  Returns:
    [B, T, H, D]: ``softmax(q_2i K^T s) V - lam_i * softmax(q_2i+1 K^T s) V``.
    With ``return_aux`` also ``logits1/2`` and ``probs1/2`` ([B, H, T, S]).
  """
  _v.check_diff_v2(q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
  q1_BxTxHxD, q2_BxTxHxD = split_pairs(q_BxTxQxD)
  return _per_token_lambda(
    q1_BxTxHxD,
    q2_BxTxHxD,
    k_BxSxKxD,
    v_BxSxKxD,
    lam_BxTxH,
    causal=causal,
    segment_ids=segment_ids,
    mask=mask,
    scale=scale,
    return_aux=return_aux,
    logits_fn=logits_fn,
    probs_fn=probs_fn,
  )


def gda_v1_reference(
  q1_BxTxHxD,
  q2_BxTxNxD,
  k1_BxSxKxD,
  k2_BxSxKxD,
  v_BxSxKxDv,
  lam,
  *,
  causal=True,
  segment_ids=None,
  mask=None,
  scale=None,
  return_aux=False,
  logits_fn=None,
  probs_fn=None,
):
  """Grouped differential attention, V1 style (GDA, arXiv 2510.06949; Motif-2).

  Args:
    q1_BxTxHxD: H signal query heads.
    q2_BxTxNxD: N = H / r noise query heads; noise head n serves signal heads n r ..
      n r + r - 1 (r = 1 is DIFF V1).
    k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv: K kv groups; N must be a multiple of K, so each
      group of r signal heads and its noise head read one kv group.
    lam: scalar or [H], as DIFF V1.
  Returns:
    [B, T, H, Dv]: ``(softmax(q1_h k1^T s) - lam_h softmax(q2_{h // r} k2^T s)) V``, before
    the per-head norm. With ``return_aux`` the maps as DIFF V1's, the noise maps repeated
    over their groups ([B, H, T, S]).
  """
  _v.check_gda_v1(q1_BxTxHxD, q2_BxTxNxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam)
  return _per_head_lambda(
    q1_BxTxHxD,
    q2_BxTxNxD,
    k1_BxSxKxD,
    k2_BxSxKxD,
    v_BxSxKxDv,
    lam,
    causal=causal,
    segment_ids=segment_ids,
    mask=mask,
    scale=scale,
    return_aux=return_aux,
    logits_fn=logits_fn,
    probs_fn=probs_fn,
  )


def split_groups(q_BxTxQxD, noise_heads: int) -> tuple[jax.Array, jax.Array]:
  """Grouped query heads -> (signal [B, T, H, D], noise [B, T, N, D]).

  The Q = N (r + 1) query heads come in N groups of r signal heads followed by their
  noise head (Motif's layout; r = 1 is DIFF V1's components and DIFF V2's pairs 2i, 2i+1).
  """
  b, t, q_heads, d = q_BxTxQxD.shape
  if noise_heads <= 0 or q_heads % noise_heads or q_heads == noise_heads:
    raise ValueError(
      f"{q_heads} query heads cannot form {noise_heads} groups of r signal heads and one "
      "noise head."
    )
  q_BxTxNxGxD = q_BxTxQxD.reshape(b, t, noise_heads, q_heads // noise_heads, d)
  return (
    q_BxTxNxGxD[:, :, :, :-1].reshape(b, t, q_heads - noise_heads, d),
    q_BxTxNxGxD[:, :, :, -1],
  )


def gda_v2_reference(
  q1_BxTxHxD,
  q2_BxTxNxD,
  k_BxSxKxD,
  v_BxSxKxD,
  lam_BxTxH,
  *,
  causal=True,
  segment_ids=None,
  mask=None,
  scale=None,
  return_aux=False,
  logits_fn=None,
  probs_fn=None,
):
  """Grouped differential attention, V2 style (Motif 3's combine on ordinary keys).

  Args:
    q1_BxTxHxD: H signal query heads; q2_BxTxNxD: N = H / r noise query heads, noise head
      n serving signal heads n r .. n r + r - 1 (:func:`split_groups` splits Motif's
      grouped layout); N a multiple of K, so a group reads one kv group.
    k_BxSxKxD, v_BxSxKxD: the baseline's keys and values.
    lam_BxTxH: per token and signal head, already squashed (sigmoid) by the caller.
  Returns:
    [B, T, H, D]: ``softmax(q1_h K^T s) V - lam_h softmax(q2_{h // r} K^T s) V``; r = 1
    is DIFF V2 on the pairs (q1_i, q2_i).
  """
  _v.check_gda_v2(q1_BxTxHxD, q2_BxTxNxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
  return _per_token_lambda(
    q1_BxTxHxD,
    q2_BxTxNxD,
    k_BxSxKxD,
    v_BxSxKxD,
    lam_BxTxH,
    causal=causal,
    segment_ids=segment_ids,
    mask=mask,
    scale=scale,
    return_aux=return_aux,
    logits_fn=logits_fn,
    probs_fn=probs_fn,
  )


def rms_norm(x, gain, eps: float = 1e-5):
  """RMSNorm over the last axis in float32 (float64 for float64 x); returns the dtype of x."""
  acc = accumulation_dtype(x.dtype)
  x_acc = x.astype(acc)
  y = x_acc * jax.lax.rsqrt(jnp.mean(x_acc * x_acc, axis=-1, keepdims=True) + eps)
  if gain is not None:
    y = y * gain.astype(acc).reshape((1,) * (y.ndim - 1) + (-1,))
  return y.astype(x.dtype)


def lambda_init_for_layer(layer_index: int, offset: int = 0) -> float:
  """DIFF V1 lambda_init = 0.8 - 0.6 * exp(-0.3 * (l + offset)), l counted from 0.

  ``offset`` 0 is the DIFF paper's code; Motif's models use -1 (their layer 0 starts at
  lambda_init = 0.8 - 0.6 e^0.3, just below 0).
  """
  import math

  if layer_index < 0:
    raise ValueError(f"layer_index={layer_index} must be >= 0 (layers count from 0).")
  return 0.8 - 0.6 * math.exp(-0.3 * (layer_index + offset))


def diff_v1_lambda(lq1, lk1, lq2, lk2, lambda_init: float, dtype=jnp.float32) -> jax.Array:
  """lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, a scalar.

  Computed in float32, or in float64 when ``dtype`` (the compute dtype) or the
  vectors are float64.
  """
  acc = accumulation_dtype(jnp.result_type(dtype, lq1, lk1, lq2, lk2))
  f = lambda a: a.astype(acc)
  return (
    jnp.exp(jnp.sum(f(lq1) * f(lk1)))
    - jnp.exp(jnp.sum(f(lq2) * f(lk2)))
    + jnp.asarray(lambda_init, acc)
  )
