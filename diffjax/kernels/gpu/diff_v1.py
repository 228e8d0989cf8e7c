"""Fused DIFF V1 attention for GPUs: both softmax maps in one kernel, lambda fused.

``out_h = (softmax(q1_h k1_g^T s) - lam_h softmax(q2_h k2_g^T s)) V_g``, g = h // (H / K).

The forward kernel streams K1, K2 and V once per query block and keeps an exact online
softmax for each map; the backward recomputes both maps and shares one
``dP = dO V^T`` and one ``dV = (P1 - lam P2)^T dO`` between them (kernels in
:mod:`diffjax.kernels.gpu.flash_pair`). The plain-JAX reference is
:func:`diffjax.core.reference.diff_v1_reference`; every test compares against it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from diffjax.core import validation as _v
from diffjax.kernels.gpu import block_sizes as bs
from diffjax.kernels.gpu import flash_pair as fp


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _diff_v1(q1, q2, k1, k2, v, lam_BxHxT, q_seg, kv_seg, cfg):
  return fp.forward(cfg, (q1, q2), (k1, k2), v, lam_BxHxT, q_seg, kv_seg)[0]


def _diff_v1_fwd(q1, q2, k1, k2, v, lam_BxHxT, q_seg, kv_seg, cfg):
  o, o2, lse_a, lse_b = fp.forward(cfg, (q1, q2), (k1, k2), v, lam_BxHxT, q_seg, kv_seg)
  return o, (q1, q2, k1, k2, v, lam_BxHxT, q_seg, kv_seg, o, o2, lse_a, lse_b)


def _diff_v1_bwd(cfg, res, do):
  q1, q2, k1, k2, v, lam_BxHxT, q_seg, kv_seg, o, o2, lse_a, lse_b = res
  d_a, d_b = fp.row_terms(do, o, o2, lam_BxHxT)
  rows = (lse_a, lse_b, d_a, d_b, lam_BxHxT)
  dk1, dk2, dv = fp.backward_dkv(cfg, (q1, q2), (k1, k2), v, do, rows, q_seg, kv_seg)
  dq1, dq2 = fp.backward_dq(cfg, (q1, q2), (k1, k2), v, do, rows, q_seg, kv_seg)
  # d lam = -sum(P2 * dP) = -rowsum(dO * O2) per row; broadcast_to sums it per head.
  return dq1, dq2, dk1, dk2, dv, -d_b, None, None


_diff_v1.defvjp(_diff_v1_fwd, _diff_v1_bwd)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "blocks", "interpret"))
def _diff_v1_padded(q1, q2, k1, k2, v, lam_H, q_seg, kv_seg, *, causal, scale, blocks,
                    interpret):
  b, t, h, d = q1.shape
  s, kh, dv = k1.shape[1], k1.shape[2], v.shape[3]
  tp, sp = fp.round_up(t, blocks.q_multiple), fp.round_up(s, blocks.kv_multiple)
  dp, dvp = bs.next_power_of_2(max(d, 16)), bs.next_power_of_2(max(dv, 16))
  cfg = fp.PairConfig(variant="v1", causal=causal, scale=scale, q_len=t, kv_len=s,
                      group=h // kh, segments=q_seg is not None, blocks=blocks,
                      interpret=interpret)
  pad_q = lambda x: fp.pad_axis(fp.pad_axis(x, 1, tp), 3, dp)
  pad_k = lambda x, width: fp.pad_axis(fp.pad_axis(x, 1, sp), 3, width)
  lam_BxHxT = jnp.broadcast_to(lam_H.astype(jnp.float32)[None, :, None], (b, h, tp))
  q_seg, kv_seg = fp.pad_segment_ids(q_seg, kv_seg, tp, sp)
  out = _diff_v1(pad_q(q1), pad_q(q2), pad_k(k1, dp), pad_k(k2, dp), pad_k(v, dvp),
                 lam_BxHxT, q_seg, kv_seg, cfg)
  return out[:, :t, :, :dv]


def diff_v1_fused(
    q1_BxTxHxD: jax.Array, q2_BxTxHxD: jax.Array, k1_BxSxKxD: jax.Array,
    k2_BxSxKxD: jax.Array, v_BxSxKxDv: jax.Array, lam_H: jax.Array, *,
    causal: bool = True, q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None, scale: float | None = None,
    block_sizes: bs.BlockSizes | dict | None = None, interpret: bool = False) -> jax.Array:
  """Fused DIFF V1 attention core (before the per-head norm), differentiable.

  Args:
    q1_BxTxHxD, q2_BxTxHxD: the two query components of the H DIFF heads.
    k1_BxSxKxD, k2_BxSxKxD: the two key components of the K kv groups (H % K == 0).
    v_BxSxKxDv: one value per kv group (Dv = 2 D in the paper; any width works).
    lam_H: lambda, a scalar or float [H]; used in float32. Its gradient is
      ``-sum_{b,t} rowsum(dO * O2)`` per head.
    causal: queries are the last T of the S key positions.
    q_segment_ids, kv_segment_ids: optional int [B, T] and [B, S]; both or neither.
    scale: score scale, default 1 / sqrt(D).
    block_sizes: None (defaults for D), a :class:`BlockSizes`, or a dict of overrides.
    interpret: run the Pallas interpreter (any backend; used by the CPU tests).
  Returns:
    [B, T, H, Dv] in the dtype of q1. Rows that see no key are zero. Softmax and all
    accumulation run in float32.
  """
  lam_H = jnp.asarray(lam_H)
  _v.check_diff_v1(q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H)
  b, t, h, d = q1_BxTxHxD.shape
  s, dv = k1_BxSxKxD.shape[1], v_BxSxKxDv.shape[3]
  q_seg, kv_seg = fp.check_segment_ids(q_segment_ids, kv_segment_ids, b, t, s)
  blocks = bs.resolve(block_sizes, bs.BlockSizes.default(d, dv)).clamped(t, s)
  lam_H = jnp.broadcast_to(lam_H, (h,))
  return _diff_v1_padded(q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv,
                         lam_H, q_seg, kv_seg, causal=bool(causal),
                         scale=_v.default_scale(scale, d), blocks=blocks,
                         interpret=bool(interpret))

