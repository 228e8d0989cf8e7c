"""DIFF V1 decoding on GPUs: one query token against a long KV cache (flash-decoding).

Decoding is memory-bound: the cost is reading the cache. The multi-call V1 path reads
V once per map; this kernel reads K1, K2 and V once, which is exactly the baseline's
cache traffic (the cache holds K1, K2 of width D and V of width 2D per kv group, the
bytes of the baseline's 2 kv heads of width D).

Layout. One program per (batch, kv group, cache split). The G query heads of a group
form the rows of the tiles (padded to 16, the smallest tensor-core dot), so a K/V tile
is loaded once for all heads of the group and both maps. Each program reduces its
part of the cache with an online softmax per map and writes its unnormalised partial
results (running max and sum per map and head, and the two float32 accumulators);
XLA then merges the parts exactly. Positions at or beyond ``kv_len[b]`` are masked and
the blocks past it are never read; a row with ``kv_len == 0`` is zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from diffjax.core import reference as ref
from diffjax.core import validation as _v
from diffjax.kernels.gpu import block_sizes as bs
from diffjax.kernels.gpu import flash_pair as fp


def _decode_kernel(q1_ref, q2_ref, k1_ref, k2_ref, v_ref, len_ref, acc1_ref, acc2_ref,
                   m1_ref, l1_ref, m2_ref, l2_ref, *, block_kv: int, split_len: int,
                   c: float):
  # The K/V refs hold the whole cache of one (batch, kv group); this program reads
  # its split's rows only, and none past kv_len.
  start = pl.program_id(2) * split_len
  kv_len = len_ref[...]
  n_blocks = jnp.clip(lax.div(kv_len - start + block_kv - 1, block_kv), 0,
                      split_len // block_kv)
  q1, q2 = q1_ref[...], q2_ref[...]

  def step(j, carry):
    acc1, acc2, m1, m2, l1, l2 = carry
    kv_start = pl.multiple_of(j * block_kv, block_kv)
    rows = pl.ds(pl.multiple_of(start + kv_start, block_kv), block_kv)
    v = v_ref[rows, :]
    visible = (start + kv_start + jnp.arange(block_kv, dtype=jnp.int32) < kv_len)[None, :]
    s1 = jnp.where(visible, fp.dot(q1, k1_ref[rows, :], trans_b=True) * c, fp.NEG)
    s2 = jnp.where(visible, fp.dot(q2, k2_ref[rows, :], trans_b=True) * c, fp.NEG)
    acc1, m1, l1 = fp.online_softmax_step(s1, v, acc1, m1, l1, masked=True)
    acc2, m2, l2 = fp.online_softmax_step(s2, v, acc2, m2, l2, masked=True)
    return acc1, acc2, m1, m2, l1, l2

  rows_q, dv = q1.shape[0], v_ref.shape[-1]
  acc0 = jnp.zeros((rows_q, dv), jnp.float32)
  m0 = jnp.full((rows_q,), fp.NEG, jnp.float32)
  l0 = jnp.zeros((rows_q,), jnp.float32)
  acc1, acc2, m1, m2, l1, l2 = lax.fori_loop(0, n_blocks, step, (acc0, acc0, m0, m0, l0, l0))
  acc1_ref[...] = acc1
  acc2_ref[...] = acc2
  m1_ref[...] = m1
  l1_ref[...] = l1
  m2_ref[...] = m2
  l2_ref[...] = l2


def _merge(acc, m, l):
  """Merges per-split partial softmax results along axis 2 (the split axis)."""
  m_max = jnp.max(m, axis=2, keepdims=True)
  w = jnp.exp2(m - m_max)
  total = jnp.sum(w * l, axis=2)
  out = jnp.sum(w[..., None] * acc, axis=2)
  return out / jnp.where(total == 0.0, 1.0, total)[..., None]


def cache_length_multiple(head_dim: int, value_dim: int | None = None,
                          block_sizes: bs.DecodeBlockSizes | dict | None = None) -> int:
  """The multiple a KV cache's length should have so decoding reads it in place.

  A cache of another length is padded to it (a copy of the whole cache) on every call.
  """
  blocks = bs.resolve(block_sizes, bs.DecodeBlockSizes.default(head_dim, value_dim),
                      cls=bs.DecodeBlockSizes)
  return blocks.block_kv


def num_splits_for(batch: int, kv_heads: int, kv_len: int, blocks: bs.DecodeBlockSizes) -> int:
  """Cache splits: the configured number, or enough programs to fill the GPU."""
  max_splits = max(1, pl.cdiv(kv_len, blocks.block_kv))
  if blocks.num_splits is not None:
    return min(blocks.num_splits, max_splits)
  return max(1, min(max_splits, pl.cdiv(blocks.target_programs, batch * kv_heads)))


@functools.partial(jax.jit, static_argnames=("scale", "blocks", "interpret"))
def _decode(q1, q2, k1, k2, v, lam_H, kv_len, *, scale, blocks, interpret):
  b, _, h, d = q1.shape
  s, kh, dv = k1.shape[1], k1.shape[2], v.shape[3]
  g = h // kh
  gp = max(16, bs.next_power_of_2(g))
  dp, dvp = bs.next_power_of_2(max(d, 16)), bs.next_power_of_2(max(dv, 16))
  bk = min(blocks.block_kv, max(16, bs.next_power_of_2(s)))
  # A cache whose length is a multiple of the block (see cache_length_multiple) and
  # whose head dims are powers of two >= 16 is read in place: no padded copy. The
  # last split may be shorter than the others; its program stops at the cache end.
  sp = fp.round_up(s, bk)
  splits = num_splits_for(b, kh, sp, blocks)
  split_len = fp.round_up(pl.cdiv(sp, splits), bk)
  splits = pl.cdiv(sp, split_len)

  def rows_of_group(q):  # [B, 1, H, D] -> [B, K, Gp, Dp]; head h = group * G + j
    return fp.pad_axis(fp.pad_axis(q.reshape(b, kh, g, d), 2, gp), 3, dp)

  pad_kv = lambda x, width: fp.pad_axis(fp.pad_axis(x, 1, sp), 3, width)
  kv_len = jnp.clip(kv_len.astype(jnp.int32), 0, s)
  q_spec = pl.BlockSpec((None, None, gp, dp), lambda bi, gi, si: (bi, gi, 0, 0))
  k_spec = pl.BlockSpec((None, sp, None, dp), lambda bi, gi, si: (bi, 0, gi, 0))
  v_spec = pl.BlockSpec((None, sp, None, dvp), lambda bi, gi, si: (bi, 0, gi, 0))
  len_spec = pl.BlockSpec((None,), lambda bi, gi, si: (bi,))
  acc_spec = pl.BlockSpec((None, None, None, gp, dvp), lambda bi, gi, si: (bi, gi, si, 0, 0))
  row_spec = pl.BlockSpec((None, None, None, gp), lambda bi, gi, si: (bi, gi, si, 0))
  acc_shape = jax.ShapeDtypeStruct((b, kh, splits, gp, dvp), jnp.float32)
  row_shape = jax.ShapeDtypeStruct((b, kh, splits, gp), jnp.float32)
  acc1, acc2, m1, l1, m2, l2 = pl.pallas_call(
      functools.partial(_decode_kernel, block_kv=bk, split_len=split_len,
                        c=scale * fp.LOG2E),
      grid=(b, kh, splits),
      in_specs=[q_spec, q_spec, k_spec, k_spec, v_spec, len_spec],
      out_specs=[acc_spec, acc_spec, row_spec, row_spec, row_spec, row_spec],
      out_shape=[acc_shape, acc_shape, row_shape, row_shape, row_shape, row_shape],
      compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                           num_stages=blocks.num_stages),
      interpret=interpret,
      name="diff_v1_decode",
  )(rows_of_group(q1), rows_of_group(q2), pad_kv(k1, dp), pad_kv(k2, dp), pad_kv(v, dvp),
    kv_len)
  o1, o2 = _merge(acc1, m1, l1), _merge(acc2, m2, l2)  # [B, K, Gp, Dvp]
  lam_KxG = lam_H.astype(jnp.float32).reshape(kh, g)
  out = o1[:, :, :g, :dv] - lam_KxG[None, :, :, None] * o2[:, :, :g, :dv]
  return out.reshape(b, 1, h, dv).astype(q1.dtype)


def diff_v1_decode(
    q1_Bx1xHxD: jax.Array, q2_Bx1xHxD: jax.Array, k1_BxSxKxD: jax.Array,
    k2_BxSxKxD: jax.Array, v_BxSxKxDv: jax.Array, lam_H: jax.Array, kv_len_B: jax.Array,
    *, scale: float | None = None, block_sizes: bs.DecodeBlockSizes | dict | None = None,
    interpret: bool = False) -> jax.Array:
  """DIFF V1 attention of one new token per sequence against a KV cache.

  Args:
    q1_Bx1xHxD, q2_Bx1xHxD: the new token's two query components (T = 1).
    k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv: the cache (S slots; Dv = 2 D in the paper).
    lam_H: lambda, a scalar or [H].
    kv_len_B: int [B], valid cache length per sequence (the new token included);
      positions >= kv_len are ignored, values are clipped to [0, S].
    scale: score scale, default 1 / sqrt(D).
    block_sizes: None, a :class:`DecodeBlockSizes` or a dict of overrides.
    interpret: run the Pallas interpreter.
  Returns:
    [B, 1, H, Dv] in the dtype of q1 (no gradient: decoding is inference only).
  """
  lam_H = jnp.asarray(lam_H)
  _v.check_diff_v1(q1_Bx1xHxD, q2_Bx1xHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H)
  _v.check_decode(q1_Bx1xHxD, kv_len_B, "diff_v1_decode", wider="diff_v1_fused")
  b, _, h, d = q1_Bx1xHxD.shape
  kv_len_B = jnp.asarray(kv_len_B)
  blocks = bs.resolve(block_sizes, bs.DecodeBlockSizes.default(d, v_BxSxKxDv.shape[3]),
                      cls=bs.DecodeBlockSizes)
  return _decode(q1_Bx1xHxD, q2_Bx1xHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv,
                 jnp.broadcast_to(lam_H, (h,)), kv_len_B, scale=_v.default_scale(scale, d),
                 blocks=blocks, interpret=bool(interpret))


def diff_v1_decode_reference(q1_Bx1xHxD, q2_Bx1xHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv,
                             lam_H, kv_len_B, *, scale: float | None = None) -> jax.Array:
  """Plain-JAX decode: :func:`diffjax.core.reference.diff_v1_reference` masked by kv_len."""
  s = k1_BxSxKxD.shape[1]
  kv_len_B = jnp.clip(jnp.asarray(kv_len_B, jnp.int32), 0, s)
  mask_Bx1x1xS = (jnp.arange(s)[None, :] < kv_len_B[:, None])[:, None, None, :]
  return ref.diff_v1_reference(q1_Bx1xHxD, q2_Bx1xHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv,
                               lam_H, causal=False, mask=mask_Bx1x1xS, scale=scale)

