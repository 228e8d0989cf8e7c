"""Fused grouped differential attention (GDA) for TPU: the noise map once per group.

gda_v1: ``(softmax(q1_h k1^T s) - lam_h softmax(q2_{h // r} k2^T s)) V``; gda_v2: the same
with one key array and lambda per token. r = H / N signal heads share noise head n.

Design. The DIFF kernels' grid unit is a DIFF head (two maps). Here it is a group: one
program per (batch, noise head n, query tile) holds the r signal heads' query tiles
[r, block_q, D] and the noise head's [block_q, D], and runs r + 1 online softmaxes over the
same K/V tiles of their kv group (:mod:`._gda_forward`): the noise map is scored and applied
to V once for its r signal heads, and each K/V tile is read once per group. The last step
writes ``o_c = acc_c / l_c - lam_c acc_n / l_n``; the residuals are the noise output
``o2`` [B, N, T, Dv] and the r + 1 log-sum-exps per row. The backward (:mod:`._gda_backward`)
keeps the DIFF backward's kv-stationary sweep (dK, dV and a chunk's dQ in VMEM) over the
group: per step r signal dP_c = dO_c V^T (shared by both maps, as in DIFF),
dV += (P1_c - lam_c P2)^T dO_c, and one noise dS2 = -P2 (sum_c lam_c dP_c - D_lam), whose
dQ2 and dK2 are the group's summed noise gradient, formed in the kernel (q2 is never
repeated). r = 1 runs the DIFF kernels (:mod:`.diff_attention`) unchanged, so it is
bitwise DIFF V1 / V2.
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
