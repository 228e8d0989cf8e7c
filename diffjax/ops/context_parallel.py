"""Context-parallel attention: the sequence axis of q, k and v sharded over a mesh axis.

For long sequences the length axis is split over C devices (the mesh axis named
``context``); every device holds T / C query and key positions. Two strategies compute
exact self-attention (the math of :mod:`diffjax.core.reference`) for the baseline, DIFF
V1 and DIFF V2:

  * ``"all_gather"``: each device gathers the whole sequence's keys and values (with
    their segment ids) and attends with its own queries. Simple; K and V of the full
    sequence sit on every device.
  * ``"ring"``: the key/value blocks travel around the ring of C devices
    (``jax.lax.ppermute``), one hop per step, and each softmax map keeps its own
    online-softmax statistics, combined only at the end (:mod:`diffjax.ops.ring`). A
    device holds its T / C queries and one T / C block of keys and values at a time.
    What computes each block is ``implementation``: ``"xla"`` scores the block as one
    tile per head (choose C so that a [T / C, T / C] tile fits); ``"pallas_tpu"`` or
    ``"pallas_gpu"`` (what the ops choose for DIFF V1 and V2 on a TPU or GPU) runs the
    per-block functions of the kernel that the dispatch table registers, or the XLA
    blocks when that kernel has none (:mod:`diffjax.ops.ring_blocks`).

Load balance. With causal masking, the late positions attend to many more keys than
the early ones, so contiguous shards give the last device most of the work. With
``load_balance=True`` the caller holds the sequence in the order of
:func:`zigzag_permutation` (2C chunks; shard i holds chunks i and 2C-1-i), which gives
every device the same amount of unmasked work. All per-token arrays (tokens,
positions, segment ids, DIFF V2's lambda) go in that order and the output comes out in
it; the causal mask still follows the original order: the ring derives which part of
each key block a device's queries see from the two shard indices, the gather from the
original positions of its queries.

The batch and head axes may be sharded as well (``batch_axis``, ``head_axis``), heads
in contiguous blocks that keep kv groups whole, as in
:mod:`diffjax.sharding.kernel_specs`.

Computation runs in float32 (float64 for float64 inputs,
:func:`diffjax.core.dtypes.accumulation_dtype`); the output has the dtype of q.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from diffjax.core import reference as ref
from diffjax.core import validation as _v
from diffjax.core.dtypes import accumulation_dtype
from diffjax.ops import dispatch
from diffjax.ops import ring_blocks as rb
from diffjax.ops.ring import make_ring

__all__ = [
  "OPS",
  "STRATEGIES",
  "context_parallel_attention",
  "inverse_permutation",
  "zigzag_permutation",
]

OPS = ("mha", "diff_v1", "diff_v2")
STRATEGIES = ("ring", "all_gather")
BLOCK_IMPLEMENTATIONS = ("xla", "pallas_tpu", "pallas_gpu")
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


def _check_inputs(op: str, arrays: Sequence[jax.Array]) -> None:
  counts = {"mha": 3, "diff_v1": 6, "diff_v2": 4}
  if op not in counts:
    raise ValueError(f"Unknown op {op!r}; expected one of {OPS}.")
  if len(arrays) != counts[op]:
    raise ValueError(
      f"op {op!r} takes {counts[op]} arrays (the positional arguments of its "
      f"reference function); got {len(arrays)}."
    )
  {"mha": _v.check_mha, "diff_v1": _v.check_diff_v1, "diff_v2": _v.check_diff_v2}[op](*arrays)


def _ring_blocks_of(op: str, implementation: str, strategy: str, interpret, dtype):
  """The per-block functions of the kernel the dispatch table registers for ``op`` and
  ``implementation``, or None for the XLA blocks (``"xla"``, or no such kernel or none
  with per-block functions in this installation); raises when the choice cannot run."""
  if implementation not in BLOCK_IMPLEMENTATIONS:
    raise ValueError(
      f"implementation={implementation!r} is not one of "
      f"{BLOCK_IMPLEMENTATIONS} (what computes each block of the ring)."
    )
  if implementation == "xla":
    return None
  name = f"implementation={implementation!r}"
  if op == "mha":
    raise ValueError(
      f"{name} runs the fused DIFF kernels per ring block; the baseline "
      "('mha') has no fused kernel of ours. Use implementation='xla'."
    )
  if strategy != "ring":
    raise ValueError(
      f"{name} runs the kernels per block of the ring; strategy={strategy!r} "
      "has no blocks. Use strategy='ring' or implementation='xla'."
    )
  if jnp.dtype(dtype) == jnp.float64:
    raise ValueError("The kernels accumulate in float32; float64 inputs need implementation='xla'.")
  platform = implementation.removeprefix("pallas_")
  # Compiling ahead of time for a TPU on a CPU host counts as the TPU (target_platform).
  if not interpret and platform not in (jax.default_backend(), dispatch.current_platform()):
    raise ValueError(
      f"{name} needs a {platform.upper()} (the backend is "
      f"{jax.default_backend()!r}); pass interpret=True to run the kernels "
      "in the Pallas interpreter, or use implementation='xla'."
    )
  return rb.registered_ring_blocks(op, implementation)


def context_parallel_attention(
  op: str,
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
    op: "mha", "diff_v1" or "diff_v2".
    arrays: the positional arguments of the op's reference function:
      mha ``(q [B,T,H,D], k [B,T,K,D], v [B,T,K,Dv])``; diff_v1 ``(q1, q2, k1, k2, v,
      lam)`` with lam a scalar or [H]; diff_v2 ``(q [B,T,2H,D], k, v, lam [B,T,H])``.
      Self-attention only: keys and queries have the same length T.
    mesh: the device mesh.
    context_axis: the mesh axis that shards the length axis (C devices; T must be a
      multiple of C, of 2C with ``load_balance``).
    batch_axis, head_axis: mesh axis names (or tuples of names, or None) that shard the
      batch and the heads. Heads split in contiguous blocks, so the head axis size must
      divide K (kv heads): every shard holds whole kv groups with their query heads.
    strategy: "ring" (K/V blocks pass around the devices; one T / C block at a time) or
      "all_gather" (every device gathers the full K/V).
    load_balance: the inputs (every per-token array, segment ids included) are in the
      order of :func:`zigzag_permutation` ``(T, C)``, and so is the output. The causal
      mask follows the original order either way.
    causal: causal masking by original position.
    segment_ids: None or int [B, T] (packed documents; same order as the inputs).
    scale: score scale, default 1/sqrt(D).
    implementation: what computes each ring step: "xla" (the score tile of the block,
      any op and dtype), "pallas_tpu" or "pallas_gpu" (the per-block functions of the
      DIFF V1 / V2 kernel the dispatch table registers for that platform, or the XLA
      blocks if it has none; ring strategy only; off that platform only with
      ``interpret=True``).
    block_sizes, interpret: passed to the kernels.
  Returns:
    [B, T, H, Dv] in the dtype of the queries, in the inputs' (permuted) order.
  """
  arrays = tuple(jnp.asarray(a) for a in arrays)
  _check_inputs(op, arrays)
  if strategy not in STRATEGIES:
    raise ValueError(f"Unknown strategy {strategy!r}; expected one of {STRATEGIES}.")
  kernel = _ring_blocks_of(op, implementation, strategy, interpret, arrays[0].dtype)
  if not isinstance(context_axis, str):
    raise ValueError(f"context_axis must be one mesh axis name; got {context_axis!r}.")
  q, k = arrays[0], arrays[2 if op == "diff_v1" else 1]
  b, t, _, d = q.shape
  kh = k.shape[2]
  if k.shape[1] != t:
    raise ValueError(
      f"Context-parallel attention is self-attention: queries and keys must "
      f"have the same length; got {t} and {k.shape[1]}."
    )
  if segment_ids is not None:
    if isinstance(segment_ids, (tuple, list)):
      raise ValueError(
        "Context-parallel attention takes one [batch, length] segment id array "
        "(self-attention), not a (q_ids, kv_ids) pair."
      )
    segment_ids = jnp.asarray(segment_ids)
    _v.split_segment_ids(segment_ids, b, t, t)
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"segment_ids must be integers; got dtype {segment_ids.dtype}.")

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
    raise ValueError(f"The batch ({b}) must be a multiple of the batch shards ({batch_shards}).")
  if kh % head_shards:
    raise ValueError(
      f"num_kv_heads={kh} must be a multiple of the head shards ({head_shards}) "
      "so that every shard holds whole kv groups with the heads that read them."
    )
  scale = _v.default_scale(scale, d)
  acc = accumulation_dtype(q.dtype)

  x_spec = P(batch_axis, context_axis, head_axis, None)
  seg_spec = P(batch_axis, context_axis)
  if op == "mha":
    specs = (x_spec,) * 3
  elif op == "diff_v1":
    h = q.shape[2]
    lam_H = jnp.broadcast_to(arrays[5].astype(acc), (h,))
    arrays = (*arrays[:5], lam_H)
    specs = (x_spec,) * 5 + (P(head_axis),)
  else:
    specs = (x_spec,) * 3 + (P(batch_axis, context_axis, head_axis),)
  with_seg = segment_ids is not None
  if with_seg:
    arrays = (*arrays, segment_ids)
    specs = (*specs, seg_spec)

  def per_device_all_gather(*local):
    seg = local[-1] if with_seg else None
    xs = local[:-1] if with_seg else local
    me = jax.lax.axis_index(context_axis)
    t_local = xs[0].shape[1]
    q_pos = _original_positions(me, c, t_local, load_balance)
    # The gathered keys are in the inputs' order: the permutation itself.
    k_pos = jnp.asarray(zigzag_permutation(t, c) if load_balance else np.arange(t), jnp.int32)
    gather = lambda x: jax.lax.all_gather(x, context_axis, axis=1, tiled=True)
    mask = (k_pos[None, :] <= q_pos[:, None]) if causal else None
    segs = None if seg is None else (seg, gather(seg))
    kw = dict(causal=False, segment_ids=segs, mask=mask, scale=scale)
    if op == "mha":
      q_, k_, v_ = xs
      return ref.mha_reference(q_, gather(k_), gather(v_), **kw)
    if op == "diff_v1":
      q1, q2, k1, k2, v_, lam_ = xs
      return ref.diff_v1_reference(q1, q2, gather(k1), gather(k2), gather(v_), lam_, **kw)
    q_, k_, v_, lam_ = xs
    return ref.diff_v2_reference(q_, gather(k_), gather(v_), lam_, **kw)

  def per_device_ring(*local):
    seg = local[-1] if with_seg else None
    xs = local[:-1] if with_seg else local
    bl, tl = xs[0].shape[:2]
    if op == "diff_v1":
      q1, q2, k1, k2, v_, lam_H = xs
      qs, ks, heads = (q1, q2), (k1, k2), q1.shape[2]
      lam_BxTxH = jnp.broadcast_to(lam_H[None, None, :], (bl, tl, heads))
    else:
      qs, ks, v_ = (xs[0],), (xs[1],), xs[2]
      heads = xs[0].shape[2] // (2 if op == "diff_v2" else 1)
      lam_BxTxH = xs[3] if op == "diff_v2" else None
    if kernel is None:
      blocks = rb.xla_blocks(op, scale)
    else:
      blocks = rb.kernel_blocks(
        kernel,
        version=1 if op == "diff_v1" else 2,
        d=d,
        dv=v_.shape[3],
        heads=heads,
        kv_heads=v_.shape[2],
        segmented=with_seg,
        scale=scale,
        block_sizes=block_sizes,
        interpret=interpret,
      )
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
    return ring(qs, ks, v_, None if lam_BxTxH is None else lam_BxTxH.astype(acc), seg)

  per_device = per_device_all_gather if strategy == "all_gather" else per_device_ring
  fn = jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=x_spec, check_vma=False)
  return fn(*arrays)
