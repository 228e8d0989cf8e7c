"""The ring of context-parallel DIFF attention with the fused kernels per block.

:mod:`diffjax.ops.context_parallel` passes key/value blocks around a ring of C devices.
Its XLA ring scores each arriving block as one [T / C, T / C] tile per head; this one
runs the fused DIFF V1 / V2 kernels on each block instead (TPU:
:mod:`diffjax.kernels.tpu.blocks`, head-major; GPU: :mod:`diffjax.kernels.gpu.blocks`,
token-major), so no score tile is written to memory and the causal tiles a block does not
need are never visited.

Which part of a block a device's queries see follows from the shard indices alone.
With device ``me`` holding its queries and the keys from shard ``src``:

  * ``src == me`` (the first step): the local causal mask. With the load-balanced
    (zigzag) order the local tokens are chunks ``me`` and ``2C - 1 - me``, and the causal
    mask of the original positions is still the causal mask of the local order.
  * ``src < me``: contiguous shards: every key is visible to every query. Zigzag: the
    block's first chunk (``src``) is visible to every query; its second chunk
    (``2C - 1 - src``) comes after both query chunks, so it is skipped.
  * ``src > me``: contiguous shards: nothing is visible, the step is skipped. Zigzag:
    the queries' first chunk (``me``) sees nothing; their second chunk
    (``2C - 1 - me``) sees the whole block.

Each case is one kernel call, causal only for the first step; segment ids still mask
inside every call. Without causal masking every step is a full-block call.

The TPU interpreter (``interpret=True``, how CPU tests run the TPU kernels) holds every
device at a barrier in each kernel call, so all devices must make the same number of
calls: there a skipped step (contiguous shards, ``src > me``) runs a block's kernel and
discards its result. On a TPU (and on a GPU) a skipped step calls nothing.

The forward merges the calls' per-map outputs with their log-sum-exps (both DIFF maps
are merged separately and combined with lambda at the end). The backward is a ring too:
each block call gets the merged statistics of the whole attention and returns its share
of dQ, dK and dV; dK and dV travel with their block, as in the XLA ring.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

# Like the dispatch table: an installation without a kernel package keeps the XLA ring.
try:
  from diffjax.kernels.tpu import blocks as tpu_blocks
except ImportError:  # pragma: no cover - depends on the installed jax
  tpu_blocks = None
try:
  from diffjax.kernels.gpu import blocks as gpu_blocks
except ImportError:  # pragma: no cover - depends on the installed jax
  gpu_blocks = None

__all__ = ["IMPLEMENTATIONS", "available", "make_kernel_ring", "shift_to_next"]


@dataclasses.dataclass(frozen=True)
class _Kernels:
  """A kernel package's block functions and the layout they take."""
  module: Any
  head_major: bool  # [B, N, T, F] (TPU) instead of the ops' [B, T, N, F] (GPU)
  barrier_in_interpreter: bool  # every device must call a kernel at every step

  @property
  def seq_axis(self) -> int:
    return 2 if self.head_major else 1

  def layout(self, x_BxTxNxF):
    """Token-major to the kernels' layout and back (a transpose is its own inverse)."""
    return jnp.transpose(x_BxTxNxF, (0, 2, 1, 3)) if self.head_major else x_BxTxNxF

  def rows(self, x):
    """A per-row reduction over the last axis of an array in the kernels' layout, [B, H, T]."""
    total = jnp.sum(x, axis=-1)
    return total if self.head_major else jnp.transpose(total, (0, 2, 1))

  def per_row(self, x_BxHxT):
    """[B, H, T] broadcastable against an array in the kernels' layout."""
    return (x_BxHxT if self.head_major else jnp.transpose(x_BxHxT, (0, 2, 1)))[..., None]


_KERNELS = {
    "pallas_tpu": None if tpu_blocks is None else _Kernels(tpu_blocks, True, True),
    "pallas_gpu": None if gpu_blocks is None else _Kernels(gpu_blocks, False, False),
}
IMPLEMENTATIONS = tuple(_KERNELS)

# Log-sum-exp of a row that has seen no key yet, in the merge (finite, so merges stay NaN-free).
_EMPTY = -1e30


def available(implementation: str) -> bool:
  """Whether this installation can run ``implementation``'s kernels per ring block."""
  return _KERNELS.get(implementation) is not None


def shift_to_next(tree, axis: str, num_shards: int):
  """Sends every array of ``tree`` to the next device on the ring (i -> i + 1)."""
  perm = [(i, (i + 1) % num_shards) for i in range(num_shards)]
  return jax.tree.map(lambda x: jax.lax.ppermute(x, axis, perm), tree)


def _rows(x, axis: int, rows: slice):
  return jax.lax.slice_in_dim(x, rows.start or 0, rows.stop or x.shape[axis], axis=axis)


