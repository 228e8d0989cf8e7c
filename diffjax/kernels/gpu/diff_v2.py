"""Fused DIFF V2 attention for GPUs: both query heads of a pair in one kernel.

``out_i = softmax(q_2i K^T s) V - lam_i softmax(q_2i+1 K^T s) V`` with one lambda per
token and pair, kv group ``i // (H / K)``. The pair shares K and V, so one program
loads each K/V tile once for both heads, and the backward shares ``dP = dO V^T``, the
dV matmul on ``P1 - lam P2``, and accumulates both heads' dK into one tile (kernels in
:mod:`diffjax.kernels.gpu.flash_pair`). Reference:
:func:`diffjax.core.reference.diff_v2_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from diffjax.core import validation as _v
from diffjax.kernels.gpu import block_sizes as bs
from diffjax.kernels.gpu import flash_pair as fp


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _diff_v2(q, k, v, lam_BxHxT, q_seg, kv_seg, cfg):
  return fp.forward(cfg, (q,), (k,), v, lam_BxHxT, q_seg, kv_seg)[0]


def _diff_v2_fwd(q, k, v, lam_BxHxT, q_seg, kv_seg, cfg):
  o, o2, lse_a, lse_b = fp.forward(cfg, (q,), (k,), v, lam_BxHxT, q_seg, kv_seg)
  return o, (q, k, v, lam_BxHxT, q_seg, kv_seg, o, o2, lse_a, lse_b)


def _diff_v2_bwd(cfg, res, do):
  q, k, v, lam_BxHxT, q_seg, kv_seg, o, o2, lse_a, lse_b = res
  d_a, d_b = fp.row_terms(do, o, o2, lam_BxHxT)
  rows = (lse_a, lse_b, d_a, d_b, lam_BxHxT)
  dk, dv = fp.backward_dkv(cfg, (q,), (k,), v, do, rows, q_seg, kv_seg)
  (dq,) = fp.backward_dq(cfg, (q,), (k,), v, do, rows, q_seg, kv_seg)
  return dq, dk, dv, -d_b, None, None


_diff_v2.defvjp(_diff_v2_fwd, _diff_v2_bwd)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "blocks", "interpret"))
def _diff_v2_padded(q, k, v, lam_BxTxH, q_seg, kv_seg, *, causal, scale, blocks, interpret):
  b, t, qh, d = q.shape
  s, kh, dv = k.shape[1], k.shape[2], v.shape[3]
  tp, sp = fp.round_up(t, blocks.q_multiple), fp.round_up(s, blocks.kv_multiple)
  dp, dvp = bs.next_power_of_2(max(d, 16)), bs.next_power_of_2(max(dv, 16))
  cfg = fp.PairConfig(variant="v2", causal=causal, scale=scale, q_len=t, kv_len=s,
                      group=qh // 2 // kh, segments=q_seg is not None, blocks=blocks,
                      interpret=interpret)
  lam_BxHxT = fp.pad_axis(jnp.transpose(lam_BxTxH.astype(jnp.float32), (0, 2, 1)), 2, tp)
  q_seg, kv_seg = fp.pad_segment_ids(q_seg, kv_seg, tp, sp)
  out = _diff_v2(fp.pad_axis(fp.pad_axis(q, 1, tp), 3, dp),
                 fp.pad_axis(fp.pad_axis(k, 1, sp), 3, dp),
                 fp.pad_axis(fp.pad_axis(v, 1, sp), 3, dvp),
                 lam_BxHxT, q_seg, kv_seg, cfg)
  return out[:, :t, :, :dv]


def diff_v2_fused(
    q_BxTxQxD: jax.Array, k_BxSxKxD: jax.Array, v_BxSxKxD: jax.Array,
    lam_BxTxH: jax.Array, *, causal: bool = True, q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None, scale: float | None = None,
    block_sizes: bs.BlockSizes | dict | None = None, interpret: bool = False) -> jax.Array:
  """Fused DIFF V2 attention on paired query heads, differentiable.

  Args:
    q_BxTxQxD: Q = 2H query heads; heads 2i and 2i+1 form pair i and read kv group
      i // (H / K).
    k_BxSxKxD, v_BxSxKxD: the baseline's keys and values.
    lam_BxTxH: per-token, per-pair lambda (already squashed), any float dtype; used in
      float32, and its gradient comes back in its dtype.
    causal, q_segment_ids, kv_segment_ids, scale, block_sizes, interpret: as in
      :func:`diffjax.kernels.gpu.diff_v1_fused`.
  Returns:
    [B, T, H, Dv] in the dtype of q. Rows that see no key are zero.
  """
  _v.check_diff_v2(q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
  b, t, _, d = q_BxTxQxD.shape
  s, dv = k_BxSxKxD.shape[1], v_BxSxKxD.shape[3]
  q_seg, kv_seg = fp.check_segment_ids(q_segment_ids, kv_segment_ids, b, t, s)
  blocks = bs.resolve(block_sizes, bs.BlockSizes.default(d, dv)).clamped(t, s)
  return _diff_v2_padded(q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH, q_seg, kv_seg,
                         causal=bool(causal), scale=_v.default_scale(scale, d),
                         blocks=blocks, interpret=bool(interpret))

