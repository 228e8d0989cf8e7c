"""Forward kernel: both softmax maps of a DIFF head (or V2 pair) in one pass.

Each step loads the K/V tiles once for both maps' online softmax; a query tile's last step
writes ``out = acc_1 / l_1 - lam acc_2 / l_2`` and, for the backward, ``o2`` and the
lane-dense log-sum-exps. The grid and its causal form: docs/kernels_tpu.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from diffjax.kernels.tpu import _layout as layout


def pop_leading_refs(plan: layout.Plan, refs: list):
  """Pops a forward kernel's step tables (causal), lambda and segment-id refs (None when
  not segmented) and reads its step: (i, j, first, last, lam_ref, q_seg_ref, kv_seg_ref)."""
  if plan.causal:
    i, j, first, last = layout.pop_step_tables(refs)
  else:
    i, j = pl.program_id(1), pl.program_id(2)
    first, last = j == 0, j == plan.num_kv_blocks - 1
  lam_ref = refs.pop(0)
  q_seg_ref, kv_seg_ref = (refs.pop(0), refs.pop(0)) if plan.segmented else (None, None)
  return i, j, first, last, lam_ref, q_seg_ref, kv_seg_ref


def _forward_kernel(*refs, plan: layout.Plan, save_residuals: bool):
  refs = list(refs)
  i, j, first, last, lam_ref, q_seg_ref, kv_seg_ref = pop_leading_refs(plan, refs)
  q_refs = (refs.pop(0), refs.pop(0))
  k_refs = (refs.pop(0),) * 2 if plan.shared_k else (refs.pop(0), refs.pop(0))
  v_ref, out_ref = refs[:2]
  o2_ref, lse_ref = refs[2:4] if save_residuals else (None, None)
  m_ref, l_ref, acc_ref = refs[-3:]

  h = pl.program_id(0) % plan.heads
  pl.when(first)(functools.partial(layout.init_softmax, m_ref, l_ref, acc_ref))

  def accumulate(apply_mask: bool):
    keep = plan.mask(i, j, q_seg_ref, kv_seg_ref) if apply_mask else None
    v = v_ref[...]
    for c in range(2):
      s = layout.scores(plan, q_refs[c][...], k_refs[c][...], keep)
      layout.online_softmax_step(m_ref, l_ref, acc_ref, c, s, v)

  for condition, apply_mask in plan.tile_cases(i, j):
    pl.when(condition)(functools.partial(accumulate, apply_mask))

  @pl.when(last)
  def _finish():
    outs, lses = zip(*(layout.finish_softmax(m_ref, l_ref, acc_ref, c) for c in range(2)))
    lam = jnp.transpose(lam_ref[...]) if plan.lam_rows else lam_ref[h]  # [bq, 1]
    out_ref[...] = (outs[0] - lam * outs[1]).astype(out_ref.dtype)
    if save_residuals:
      o2_ref[...] = outs[1].astype(o2_ref.dtype)
      # Columns lse_1, lse_2 of a [bq, 128] tile, transposed to the rows of the slab.
      lane = jax.lax.broadcasted_iota(jnp.int32, (plan.block_q, 128), 1)
      lse_ref[...] = jnp.transpose(jnp.where(lane == 0, lses[0], lses[1]))[:2]


def vmem_bytes(bq: int, bk: int, d: int, dv: int, itemsize: int, key_components: int, r: int = 1):
  """The forward's VMEM estimate for one step: both buffers of every tile (the r + 1 query
  heads, the key components, V, r + 1 output rows) and the float32 softmax states, scores
  and probabilities (r: the grouped kernel's signal heads a noise head; DIFF: 1)."""
  tiles = 2 * itemsize * ((r + 1) * bq * d + key_components * bk * d + bk * dv + (r + 1) * bq * dv)
  return tiles + 4 * ((r + 1) * bq * dv + 2 * (r + 1) * bq * 128 + 4 * bq * bk)


def leading_inputs(plan: layout.Plan, spec, heads_block, lam, q_seg, kv_seg):
  """BlockSpecs and arrays of a forward call's first inputs: lambda (float32 [H] in SMEM,
  or lane-dense rows whose block takes ``heads_block`` of the heads axis) and the segment
  ids when segmented; ``spec`` a :func:`_layout.grid_specs` maker of the call's grid."""
  if plan.lam_rows:
    lam_spec = spec((None, *heads_block, 1, plan.block_q), lambda b_, h_, i, j: (b_, h_, i, 0, 0))
  else:
    lam_spec = pl.BlockSpec(memory_space=pltpu.SMEM)
  if not plan.segmented:
    return [lam_spec], [lam]
  seg_specs = layout.segment_specs(plan, spec, lambda h_, i, j: i, lambda h_, i, j: j)
  return [lam_spec, *seg_specs], [lam, q_seg, kv_seg]


def _in_specs(plan: layout.Plan, spec, tile, qs, ks, v, lam, q_seg, kv_seg, widths):
  """The call's input BlockSpecs and arrays, in the kernel's argument order; ``spec`` and
  ``tile`` are :func:`_layout.grid_specs` makers of the call's grid."""
  d, dv = widths
  bq, bk, g = plan.block_q, plan.block_kv, plan.group
  in_specs, args = leading_inputs(plan, spec, (None, None), lam, q_seg, kv_seg)
  for c in range(2):
    array, _ = plan.q_head(c, 0)
    in_specs.append(tile(bq, d, lambda b_, h_, i, j, c=c: (b_, plan.q_head(c, h_)[1], i)))
    args.append(qs[array])
  for k in ks:
    in_specs.append(tile(bk, d, lambda b_, h_, i, j: (b_, h_ // g, j)))
    args.append(k)
  in_specs.append(tile(bk, dv, lambda b_, h_, i, j: (b_, h_ // g, j)))
  args.append(v)
  return in_specs, args


def _outputs(plan: layout.Plan, spec, tile, b: int, tp: int, dv: int, dtype, save_residuals: bool):
  """The call's output shapes and BlockSpecs: out, then o2 and lse with ``save_residuals``."""
  h, bq = plan.heads, plan.block_q
  row_spec = tile(bq, dv, lambda b_, h_, i, j: (b_, h_, i))
  out_shape = [jax.ShapeDtypeStruct(plan.shape(b, h, tp, dv), dtype)]
  out_specs = [row_spec]
  if save_residuals:
    out_shape += [
      jax.ShapeDtypeStruct(plan.shape(b, h, tp, dv), dtype),
      jax.ShapeDtypeStruct((b, h, plan.num_q_blocks, 2, bq), jnp.float32),
    ]
    out_specs += [row_spec, spec((None, None, None, 2, bq), lambda b_, h_, i, j: (b_, h_, i, 0, 0))]
  return out_shape, out_specs


def _cost(plan: layout.Plan, qs, ks, v, widths, save_residuals: bool) -> pl.CostEstimate:
  """The call's FLOPs, exponentials and HBM bytes, for XLA's scheduling."""
  ax = plan.seq_axis
  b, tp, sp = qs[0].shape[0], qs[0].shape[ax], ks[0].shape[ax]
  d, dv = widths
  h, g = plan.heads, plan.group
  itemsize = qs[0].dtype.itemsize
  visible = 0.5 if plan.causal else 1.0
  kv_size = sum(k.size for k in ks) + v.size
  return pl.CostEstimate(
    flops=int(visible * b * h * tp * sp * (4 * d + 4 * dv)),
    transcendentals=int(visible * b * h * tp * sp * 2),
    bytes_accessed=int(
      itemsize * (2 * b * h * tp * d + b * h * tp * (1 + save_residuals) * dv)
      + itemsize * kv_size * plan.num_q_blocks * g
    ),
  )


def forward(
  plan: layout.Plan,
  qs,
  ks,
  v,
  lam,
  q_seg,
  kv_seg,
  *,
  widths: tuple[int, int],
  save_residuals: bool,
  interpret,
):
  """Runs the forward kernel on padded head-major arrays (``_layout``).

  Args:
    qs: the query arrays (V1 two [B, H, Tp, D], V2 one [B, 2H, Tp, D]), ks: the key
      arrays (V1 two, V2 one) [B, K, Sp, D], v [B, K, Sp, Dv];
      lam float32 [H] or lane-dense rows [B, H, Tp / block_q, 1, block_q]; q_seg
      [B, Tp, 1] / kv_seg [B, 1, Sp] int32 or None; widths: (D, Dv) of one head.
  Returns:
    out [B, H, Tp, Dv] in q's dtype; with ``save_residuals``
    (for the backward) also o2 (the same) and lse float32 [B, H, Tp / block_q, 2,
    block_q], else None, None.
  """
  ax = plan.seq_axis
  b, tp, sp = qs[0].shape[0], qs[0].shape[ax], ks[0].shape[ax]
  d, dv = widths
  h, bq, bk = plan.heads, plan.block_q, plan.block_kv
  dtype = qs[0].dtype
  assert tp == plan.q_len_padded and sp == plan.kv_len_padded, (qs[0].shape, v.shape, plan)

  grid, coords, prefetch = layout.forward_grid(plan, b, h)
  spec, tile = layout.grid_specs(plan, coords)
  in_specs, args = _in_specs(plan, spec, tile, qs, ks, v, lam, q_seg, kv_seg, widths)
  out_shape, out_specs = _outputs(plan, spec, tile, b, tp, dv, dtype, save_residuals)
  outs = layout.call(
    functools.partial(_forward_kernel, plan=plan, save_residuals=save_residuals),
    args,
    grid=grid,
    prefetch=prefetch,
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    scratch=[
      pltpu.VMEM((2, bq, 1), jnp.float32),
      pltpu.VMEM((2, bq, 1), jnp.float32),
      pltpu.VMEM((2, bq, dv), jnp.float32),
    ],
    # The last axis carries the online softmax from step to step; the others are independent.
    semantics=("parallel",) * (len(grid) - 1) + ("arbitrary",),
    vmem=vmem_bytes(bq, bk, d, dv, dtype.itemsize, len(ks)),
    cost=_cost(plan, qs, ks, v, widths, save_residuals),
    interpret=interpret,
    name="diff_attention_fwd",
  )
  return (*outs, None, None)[:3]
