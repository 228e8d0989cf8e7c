"""Context-parallel attention: the sequence axis of q, k and v sharded over a mesh axis.

A ring of key/value blocks (:mod:`diffjax.ops.ring`) or gathered keys and values; the
load-balanced order is :func:`zigzag_permutation`. Design: docs/scaling.md, "Context parallelism".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from diffjax import sharding
from diffjax.core import validation
from diffjax.core.dtypes import accumulation_dtype
from diffjax.core.op_specs import OpSpec
from diffjax.ops import dispatch, ring_blocks
from diffjax.ops.ring import make_ring

__all__ = ["STRATEGIES", "context_parallel_attention", "inverse_permutation", "zigzag_permutation"]

STRATEGIES = ("ring", "all_gather")
AxisName = str | tuple[str, ...] | None

# ------------------------------------------------------------------------------------------
# Sequence order.


def zigzag_permutation(length: int, num_shards: int) -> np.ndarray:
  """The load-balanced causal order of ``length`` positions over ``num_shards`` shards.

  The sequence splits into ``2 * num_shards`` equal chunks; shard i holds chunk i, then
  chunk ``2 * num_shards - 1 - i``. Apply it as ``x[:, perm]``: shard i then gets
  ``permuted[:, i * T / C:(i + 1) * T / C]``, and ``perm[p]`` is the original position of
  permuted position p.

  Returns:
    int32 [length].
  """
  length, num_shards = int(length), int(num_shards)
  if num_shards <= 0:
    raise ValueError(f"num_shards must be positive; got {num_shards}.")
  if length <= 0 or length % (2 * num_shards):
    raise ValueError(
      f"The load-balanced order needs the length ({length}) to be a positive "
      f"multiple of 2 * num_shards = {2 * num_shards} (two equal chunks per "
      "shard). Pad the sequence or use load_balance=False."
    )
  chunk = length // (2 * num_shards)
  chunks_CxL = np.arange(length, dtype=np.int32).reshape(2 * num_shards, chunk)
  order = [c for i in range(num_shards) for c in (i, 2 * num_shards - 1 - i)]
  return chunks_CxL[order].reshape(length)


def inverse_permutation(perm) -> np.ndarray:
  """The permutation that undoes ``perm``: ``x[:, perm][:, inverse_permutation(perm)] == x``."""
  perm = np.asarray(perm)
  if perm.ndim != 1 or not np.array_equal(np.sort(perm), np.arange(perm.size)):
    raise ValueError(f"perm must be a permutation of range({perm.size}); got {perm!r}.")
  inv = np.empty_like(perm, dtype=np.int32)
  inv[perm] = np.arange(perm.size, dtype=np.int32)
  return inv


def _original_positions(shard, num_shards: int, t_local: int, load_balance: bool):
  """int32 [t_local]: original sequence positions of the tokens that shard ``shard`` holds.

  ``shard`` may be traced (the device's index on the context axis).
  """
  j = jnp.arange(t_local, dtype=jnp.int32)
  shard = jnp.asarray(shard, jnp.int32)
  if not load_balance:
    return shard * t_local + j
  chunk = t_local // 2
  first = shard * chunk + j
  second = (2 * num_shards - 1 - shard) * chunk + (j - chunk)
  return jnp.where(j < chunk, first, second)


# ------------------------------------------------------------------------------------------
# The global-view op.


def _axis_names(axes: AxisName) -> tuple[str, ...]:
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def _axis_size(mesh: Mesh, axes: AxisName, what: str) -> int:
  names = _axis_names(axes)
  for n in names:
    if n not in mesh.shape:
      raise ValueError(
        f"{what}={axes!r} names mesh axis {n!r}, which the mesh (axes "
        f"{tuple(mesh.shape)}) does not have."
      )
  return math.prod(mesh.shape[n] for n in names)


def _spec(op: OpSpec | str, arrays) -> OpSpec:
  spec = op if isinstance(op, OpSpec) else dispatch.OPS.get(op)
  if spec is None or spec.decode:
    raise ValueError(f"Unknown op {op!r}; expected one of {tuple(dispatch.OPS)} (no decode op).")
  if len(arrays) != len(spec.arrays):
    raise ValueError(
      f"op {spec.name!r} takes {len(spec.arrays)} arrays {spec.arrays} (the positional "
      f"arguments of its reference function); got {len(arrays)}."
    )
  spec.check(*arrays)
  return spec


def _ring_row(spec: OpSpec, implementation: str, strategy: str, interpret, probe: dict):
  """The dispatch row whose per-block functions compute the ring, or None for the XLA
  blocks: the first candidate of ``implementation`` that is not refused, when it has
  per-block functions (its ``block_config`` may refuse the block with
  ``NotImplementedError``); raises when a kernel asked for by name refuses."""
  rows = dispatch.candidates(spec.name, implementation, interpret)
  named = implementation not in ("auto", "xla")
  if named and strategy != "ring":
    raise ValueError(
      f"implementation={implementation!r} runs the kernels per block of the ring; "
      f"strategy={strategy!r} has no blocks. Use strategy='ring' or implementation='xla'."
    )
  tried = []
  for row in rows:
    if row == dispatch.XLA or strategy != "ring":
      break
    if row.ring_blocks is None:  # a kernel without per-block functions: XLA blocks
      break
    reason = dispatch.refusal(row, probe["query"], None)
    if reason is None:
      try:
        row.ring_blocks.block_config(**row.ring_options, **probe["config"])
        return row
      except NotImplementedError as e:
        reason = str(e)
    tried.append(f"{row.name} refuses: {reason}")
  if named and tried:
    raise ValueError(
      f"implementation={implementation!r} cannot compute the ring blocks of {spec.name!r} ("
      + "; ".join(tried)
      + "). Use implementation='xla'."
    )
  return None


def context_parallel_attention(
  op: OpSpec | str,
  arrays: Sequence[jax.Array],
  *,
  mesh: Mesh,
  context_axis: str = "context",
  batch_axis: AxisName = None,
  head_axis: AxisName = None,
  strategy: str = "ring",
  load_balance: bool = True,
  causal: bool = True,
  segment_ids: jax.Array | None = None,
  scale: float | None = None,
  implementation: str = "xla",
  block_sizes=None,
  interpret=False,
) -> jax.Array:
  """Exact self-attention with the sequence axis sharded over ``context_axis``.

  Args:
    op: the op's :class:`~diffjax.core.op_specs.OpSpec`, or its name.
    arrays: the op's positional arrays (self-attention: keys as long as the queries, T).
    mesh: the device mesh.
    context_axis: the mesh axis that shards the length (C devices; T a multiple of C, of
      2C with ``load_balance``).
    batch_axis, head_axis: mesh axis names (or tuples, or None) that shard the batch and
      the heads (in contiguous blocks: the head axis size must divide the kv heads).
    strategy: "ring" (key/value blocks pass around the devices) or "all_gather".
    load_balance: the inputs (every per-token array, segment ids included) and the output
      are in :func:`zigzag_permutation` order; the causal mask follows the original order.
    causal, segment_ids, scale: as in :func:`diffjax.ops.run_op` (one [B, T] id array).
    implementation: chosen as the ops choose; a row with per-block functions computes each
      block of the ring, anything else the XLA tile. A kernel named explicitly must run here
      (or with ``interpret=True``) and take the blocks.
    block_sizes, interpret: passed to the kernels.
  Returns:
    [B, T, H, Dv] in the dtype of the queries, in the inputs' (permuted) order.
  """
  arrays = tuple(jnp.asarray(a) for a in arrays)
  spec = _spec(op, arrays)
  if strategy not in STRATEGIES:
    raise ValueError(f"Unknown strategy {strategy!r}; expected one of {STRATEGIES}.")
  if not isinstance(context_axis, str):
    raise ValueError(f"context_axis must be one mesh axis name; got {context_axis!r}.")
  q, v = spec.query(arrays), arrays[spec.value]
  segment_ids = _check_segment_ids(segment_ids, q.shape[0], q.shape[1])
  c = _check_layout(spec, arrays, mesh, context_axis, batch_axis, head_axis, load_balance)
  scale = validation.default_scale(scale, q.shape[-1])
  arrays = spec.to_kernel(arrays)
  heads = spec.split_maps(tuple(arrays[i] for i in spec.queries))[0].shape[2]
  probe = {
    "query": q,
    "config": dict(
      t=q.shape[1] // c,
      s=q.shape[1] // c,
      d=q.shape[-1],
      dv=v.shape[-1],
      heads=heads,
      kv_heads=v.shape[2],
      causal=causal,
      segmented=segment_ids is not None,
      scale=scale,
      block_sizes=block_sizes,
      interpret=interpret,
      dtype=q.dtype,
    ),
  }
  row = _ring_row(spec, implementation, strategy, interpret, probe)
  with_seg = segment_ids is not None
  in_specs, x_spec = sharding.kernel_partition_specs(
    spec.axes, batch_axis, head_axis, segment_ids=with_seg, length_axis=context_axis
  )
  if strategy == "all_gather":
    per_device = _all_gather_fn(spec, c, context_axis, load_balance, causal, scale, with_seg)
  else:
    per_device = _ring_fn(spec, row, probe["config"], c, context_axis, load_balance, with_seg)
  fn = jax.shard_map(
    per_device,
    mesh=mesh,
    in_specs=in_specs[: len(arrays) + with_seg],
    out_specs=x_spec,
    check_vma=False,
  )
  return fn(*arrays, *((segment_ids,) if with_seg else ()))


def _check_segment_ids(segment_ids, b: int, t: int):
  if segment_ids is None:
    return None
  if isinstance(segment_ids, (tuple, list)):
    raise ValueError(
      "Context-parallel attention takes one [batch, length] segment id array "
      "(self-attention), not a (q_ids, kv_ids) pair."
    )
  segment_ids = jnp.asarray(segment_ids)
  validation.split_segment_ids(segment_ids, b, t, t)
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise ValueError(f"segment_ids must be integers; got dtype {segment_ids.dtype}.")
  return segment_ids


def _check_layout(spec, arrays, mesh, context_axis, batch_axis, head_axis, load_balance) -> int:
  """The context axis size C, after checking that the mesh splits the arrays evenly."""
  q, k = spec.query(arrays), spec.key(arrays)
  b, t = q.shape[:2]
  if k.shape[1] != t:
    raise ValueError(
      f"Context-parallel attention is self-attention: queries and keys must "
      f"have the same length; got {t} and {k.shape[1]}."
    )
  c = _axis_size(mesh, context_axis, "context_axis")
  batch_shards = _axis_size(mesh, batch_axis, "batch_axis")
  head_shards = _axis_size(mesh, head_axis, "head_axis")
  used = [context_axis, *_axis_names(batch_axis), *_axis_names(head_axis)]
  if len(set(used)) != len(used):
    raise ValueError(
      f"context_axis, batch_axis and head_axis must name different mesh axes; "
      f"got {context_axis!r}, {batch_axis!r}, {head_axis!r}."
    )
  parts = 2 * c if load_balance else c
  if t % parts:
    raise ValueError(
      f"The length ({t}) must be a multiple of {parts} ("
      f"{'2 * ' if load_balance else ''}the context axis size {c}"
      f"{', two chunks per shard' if load_balance else ''})."
    )
  if b % batch_shards:
    raise ValueError(
      f"The batch ({b}) must be a multiple of the batch shards ({batch_shards}: mesh axes "
      f"{_axis_names(batch_axis)}). Use a batch that is a multiple of {batch_shards}, or a "
      "mesh with fewer devices on those axes."
    )
  if k.shape[2] % head_shards:
    raise ValueError(
      f"num_kv_heads={k.shape[2]} must be a multiple of the head shards ({head_shards}: mesh "
      f"axes {_axis_names(head_axis)}) so that every shard holds whole kv groups with the "
      "heads that read them. Use a mesh whose head axes span a divisor of "
      f"{k.shape[2]} devices."
    )
  return c


def _all_gather_fn(spec, c, context_axis, load_balance, causal, scale, with_seg):
  """One device's attention after gathering the whole sequence's keys and values."""
  gathered = set(spec.keys) | {spec.value}

  def per_device(*local):
    seg = local[-1] if with_seg else None
    xs = local[:-1] if with_seg else local
    t_local = xs[0].shape[1]
    t = t_local * c
    q_pos = _original_positions(jax.lax.axis_index(context_axis), c, t_local, load_balance)
    # The gathered keys are in the inputs' order: the permutation itself.
    k_pos = jnp.asarray(zigzag_permutation(t, c) if load_balance else np.arange(t), jnp.int32)
    gather = lambda x: jax.lax.all_gather(x, context_axis, axis=1, tiled=True)
    mask = (k_pos[None, :] <= q_pos[:, None]) if causal else None
    segs = None if seg is None else (seg, gather(seg))
    xs = tuple(gather(x) if i in gathered else x for i, x in enumerate(xs))
    return spec.reference(*xs, causal=False, segment_ids=segs, mask=mask, scale=scale)

  return per_device


def _ring_fn(spec, row, config, c, context_axis, load_balance, with_seg):
  """One device's ring attention: key and value blocks pass around the context axis, each
  computed by ``row``'s per-block functions (XLA's without a row)."""
  causal, interpret = config["causal"], config["interpret"]

  def per_device(*local):
    seg = local[-1] if with_seg else None
    xs = local[:-1] if with_seg else local
    bl, tl = xs[0].shape[:2]
    qs = tuple(xs[i] for i in spec.queries)
    ks = tuple(xs[i] for i in spec.keys)
    heads = spec.split_maps(qs)[0].shape[2]  # this shard's
    if row is None:
      blocks = ring_blocks.xla_blocks(spec, config["scale"])
    else:
      local_dims = dict(heads=heads, kv_heads=xs[spec.value].shape[2])
      blocks = ring_blocks.kernel_blocks(row, **{**config, **local_dims})
    lam = None
    if spec.lam is not None:
      lam = spec.lam_per_token(xs[spec.lam], bl, tl, heads)
      lam = lam.astype(accumulation_dtype(qs[0].dtype))
    ring = make_ring(
      blocks,
      axis=context_axis,
      num_shards=c,
      load_balance=load_balance,
      causal=causal,
      length=tl,
      heads=heads,
      interpret=interpret,
    )
    return ring(qs, ks, xs[spec.value], lam, seg)

  return per_device
