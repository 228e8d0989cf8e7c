"""Backward kernel of grouped differential attention: every gradient in one pass per chunk.

The noise map is scored once per group; its one dS2 gives dQ2 and the group's summed dK2.
Design: docs/kernels_tpu.md, "Grouped differential attention".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from diffjax.kernels.tpu import _backward as diff_bwd
from diffjax.kernels.tpu import _layout as layout


def stat_rows(r: int) -> dict[str, int]:
  """The first row of each statistic in the row-statistics slabs (``"rows"``: their
  count, padded to 8): lse of the r signal maps then the noise map, D_c, D_lam, lam_c."""
  rows = {"lse": 0, "d1": r + 1, "d_lam": 2 * r + 1, "lam": 2 * r + 2}
  rows["rows"] = layout.round_up(3 * r + 2, 8)
  return rows


def _backward_kernel(*refs, plan, chunk):
  refs = list(refs)
  r, nq = plan.signal, chunk.num_q_blocks
  rows_of = stat_rows(r)
  t, j, kv_first, kv_last = diff_bwd.step_tables(plan, chunk, refs)
  q_seg_ref, kv_seg_ref = (refs.pop(0), refs.pop(0)) if plan.segmented else (None, None)
  n_k = 1 if plan.shared_k else 2
  take = lambda n: tuple(refs.pop(0) for _ in range(n))
  q1_ref, q2_ref = take(2)  # [r, bq, D], [bq, D]
  k_refs = take(n_k)
  v_ref, do_ref, stats_ref = take(3)  # do: [r, bq, Dv]
  dk_prev, dv_prev = (take(n_k), refs.pop(0)) if chunk.prev_kv_blocks else (None, None)
  dk_refs = take(n_k)
  dv_ref = refs.pop(0)
  dq1_ref, dq2_ref = take(2)  # the group's [G r, rows, D] and [G, rows, D]
  dk_acc, dv_acc, dq1_acc, dq2_acc = refs

  head = t // nq  # the noise head's place in the kv group
  i = chunk.first + t % nq  # the query tile in the whole sequence (masks)
  rows = pl.ds(pl.multiple_of(t % nq * plan.block_q, plan.block_q), plan.block_q)

  kv_refs = (dk_acc, dv_acc)
  init = diff_bwd.init_kv_accumulators
  pl.when(kv_first)(functools.partial(init, chunk, j, dk_prev, dv_prev, *kv_refs))

  def add_dq(acc, index, value):
    # Key tile 0 is the first visited one of every query tile.
    @pl.when(j == 0)
    def _():
      acc[index, rows, :] = value

    @pl.when(j > 0)
    def _():
      acc[index, rows, :] += value

  def step(apply_mask: bool):
    keep = plan.mask(i, j, q_seg_ref, kv_seg_ref) if apply_mask else None
    stats = jnp.transpose(stats_ref[...])  # [bq, rows]
    col = lambda row: stats[:, row : row + 1]
    k1, k2 = k_refs[0][...], k_refs[-1][...]
    v, q2 = v_ref[...], q2_ref[...]
    probs = functools.partial(layout.probs, plan, keep=keep)

    p2 = probs(q2, k2, lse=col(rows_of["lse"] + r))
    dp_lam = None
    for c in range(r):
      q1, do = q1_ref[c], do_ref[c]
      lam = col(rows_of["lam"] + c)
      p1 = probs(q1, k1, lse=col(rows_of["lse"] + c))
      dp = layout.dot_nt(do, v)
      dv_acc[...] += layout.dot_tn((p1 - lam * p2).astype(do.dtype), do)
      ds1 = (p1 * (dp - col(rows_of["d1"] + c))).astype(q1.dtype)
      dk_acc[0] += layout.dot_tn(ds1, q1)
      add_dq(dq1_acc, head * r + c, layout.dot_nn(ds1, k1) * plan.scale)
      dp_lam = lam * dp if dp_lam is None else dp_lam + lam * dp
    ds2 = (-p2 * (dp_lam - col(rows_of["d_lam"]))).astype(q2.dtype)
    dk_acc[n_k - 1] += layout.dot_tn(ds2, q2)
    add_dq(dq2_acc, head, layout.dot_nn(ds2, k2) * plan.scale)

    # The last key tile that adds to query tile i (always visited, see Plan.block_visible).
    last_j = plan.last_visible_kv_block(i) if plan.causal else plan.num_kv_blocks - 1

    @pl.when(j == last_j)
    def _():
      for c in range(r):
        dq1_ref[head * r + c, rows, :] = dq1_acc[head * r + c, rows, :].astype(dq1_ref.dtype)
      dq2_ref[head, rows, :] = dq2_acc[head, rows, :].astype(dq2_ref.dtype)

  for condition, apply_mask in plan.tile_cases(i, j):
    pl.when(condition)(functools.partial(step, apply_mask))

  write = diff_bwd.write_kv_grads
  pl.when(kv_last)(functools.partial(write, plan, chunk, dk_refs, dv_ref, *kv_refs))


def _backward_budget(plan, chunk, b, n_rows, widths, n_k, stat_rows, itemsize, out_item):
  """(VMEM bytes, the compiler's cost estimate) of one backward chunk."""
  d, dv_width = widths
  r, n_kv, bq, bk = plan.signal, plan.kv_heads, plan.block_q, plan.block_kv
  nkv = chunk.num_kv_blocks
  vmem = diff_bwd.step_vmem_bytes(
    bq,
    bk,
    d,
    dv_width,
    itemsize,
    n_k,
    out_item=out_item,
    partials_in=bool(chunk.prev_kv_blocks),
    r=r,
  ) + n_rows * diff_bwd.dq_row_bytes(plan.group, d, itemsize, r)
  visible = 0.5 if plan.causal else 1.0
  steps = b * plan.heads * chunk.num_q_blocks * nkv * visible
  kv_bytes = n_k * bk * d + bk * dv_width
  return vmem, pl.CostEstimate(
    flops=int(steps * bq * bk * (r * (8 * d + 4 * dv_width) + 6 * d)),
    transcendentals=int(steps * bq * bk * (r + 1)),
    bytes_accessed=int(
      b * n_kv * nkv * kv_bytes * (itemsize + out_item)
      + b * plan.heads * (r + 1) * 2 * n_rows * d * itemsize
      + steps * bq * (itemsize * ((r + 1) * d + r * dv_width) + 4 * stat_rows)
    ),
  )


def _backward_chunk(plan, chunk, n_rows: int, prev, *, args, widths, interpret):
  (q1, q2), ks, v, do, stats, q_seg, kv_seg = args
  d, dv_width = widths
  b, n_kv = q1.shape[0], plan.kv_heads
  r, g, n_k = plan.signal, plan.group, len(ks)
  bq, bk = plan.block_q, plan.block_kv
  nq, nkv = chunk.num_q_blocks, chunk.num_kv_blocks

  grid, coords, prefetch = diff_bwd.backward_grid(plan, chunk, b)
  spec, tile = layout.grid_specs(plan, coords)
  q_block = lambda t: chunk.first + t % nq
  noise = lambda g_, t: g_ * g + t // nq  # the noise head in the whole layer
  signal = lambda width: spec(
    (None, r, bq, width), lambda b_, g_, j, t: (b_, noise(g_, t), q_block(t), 0)
  )
  in_specs, call_args = [], []
  if plan.segmented:
    in_specs += layout.segment_specs(plan, spec, lambda g_, j, t: q_block(t), lambda g_, j, t: j)
    call_args += [q_seg, kv_seg]
  key_tile = lambda width: tile(bk, width, lambda b_, g_, j, t: (b_, g_, j))
  in_specs += [
    signal(d),
    tile(bq, d, lambda b_, g_, j, t: (b_, noise(g_, t), q_block(t))),
    *[key_tile(d)] * n_k,
    key_tile(dv_width),
    signal(dv_width),
    spec(
      (None, None, None, stats.shape[3], bq),
      lambda b_, g_, j, t: (b_, noise(g_, t), q_block(t), 0, 0),
    ),
  ]
  call_args += [q1, q2, *ks, v, do, stats]
  prev_specs, prev_args = diff_bwd.previous_partials(plan, chunk, tile, widths, n_k, prev)
  in_specs, call_args = in_specs + prev_specs, call_args + prev_args

  out_kv = (ks[0].dtype, v.dtype) if chunk.final else (jnp.float32, jnp.float32)
  sp_c = nkv * bk
  # dQ: the kv group's heads over the chunk; the block moves only with the leading axis.
  group_block = lambda heads: plan.group_spec(
    n_rows, d, heads, lambda bg, *_: (bg // n_kv, bg % n_kv)
  )
  out_specs = [key_tile(d)] * n_k + [key_tile(dv_width), group_block(g * r), group_block(g)]
  out_shape = [jax.ShapeDtypeStruct(plan.shape(b, n_kv, sp_c, d), out_kv[0])] * n_k + [
    jax.ShapeDtypeStruct(plan.shape(b, n_kv, sp_c, dv_width), out_kv[1]),
    jax.ShapeDtypeStruct(plan.shape(b, plan.heads * r, n_rows, d), q1.dtype),
    jax.ShapeDtypeStruct(plan.shape(b, plan.heads, n_rows, d), q2.dtype),
  ]
  itemsize = q1.dtype.itemsize
  out_item = itemsize if chunk.final else 4  # partial dK and dV sums stay float32
  vmem, cost = _backward_budget(
    plan, chunk, b, n_rows, widths, n_k, stats.shape[3], itemsize, out_item
  )
  outs = layout.call(
    functools.partial(_backward_kernel, plan=plan, chunk=chunk),
    call_args,
    grid=grid,
    prefetch=prefetch,
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    scratch=[
      pltpu.VMEM((n_k, bk, d), jnp.float32),
      pltpu.VMEM((bk, dv_width), jnp.float32),
      pltpu.VMEM((g * r, n_rows, d), jnp.float32),
      pltpu.VMEM((g, n_rows, d), jnp.float32),
    ],
    semantics=("parallel",) + ("arbitrary",) * (len(grid) - 1),
    vmem=vmem,
    cost=cost,
    interpret=interpret,
    name="gda_attention_bwd",
  )
  return tuple(outs[:n_k]), outs[n_k], tuple(outs[n_k + 1 :])


def backward(plan, qs, ks, v, q_seg, kv_seg, do, stats, *, widths, interpret):
  """Runs the backward kernel on padded head-major arrays, one call per query chunk.

  Args:
    qs (q1 [B, H, Tp, D], q2 [B, N, Tp, D]), ks, v, q_seg, kv_seg, widths: as for
      :func:`diffjax.kernels.tpu._gda_forward.forward`.
    do: [B, H, Tp, Dv] output cotangent in q's dtype.
    stats: float32 lane-dense slabs [B, N, Tp / block_q, R, block_q], rows as
      :func:`stat_rows`.
  Returns:
    ((dq1, dq2), dks, dv) over Tp query rows, in the inputs' dtypes.
  """
  args = (qs, ks, v, do, stats, q_seg, kv_seg)
  return diff_bwd.run_chunks(plan, _backward_chunk, args, qs, v, widths=widths, interpret=interpret)
