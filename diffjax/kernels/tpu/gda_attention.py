"""Fused grouped differential attention (GDA) for TPU: the noise map once per group.

:func:`gda_v1_pallas_tpu` and :func:`gda_v2_pallas_tpu` (r = 1 runs :mod:`.diff_attention`).
Design: docs/kernels_tpu.md, "Grouped differential attention".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from diffjax.core import validation as _v
from diffjax.kernels.tpu._core import Interpret
from diffjax.kernels.tpu.block_sizes import BlockSizes
from diffjax.kernels.tpu.diff_attention import diff_v1_pallas_tpu, diff_v2_pallas_tpu, fused_call


def gda_v1_pallas_tpu(
  q1_BxTxHxD: jax.Array,
  q2_BxTxNxD: jax.Array,
  k1_BxSxKxD: jax.Array,
  k2_BxSxKxD: jax.Array,
  v_BxSxKxDv: jax.Array,
  lam_H: jax.Array | float,
  *,
  causal: bool = True,
  q_segment_ids: jax.Array | None = None,
  kv_segment_ids: jax.Array | None = None,
  scale: float | None = None,
  block_sizes: BlockSizes | Mapping[str, Any] | None = None,
  interpret: Interpret = False,
) -> jax.Array:
  """Grouped differential attention, V1 style, fused on TPU.

  Args:
    q1_BxTxHxD: H signal query heads; q2_BxTxNxD: N = H / r noise query heads (noise
      head n serves signal heads n r .. n r + r - 1); N a multiple of K.
    k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv: K kv groups.
    lam_H: lambda per signal head, float32 [H] (a scalar is broadcast). Differentiable.
    causal, q_segment_ids, kv_segment_ids, scale, block_sizes, interpret: as in
      :func:`diffjax.kernels.tpu.diff_v1_pallas_tpu`.
  Returns:
    [B, T, H, Dv] in the dtype of q1. r = 1 runs :func:`diff_v1_pallas_tpu`.
  """
  lam = jnp.asarray(lam_H)
  _v.check_gda_v1(q1_BxTxHxD, q2_BxTxNxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam)
  h = q1_BxTxHxD.shape[2]
  n = q2_BxTxNxD.shape[2]
  kw = dict(
    causal=causal,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    scale=scale,
    block_sizes=block_sizes,
    interpret=interpret,
  )
  if n == h:
    return diff_v1_pallas_tpu(
      q1_BxTxHxD, q2_BxTxNxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H, **kw
    )
  return fused_call(
    (q1_BxTxHxD, q2_BxTxNxD),
    (k1_BxSxKxD, k2_BxSxKxD),
    v_BxSxKxDv,
    lam,
    n,
    shared_k=False,
    signal=h // n,
    **kw,
  )


def gda_v2_pallas_tpu(
  q1_BxTxHxD: jax.Array,
  q2_BxTxNxD: jax.Array,
  k_BxSxKxD: jax.Array,
  v_BxSxKxD: jax.Array,
  lam_BxTxH: jax.Array,
  *,
  causal: bool = True,
  q_segment_ids: jax.Array | None = None,
  kv_segment_ids: jax.Array | None = None,
  scale: float | None = None,
  block_sizes: BlockSizes | Mapping[str, Any] | None = None,
  interpret: Interpret = False,
) -> jax.Array:
  """Grouped differential attention, V2 style, fused on TPU.

  Args:
    q1_BxTxHxD, q2_BxTxNxD: signal and noise query heads, as :func:`gda_v1_pallas_tpu`.
    k_BxSxKxD, v_BxSxKxD: the baseline's keys and values.
    lam_BxTxH: per token and signal head, already squashed. Differentiable.
  Returns:
    [B, T, H, Dv]: ``softmax(q1_h K^T s) V - lam_h softmax(q2_{h // r} K^T s) V``. r = 1
    runs :func:`diff_v2_pallas_tpu` on the pairs (q1_i, q2_i).
  """
  _v.check_gda_v2(q1_BxTxHxD, q2_BxTxNxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
  b, t, h, d = q1_BxTxHxD.shape
  n = q2_BxTxNxD.shape[2]
  kw = dict(
    causal=causal,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    scale=scale,
    block_sizes=block_sizes,
    interpret=interpret,
  )
  if n == h:  # DIFF V2 takes the pairs as heads 2i, 2i + 1 of one array
    q = jnp.stack([q1_BxTxHxD, q2_BxTxNxD], axis=3).reshape(b, t, 2 * h, d)
    return diff_v2_pallas_tpu(q, k_BxSxKxD, v_BxSxKxD, lam_BxTxH, **kw)
  return fused_call(
    (q1_BxTxHxD, q2_BxTxNxD),
    (k_BxSxKxD,),
    v_BxSxKxD,
    lam_BxTxH,
    n,
    shared_k=True,
    signal=h // n,
    **kw,
  )
