"""Fused DIFF V1 and DIFF V2 attention for TPU (Pallas, Mosaic TPU).

:func:`diff_v1_pallas_tpu` and :func:`diff_v2_pallas_tpu`: :mod:`._forward` and
:mod:`._backward` under one ``jax.custom_vjp``. Design: docs/kernels_tpu.md.
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


def fused_call(
  qs, ks, v, lam, heads: int, *, shared_k: bool, q_segment_ids, kv_segment_ids, signal=1, **kw
):
  """Checks the segment ids, plans the call and runs the kernels (:func:`_fused`) on queries
  qs [B, T, ., D] against keys ks [B, S, K, D] and values v [B, S, K, Dv] (V1: lambda per
  query head of qs[0], a scalar broadcast; V2 and its grouped form: ``shared_k``, lambda per
  row). ``kw``: causal, scale, block_sizes and interpret."""
  b, t, _, d = qs[0].shape
  s, kv_heads = ks[0].shape[1], ks[0].shape[2]
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError(
      "Pass both q_segment_ids and kv_segment_ids, or neither; got "
      f"q_segment_ids={'None' if q_segment_ids is None else 'array'}, "
      f"kv_segment_ids={'None' if kv_segment_ids is None else 'array'}."
    )
  if q_segment_ids is not None:
    _v.split_segment_ids((q_segment_ids, kv_segment_ids), b, t, s)
  cfg = make_config(
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
  if not shared_k:
    lam = jnp.broadcast_to(lam.astype(jnp.float32), (qs[0].shape[2],))
  return _fused(cfg, qs, ks, v, lam, q_segment_ids, kv_segment_ids)


@functools.partial(jax.jit, static_argnums=(0,))
def _fused(cfg, qs, ks, v, lam, q_seg, kv_seg):
  # [B, T, N, D] -> [B, N, T, D] per component, never stacked: a bitcast for the TPU
  # compiler's layout of these arrays (see ``_layout``). V2: pair i is heads 2i, 2i + 1.
  heads = lambda x: x.transpose(0, 2, 1, 3)
  if cfg.fwd.lam_rows:
    lam = lam.astype(jnp.float32).transpose(0, 2, 1)  # [B, T, H] -> [B, H, T]
  out = diff_core(cfg, tuple(map(heads, qs)), tuple(map(heads, ks)), heads(v), lam, q_seg, kv_seg)
  return heads(out)


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
  return fused_call(
    (q1_BxTxHxD, q2_BxTxHxD),
    (k1_BxSxKxD, k2_BxSxKxD),
    v_BxSxKxDv,
    lam,
    q1_BxTxHxD.shape[2],
    shared_k=False,
    causal=causal,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    scale=scale,
    block_sizes=block_sizes,
    interpret=interpret,
  )


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
  return fused_call(
    (q_BxTxQxD,),
    (k_BxSxKxD,),
    v_BxSxKxD,
    lam_BxTxH,
    q_BxTxQxD.shape[2] // 2,
    shared_k=True,
    causal=causal,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    scale=scale,
    block_sizes=block_sizes,
    interpret=interpret,
  )


# Context-parallel attention runs these kernels on each key/value block of its ring when
# the function it finds in the dispatch table carries ``ring_blocks``
# (:mod:`diffjax.ops.ring`): the per-block forward and backward with log-sum-exps.
diff_v1_pallas_tpu.ring_blocks = ring_blocks
diff_v2_pallas_tpu.ring_blocks = ring_blocks
