"""Functional attention ops: baseline (MHA/GQA), DIFF V1 and DIFF V2.

Every op takes an ``implementation=`` argument:

  * ``"xla"``: the plain-JAX reference math (:mod:`diffjax.ops.reference`); runs
    everywhere and supports every mask.
  * ``"pallas"``: the fused Pallas kernel for the current backend; ``"pallas_tpu"``
    and ``"pallas_gpu"`` name a backend explicitly (with ``interpret=True`` they run
    in the Pallas interpreter on any machine, which is how CPU tests check them).
  * ``"stock"``: composes existing attention kernels the way the authors' code does
    (several calls of a standard attention kernel), as the peer the fused kernel
    must beat.
  * ``"auto"`` (default): the fused kernel on TPU and GPU when one is registered
    and the call needs no explicit ``mask`` (for the baseline, the stock flash
    kernel of the platform); the XLA path otherwise (and on CPU).

The table of which kernel runs where is :mod:`diffjax.ops.dispatch`; users add
their own with :func:`register_implementation`, so callers never change when a
faster path appears.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from diffjax import sharding
from diffjax.core import reference as ref
from diffjax.core import validation as _v
from diffjax.core.dtypes import accumulation_dtype
from diffjax.ops.context_parallel import context_parallel_attention
from diffjax.ops.dispatch import (
  call_decode_kernel,
  call_kernel,
  mosaic_gpu_decodes,
  mosaic_gpu_takes,
  resolve,
)


def _is_float64(x: jax.Array) -> bool:
  return jnp.result_type(x) == jnp.float64


def _sequence_sharded(
  op: str, arrays, *, mask, causal, segment_ids, scale, implementation, block_sizes, interpret
):
  """The op's output under context parallelism (the active rules shard ``length`` over a
  mesh axis of size > 1), else None. There every implementation runs the exact math of
  :mod:`diffjax.ops.context_parallel`: the fused kernels per ring block when the
  implementation resolves to "pallas_tpu" or "pallas_gpu" (DIFF V1 and V2, ring strategy),
  XLA per block inside the ring or after the gather otherwise."""
  cp = sharding.context_parallel()
  if cp is None:
    return None
  if mask is not None:
    raise ValueError(
      "An explicit mask is not supported when the sequence is sharded over "
      f"the {cp.axis!r} mesh axis; use causal and segment_ids, or a mesh "
      "whose context axis is 1."
    )
  block_impl = "xla"
  if op != "mha" and cp.strategy == "ring":
    chosen = resolve(
      op, implementation, has_mask=False, interpret=interpret, float64=_is_float64(arrays[0])
    )
    block_impl = chosen if chosen in ("pallas_tpu", "pallas_gpu") else "xla"
  _, rules = sharding.current()
  batch_axis = sharding.logical_to_spec(("batch",), rules)[0]
  head_axis = sharding.logical_to_spec(("batch", "heads"), rules)[1]
  return context_parallel_attention(
    op,
    arrays,
    mesh=cp.mesh,
    context_axis=cp.axis,
    batch_axis=batch_axis,
    head_axis=head_axis,
    strategy=cp.strategy,
    load_balance=cp.load_balance,
    causal=causal,
    segment_ids=segment_ids,
    scale=scale,
    implementation=block_impl,
    block_sizes=block_sizes if block_impl != "xla" else None,
    interpret=interpret,
  )


def dot_product_attention(
  q_BxTxHxD: jax.Array,
  k_BxSxKxD: jax.Array,
  v_BxSxKxDv: jax.Array,
  *,
  causal: bool = True,
  segment_ids=None,
  mask: jax.Array | None = None,
  scale: float | None = None,
  implementation: str = "auto",
  block_sizes=None,
  interpret: bool = False,
) -> jax.Array:
  """Baseline multi-head / grouped-query attention.

  Args:
    q_BxTxHxD: queries; H must be a multiple of K.
    k_BxSxKxD, v_BxSxKxDv: keys and values of the K kv heads.
    causal: causal masking (queries are the last T of the S positions).
    segment_ids: None, one int [B, T] array (self-attention, T == S) or a pair
      ``(q_ids [B, T], kv_ids [B, S])``; tokens attend only within their segment.
    mask: optional boolean array broadcastable to [B, H, T, S] (True = attend).
    scale: score scale, default 1/sqrt(D).
  Returns:
    [B, T, H, Dv] in the dtype of q. Softmax runs in float32 (float64 for float64
    inputs, which always take the XLA path).
  """
  _v.check_mha(q_BxTxHxD, k_BxSxKxD, v_BxSxKxDv)
  out = _sequence_sharded(
    "mha",
    (q_BxTxHxD, k_BxSxKxD, v_BxSxKxDv),
    mask=mask,
    causal=causal,
    segment_ids=segment_ids,
    scale=scale,
    implementation=implementation,
    block_sizes=block_sizes,
    interpret=interpret,
  )
  if out is not None:
    return out
  impl = resolve(
    "mha",
    implementation,
    has_mask=mask is not None,
    interpret=interpret,
    float64=_is_float64(q_BxTxHxD),
  )
  if impl == "xla":
    return ref.mha_reference(
      q_BxTxHxD,
      k_BxSxKxD,
      v_BxSxKxDv,
      causal=causal,
      segment_ids=segment_ids,
      mask=mask,
      scale=scale,
    )
  return call_kernel(
    "mha",
    impl,
    (q_BxTxHxD, k_BxSxKxD, v_BxSxKxDv),
    causal=causal,
    segment_ids=segment_ids,
    scale=scale,
    block_sizes=block_sizes,
    interpret=interpret,
  )


def diff_v1_attention_core(
  q1_BxTxHxD: jax.Array,
  q2_BxTxHxD: jax.Array,
  k1_BxSxKxD: jax.Array,
  k2_BxSxKxD: jax.Array,
  v_BxSxKxDv: jax.Array,
  lam: jax.Array | float,
  *,
  causal: bool = True,
  segment_ids=None,
  mask: jax.Array | None = None,
  scale: float | None = None,
  implementation: str = "auto",
  block_sizes=None,
  interpret: bool = False,
) -> jax.Array:
  """DIFF V1 differential attention before the per-head norm.

  ``out_h = (softmax(q1_h k1_g^T * scale) - lam * softmax(q2_h k2_g^T * scale)) V_g``
  with g = h // (H // K). Both maps share one value of width Dv (= 2D in the paper).

  Args:
    q1_BxTxHxD, q2_BxTxHxD: the two query components of the H DIFF heads.
    k1_BxSxKxD, k2_BxSxKxD: the two key components of the K kv groups.
    v_BxSxKxDv: the value of each kv group.
    lam: the layer's lambda, a scalar, or one per head ([H]).
    causal, segment_ids, mask, scale: as in :func:`dot_product_attention`.
  Returns:
    [B, T, H, Dv] in the dtype of q1.
  """
  lam = jnp.asarray(lam)
  _v.check_diff_v1(q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam)
  out = _sequence_sharded(
    "diff_v1",
    (q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam),
    mask=mask,
    causal=causal,
    segment_ids=segment_ids,
    scale=scale,
    implementation=implementation,
    block_sizes=block_sizes,
    interpret=interpret,
  )
  if out is not None:
    return out
  impl = resolve(
    "diff_v1",
    implementation,
    has_mask=mask is not None,
    interpret=interpret,
    float64=_is_float64(q1_BxTxHxD),
    mosaic=mosaic_gpu_takes(
      "diff_v1",
      (q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv),
      segments=segment_ids is not None,
      block_sizes=block_sizes,
      interpret=interpret,
    ),
  )
  if impl == "xla":
    return ref.diff_v1_reference(
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
    )
  h = q1_BxTxHxD.shape[2]
  lam_H = jnp.broadcast_to(lam.astype(jnp.float32), (h,))
  return call_kernel(
    "diff_v1",
    impl,
    (q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H),
    causal=causal,
    segment_ids=segment_ids,
    scale=scale,
    block_sizes=block_sizes,
    interpret=interpret,
  )


def diff_v1_attention(
  q1_BxTxHxD: jax.Array,
  q2_BxTxHxD: jax.Array,
  k1_BxSxKxD: jax.Array,
  k2_BxSxKxD: jax.Array,
  v_BxSxKxDv: jax.Array,
  lam: jax.Array | float,
  *,
  norm_gain: jax.Array | None,
  lambda_init: float,
  eps: float = 1e-5,
  **kwargs,
) -> jax.Array:
  """DIFF V1 head outputs with the per-head RMSNorm and the (1 - lambda_init) scale.

  ``norm_gain`` has shape [Dv] (shared by the heads of the layer) or is None for a
  gain-free norm. Other arguments as in :func:`diff_v1_attention_core`.
  Returns [B, T, H, Dv] in the dtype of q1.
  """
  out_BxTxHxDv = diff_v1_attention_core(
    q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam, **kwargs
  )
  dv = out_BxTxHxDv.shape[-1]
  if norm_gain is not None and tuple(jnp.shape(norm_gain)) != (dv,):
    raise ValueError(f"norm_gain must have shape ({dv},); got {tuple(jnp.shape(norm_gain))}.")
  normed_BxTxHxDv = ref.rms_norm(out_BxTxHxDv, norm_gain, eps)
  acc = accumulation_dtype(out_BxTxHxDv.dtype)
  return (normed_BxTxHxDv.astype(acc) * (1.0 - lambda_init)).astype(out_BxTxHxDv.dtype)


def diff_v2_attention(
  q_BxTxQxD: jax.Array,
  k_BxSxKxD: jax.Array,
  v_BxSxKxD: jax.Array,
  lam_BxTxH: jax.Array,
  *,
  causal: bool = True,
  segment_ids=None,
  mask: jax.Array | None = None,
  scale: float | None = None,
  implementation: str = "auto",
  block_sizes=None,
  interpret: bool = False,
) -> jax.Array:
  """DIFF V2 differential attention on paired query heads.

  Args:
    q_BxTxQxD: Q = 2H query heads; heads 2i and 2i+1 form pair i and share kv group
      i // (H // K).
    k_BxSxKxD, v_BxSxKxD: the baseline's keys and values.
    lam_BxTxH: per-token, per-pair lambda (already passed through a sigmoid).
  Returns:
    [B, T, H, D] in the dtype of q:
    ``softmax(q_2i K^T s) V - lam_i * softmax(q_2i+1 K^T s) V``.
  """
  _v.check_diff_v2(q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
  out = _sequence_sharded(
    "diff_v2",
    (q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH),
    mask=mask,
    causal=causal,
    segment_ids=segment_ids,
    scale=scale,
    implementation=implementation,
    block_sizes=block_sizes,
    interpret=interpret,
  )
  if out is not None:
    return out
  impl = resolve(
    "diff_v2",
    implementation,
    has_mask=mask is not None,
    interpret=interpret,
    float64=_is_float64(q_BxTxQxD),
    mosaic=mosaic_gpu_takes(
      "diff_v2",
      (q_BxTxQxD, k_BxSxKxD, v_BxSxKxD),
      segments=segment_ids is not None,
      block_sizes=block_sizes,
      interpret=interpret,
    ),
  )
  if impl == "xla":
    return ref.diff_v2_reference(
      q_BxTxQxD,
      k_BxSxKxD,
      v_BxSxKxD,
      lam_BxTxH,
      causal=causal,
      segment_ids=segment_ids,
      mask=mask,
      scale=scale,
    )
  return call_kernel(
    "diff_v2",
    impl,
    (q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH),
    causal=causal,
    segment_ids=segment_ids,
    scale=scale,
    block_sizes=block_sizes,
    interpret=interpret,
  )


# Decoding: one new token per row attends to a KV cache of S slots, of which the first
# kv_len[b] are valid (the new token's own key and value included). Slots at or past
# kv_len are never attended, so rows of different lengths share one cache array.


def _length_mask(kv_len_B: jax.Array, s: int) -> jax.Array:
  """[B, 1, 1, S]: slot j of row b is visible when j < kv_len[b]."""
  kv_len_B = jnp.asarray(kv_len_B, jnp.int32)
  return (jnp.arange(s, dtype=jnp.int32)[None, :] < kv_len_B[:, None])[:, None, None, :]


def dot_product_attention_decode(
  q_Bx1xHxD: jax.Array,
  k_BxSxKxD: jax.Array,
  v_BxSxKxD: jax.Array,
  kv_len_B: jax.Array,
  *,
  scale: float | None = None,
  implementation: str = "auto",
  block_sizes=None,
  interpret: bool = False,
) -> jax.Array:
  """Baseline attention of one new token per row against a KV cache.

  Args:
    q_Bx1xHxD: the new token's queries.
    k_BxSxKxD, v_BxSxKxD: the cache (S slots per row).
    kv_len_B: int [B], valid slots per row; slots >= kv_len are ignored.
  Returns:
    [B, 1, H, D] in the dtype of q: the last row of causal attention over the
    first kv_len[b] slots.
  """
  _v.check_mha(q_Bx1xHxD, k_BxSxKxD, v_BxSxKxD)
  _v.check_decode(q_Bx1xHxD, kv_len_B, "decode attention")
  impl = resolve(
    "mha_decode",
    implementation,
    has_mask=False,
    interpret=interpret,
    float64=_is_float64(q_Bx1xHxD),
  )
  if impl == "xla":
    return ref.mha_reference(
      q_Bx1xHxD,
      k_BxSxKxD,
      v_BxSxKxD,
      causal=False,
      mask=_length_mask(kv_len_B, k_BxSxKxD.shape[1]),
      scale=scale,
    )
  return call_decode_kernel(
    "mha_decode",
    impl,
    (q_Bx1xHxD, k_BxSxKxD, v_BxSxKxD, kv_len_B),
    scale=scale,
    block_sizes=block_sizes,
    interpret=interpret,
  )


def diff_v1_attention_decode(
  q1_Bx1xHxD: jax.Array,
  q2_Bx1xHxD: jax.Array,
  k1_BxSxKxD: jax.Array,
  k2_BxSxKxD: jax.Array,
  v_BxSxKxDv: jax.Array,
  lam: jax.Array | float,
  kv_len_B: jax.Array,
  *,
  scale: float | None = None,
  implementation: str = "auto",
  block_sizes=None,
  interpret: bool = False,
) -> jax.Array:
  """DIFF V1 attention (before the per-head norm) of one new token against a cache.

  "auto" runs a fused decode kernel, which reads K1, K2 and V once, on TPU
  (:func:`diffjax.kernels.tpu.diff_v1_decode_pallas_tpu`) and on a Hopper GPU for bf16/fp16
  (:func:`diffjax.kernels.gpu.mosaic_decode.diff_v1_decode_pallas_gpu`); elsewhere the
  reference math through XLA. ``block_sizes`` are the chosen kernel's. Arguments as in
  :func:`diff_v1_attention_core` and
  :func:`dot_product_attention_decode`. Returns [B, 1, H, Dv] in the dtype of q1.
  """
  lam = jnp.asarray(lam)
  _v.check_diff_v1(q1_Bx1xHxD, q2_Bx1xHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam)
  _v.check_decode(q1_Bx1xHxD, kv_len_B, "decode attention")
  impl = resolve(
    "diff_v1_decode",
    implementation,
    has_mask=False,
    interpret=interpret,
    float64=_is_float64(q1_Bx1xHxD),
    mosaic=mosaic_gpu_decodes(
      (q1_Bx1xHxD, q2_Bx1xHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv),
      block_sizes=block_sizes,
      interpret=interpret,
    ),
  )
  if impl == "xla":
    return ref.diff_v1_reference(
      q1_Bx1xHxD,
      q2_Bx1xHxD,
      k1_BxSxKxD,
      k2_BxSxKxD,
      v_BxSxKxDv,
      lam,
      causal=False,
      mask=_length_mask(kv_len_B, k1_BxSxKxD.shape[1]),
      scale=scale,
    )
  h = q1_Bx1xHxD.shape[2]
  lam_H = jnp.broadcast_to(lam.astype(jnp.float32), (h,))
  return call_decode_kernel(
    "diff_v1_decode",
    impl,
    (
      q1_Bx1xHxD,
      q2_Bx1xHxD,
      k1_BxSxKxD,
      k2_BxSxKxD,
      v_BxSxKxDv,
      lam_H,
      jnp.asarray(kv_len_B, jnp.int32),
    ),
    scale=scale,
    block_sizes=block_sizes,
    interpret=interpret,
  )


def diff_v2_attention_decode(
  q_Bx1xQxD: jax.Array,
  k_BxSxKxD: jax.Array,
  v_BxSxKxD: jax.Array,
  lam_Bx1xH: jax.Array,
  kv_len_B: jax.Array,
  *,
  scale: float | None = None,
  implementation: str = "auto",
  block_sizes=None,
  interpret: bool = False,
) -> jax.Array:
  """DIFF V2 attention of one new token per row against the (baseline's) KV cache.

  Arguments as in :func:`diff_v2_attention` and :func:`dot_product_attention_decode`.
  Returns [B, 1, H, D] in the dtype of q.
  """
  _v.check_diff_v2(q_Bx1xQxD, k_BxSxKxD, v_BxSxKxD, lam_Bx1xH)
  _v.check_decode(q_Bx1xQxD, kv_len_B, "decode attention")
  impl = resolve(
    "diff_v2_decode",
    implementation,
    has_mask=False,
    interpret=interpret,
    float64=_is_float64(q_Bx1xQxD),
  )
  if impl == "xla":
    return ref.diff_v2_reference(
      q_Bx1xQxD,
      k_BxSxKxD,
      v_BxSxKxD,
      lam_Bx1xH,
      causal=False,
      mask=_length_mask(kv_len_B, k_BxSxKxD.shape[1]),
      scale=scale,
    )
  return call_decode_kernel(
    "diff_v2_decode",
    impl,
    (q_Bx1xQxD, k_BxSxKxD, v_BxSxKxD, lam_Bx1xH, kv_len_B),
    scale=scale,
    block_sizes=block_sizes,
    interpret=interpret,
  )
