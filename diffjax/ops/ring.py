"""The ring of context-parallel attention: one device's forward, backward and custom_vjp.

Key and value blocks pass around a mesh axis; the maps combine only at the end.
Design: docs/scaling.md, "Context parallelism".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from diffjax.core.dtypes import accumulation_dtype

__all__ = ["BlockFunctions", "make_ring", "shift_to_next"]

# Log-sum-exp of a row that has seen no key yet, in the merge (finite, so merges stay NaN-free).
_EMPTY = -1e30


@dataclasses.dataclass(frozen=True)
class BlockFunctions:
  """What computes one block of the ring.

  Arrays are in the block functions' layout: token-major [B, T, N, F], or head-major
  [B, N, T, F] with ``head_major``. Queries ``qs``, keys ``ks`` and the value ``v`` are
  the op's (V1 ``(q1, q2)``, ``(k1, k2)``; V2 ``(q,)`` of 2H heads, ``(k,)``; the baseline
  ``(q,)``, ``(k,)``); ``lam`` is [B, H, T] in the accumulation dtype (None for one map).
  Log-sum-exps are [B, H, maps, T], ``+inf`` on rows that see no key of the block.

  Attributes:
    config: ``(query rows, key rows, causal) -> plan``, the static plan of one call
      (causal: the queries are the last of the keys' positions).
    forward: ``(plan, qs, ks, v, lam, q_seg, kv_seg) -> (*outs, lse)``: every map's
      normalized output [.., Dv] over the block's keys and the log-sum-exps.
    backward: ``(plan, qs, ks, v, lam, q_seg, kv_seg, d_out, lse, *deltas) -> (dqs, dks,
      dv)``: the block's share of the gradients, given the cotangent of the combined
      output, the log-sum-exps over *all* keys and ``D_s = rowsum(dO * O_s)`` [B, H, T].
    maps: 1 (the baseline) or 2 (DIFF: ``out = O_1 - lam O_2``).
    head_major: the layout above.
    interpreter_barrier: in interpret mode every device must call at every step.
  """

  config: Callable[[int, int, bool], Any]
  forward: Callable[..., tuple]
  backward: Callable[..., tuple]
  maps: int
  head_major: bool = False
  interpreter_barrier: bool = False

  def layout(self, x_BxTxNxF):
    """Token-major to the blocks' layout and back (a transpose is its own inverse)."""
    return jnp.transpose(x_BxTxNxF, (0, 2, 1, 3)) if self.head_major else x_BxTxNxF

  @property
  def seq_axis(self) -> int:
    return 2 if self.head_major else 1

  def row_sums(self, x):
    """A per-row sum over the last axis of an array in the blocks' layout, [B, H, T]."""
    total = jnp.sum(x, axis=-1)
    return total if self.head_major else jnp.transpose(total, (0, 2, 1))

  def per_row(self, x_BxHxT):
    """[B, H, T] broadcastable against an array in the blocks' layout."""
    return (x_BxHxT if self.head_major else jnp.transpose(x_BxHxT, (0, 2, 1)))[..., None]


def shift_to_next(tree, axis: str, num_shards: int):
  """Sends every array of ``tree`` to the next device on the ring (i -> i + 1)."""
  perm = [(i, (i + 1) % num_shards) for i in range(num_shards)]
  return jax.tree.map(lambda x: jax.lax.ppermute(x, axis, perm), tree)


def _rows(x, axis: int, rows: slice):
  if x is None:
    return None
  return jax.lax.slice_in_dim(x, rows.start, rows.stop, axis=axis)


def _pad_rows(x, axis: int, rows: slice, length: int, value=0.0):
  """Places x (the ``rows`` of a length-``length`` axis) back on the full axis."""
  after = length - rows.start - x.shape[axis]
  if rows.start == 0 and after == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (rows.start, after)
  return jnp.pad(x, widths, constant_values=value)


def _around_the_ring(
  step, block, carry, axis: str, num_shards: int, lagging: int = 0, in_order: bool = False
):
  """Passes ``block`` around the ring, calling ``step(i, block, carry) -> (block, carry)``
  on the block that arrives at each step i = 1 .. C - 1 (step 0, the local block, is the
  caller's, and ``carry`` its result).

  The last ``lagging`` entries of ``block`` (the backward's gradient accumulators) are
  what ``step`` updates: they travel after the step's math, the rest before it, so that
  the transfer may overlap the math. The accumulators end one hop short of their owner.
  ``in_order``: every transfer waits for the math before it (the TPU interpreter holds all
  devices at a barrier in each kernel call; a device that entered a transfer first would wait
  there for one held at the barrier, which waits for it).
  """
  if num_shards == 1:
    return block, carry
  if in_order:
    block = _after_the_calls(block)
  block = shift_to_next(block, axis, num_shards)
  ahead = len(block) - lagging

  def body(i, state):
    block, carry = state
    if in_order:
      updated, carry = step(i, block, carry)
      nxt = shift_to_next(_after_the_calls(block[:ahead]), axis, num_shards)
      block = updated
    else:
      nxt = shift_to_next(block[:ahead], axis, num_shards)
      block, carry = step(i, block, carry)
    return (*nxt, *shift_to_next(block[ahead:], axis, num_shards)), carry

  block, carry = jax.lax.fori_loop(1, num_shards - 1, body, (block, carry))
  return step(num_shards - 1, block, carry)


def _after_the_calls(tree):
  """``tree`` as it comes back from an ordered host callback: a value that exists only once
  every interpreted kernel call before it has returned (the interpreter ends each call with
  an ordered callback, and ordered callbacks run in program order)."""
  leaves, treedef = jax.tree.flatten(tree)
  shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
  leaves = io_callback(lambda *xs: tuple(np.asarray(x) for x in xs), shapes, *leaves, ordered=True)
  return jax.tree.unflatten(treedef, list(leaves))


def make_ring(
  blocks: BlockFunctions,
  *,
  axis: str,
  num_shards: int,
  load_balance: bool,
  causal: bool,
  length: int,
  heads: int,
  interpret=False,
):
  """The ring attention of one device, a ``custom_vjp`` function.

  ``ring(qs, ks, v, lam, seg)`` on the device's local token-major arrays (the op's
  queries and keys as in :class:`BlockFunctions`, ``v`` [B, T, K, Dv], ``lam`` None or
  [B, T, H] for two maps, ``seg`` None or int [B, T]) returns [B, T, H, Dv] in q's dtype.

  Args:
    blocks: what computes each block.
    axis, num_shards: the mesh axis of the ring and its size C.
    load_balance: the local tokens are chunks ``me`` and ``2C - 1 - me`` (zig-zag).
    causal: causal masking by original position.
    length, heads: the local length T and the heads H of the output.
    interpret: the block functions run in an interpreter.
  """
  if load_balance and length % 2:
    raise ValueError(f"The zig-zag order needs an even local length; got {length}.")
  t = length
  every, half = slice(0, t), t // 2
  # (query rows, key rows, plan) of the first step and of the later steps' two cases
  # (``src < me`` and ``src > me``; None: nothing visible).
  first = (every, every, blocks.config(t, t, causal))
  if not causal:
    earlier = later = first
  elif load_balance:
    earlier = (every, slice(0, half), blocks.config(t, half, False))
    later = (slice(half, t), every, blocks.config(t - half, t, False))
  else:
    earlier, later = (every, every, blocks.config(t, t, False)), None
  plan = _Ring(
    blocks,
    axis,
    num_shards,
    t,
    heads,
    bool(interpret) and blocks.interpreter_barrier,
    first,
    earlier,
    later,
  )

  @jax.custom_vjp
  def ring(qs, ks, v, lam, seg):
    return plan.forward(qs, ks, v, lam, seg)[0]

  ring.defvjp(plan.forward, plan.backward)
  return ring


@dataclasses.dataclass(frozen=True)
class _Ring:
  """The static plan of one device's ring (:func:`make_ring`) and its forward and backward."""

  blocks: BlockFunctions
  axis: str
  num_shards: int
  t: int
  h: int
  # The TPU interpreter's device barrier: a skipped step still calls its block, and every
  # transfer waits for the calls before it.
  interpreted: bool
  first: tuple
  earlier: tuple
  later: tuple | None

  def by_source(self, me, step_index, part, block):
    """``part`` of the block that arrives at ``step_index``, by the shard it comes from."""
    if self.earlier is self.later:
      return part(self.earlier, block)
    src = jnp.mod(me - step_index, self.num_shards)
    return jax.lax.cond(
      src < me, lambda blk: part(self.earlier, blk), lambda blk: part(self.later, blk), block
    )

  def local(self, qs, lam):
    acc = accumulation_dtype(qs[0].dtype)
    lam_BxHxT = None if lam is None else jnp.transpose(lam.astype(acc), (0, 2, 1))
    return acc, tuple(self.blocks.layout(q) for q in qs), lam_BxHxT

  def block_args(self, case, qs_k, lam_BxHxT, seg, block):
    q_rows, k_rows, plan = case
    ks_blk, v_blk, seg_blk = block[:3]
    ax = self.blocks.seq_axis
    return (
      plan,
      tuple(_rows(q, ax, q_rows) for q in qs_k),
      tuple(_rows(k, ax, k_rows) for k in ks_blk),
      _rows(v_blk, ax, k_rows),
      _rows(lam_BxHxT, 2, q_rows),
      _rows(seg, 1, q_rows),
      _rows(seg_blk, 1, k_rows),
    )

  def forward(self, qs, ks, v, lam, seg):
    blocks, t, h, maps, ax = self.blocks, self.t, self.h, self.blocks.maps, self.blocks.seq_axis
    me = jax.lax.axis_index(self.axis)
    acc, qs_k, lam_BxHxT = self.local(qs, lam)
    b, dv = qs[0].shape[0], v.shape[-1]
    o_shape = (b, h, t, dv) if blocks.head_major else (b, t, h, dv)

    def part(case, block):
      if case is None:
        if self.interpreted:  # call, keep nothing
          outs, lse = part(self.earlier, block)
          return (
            tuple(jnp.where(jnp.isnan(o), 0.0, 0.0) for o in outs),
            jnp.where(jnp.isnan(lse), _EMPTY, _EMPTY),
          )
        return (
          tuple(jnp.zeros(o_shape, acc) for _ in range(maps)),
          jnp.full((b, h, maps, t), _EMPTY, acc),
        )
      *outs, lse = blocks.forward(*self.block_args(case, qs_k, lam_BxHxT, seg, block))
      lse = jnp.where(jnp.isinf(lse), _EMPTY, lse.astype(acc))
      return (
        tuple(_pad_rows(o.astype(acc), ax, case[0], t) for o in outs),
        _pad_rows(lse, 3, case[0], t, _EMPTY),
      )

    def step(i, block, stats):
      return block, _merge(blocks, stats, self.by_source(me, i, part, block))

    kv = (tuple(blocks.layout(k) for k in ks), blocks.layout(v), seg)
    _, (outs, lse) = _around_the_ring(
      step, kv, part(self.first, kv), self.axis, self.num_shards, in_order=self.interpreted
    )
    lse = jnp.where(lse <= 0.5 * _EMPTY, jnp.inf, lse)  # rows that saw no key at all
    combined = outs[0] if maps == 1 else outs[0] - blocks.per_row(lam_BxHxT) * outs[1]
    out = blocks.layout(combined).astype(qs[0].dtype)
    return out, (qs, ks, v, lam, seg, outs, lse)

  def backward(self, res, d_out_BxTxHxDv):
    blocks, t, ax = self.blocks, self.t, self.blocks.seq_axis
    qs, ks, v, lam, seg, outs, lse = res
    me = jax.lax.axis_index(self.axis)
    acc, qs_k, lam_BxHxT = self.local(qs, lam)
    d_out = blocks.layout(d_out_BxTxHxDv)
    d_out_acc = d_out.astype(acc)
    deltas = tuple(blocks.row_sums(d_out_acc * o) for o in outs)
    d_out = d_out.astype(qs[0].dtype)

    def part(case, block):
      ks_blk, v_blk = block[:2]
      if case is None:
        if self.interpreted:  # call, keep nothing
          zero = lambda x: jnp.where(jnp.isnan(x), 0.0, 0.0)
          return jax.tree.map(zero, part(self.earlier, block))
        return (
          tuple(jnp.zeros(q.shape, acc) for q in qs_k),
          tuple(jnp.zeros(k.shape, acc) for k in ks_blk),
          jnp.zeros(v_blk.shape, acc),
        )
      q_rows, k_rows = case[:2]
      dqs, dks, dv = blocks.backward(
        *self.block_args(case, qs_k, lam_BxHxT, seg, block),
        _rows(d_out, ax, q_rows),
        _rows(lse, 3, q_rows),
        *(_rows(dl, 2, q_rows) for dl in deltas),
      )
      up = lambda x, rows: _pad_rows(x.astype(acc), ax, rows, t)
      dqs = tuple(up(dq, q_rows) for dq in dqs)
      return dqs, tuple(up(dk, k_rows) for dk in dks), up(dv, k_rows)

    add = lambda a, b_: jax.tree.map(jnp.add, a, b_)

    def step(i, block, dqs):
      dq_s, dk_s, dv_s = self.by_source(me, i, part, block[:3])
      return (*block[:3], add(block[3], dk_s), block[4] + dv_s), add(dqs, dq_s)

    kv = (tuple(blocks.layout(k) for k in ks), blocks.layout(v), seg)
    dqs, dks, dv = part(self.first, kv)
    block, dqs = _around_the_ring(
      step, (*kv, dks, dv), dqs, self.axis, self.num_shards, lagging=2, in_order=self.interpreted
    )
    dks, dv = block[3:]
    if self.num_shards > 1:  # a block's accumulators finish one device before its owner
      dks, dv = shift_to_next((dks, dv), self.axis, self.num_shards)
    dqs = tuple(blocks.layout(dq).astype(q.dtype) for dq, q in zip(dqs, qs))
    dks = tuple(blocks.layout(dk).astype(k.dtype) for dk, k in zip(dks, ks))
    dlam = None if blocks.maps == 1 else jnp.transpose(-deltas[1], (0, 2, 1)).astype(lam.dtype)
    return dqs, dks, blocks.layout(dv).astype(v.dtype), dlam, None


def _merge(blocks: BlockFunctions, a, b):
  """Two blocks' (normalized outputs, log-sum-exps) merged map by map, as flash attention
  merges tiles."""
  (outs_a, lse_a), (outs_b, lse_b) = a, b
  m = jnp.maximum(lse_a, lse_b)
  wa, wb = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
  total = wa + wb
  col = lambda x, i: blocks.per_row(x[:, :, i])
  outs = tuple(
    (oa * col(wa, i) + ob * col(wb, i)) / col(total, i)
    for i, (oa, ob) in enumerate(zip(outs_a, outs_b))
  )
  return outs, m + jnp.log(total)
