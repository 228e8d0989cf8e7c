"""The authors' composition of stock attention calls, on TPU with splash attention.

The peer the fused kernels are measured against, not a path to train with: two splash
calls for DIFF V1 (one per map), one over the 2H query heads for DIFF V2, one for the
baseline. Padding and fully masked rows: docs/kernels_tpu.md.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from diffjax.core import validation as _v
from diffjax.kernels.tpu._layout import round_up


def _splash_blocks(block_sizes, tp: int, sp: int) -> splash.BlockSizes:
  if isinstance(block_sizes, splash.BlockSizes):
    return block_sizes
  if block_sizes is not None:
    raise TypeError(
      "The stock path takes None or a splash_attention.BlockSizes; got "
      f"{type(block_sizes).__name__}."
    )
  bq, bk = min(512, tp), min(512, sp)
  return splash.BlockSizes(
    block_q=bq,
    block_kv=bk,
    block_kv_compute=bk,
    block_q_dkv=bq,
    block_kv_dkv=bk,
    block_kv_dkv_compute=bk,
    block_q_dq=bq,
    block_kv_dq=bk,
  )


class _Options(NamedTuple):
  """The static arguments of a stock call (one jit compilation each)."""

  causal: bool
  scale: float
  block_sizes: Any
  interpret: bool


def _options(d: int, causal, scale, block_sizes, interpret) -> _Options:
  return _Options(bool(causal), _v.default_scale(scale, d), block_sizes, bool(interpret))


def _heads_first(x):
  """[B, T, N, X] <-> [B, N, T, X]."""
  return x.transpose(0, 2, 1, 3)


def _attend(opts: _Options, q_BxHxTxD, k_BxKxSxD, v_BxKxSxDv, q_seg, kv_seg):
  """Splash attention over [B, heads, len, dim] arrays; returns [B, H, T, Dv]."""
  b, h, t, _ = q_BxHxTxD.shape
  s = k_BxKxSxD.shape[2]
  tp, sp = round_up(t, 128), round_up(s, 128)
  blocks = _splash_blocks(opts.block_sizes, tp, sp)
  tp, sp = round_up(tp, blocks.block_q), round_up(sp, blocks.block_kv)
  pad = lambda x, n: jnp.pad(x, [(0, 0), (0, 0), (0, n - x.shape[2]), (0, 0)])
  q = pad(q_BxHxTxD * jnp.asarray(opts.scale, q_BxHxTxD.dtype), tp)  # splash does not scale
  k, v = pad(k_BxKxSxD, sp), pad(v_BxKxSxDv, sp)
  if q_seg is None:
    q_seg = jnp.zeros((b, t), jnp.int32)
    kv_seg = jnp.zeros((b, s), jnp.int32)
  q_seg, kv_seg = q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)
  # Padded keys get an id below every real query id, so nobody attends to them.
  hidden = jnp.min(q_seg) - 1
  q_seg = jnp.pad(q_seg, [(0, 0), (0, tp - t)], constant_values=0)
  kv_seg = jnp.pad(kv_seg, [(0, 0), (0, sp - s)]).at[:, s:].set(hidden)
  if opts.causal:
    head_mask = splash.CausalMask((tp, sp), offset=s - t)
  else:
    head_mask = splash.FullMask((tp, sp))
  kernel = splash.make_splash_mha(
    splash.MultiHeadMask([head_mask] * h),
    block_sizes=blocks,
    head_shards=1,
    q_seq_shards=1,
    interpret=opts.interpret,
  )
  out = jax.vmap(kernel)(q, k, v, segment_ids=splash.SegmentIds(q_seg, kv_seg))
  return out[:, :, :t]


def _maps(opts: _Options, qs, ks, v, q_seg, kv_seg):
  """float32 [B, N, T, Dv] of one splash call per (query, key) array pair of [B, T, N, X]
  arrays, all on the value v."""
  v_h = _heads_first(v)
  return [
    _attend(opts, _heads_first(q), _heads_first(k), v_h, q_seg, kv_seg).astype(jnp.float32)
    for q, k in zip(qs, ks)
  ]


def mha_stock_tpu(
  q_BxTxHxD,
  k_BxSxKxD,
  v_BxSxKxDv,
  *,
  causal: bool = True,
  q_segment_ids=None,
  kv_segment_ids=None,
  scale: float | None = None,
  block_sizes=None,
  interpret: bool = False,
) -> jax.Array:
  """Baseline attention (MHA / GQA) as one splash-attention call: the matched peer.

  Returns [B, T, H, Dv] in the dtype of q.
  """
  _v.check_mha(q_BxTxHxD, k_BxSxKxD, v_BxSxKxDv)
  opts = _options(q_BxTxHxD.shape[-1], causal, scale, block_sizes, interpret)
  return _mha_stock(opts, q_BxTxHxD, k_BxSxKxD, v_BxSxKxDv, q_segment_ids, kv_segment_ids)


@functools.partial(jax.jit, static_argnums=(0,))
def _mha_stock(opts, q, k, v, q_seg, kv_seg):
  out = _attend(opts, _heads_first(q), _heads_first(k), _heads_first(v), q_seg, kv_seg)
  return _heads_first(out).astype(q.dtype)


def diff_v1_stock_tpu(
  q1_BxTxHxD,
  q2_BxTxHxD,
  k1_BxSxKxD,
  k2_BxSxKxD,
  v_BxSxKxDv,
  lam_H,
  *,
  causal: bool = True,
  q_segment_ids=None,
  kv_segment_ids=None,
  scale: float | None = None,
  block_sizes=None,
  interpret: bool = False,
) -> jax.Array:
  """DIFF V1 as two splash-attention calls with the 2D-wide value, then a subtraction.

  Arguments and result as in :func:`diffjax.kernels.tpu.diff_v1_pallas_tpu`;
  ``block_sizes`` is None or a ``splash_attention.BlockSizes``.
  """
  lam = jnp.asarray(lam_H)
  _v.check_diff_v1(q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam)
  h, d = q1_BxTxHxD.shape[2:]
  lam_H = jnp.broadcast_to(lam.astype(jnp.float32), (h,))
  return _diff_v1_stock(
    _options(d, causal, scale, block_sizes, interpret),
    (q1_BxTxHxD, q2_BxTxHxD),
    (k1_BxSxKxD, k2_BxSxKxD),
    v_BxSxKxDv,
    lam_H,
    q_segment_ids,
    kv_segment_ids,
  )


@functools.partial(jax.jit, static_argnums=(0,))
def _diff_v1_stock(opts, qs, ks, v, lam_H, q_seg, kv_seg):
  o1, o2 = _maps(opts, qs, ks, v, q_seg, kv_seg)
  out_BxHxTxDv = o1 - lam_H[None, :, None, None] * o2
  return _heads_first(out_BxHxTxDv).astype(qs[0].dtype)


def diff_v2_stock_tpu(
  q_BxTxQxD,
  k_BxSxKxD,
  v_BxSxKxD,
  lam_BxTxH,
  *,
  causal: bool = True,
  q_segment_ids=None,
  kv_segment_ids=None,
  scale: float | None = None,
  block_sizes=None,
  interpret: bool = False,
) -> jax.Array:
  """DIFF V2 as one splash-attention call over the 2H query heads, then pair combining.

  Arguments and result as in :func:`diffjax.kernels.tpu.diff_v2_pallas_tpu`.
  """
  _v.check_diff_v2(q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
  opts = _options(q_BxTxQxD.shape[-1], causal, scale, block_sizes, interpret)
  return _diff_v2_stock(
    opts, q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH, q_segment_ids, kv_segment_ids
  )


@functools.partial(jax.jit, static_argnums=(0,))
def _diff_v2_stock(opts, q, k, v, lam, q_seg, kv_seg):
  (o_BxQxTxD,) = _maps(opts, (q,), (k,), v, q_seg, kv_seg)
  lam_BxHxT = lam.astype(jnp.float32).transpose(0, 2, 1)
  out_BxHxTxD = o_BxQxTxD[:, 0::2] - lam_BxHxT[..., None] * o_BxQxTxD[:, 1::2]
  return _heads_first(out_BxHxTxD).astype(q.dtype)


def gda_v1_stock_tpu(
  q1_BxTxHxD,
  q2_BxTxNxD,
  k1_BxSxKxD,
  k2_BxSxKxD,
  v_BxSxKxDv,
  lam_H,
  *,
  causal: bool = True,
  q_segment_ids=None,
  kv_segment_ids=None,
  scale: float | None = None,
  block_sizes=None,
  interpret: bool = False,
) -> jax.Array:
  """Grouped differential attention (V1 style) as two splash calls: the H signal heads on
  K1 and the N noise heads on K2 (each noise map once), combined per group.

  Arguments and result as in :func:`diffjax.kernels.tpu.gda_v1_pallas_tpu`;
  ``block_sizes`` is None or a ``splash_attention.BlockSizes``.
  """
  lam = jnp.asarray(lam_H)
  _v.check_gda_v1(q1_BxTxHxD, q2_BxTxNxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam)
  h, d = q1_BxTxHxD.shape[2:]
  return _gda_stock(
    _options(d, causal, scale, block_sizes, interpret),
    (q1_BxTxHxD, q2_BxTxNxD),
    (k1_BxSxKxD, k2_BxSxKxD),
    v_BxSxKxDv,
    jnp.broadcast_to(lam.astype(jnp.float32), (h,))[None, :, None],
    q_segment_ids,
    kv_segment_ids,
  )


def gda_v2_stock_tpu(
  q1_BxTxHxD,
  q2_BxTxNxD,
  k_BxSxKxD,
  v_BxSxKxD,
  lam_BxTxH,
  *,
  causal: bool = True,
  q_segment_ids=None,
  kv_segment_ids=None,
  scale: float | None = None,
  block_sizes=None,
  interpret: bool = False,
) -> jax.Array:
  """Grouped differential attention (V2 style) as two splash calls on K: the signal heads
  and the noise heads (each noise map once), combined per group.

  Arguments and result as in :func:`diffjax.kernels.tpu.gda_v2_pallas_tpu`.
  """
  _v.check_gda_v2(q1_BxTxHxD, q2_BxTxNxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
  return _gda_stock(
    _options(q1_BxTxHxD.shape[-1], causal, scale, block_sizes, interpret),
    (q1_BxTxHxD, q2_BxTxNxD),
    (k_BxSxKxD, k_BxSxKxD),
    v_BxSxKxD,
    lam_BxTxH.astype(jnp.float32).transpose(0, 2, 1),
    q_segment_ids,
    kv_segment_ids,
  )


@functools.partial(jax.jit, static_argnums=(0,))
def _gda_stock(opts, qs, ks, v, lam_BxHxT, q_seg, kv_seg):
  o1_BxHxTxDv, o2_BxNxTxDv = _maps(opts, qs, ks, v, q_seg, kv_seg)
  b, h, t, dv = o1_BxHxTxDv.shape
  n = o2_BxNxTxDv.shape[1]
  lam_BxNxRxT = jnp.broadcast_to(lam_BxHxT, (b, h, t)).reshape(b, n, h // n, t)
  out = o1_BxHxTxDv.reshape(b, n, h // n, t, dv) - lam_BxNxRxT[..., None] * o2_BxNxTxDv[:, :, None]
  return _heads_first(out.reshape(b, h, t, dv)).astype(qs[0].dtype)
