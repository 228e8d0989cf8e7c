"""Functional attention ops: baseline (MHA/GQA), DIFF V1 / V2 and their grouped forms (GDA).

Each is :func:`run_op` (or :func:`run_decode_op`) of its OpSpec. ``implementation=``,
``block_sizes`` and ``interpret``: docs/architecture.md, "Dispatch: which function runs".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from diffjax import sharding
from diffjax.core import op_specs
from diffjax.core import reference as ref
from diffjax.core.dtypes import accumulation_dtype
from diffjax.core.op_specs import OpSpec
from diffjax.ops import dispatch
from diffjax.ops.context_parallel import context_parallel_attention


def _check_mask(shape: tuple[int, ...], t: int, s: int) -> None:
  """Refuses a mask that cannot broadcast to [B, H, T, S] on its query and key axes."""
  trailing = shape[-2:]
  if len(shape) > 4 or any(n not in (1, want) for n, want in zip(trailing[::-1], (s, t))):
    raise ValueError(
      f"mask of shape {shape} does not broadcast to [B, H, T={t}, S={s}]: give it at most 4 "
      "axes, its last two T (or 1) and S (or 1)."
    )


def run_op(
  spec: OpSpec,
  arrays: tuple,
  *,
  causal: bool = True,
  segment_ids=None,
  mask: jax.Array | None = None,
  scale: float | None = None,
  implementation: str = "auto",
  block_sizes=None,
  interpret: bool = False,
) -> jax.Array:
  """The op ``spec`` on ``arrays`` (its positional arguments), checked, dispatched, and
  run per device under the active mesh; under context parallelism (the active rules
  shard ``length`` over a mesh axis of size > 1) the exact math of
  :mod:`diffjax.ops.context_parallel`."""
  arrays = tuple(arrays)
  spec.check(*arrays)
  if mask is not None:
    _check_mask(jnp.shape(mask), spec.query(arrays).shape[1], spec.key(arrays).shape[1])
  cp = sharding.context_parallel()
  # What both paths take alike.
  kw = dict(
    causal=causal,
    segment_ids=segment_ids,
    scale=scale,
    block_sizes=block_sizes,
    interpret=interpret,
  )
  if cp is None:
    return dispatch.run(spec, implementation, arrays, mask=mask, **kw)
  if mask is not None:
    raise ValueError(
      "An explicit mask is not supported when the sequence is sharded over "
      f"the {cp.axis!r} mesh axis; use causal and segment_ids, or a mesh "
      "whose context axis is 1."
    )
  mesh, rules = sharding.current()
  batch_axis, head_axis = dispatch.kernel_axes(mesh, rules)
  return context_parallel_attention(
    spec,
    arrays,
    mesh=cp.mesh,
    context_axis=cp.axis,
    batch_axis=batch_axis,
    head_axis=head_axis,
    strategy=cp.strategy,
    load_balance=cp.load_balance,
    implementation=implementation,
    **kw,
  )


def run_decode_op(
  spec: OpSpec,
  arrays: tuple,
  *,
  scale: float | None = None,
  implementation: str = "auto",
  block_sizes=None,
  interpret: bool = False,
) -> jax.Array:
  """The decode op ``spec`` (one query token per row against a cache; the int [B] valid
  lengths last in ``arrays``), checked and dispatched."""
  arrays = tuple(arrays)
  spec.check(*arrays)
  return dispatch.run(
    spec, implementation, arrays, scale=scale, block_sizes=block_sizes, interpret=interpret
  )


def dot_product_attention(
  q_BxTxHxD: jax.Array, k_BxSxKxD: jax.Array, v_BxSxKxDv: jax.Array, **kwargs
) -> jax.Array:
  """Baseline multi-head / grouped-query attention.

  Args:
    q_BxTxHxD: queries; H must be a multiple of K.
    k_BxSxKxD, v_BxSxKxDv: keys and values of the K kv heads.
    causal: causal masking (queries are the last T of the S positions); default True.
    segment_ids: None, one int [B, T] array (self-attention, T == S) or a pair
      ``(q_ids [B, T], kv_ids [B, S])``; tokens attend only within their segment.
    mask: optional boolean array broadcastable to [B, H, T, S] (True = attend).
    scale: score scale, default 1/sqrt(D).
    implementation, block_sizes, interpret: see the module docstring.
  Returns:
    [B, T, H, Dv] in the dtype of q. Softmax runs in float32 (float64 for float64
    inputs, which always take the XLA path).
  """
  return run_op(op_specs.MHA, (q_BxTxHxD, k_BxSxKxD, v_BxSxKxDv), **kwargs)


def diff_v1_attention_core(
  q1_BxTxHxD: jax.Array,
  q2_BxTxHxD: jax.Array,
  k1_BxSxKxD: jax.Array,
  k2_BxSxKxD: jax.Array,
  v_BxSxKxDv: jax.Array,
  lam: jax.Array | float,
  **kwargs,
) -> jax.Array:
  """DIFF V1 differential attention before the per-head norm.

  ``out_h = (softmax(q1_h k1_g^T * scale) - lam * softmax(q2_h k2_g^T * scale)) V_g``
  with g = h // (H // K). Both maps share one value of width Dv (= 2D in the paper).

  Args:
    q1_BxTxHxD, q2_BxTxHxD: the two query components of the H DIFF heads.
    k1_BxSxKxD, k2_BxSxKxD: the two key components of the K kv groups.
    v_BxSxKxDv: the value of each kv group.
    lam: the layer's lambda, a scalar, or one per head ([H]).
    **kwargs: ``causal, segment_ids, mask, scale, implementation, block_sizes,
      interpret`` as in :func:`dot_product_attention`.
  Returns:
    [B, T, H, Dv] in the dtype of q1.
  """
  arrays = (q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, jnp.asarray(lam))
  return run_op(op_specs.DIFF_V1, arrays, **kwargs)


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
  q_BxTxQxD: jax.Array, k_BxSxKxD: jax.Array, v_BxSxKxD: jax.Array, lam_BxTxH: jax.Array, **kwargs
) -> jax.Array:
  """DIFF V2 differential attention on paired query heads.

  Args:
    q_BxTxQxD: Q = 2H query heads; heads 2i and 2i+1 form pair i and share kv group
      i // (H // K).
    k_BxSxKxD, v_BxSxKxD: the baseline's keys and values.
    lam_BxTxH: per-token, per-pair lambda (already passed through a sigmoid).
    **kwargs: as in :func:`dot_product_attention`.
  Returns:
    [B, T, H, D] in the dtype of q:
    ``softmax(q_2i K^T s) V - lam_i * softmax(q_2i+1 K^T s) V``.
  """
  return run_op(op_specs.DIFF_V2, (q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH), **kwargs)


def gda_v1_attention_core(
  q1_BxTxHxD: jax.Array,
  q2_BxTxNxD: jax.Array,
  k1_BxSxKxD: jax.Array,
  k2_BxSxKxD: jax.Array,
  v_BxSxKxDv: jax.Array,
  lam: jax.Array | float,
  **kwargs,
) -> jax.Array:
  """Grouped differential attention (V1 style, Motif-2) before the per-head norm.

  ``out_h = (softmax(q1_h k1^T s) - lam_h softmax(q2_{h // r} k2^T s)) V``: the N = H / r
  noise heads each serve r consecutive signal heads (r = 1 is DIFF V1). N must be a
  multiple of K. Other arguments as in :func:`diff_v1_attention_core`.
  Returns [B, T, H, Dv] in the dtype of q1.
  """
  arrays = (q1_BxTxHxD, q2_BxTxNxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, jnp.asarray(lam))
  return run_op(op_specs.GDA_V1, arrays, **kwargs)


def gda_v2_attention(
  q1_BxTxHxD: jax.Array,
  q2_BxTxNxD: jax.Array,
  k_BxSxKxD: jax.Array,
  v_BxSxKxD: jax.Array,
  lam_BxTxH: jax.Array,
  **kwargs,
) -> jax.Array:
  """Grouped differential attention, V2 style (Motif 3's combine on ordinary keys).

  ``out_h = softmax(q1_h K^T s) V - lam_h softmax(q2_{h // r} K^T s) V`` with ``lam_BxTxH``
  already squashed; r = H / N (r = 1 is DIFF V2 with q1, q2 the pairs' heads). Returns
  [B, T, H, D] in the dtype of q1.
  """
  arrays = (q1_BxTxHxD, q2_BxTxNxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
  return run_op(op_specs.GDA_V2, arrays, **kwargs)


# Decoding: one new token per row attends to a KV cache of S slots, of which the first
# kv_len[b] are valid (the new token's own key and value included). Slots at or past
# kv_len are never attended, so rows of different lengths share one cache array.


def dot_product_attention_decode(
  q_Bx1xHxD: jax.Array, k_BxSxKxD: jax.Array, v_BxSxKxD: jax.Array, kv_len_B: jax.Array, **kwargs
) -> jax.Array:
  """Baseline attention of one new token per row against a KV cache.

  Args:
    q_Bx1xHxD: the new token's queries.
    k_BxSxKxD, v_BxSxKxD: the cache (S slots per row).
    kv_len_B: int [B], valid slots per row; slots >= kv_len are ignored.
    **kwargs: ``scale, implementation, block_sizes, interpret``.
  Returns:
    [B, 1, H, D] in the dtype of q: the last row of causal attention over the
    first kv_len[b] slots.
  """
  return run_decode_op(op_specs.MHA_DECODE, (q_Bx1xHxD, k_BxSxKxD, v_BxSxKxD, kv_len_B), **kwargs)


def diff_v1_attention_decode(
  q1_Bx1xHxD: jax.Array,
  q2_Bx1xHxD: jax.Array,
  k1_BxSxKxD: jax.Array,
  k2_BxSxKxD: jax.Array,
  v_BxSxKxDv: jax.Array,
  lam: jax.Array | float,
  kv_len_B: jax.Array,
  **kwargs,
) -> jax.Array:
  """DIFF V1 attention (before the per-head norm) of one new token against a cache.

  "auto" runs a fused decode kernel, which reads K1, K2 and V once, on TPU
  (:func:`diffjax.kernels.tpu.diff_v1_decode_pallas_tpu`) and on a Hopper GPU for bf16/fp16
  (:func:`diffjax.kernels.gpu.mosaic_decode.diff_v1_decode_pallas_gpu`); elsewhere the
  reference math through XLA. Arguments as in :func:`diff_v1_attention_core` and
  :func:`dot_product_attention_decode`. Returns [B, 1, H, Dv] in the dtype of q1.
  """
  arrays = (q1_Bx1xHxD, q2_Bx1xHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, jnp.asarray(lam))
  return run_decode_op(op_specs.DIFF_V1_DECODE, (*arrays, kv_len_B), **kwargs)


def diff_v2_attention_decode(
  q_Bx1xQxD: jax.Array,
  k_BxSxKxD: jax.Array,
  v_BxSxKxD: jax.Array,
  lam_Bx1xH: jax.Array,
  kv_len_B: jax.Array,
  **kwargs,
) -> jax.Array:
  """DIFF V2 attention of one new token per row against a KV cache (the baseline's keys
  and values); ``lam_Bx1xH`` the new token's lambda per pair. Returns [B, 1, H, D]."""
  arrays = (q_Bx1xQxD, k_BxSxKxD, v_BxSxKxD, lam_Bx1xH, kv_len_B)
  return run_decode_op(op_specs.DIFF_V2_DECODE, arrays, **kwargs)


def gda_v1_attention_decode(
  q1_Bx1xHxD, q2_Bx1xNxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam, kv_len_B, **kwargs
) -> jax.Array:
  """Grouped differential attention (V1 style) of one new token against a cache of K1,
  K2 and V. Returns [B, 1, H, Dv]."""
  arrays = (q1_Bx1xHxD, q2_Bx1xNxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, jnp.asarray(lam))
  return run_decode_op(op_specs.GDA_V1_DECODE, (*arrays, kv_len_B), **kwargs)


def gda_v2_attention_decode(
  q1_Bx1xHxD, q2_Bx1xNxD, k_BxSxKxD, v_BxSxKxD, lam_Bx1xH, kv_len_B, **kwargs
) -> jax.Array:
  """Grouped DIFF V2 attention of one new token against the baseline's cache. Returns
  [B, 1, H, D]."""
  arrays = (q1_Bx1xHxD, q2_Bx1xNxD, k_BxSxKxD, v_BxSxKxD, lam_Bx1xH, kv_len_B)
  return run_decode_op(op_specs.GDA_V2_DECODE, arrays, **kwargs)