def _pad_rows(x, axis: int, rows: slice, length: int, value=0.0):
  """Places x (the ``rows`` of a length-``length`` axis) back on the full axis."""
  start = rows.start or 0
  after = length - start - x.shape[axis]
  if start == 0 and after == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (start, after)
  return jnp.pad(x, widths, constant_values=value)


def make_kernel_ring(*, implementation: str, version: int, axis: str, num_shards: int,
                     load_balance: bool, causal: bool, scale: float, local_shapes,
                     segmented: bool, block_sizes=None, interpret=False):
  """The ring attention of one device with kernel blocks, a ``custom_vjp`` function.

  ``ring(qs, ks, v, lam, seg)`` on the device's local token-major blocks: ``qs`` V1
  ``(q1, q2)`` [B, T, H, D] or V2 ``(q,)`` [B, T, 2H, D]; ``ks`` V1 ``(k1, k2)`` / V2
  ``(k,)`` [B, T, K, D]; ``v`` [B, T, K, Dv]; ``lam`` float32 [B, T, H] (V1: the heads'
  lambda broadcast over tokens); ``seg`` None or int [B, T]. Returns [B, T, H, Dv] in
  q's dtype.

  Args:
    implementation: "pallas_tpu" or "pallas_gpu", the kernels that run on each block.
    version: 1 (DIFF V1) or 2 (DIFF V2).
    local_shapes: ``(B, T, H, D, K, Dv)`` of the local blocks, H the DIFF heads.
    block_sizes, interpret: passed to the kernels.
  """
  if implementation not in _KERNELS:
    raise ValueError(f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}.")
  kernels = _KERNELS[implementation]
  if kernels is None:
    raise ValueError(f"The {implementation} kernels cannot be imported in this installation; "
                     "use the XLA ring (implementation='xla').")
  blocks = kernels.module
  ax = kernels.seq_axis
  skip_calls_a_kernel = bool(interpret) and kernels.barrier_in_interpreter
  _, t, h, d, kh, dv = local_shapes
  half = t // 2
  every = slice(0, t)

  def config(tq, tk, is_causal):
    return blocks.block_config(
        version=version, t=tq, s=tk, d=d, dv=dv, heads=h, kv_heads=kh, causal=is_causal,
        segmented=segmented, scale=scale, block_sizes=block_sizes, interpret=interpret)

  # (query rows, key rows, plan) of the first step and of the later steps' two cases.
  first = (every, every, config(t, t, causal))
  if not causal:
    earlier = later = first
  elif load_balance:
    earlier = (every, slice(0, half), config(t, half, False))
    later = (slice(half, t), every, config(t - half, t, False))
  else:
    earlier, later = (every, every, config(t, t, False)), None

  def forward(qs, ks, v, lam, seg):
    me = jax.lax.axis_index(axis)
    qs_k = tuple(kernels.layout(q) for q in qs)
    lam_BxHxT = jnp.transpose(lam.astype(jnp.float32), (0, 2, 1))
    b = qs[0].shape[0]
    o_shape = (b, h, t, dv) if kernels.head_major else (b, t, h, dv)

    def part(case, block):
      if case is None:
        if skip_calls_a_kernel:  # the interpreter's device barrier: call, keep nothing
          o1, _, lse = part(earlier, block)
          zeros = jnp.where(jnp.isnan(o1), 0.0, 0.0)
          return zeros, zeros, jnp.where(jnp.isnan(lse), _EMPTY, _EMPTY)
        zeros = jnp.zeros(o_shape, jnp.float32)
        return zeros, zeros, jnp.full((b, h, 2, t), _EMPTY, jnp.float32)
      q_rows, k_rows, cfg = case
      ks_blk, v_blk, seg_blk = block
      o1, o2, lse = blocks.block_forward(
          cfg, tuple(_rows(q, ax, q_rows) for q in qs_k),
          tuple(_rows(k, ax, k_rows) for k in ks_blk), _rows(v_blk, ax, k_rows),
          _rows(lam_BxHxT, 2, q_rows), None if seg is None else _rows(seg, 1, q_rows),
          None if seg_blk is None else _rows(seg_blk, 1, k_rows))
      lse = jnp.where(jnp.isinf(lse), _EMPTY, lse)
      return (_pad_rows(o1, ax, q_rows, t), _pad_rows(o2, ax, q_rows, t),
              _pad_rows(lse, 3, q_rows, t, _EMPTY))

    def merge(acc, new):
      o1a, o2a, la = acc
      o1b, o2b, lb = new
      m = jnp.maximum(la, lb)
      wa, wb = jnp.exp(la - m), jnp.exp(lb - m)
      total = wa + wb
      col = lambda x, i: kernels.per_row(x[:, :, i])
      mix = lambda oa, ob, i: (oa * col(wa, i) + ob * col(wb, i)) / col(total, i)
      return mix(o1a, o1b, 0), mix(o2a, o2b, 1), m + jnp.log(total)

    def step(step_index, block, acc):
      src = jnp.mod(me - step_index, num_shards)
      new = jax.lax.cond(src < me, lambda blk: part(earlier, blk),
                         lambda blk: part(later, blk), block)
      return merge(acc, new)

    block = (tuple(kernels.layout(k) for k in ks), kernels.layout(v), seg)
    acc = part(first, block)
    if num_shards > 1:
      block = shift_to_next(block, axis, num_shards)

      def body(i, carry):
        block, acc = carry
        nxt = shift_to_next(block, axis, num_shards)  # independent of this step: may overlap
        return nxt, step(i, block, acc)

      block, acc = jax.lax.fori_loop(1, num_shards - 1, body, (block, acc))
      acc = step(num_shards - 1, block, acc)

    o1, o2, lse = acc
    lse = jnp.where(lse <= 0.5 * _EMPTY, jnp.inf, lse)  # rows that saw no key at all
    out = kernels.layout(o1 - kernels.per_row(lam_BxHxT) * o2).astype(qs[0].dtype)
    return out, (qs, ks, v, lam, seg, o1, o2, lse)

  def backward(res, d_out_BxTxHxDv):
    qs, ks, v, lam, seg, o1, o2, lse = res
    me = jax.lax.axis_index(axis)
    qs_k = tuple(kernels.layout(q) for q in qs)
    lam_BxHxT = jnp.transpose(lam.astype(jnp.float32), (0, 2, 1))
    d_out = kernels.layout(d_out_BxTxHxDv)
    d_out_f = d_out.astype(jnp.float32)
    d1, d2 = kernels.rows(d_out_f * o1), kernels.rows(d_out_f * o2)
    d_out = d_out.astype(qs[0].dtype)

    def part(case, block):
      ks_blk, v_blk, seg_blk = block
      if case is None:
        if skip_calls_a_kernel:  # the interpreter's device barrier: call, keep nothing
          return jax.tree.map(lambda x: jnp.where(jnp.isnan(x), 0.0, 0.0),
                              part(earlier, block))
        return (tuple(jnp.zeros(q.shape, jnp.float32) for q in qs_k),
                tuple(jnp.zeros(k.shape, jnp.float32) for k in ks_blk),
                jnp.zeros(v_blk.shape, jnp.float32))
      q_rows, k_rows, cfg = case
      dqs, dks, dv = blocks.block_backward(
          cfg, tuple(_rows(q, ax, q_rows) for q in qs_k),
          tuple(_rows(k, ax, k_rows) for k in ks_blk), _rows(v_blk, ax, k_rows),
          _rows(lam_BxHxT, 2, q_rows), None if seg is None else _rows(seg, 1, q_rows),
          None if seg_blk is None else _rows(seg_blk, 1, k_rows), _rows(d_out, ax, q_rows),
          _rows(lse, 3, q_rows), _rows(d1, 2, q_rows), _rows(d2, 2, q_rows))
      up = lambda x, rows: _pad_rows(x.astype(jnp.float32), ax, rows, t)
      return (tuple(up(dq, q_rows) for dq in dqs), tuple(up(dk, k_rows) for dk in dks),
              up(dv, k_rows))

    def add(a, b_):
      return jax.tree.map(jnp.add, a, b_)

    def step(step_index, block, dqs):
      kv, (dks, dv) = block[:3], block[3:]
      src = jnp.mod(me - step_index, num_shards)
      dq_s, dk_s, dv_s = jax.lax.cond(src < me, lambda blk: part(earlier, blk),
                                      lambda blk: part(later, blk), kv)
      return (*kv, add(dks, dk_s), dv + dv_s), add(dqs, dq_s)

    kv = (tuple(kernels.layout(k) for k in ks), kernels.layout(v), seg)
    dqs, dks, dv = part(first, kv)
    if num_shards > 1:
      block = shift_to_next((*kv, dks, dv), axis, num_shards)

      def body(i, carry):
        block, dqs = carry
        kv_next = shift_to_next(block[:3], axis, num_shards)  # independent of this step
        (_, _, _, dks, dv), dqs = step(i, block, dqs)
        return (*kv_next, *shift_to_next((dks, dv), axis, num_shards)), dqs

      block, dqs = jax.lax.fori_loop(1, num_shards - 1, body, (block, dqs))
      (_, _, _, dks, dv), dqs = step(num_shards - 1, block, dqs)
      # A block's accumulators finish one device before the block's owner.
      dks, dv = shift_to_next((dks, dv), axis, num_shards)

    dqs = tuple(kernels.layout(dq).astype(q.dtype) for dq, q in zip(dqs, qs))
    dks = tuple(kernels.layout(dk).astype(k.dtype) for dk, k in zip(dks, ks))
    dlam = jnp.transpose(-d2, (0, 2, 1)).astype(lam.dtype)
    return dqs, dks, kernels.layout(dv).astype(v.dtype), dlam, None

  @jax.custom_vjp
  def ring(qs, ks, v, lam, seg):
    return forward(qs, ks, v, lam, seg)[0]

  ring.defvjp(forward, backward)
  return ring
