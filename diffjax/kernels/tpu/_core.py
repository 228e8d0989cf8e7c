"""custom_vjp around the two kernels, on the head-major layout without padding.

Shared by DIFF V1 / V2 and their grouped forms; pads to the forward's and the backward's tiles.
Design: docs/kernels_tpu.md, "What the fused TPU kernels do".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from diffjax.core import validation as _v
from diffjax.kernels.tpu import _backward as bwd_kernel
from diffjax.kernels.tpu import _forward as fwd_kernel
from diffjax.kernels.tpu import _gda_backward as gda_bwd
from diffjax.kernels.tpu import _gda_forward as gda_fwd
from diffjax.kernels.tpu import _layout as layout
from diffjax.kernels.tpu.block_sizes import resolve_block_sizes


@dataclasses.dataclass(frozen=True)
class CoreConfig:
  fwd: layout.Plan
  bwd: layout.Plan
  interpret: Any  # False, or the interpreter parameters
  widths: tuple[int, int]  # (D, Dv) of one head


Interpret = bool | pltpu.InterpretParams


def interpret_mode(interpret: Interpret):
  """False on TPU; otherwise the TPU interpreter, which simulates VMEM, SMEM, DMAs
  and semaphores."""
  if interpret is True:
    return pltpu.InterpretParams()
  if interpret is False or interpret is None:
    return False
  if isinstance(interpret, pltpu.InterpretParams):
    return interpret
  raise TypeError(f"interpret must be a bool or pltpu.InterpretParams; got {interpret!r}.")


def make_config(
  *, t, s, d, dv, h, kv_heads, causal, segmented, scale, block_sizes, shared_k, lam_rows, interpret,
  signal=1,
) -> CoreConfig:  # fmt: skip
  """The forward and backward plans of one call: T queries against S keys of H heads
  (V1 DIFF heads or V2 pairs; grouped: the noise heads, each with ``signal`` signal
  heads) over K kv groups, with the block sizes resolved for D."""
  bs = resolve_block_sizes(block_sizes, d)
  common = dict(
    q_len=t,
    kv_len=s,
    causal=bool(causal),
    segmented=segmented,
    scale=float(_v.default_scale(scale, d)),
    shared_k=shared_k,
    lam_rows=lam_rows,
    heads=h,
    kv_heads=kv_heads,
    signal=signal,
  )
  return CoreConfig(
    fwd=layout.make_plan(block_q=bs.block_q, block_kv=bs.block_kv, **common),
    bwd=layout.make_plan(
      block_q=bs.block_q_bwd, block_kv=bs.block_kv_bwd, dq_chunk=bs.dq_chunk, **common
    ),
    interpret=interpret_mode(interpret),
    widths=(d, dv),
  )


def _pad_axis(x, axis: int, length: int):
  if x is None or x.shape[axis] == length:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, widths)


def _slice_axis(x, axis: int, length: int):
  return x if x.shape[axis] == length else jax.lax.slice_in_dim(x, 0, length, axis=axis)


def _prepare(plan: layout.Plan, qs, ks, v, q_seg, kv_seg):
  tp, sp, ax = plan.q_len_padded, plan.kv_len_padded, plan.seq_axis
  qs = tuple(_pad_axis(q, ax, tp) for q in qs)
  ks = tuple(_pad_axis(k, ax, sp) for k in ks)
  v = _pad_axis(v, ax, sp)
  if plan.segmented:
    q_seg = _pad_axis(q_seg.astype(jnp.int32), 1, tp)[:, :, None]
    kv_seg = _pad_axis(kv_seg.astype(jnp.int32), 1, sp)[:, None, :]
  return qs, ks, v, q_seg, kv_seg


def _lam_rows(plan: layout.Plan, lam, batch: int, heads: int, length: int):
  """lambda per row [B, H, length] in float32 (V1 broadcasts its [H])."""
  lam = lam.astype(jnp.float32)
  if plan.lam_rows:
    return lam
  return jnp.broadcast_to(lam[None, :, None], (batch, heads, length))


def _row_sums(x, y):
  """float32 rowsum(x * y) per head and row, [B, H, T], of two [B, H, T, Dv] operands."""
  return jnp.sum(x.astype(jnp.float32) * y.astype(jnp.float32), axis=-1)


def _forward(cfg: CoreConfig, qs, ks, v, lam, q_seg, kv_seg, save_residuals: bool):
  """Pads the inputs to the forward tiles, runs the forward kernel (grouped: with r signal
  heads a noise head) and slices its outputs back; (out, o2, lse) with ``save_residuals``,
  else (out, None, None)."""
  plan = cfg.fwd
  t = qs[0].shape[plan.seq_axis]
  qp, kp, vp, q_seg_p, kv_seg_p = _prepare(plan, qs, ks, v, q_seg, kv_seg)
  lam_in = (
    layout.rows_to_tiles(lam.astype(jnp.float32)[:, :, None], plan.block_q, plan.q_len_padded)
    if plan.lam_rows
    else lam.astype(jnp.float32)
  )
  out, o2, lse = (gda_fwd if plan.signal > 1 else fwd_kernel).forward(
    plan,
    qp,
    kp,
    vp,
    lam_in,
    q_seg_p,
    kv_seg_p,
    widths=cfg.widths,
    save_residuals=save_residuals,
    interpret=cfg.interpret,
  )
  out = _slice_axis(out, plan.seq_axis, t)
  if not save_residuals:
    return out, None, None
  # lse stays in the kernel's lane-dense slabs [B, H, Tp / block_q, 2, block_q].
  return out, _slice_axis(o2, plan.seq_axis, t), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def diff_core(cfg: CoreConfig, qs, ks, v, lam, q_seg, kv_seg):
  """Differential attention on arrays in the plans' layout (``_layout``).

  Args:
    cfg: the forward and backward plans, the interpreter setting and the head widths.
    qs: the query arrays (V1: q1, q2 [B, H, T, D]; V2: one [B, 2H, T, D] of the pairs'
      query heads; grouped, the plans' heads the N noise heads of ``signal`` r signal
      heads each: q1 [B, H, T, D] and q2 [B, N, T, D]); ks: the key arrays (V1: k1, k2;
      V2: k) [B, K, S, D]; v [B, K, S, Dv].
    lam: float32 [H] (V1) or [B, H, T] (V2).
    q_seg, kv_seg: int [B, T] and [B, S], or None.
  Returns:
    [B, H, T, Dv] in q's dtype.
  """
  # Without differentiation the kernel skips writing the backward's residuals.
  return _forward(cfg, qs, ks, v, lam, q_seg, kv_seg, save_residuals=False)[0]


def _diff_core_fwd(cfg, qs, ks, v, lam, q_seg, kv_seg):
  out, o2, lse = _forward(cfg, qs, ks, v, lam, q_seg, kv_seg, save_residuals=True)
  return out, (qs, ks, v, lam, q_seg, kv_seg, out, o2, lse)


def backward_with_stats(
  cfg: CoreConfig, qs, ks, v, lam, q_seg, kv_seg, d_out, lse_BxHx2xT, d1_BxHxT, d2_BxHxT
):
  """The backward kernel given the softmax row statistics: both maps' log-sum-exps
  [B, H, 2, T] and row terms ``D_m = rowsum(dO * O_m)`` [B, H, T] (float32).

  The whole attention's backward passes its own; a block of a ring passes the merged
  statistics of the whole attention (:mod:`diffjax.kernels.tpu.blocks`). Returns
  ``(dqs, dks, dv)`` unpadded, in the inputs' dtypes.
  """
  plan = cfg.bwd
  b, t = qs[0].shape[0], qs[0].shape[plan.seq_axis]
  lam_rows = _lam_rows(plan, lam, b, plan.heads, t)
  zeros = jnp.zeros_like(d2_BxHxT)
  stats_BxHx8xT = jnp.stack(
    [
      lse_BxHx2xT[:, :, 0],
      lse_BxHx2xT[:, :, 1],
      d1_BxHxT.astype(jnp.float32),
      d2_BxHxT.astype(jnp.float32),
      lam_rows,
      zeros,
      zeros,
      zeros,
    ],
    axis=2,
  )
  assert stats_BxHx8xT.shape[2] == bwd_kernel.ROW_STATS
  lam_in = (None if plan.lam_rows else lam.astype(jnp.float32),)
  return _padded_backward(
    cfg, bwd_kernel.backward, lam_in, qs, ks, v, q_seg, kv_seg, d_out, stats_BxHx8xT
  )


def _padded_backward(cfg: CoreConfig, kernel, lam_in, qs, ks, v, q_seg, kv_seg, d_out, stats):
  """Pads the inputs to the backward tiles, runs ``kernel`` (``lam_in``: its arguments
  before the segment ids) with the row statistics [B, H, R, T] in slabs and slices the
  gradients back: ``(dqs, dks, dv)``."""
  plan = cfg.bwd
  ax = plan.seq_axis
  t, s = qs[0].shape[ax], ks[0].shape[ax]
  qp, kp, vp, q_seg_p, kv_seg_p = _prepare(plan, qs, ks, v, q_seg, kv_seg)
  tp = plan.q_len_padded
  dqs, dks, dv = kernel(
    plan,
    qp,
    kp,
    vp,
    *lam_in,
    q_seg_p,
    kv_seg_p,
    _pad_axis(d_out, ax, tp),
    layout.rows_to_tiles(stats, plan.block_q, tp),
    widths=cfg.widths,
    interpret=cfg.interpret,
  )
  return (
    tuple(_slice_axis(dq, ax, t) for dq in dqs),
    tuple(_slice_axis(dk, ax, s) for dk in dks),
    _slice_axis(dv, ax, s),
  )


def _diff_core_bwd(cfg, residuals, d_out):
  if cfg.bwd.signal > 1:
    return _grouped_bwd(cfg, residuals, d_out)
  qs, ks, v, lam, q_seg, kv_seg, out, o2, lse = residuals
  plan = cfg.bwd
  b, t = qs[0].shape[0], qs[0].shape[plan.seq_axis]
  # Softmax-backward row terms of the two maps; out = O_1 - lam O_2 gives O_1.
  d2 = _row_sums(d_out, o2)
  d1 = _row_sums(d_out, out) + _lam_rows(plan, lam, b, plan.heads, t) * d2
  dqs, dks, dv = backward_with_stats(
    cfg, qs, ks, v, lam, q_seg, kv_seg, d_out, layout.tiles_to_rows(lse, t), d1, d2
  )
  # d out / d lam = -O_2, so d lam = -rowsum(dO * O_2) per row (summed for V1).
  dlam = -d2 if plan.lam_rows else -jnp.sum(d2, axis=(0, 2))
  return dqs, dks, dv, dlam.astype(lam.dtype), None, None


def _grouped_bwd(cfg, residuals, d_out):
  """The backward of grouped attention (r signal heads a noise head, :mod:`._gda_backward`)."""
  qs, ks, v, lam, q_seg, kv_seg, out, o2, lse = residuals
  plan = cfg.bwd
  b, h, t, dv = d_out.shape
  n, r = qs[1].shape[1], plan.signal
  f32 = lambda x: x.astype(jnp.float32)
  lam_BxNxRxT = _lam_rows(plan, lam, b, h, t).reshape(b, n, r, t)
  do_BxNxRxTxDv = f32(d_out).reshape(b, n, r, t, dv)
  # Softmax-backward row terms: D2_c = rowsum(dO_c * O2) against the group's one noise
  # output; O1_c = out_c + lam_c O2 gives D1_c.
  d2 = jnp.sum(do_BxNxRxTxDv * f32(o2)[:, :, None], axis=-1)
  d1 = jnp.sum(do_BxNxRxTxDv * f32(out).reshape(b, n, r, t, dv), axis=-1) + lam_BxNxRxT * d2
  d_lam = jnp.sum(lam_BxNxRxT * d2, axis=2, keepdims=True)
  rows_of = gda_bwd.stat_rows(r)
  parts = [layout.tiles_to_rows(lse, t), d1, d_lam, lam_BxNxRxT]
  pad = rows_of["rows"] - rows_of["lam"] - r
  stats = jnp.concatenate(parts + [jnp.zeros((b, n, pad, t), jnp.float32)], axis=2)
  dqs, dks, dv_ = _padded_backward(
    cfg, gda_bwd.backward, (), qs, ks, v, q_seg, kv_seg, d_out, stats
  )
  # d out_c / d lam_c = -O2: d lam = -rowsum(dO_c * O2) per row (summed for V1).
  dlam = -d2.reshape(b, h, t)
  if lam.ndim == 1:
    dlam = jnp.sum(dlam, axis=(0, 2))
  return dqs, dks, dv_, dlam.astype(lam.dtype), None, None


diff_core.defvjp(_diff_core_fwd, _diff_core_bwd)
