"""Backward kernel: one pass over the tiles for every gradient of both maps.

The queries go in chunks whose dQ stays in VMEM (:func:`chunk_rows`), one call each.
Design: docs/kernels_tpu.md, "What the fused TPU kernels do".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from diffjax.kernels.tpu import _layout as layout

# Rows of the row-statistics slabs (columns once transposed in the kernel).
_LSE1, _LSE2, _D1, _D2, _LAM = 0, 1, 2, 3, 4
ROW_STATS = 8

# VMEM for a chunk's dQ: the float32 accumulator and both pipeline buffers of the
# output block [G, 2, chunk, D] (with the step's tiles, about 32 MiB in all at D = 128,
# under the 64 MiB limit `_layout.vmem_limit` may request).
DQ_VMEM_BUDGET = 24 * 2**20
_LANES = 128


def dq_row_bytes(group: int, head_dim: int, itemsize: int, r: int = 1) -> int:
  """VMEM bytes per query row of a chunk's dQ: the float32 accumulator and the two
  output buffers in the input dtype, [G, r + 1, ., D] each with D on (padded to) 128 lanes
  (r: the grouped kernel's signal heads a noise head; DIFF: 1, two components a head)."""
  return group * (r + 1) * layout.round_up(head_dim, _LANES) * (4 + 2 * itemsize)


def chunk_rows(plan: layout.Plan, head_dim: int, itemsize: int) -> int:
  """Query rows per chunk (a multiple of the tile): ``plan.dq_chunk`` when set, else
  the fewest chunks whose dQ fits DQ_VMEM_BUDGET, of balanced length. At least one
  tile, so a kv group too wide for the budget still runs, past it."""
  tp, bq = plan.q_len_padded, plan.block_q
  if plan.dq_chunk is not None:
    if plan.dq_chunk % bq:
      raise ValueError(
        f"dq_chunk={plan.dq_chunk} must be a multiple of the backward query tile ({bq})."
      )
    return min(plan.dq_chunk, tp)
  most = DQ_VMEM_BUDGET // dq_row_bytes(plan.group, head_dim, itemsize, plan.signal) // bq * bq
  n = -(-tp // max(most, bq))
  return layout.round_up(-(-tp // n), bq)


def step_vmem_bytes(
  bq: int,
  bk: int,
  d: int,
  dv: int,
  itemsize: int,
  key_components: int,
  *,
  out_item: int,
  partials_in: bool,
  r: int = 1,
) -> int:
  """The backward's VMEM estimate for one step, without the chunk's dQ: both buffers of
  every tile (the r + 1 query heads, K, V, r dO rows, the stats slab, the dK/dV outputs in
  ``out_item`` bytes and, with ``partials_in``, the previous chunk's float32 partial sums),
  the float32 dK/dV accumulators and r + 7 float32 [bq, bk] temporaries (r: the grouped
  kernel's signal heads a noise head; DIFF: 1)."""
  kv_tile = key_components * bk * d + bk * dv
  stat_rows = layout.round_up(3 * r + 2, 8)  # ROW_STATS for DIFF
  tiles = (
    2 * itemsize * ((r + 1) * bq * d + kv_tile + r * bq * dv)
    + 2 * out_item * kv_tile
    + 2 * 4 * stat_rows * layout.round_up(bq, _LANES)
    + (2 * 4 * kv_tile if partials_in else 0)
  )
  return tiles + 4 * (kv_tile + (r + 7) * bq * bk)


@dataclasses.dataclass(frozen=True)
class Chunk:
  """One kernel call: query tiles [first, first + num_q_blocks), key tiles
  [0, num_kv_blocks); the previous chunk's partial dK/dV cover key tiles
  [0, prev_kv_blocks) (0: the first chunk); ``final``: writes the input dtype."""

  first: int
  num_q_blocks: int
  num_kv_blocks: int
  prev_kv_blocks: int
  final: bool


def chunks(plan: layout.Plan, rows: int) -> list[Chunk]:
  """The calls that cover the padded queries with chunks of ``rows`` rows."""
  per = rows // plan.block_q
  out, prev = [], 0
  for first in range(0, plan.num_q_blocks, per):
    n = min(per, plan.num_q_blocks - first)
    if plan.causal:  # Plan.last_visible_kv_block of the chunk's last tile, in Python
      last_q = (first + n) * plan.block_q - 1 + plan.causal_offset
      nkv = min(max(last_q // plan.block_kv, 0), plan.num_kv_blocks - 1) + 1
    else:
      nkv = plan.num_kv_blocks
    final = first + n == plan.num_q_blocks
    assert not final or nkv == plan.num_kv_blocks, (plan, first, nkv)
    out.append(Chunk(first, n, nkv, prev, final))
    prev = nkv
  return out


def chunk_steps(plan: layout.Plan, chunk: Chunk) -> tuple[np.ndarray, np.ndarray]:
  """The causal grid of one call: int32 scalar-prefetch tables, per step the inner index
  t = head * chunk.num_q_blocks + (query tile - chunk.first) and the key tile with the
  flags of its first and last step (``_layout.pack_kv_step``). Key tile outer, then the
  kv group's heads, then the chunk's query tiles visited with that key tile
  (``Plan.visited_tiles``; every key tile of the call has one)."""
  nq = chunk.num_q_blocks
  seen = plan.visited_tiles()[chunk.first : chunk.first + nq, : chunk.num_kv_blocks]
  j, t = [], []
  for jj in range(chunk.num_kv_blocks):
    rows = np.flatnonzero(seen[:, jj])
    assert len(rows), (plan, chunk, jj)
    for head in range(plan.group):
      t.append(head * nq + rows)
      j.append(np.full(len(rows), jj))
  t, j = np.concatenate(t), np.concatenate(j)
  first = layout.run_edges(j, first=True)
  last = layout.run_edges(j, first=False)
  return t.astype(np.int32), layout.pack_kv_step(j, first, last)


def backward_grid(plan: layout.Plan, chunk: Chunk, batch: int):
  """The grid of one call, its block coordinates and scalar-prefetch tables: batch and kv
  groups share the leading parallel axis (see :func:`_layout.forward_grid`), then key tiles
  and the inner index t (causal: the flat schedule of :func:`chunk_steps`);
  ``coords(*grid)`` gives (batch, kv group, key tile, t)."""
  n_kv = plan.kv_heads
  if plan.causal:
    t_steps, kv_steps = chunk_steps(plan, chunk)

    def coords(bg, step, t_ref, kv_ref):
      return bg // n_kv, bg % n_kv, layout.unpack_kv_step(kv_ref[step])[0], t_ref[step]

    return (batch * n_kv, len(t_steps)), coords, [jnp.asarray(t_steps), jnp.asarray(kv_steps)]

  def coords(bg, j, t):
    return bg // n_kv, bg % n_kv, j, t

  return (batch * n_kv, chunk.num_kv_blocks, plan.group * chunk.num_q_blocks), coords, []


def step_tables(plan: layout.Plan, chunk: Chunk, refs: list):
  """Pops a kernel's step tables (causal) and reads its step: (t, key tile j, first and
  last step of the key tile)."""
  if plan.causal:
    return layout.pop_step_tables(refs)
  j, t = pl.program_id(1), pl.program_id(2)
  return t, j, t == 0, t == plan.group * chunk.num_q_blocks - 1


def init_kv_accumulators(chunk: Chunk, j, dk_prev, dv_prev, dk_acc, dv_acc):
  """Starts key tile j's dK and dV: zero, or the previous chunk's partial sums."""

  def zero():
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
    dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

  if dk_prev is None:
    zero()
    return

  @pl.when(j < chunk.prev_kv_blocks)
  def _():
    for c, ref in enumerate(dk_prev):
      dk_acc[c] = ref[...]
    dv_acc[...] = dv_prev[...]

  pl.when(j >= chunk.prev_kv_blocks)(zero)


def write_kv_grads(plan: layout.Plan, chunk: Chunk, dk_refs, dv_ref, dk_acc, dv_acc):
  """Writes key tile j's dK and dV after its last step."""
  for c, ref in enumerate(dk_refs):
    # The last chunk writes the gradient, the others the unscaled float32 partial.
    ref[...] = (dk_acc[c] * plan.scale).astype(ref.dtype) if chunk.final else dk_acc[c]
  dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def previous_partials(plan: layout.Plan, chunk: Chunk, tile, widths, n_k: int, prev):
  """BlockSpecs and arrays of the previous chunk's partial dK, dV (none for the first)."""
  if not chunk.prev_kv_blocks:
    return [], []
  d, dv_width = widths
  last_prev = chunk.prev_kv_blocks - 1
  # Key tiles the previous chunk did not see keep its last block (no copy).
  prev_tile = lambda width: tile(
    plan.block_kv, width, lambda b_, g_, j, t: (b_, g_, jnp.minimum(j, last_prev))
  )
  return [prev_tile(d)] * n_k + [prev_tile(dv_width)], list(prev[0]) + [prev[1]]


def run_chunks(plan: layout.Plan, backward_chunk, args, qs, v, *, widths, interpret):
  """Runs ``backward_chunk(plan, chunk, n_rows, prev, args=, widths=, interpret=)`` ->
  (dks, dv, dqs) on padded head-major arrays (queries qs, values v) over the query chunks
  of :func:`chunk_rows` rows, each after the one whose partial dK, dV it continues;
  returns (dqs over all rows, dks, dv)."""
  tp, sp = qs[0].shape[plan.seq_axis], v.shape[plan.seq_axis]
  assert tp == plan.q_len_padded and sp == plan.kv_len_padded, (qs[0].shape, v.shape, plan)
  dq_parts, prev = [], None
  for chunk in chunks(plan, chunk_rows(plan, widths[0], qs[0].dtype.itemsize)):
    n_rows = chunk.num_q_blocks * plan.block_q
    dks, dv, dqs = backward_chunk(
      plan, chunk, n_rows, prev, args=args, widths=widths, interpret=interpret
    )
    dq_parts.append(dqs)
    prev = (dks, dv)
  if len(dq_parts) == 1:
    return dq_parts[0], dks, dv
  dqs = tuple(jnp.concatenate(parts, axis=plan.seq_axis) for parts in zip(*dq_parts))
  return dqs, dks, dv


def _backward_kernel(*refs, plan: layout.Plan, chunk: Chunk):
  # One function: its stages share the refs popped here and read top to bottom.
  refs = list(refs)
  nq = chunk.num_q_blocks
  t, j, kv_first, kv_last = step_tables(plan, chunk, refs)
  lam_ref = None if plan.lam_rows else refs.pop(0)
  q_seg_ref, kv_seg_ref = (refs.pop(0), refs.pop(0)) if plan.segmented else (None, None)
  n_k = 1 if plan.shared_k else 2
  n_dq = 1 if plan.q_in_one_array else 2
  take = lambda n: tuple(refs.pop(0) for _ in range(n))
  q_refs = take(2)
  k_refs = take(n_k)
  v_ref, do_ref, stats_ref = take(3)
  dk_prev, dv_prev = (take(n_k), refs.pop(0)) if chunk.prev_kv_blocks else (None, None)
  dk_refs = take(n_k)
  dv_ref = refs.pop(0)
  # dq_refs: the group's output blocks over the chunk; dq_acc [G, 2, chunk, D] float32.
  dq_refs = take(n_dq)
  dk_acc, dv_acc, dq_acc = refs

  bg = pl.program_id(0)
  head = t // nq  # the head's place in the kv group
  h = bg % plan.kv_heads * plan.group + head
  i = chunk.first + t % nq  # the query tile in the whole sequence (masks)
  rows = pl.ds(pl.multiple_of(t % nq * plan.block_q, plan.block_q), plan.block_q)

  kv_refs = (dk_acc, dv_acc)
  pl.when(kv_first)(functools.partial(init_kv_accumulators, chunk, j, dk_prev, dv_prev, *kv_refs))

  def gradients(apply_mask: bool):
    """Accumulates dK and dV of tile (i, j); returns its dQ_1, dQ_2 [block_q, D]."""
    keep = plan.mask(i, j, q_seg_ref, kv_seg_ref) if apply_mask else None
    stats = jnp.transpose(stats_ref[...])  # [bq, ROW_STATS]
    lam = stats[:, _LAM : _LAM + 1] if plan.lam_rows else lam_ref[h]
    q1, q2 = q_refs[0][...], q_refs[1][...]
    k1, k2 = k_refs[0][...], k_refs[-1][...]
    v, do = v_ref[...], do_ref[...]

    p1 = layout.probs(plan, q1, k1, keep, stats[:, _LSE1 : _LSE1 + 1])
    p2 = layout.probs(plan, q2, k2, keep, stats[:, _LSE2 : _LSE2 + 1])
    dp = layout.dot_nt(do, v)
    dv_acc[...] += layout.dot_tn((p1 - lam * p2).astype(do.dtype), do)
    ds1 = (p1 * (dp - stats[:, _D1 : _D1 + 1])).astype(q1.dtype)
    ds2 = ((-lam) * p2 * (dp - stats[:, _D2 : _D2 + 1])).astype(q2.dtype)
    if plan.shared_k:
      dk_acc[0] += layout.dot_tn(ds1, q1) + layout.dot_tn(ds2, q2)
    else:
      dk_acc[0] += layout.dot_tn(ds1, q1)
      dk_acc[1] += layout.dot_tn(ds2, q2)
    return layout.dot_nn(ds1, k1) * plan.scale, layout.dot_nn(ds2, k2) * plan.scale

  # The last key tile that adds to query tile i (always visited, see Plan.block_visible).
  last_j = plan.last_visible_kv_block(i) if plan.causal else plan.num_kv_blocks - 1

  def step(apply_mask: bool):
    dq1, dq2 = gradients(apply_mask)

    # Key tile 0 is the first visited one of every query tile.
    @pl.when(j == 0)
    def _():
      dq_acc[head, 0, rows, :] = dq1
      dq_acc[head, 1, rows, :] = dq2

    @pl.when(j > 0)
    def _():
      dq_acc[head, 0, rows, :] += dq1
      dq_acc[head, 1, rows, :] += dq2

    @pl.when(j == last_j)
    def _():
      for c in range(2):
        value = dq_acc[head, c, rows, :].astype(dq_refs[0].dtype)
        if plan.q_in_one_array:  # V2: heads 2r, 2r + 1 of the group's block
          dq_refs[0][2 * head + c, rows, :] = value
        else:
          dq_refs[c][head, rows, :] = value

  for condition, apply_mask in plan.tile_cases(i, j):
    pl.when(condition)(functools.partial(step, apply_mask))

  pl.when(kv_last)(functools.partial(write_kv_grads, plan, chunk, dk_refs, dv_ref, *kv_refs))


def _in_specs(plan: layout.Plan, chunk: Chunk, spec, tile, args, prev, widths):
  """The call's input BlockSpecs and arrays, in the kernel's argument order; ``spec`` and
  ``tile`` are :func:`_layout.grid_specs` makers of the call's grid."""
  lam, qs, ks, v, do, stats, q_seg, kv_seg = args
  d, dv_width = widths
  bq, bk, g = plan.block_q, plan.block_kv, plan.group
  nq, n_k = chunk.num_q_blocks, len(ks)

  def q_block(j, t):
    return chunk.first + t % nq

  def head(g_, t):
    return g_ * g + t // nq

  in_specs, call_args = [], []
  if not plan.lam_rows:
    in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    call_args.append(lam)
  if plan.segmented:
    in_specs += layout.segment_specs(plan, spec, lambda g_, j, t: q_block(j, t), lambda g_, j, t: j)
    call_args += [q_seg, kv_seg]
  for c in range(2):
    in_specs.append(
      tile(bq, d, lambda b_, g_, j, t, c=c: (b_, plan.q_head(c, head(g_, t))[1], q_block(j, t)))
    )
    call_args.append(qs[plan.q_head(c, 0)[0]])
  key_tile = lambda width: tile(bk, width, lambda b_, g_, j, t: (b_, g_, j))
  in_specs += [key_tile(d)] * n_k + [
    key_tile(dv_width),
    tile(bq, dv_width, lambda b_, g_, j, t: (b_, head(g_, t), q_block(j, t))),
    spec(
      (None, None, None, ROW_STATS, bq), lambda b_, g_, j, t: (b_, head(g_, t), q_block(j, t), 0, 0)
    ),
  ]
  call_args += [*ks, v, do, stats]
  prev_specs, prev_args = previous_partials(plan, chunk, tile, widths, n_k, prev)
  return in_specs + prev_specs, call_args + prev_args


def _outputs(plan: layout.Plan, chunk: Chunk, tile, rows: int, qs, ks, v, widths):
  """The call's output BlockSpecs and shapes: dK (one per key array) and dV over the key
  tiles the chunk sees, then dQ over its ``rows``."""
  d, dv_width = widths
  b, h, n_kv = qs[0].shape[0], plan.heads, plan.kv_heads
  bk, g, n_k = plan.block_kv, plan.group, len(ks)
  dtype = qs[0].dtype
  out_kv = (ks[0].dtype, v.dtype) if chunk.final else (jnp.float32, jnp.float32)
  sp_c = chunk.num_kv_blocks * bk
  key_tile = lambda width: tile(bk, width, lambda b_, g_, j, t: (b_, g_, j))
  out_specs = [key_tile(d)] * n_k + [key_tile(dv_width)]
  out_shape = [jax.ShapeDtypeStruct(plan.shape(b, n_kv, sp_c, d), out_kv[0])] * n_k + [
    jax.ShapeDtypeStruct(plan.shape(b, n_kv, sp_c, dv_width), out_kv[1])
  ]
  # dQ: the kv group's heads over the chunk. The index moves only with the leading axis,
  # so the block stays in VMEM over the (j, t) sweep.
  if plan.q_in_one_array:
    out_specs.append(plan.group_spec(rows, d, 2 * g, lambda bg, *_: (bg // n_kv, bg % n_kv)))
    out_shape.append(jax.ShapeDtypeStruct(plan.shape(b, 2 * h, rows, d), dtype))
  else:
    out_specs += [plan.group_spec(rows, d, g, lambda bg, *_: (bg // n_kv, bg % n_kv))] * 2
    out_shape += [jax.ShapeDtypeStruct(plan.shape(b, h, rows, d), dtype)] * 2
  return out_specs, out_shape


def _vmem_and_cost(plan: layout.Plan, chunk: Chunk, rows: int, b: int, n_k: int, widths, itemsize):
  """The call's VMEM estimate in bytes and its cost estimate."""
  d, dv_width = widths
  bq, bk, g = plan.block_q, plan.block_kv, plan.group
  h, n_kv = plan.heads, plan.kv_heads
  nq, nkv = chunk.num_q_blocks, chunk.num_kv_blocks
  kv_tile = n_k * bk * d + bk * dv_width
  out_item = itemsize if chunk.final else 4
  vmem = step_vmem_bytes(
    bq, bk, d, dv_width, itemsize, n_k, out_item=out_item, partials_in=bool(chunk.prev_kv_blocks)
  ) + rows * dq_row_bytes(g, d, itemsize)
  visible = 0.5 if plan.causal else 1.0
  steps = b * h * nq * nkv * visible  # visible (query tile, key tile) pairs, roughly
  cost = pl.CostEstimate(
    flops=int(steps * bq * bk * (12 * d + 4 * dv_width)),
    transcendentals=int(steps * bq * bk * 2),
    bytes_accessed=int(
      b * n_kv * nkv * kv_tile * (itemsize + out_item)
      + (4 * b * n_kv * chunk.prev_kv_blocks * kv_tile)
      + b * h * 2 * rows * d * itemsize
      + steps * bq * (itemsize * (2 * d + dv_width) + 4 * ROW_STATS)
    ),
  )
  return vmem, cost


def _backward_chunk(plan: layout.Plan, chunk: Chunk, rows: int, prev, *, args, widths, interpret):
  """One kernel call; returns (dks, dv, dqs): dks and dqs tuples like ks and qs, dq over
  the chunk's rows in q's dtype; the final dK, dV for the last chunk, float32 partial
  sums over its key tiles otherwise."""
  qs, ks, v = args[1:4]
  d, dv_width = widths
  b, n_k, dtype = qs[0].shape[0], len(ks), qs[0].dtype
  grid, coords, prefetch = backward_grid(plan, chunk, b)
  spec, tile = layout.grid_specs(plan, coords)
  in_specs, call_args = _in_specs(plan, chunk, spec, tile, args, prev, widths)
  out_specs, out_shape = _outputs(plan, chunk, tile, rows, qs, ks, v, widths)
  vmem, cost = _vmem_and_cost(plan, chunk, rows, b, n_k, widths, dtype.itemsize)
  outs = layout.call(
    functools.partial(_backward_kernel, plan=plan, chunk=chunk),
    call_args,
    grid=grid,
    prefetch=prefetch,
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    scratch=[
      pltpu.VMEM((n_k, plan.block_kv, d), jnp.float32),
      pltpu.VMEM((plan.block_kv, dv_width), jnp.float32),
      pltpu.VMEM((plan.group, 2, rows, d), jnp.float32),
    ],
    semantics=("parallel",) + ("arbitrary",) * (len(grid) - 1),
    vmem=vmem,
    cost=cost,
    interpret=interpret,
    name="diff_attention_bwd",
  )
  return tuple(outs[:n_k]), outs[n_k], tuple(outs[n_k + 1 :])


def backward(plan: layout.Plan, qs, ks, v, lam, q_seg, kv_seg, do, stats, *, widths, interpret):
  """Runs the backward kernel on padded head-major arrays, one call per query chunk.

  Args:
    qs, ks, v, lam, q_seg, kv_seg, widths: as for
      :func:`diffjax.kernels.tpu._forward.forward` (lam float32 [H] for V1; for V2
      lambda travels in ``stats`` instead).
    do: [B, H, Tp, Dv] output cotangent in q's dtype.
    stats: float32 lane-dense slabs [B, H, Tp / block_q, 8, block_q], rows lse_1,
      lse_2, D_1, D_2, lambda (V2), 0, 0, 0.
  Returns:
    (dqs, dks, dv): like qs (over Tp rows), ks and v, in their dtypes.
  """
  args = (lam, qs, ks, v, do, stats, q_seg, kv_seg)
  return run_chunks(plan, _backward_chunk, args, qs, v, widths=widths, interpret=interpret)
