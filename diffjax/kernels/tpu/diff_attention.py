"""Fused DIFF V1 and DIFF V2 attention for TPU (Pallas, Mosaic TPU).

One ``pallas_call`` computes both softmax maps of a DIFF head (V1) or head pair (V2) per
tile and applies lambda (:mod:`._forward`); one more computes every gradient
(:mod:`._backward`). Both are checked against :mod:`diffjax.core.reference` and run on one
device; :mod:`diffjax.sharding.kernel_specs` gives their PartitionSpecs for ``shard_map``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from diffjax.core import validation as _v
from diffjax.kernels.tpu import blocks as ring_blocks
from diffjax.kernels.tpu._core import Interpret, diff_core, make_config
from diffjax.kernels.tpu.block_sizes import BlockSizes


def call_config(
  q, k, v, heads: int, *, shared_k: bool, q_segment_ids, kv_segment_ids, signal: int = 1, **kw
):
  """Checks the segment ids and gives the plans of a call of queries q [B, T, ., D] against
  keys k [B, S, K, D] and values v [B, S, K, Dv] (V1: k1; V2 and its grouped form:
  ``shared_k``, lambda per row). ``kw``: causal, scale, block_sizes and interpret."""
  b, t, _, d = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError(
      "Pass both q_segment_ids and kv_segment_ids, or neither; got "
      f"q_segment_ids={'None' if q_segment_ids is None else 'array'}, "
      f"kv_segment_ids={'None' if kv_segment_ids is None else 'array'}."
    )
  if q_segment_ids is not None:
    _v.split_segment_ids((q_segment_ids, kv_segment_ids), b, t, s)
  return make_config(
    t=t,
    s=s,
    d=d,
    dv=v.shape[-1],
    h=heads,
    kv_heads=kv_heads,
    segmented=q_segment_ids is not None,
    shared_k=shared_k,
    lam_rows=shared_k,
    signal=signal,
    **kw,
  )


def diff_v1_pallas_tpu(
  q1_BxTxHxD: jax.Array,
  q2_BxTxHxD: jax.Array,
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
  """DIFF V1 attention core, ``(softmax(q1 k1^T s) - lam softmax(q2 k2^T s)) V``.

  Args:
    q1_BxTxHxD, q2_BxTxHxD: the two query components of the H DIFF heads.
    k1_BxSxKxD, k2_BxSxKxD: the two key components of the K kv groups; head h
      reads group h // (H // K).
    v_BxSxKxDv: one value per kv group (Dv = 2 D in the paper; any width works).
    lam_H: lambda per head, float32 [H] (a scalar is broadcast). Differentiable.
    causal: queries are the last T of the S positions.
    q_segment_ids, kv_segment_ids: int [B, T] and [B, S], or both None.
    scale: score scale, default 1 / sqrt(D).
    block_sizes: None (defaults for D), a :class:`BlockSizes`, or a dict of its fields.
    interpret: run in the TPU interpreter (True, or ``pltpu.InterpretParams``).
  Returns:
    [B, T, H, Dv] in the dtype of q1. Fully masked query rows are zero.
  """
  lam = jnp.asarray(lam_H)
  _v.check_diff_v1(q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam)
  h = q1_BxTxHxD.shape[2]
  cfg = call_config(
    q1_BxTxHxD,
    k1_BxSxKxD,
    v_BxSxKxDv,
    h,
    shared_k=False,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    causal=causal,
    scale=scale,
    block_sizes=block_sizes,
    interpret=interpret,
  )
  lam_H = jnp.broadcast_to(lam.astype(jnp.float32), (h,))
  return _diff_v1(
    cfg,
    q1_BxTxHxD,
    q2_BxTxHxD,
    k1_BxSxKxD,
    k2_BxSxKxD,
    v_BxSxKxDv,
    lam_H,
    q_segment_ids,
    kv_segment_ids,
  )


@functools.partial(jax.jit, static_argnums=(0,))
def _diff_v1(cfg, q1, q2, k1, k2, v, lam_H, q_seg, kv_seg):
  # [B, T, N, D] -> [B, N, T, D] per component, never stacked: a bitcast for the TPU
  # compiler's layout of these arrays (see ``_layout``).
  heads = lambda x: x.transpose(0, 2, 1, 3)
  out_BxHxTxDv = diff_core(
    cfg, (heads(q1), heads(q2)), (heads(k1), heads(k2)), heads(v), lam_H, q_seg, kv_seg
  )
  return out_BxHxTxDv.transpose(0, 2, 1, 3)


def diff_v2_pallas_tpu(
  q_BxTxQxD: jax.Array,
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
  """DIFF V2 attention on paired query heads.

  Args:
    q_BxTxQxD: Q = 2H query heads; heads 2i and 2i+1 form pair i and read kv
      group i // (H // K).
    k_BxSxKxD, v_BxSxKxD: the baseline's keys and values.
    lam_BxTxH: per-token, per-pair lambda (already squashed). Differentiable.
    causal, q_segment_ids, kv_segment_ids, scale, block_sizes, interpret: as in
      :func:`diff_v1_pallas_tpu`.
  Returns:
    [B, T, H, Dv]: ``softmax(q_2i K^T s) V - lam_i softmax(q_2i+1 K^T s) V`` in q's dtype.
  """
  _v.check_diff_v2(q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
  cfg = call_config(
    q_BxTxQxD,
    k_BxSxKxD,
    v_BxSxKxD,
    q_BxTxQxD.shape[2] // 2,
    shared_k=True,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    causal=causal,
    scale=scale,
    block_sizes=block_sizes,
    interpret=interpret,
  )
  return _diff_v2(cfg, q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH, q_segment_ids, kv_segment_ids)


@functools.partial(jax.jit, static_argnums=(0,))
def _diff_v2(cfg, q, k, v, lam, q_seg, kv_seg):
  b, t, qh, d = q.shape
  lam_BxHxT = lam.astype(jnp.float32).transpose(0, 2, 1)
  # [B, T, N, D] -> [B, N, T, D] (bitcasts, see _diff_v1); pair i is heads 2i, 2i + 1.
  heads = lambda x: x.transpose(0, 2, 1, 3)
  out_BxHxTxD = diff_core(cfg, (heads(q),), (heads(k),), heads(v), lam_BxHxT, q_seg, kv_seg)
  return out_BxHxTxD.transpose(0, 2, 1, 3)


# Context-parallel attention runs these kernels on each key/value block of its ring when
# the function it finds in the dispatch table carries ``ring_blocks``
# (:mod:`diffjax.ops.ring`): the per-block forward and backward with log-sum-exps.
diff_v1_pallas_tpu.ring_blocks = ring_blocks
diff_v2_pallas_tpu.ring_blocks = ring_blocks
