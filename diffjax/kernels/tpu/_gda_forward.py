"""Forward kernel of grouped differential attention: r signal maps and one noise map.

One program per (batch, noise head, query tile): r + 1 online softmaxes over one kv group's tiles.
Design: docs/kernels_tpu.md, "Grouped differential attention".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from diffjax.kernels.tpu import _forward as diff_fwd
from diffjax.kernels.tpu import _layout as layout


def _forward_kernel(*refs, plan, save_residuals: bool):
  refs = list(refs)
  r = plan.signal
  i, j, first, last, lam_ref, q_seg_ref, kv_seg_ref = diff_fwd.pop_leading_refs(plan, refs)
  q1_ref, q2_ref = refs.pop(0), refs.pop(0)  # [r, bq, D] and [bq, D]
  k1_ref = refs.pop(0)
  k2_ref = k1_ref if plan.shared_k else refs.pop(0)
  v_ref, out_ref = refs.pop(0), refs.pop(0)
  o2_ref, lse_ref = (refs.pop(0), refs.pop(0)) if save_residuals else (None, None)
  m_ref, l_ref, acc_ref = refs  # map c < r: signal head c of the group; map r: the noise

  n = pl.program_id(0) % plan.heads
  pl.when(first)(functools.partial(layout.init_softmax, m_ref, l_ref, acc_ref))

  def accumulate(apply_mask: bool):
    keep = plan.mask(i, j, q_seg_ref, kv_seg_ref) if apply_mask else None
    v = v_ref[...]
    k1 = k1_ref[...]
    k2 = k1 if plan.shared_k else k2_ref[...]
    for c in range(r + 1):
      q, k = (q1_ref[c], k1) if c < r else (q2_ref[...], k2)
      layout.online_softmax_step(m_ref, l_ref, acc_ref, c, layout.scores(plan, q, k, keep), v)

  for condition, apply_mask in plan.tile_cases(i, j):
    pl.when(condition)(functools.partial(accumulate, apply_mask))

  @pl.when(last)
  def _finish():
    outs, lses = zip(*(layout.finish_softmax(m_ref, l_ref, acc_ref, c) for c in range(r + 1)))
    for c in range(r):
      # V2: lambda rows [r, 1, bq] -> [bq, 1]; V1: one float32 per signal head in SMEM.
      lam = jnp.transpose(lam_ref[c]) if plan.lam_rows else lam_ref[n * r + c]
      out_ref[c] = (outs[c] - lam * outs[r]).astype(out_ref.dtype)
    if save_residuals:
      o2_ref[...] = outs[r].astype(o2_ref.dtype)
      # Column c of a [bq, 128] tile holds lse_c; transposed, its first r + 1 rows.
      lane = jax.lax.broadcasted_iota(jnp.int32, (plan.block_q, 128), 1)
      tile = jnp.zeros((plan.block_q, 128), jnp.float32)
      for c in range(r + 1):
        tile = jnp.where(lane == c, lses[c], tile)
      lse_ref[...] = jnp.transpose(tile)[: r + 1]


def forward(plan, qs, ks, v, lam, q_seg, kv_seg, *, widths, save_residuals: bool, interpret):
  """Runs the forward kernel on padded head-major arrays.

  Args:
    plan: a grouped plan (``heads`` = N noise heads, ``signal`` = r).
    qs: q1 [B, H, Tp, D] and q2 [B, N, Tp, D]; ks (V1: k1, k2; V2: k) [B, K, Sp, D],
      v [B, K, Sp, Dv]; lam float32 [H] (V1) or lane-dense rows [B, H, Tp / block_q, 1,
      block_q] (V2); q_seg [B, Tp, 1] / kv_seg [B, 1, Sp] int32 or None.
  Returns:
    out [B, H, Tp, Dv] in q's dtype; with ``save_residuals`` also o2 [B, N, Tp, Dv] and
    the log-sum-exps float32 [B, N, Tp / block_q, r + 1, block_q] (rows: the r signal
    maps, then the noise map), else None, None.
  """
  q1, q2 = qs
  ax = plan.seq_axis
  b, tp, sp = q1.shape[0], q1.shape[ax], ks[0].shape[ax]
  d, dv = widths
  n_heads, r, g = plan.heads, plan.signal, plan.group
  bq, bk = plan.block_q, plan.block_kv
  dtype = q1.dtype
  assert tp == plan.q_len_padded and sp == plan.kv_len_padded, (q1.shape, v.shape, plan)

  grid, coords, prefetch = layout.forward_grid(plan, b, n_heads)
  spec, tile = layout.grid_specs(plan, coords)
  signal = lambda width: spec((None, r, bq, width), lambda b_, n_, i, j: (b_, n_, i, 0))
  # V2: lambda rows of the group's r signal heads [r, 1, bq].
  in_specs, args = diff_fwd.leading_inputs(plan, spec, (r, None), lam, q_seg, kv_seg)
  in_specs += [signal(d), tile(bq, d, lambda b_, n_, i, j: (b_, n_, i))]
  args += [q1, q2]
  kv_tile = lambda width: tile(bk, width, lambda b_, n_, i, j: (b_, n_ // g, j))
  in_specs += [kv_tile(d)] * len(ks) + [kv_tile(dv)]
  args += [*ks, v]

  out_shape = [jax.ShapeDtypeStruct(plan.shape(b, n_heads * r, tp, dv), dtype)]
  out_specs = [signal(dv)]
  if save_residuals:
    out_shape += [
      jax.ShapeDtypeStruct(plan.shape(b, n_heads, tp, dv), dtype),
      jax.ShapeDtypeStruct((b, n_heads, plan.num_q_blocks, r + 1, bq), jnp.float32),
    ]
    out_specs += [
      tile(bq, dv, lambda b_, n_, i, j: (b_, n_, i)),
      spec((None, None, None, r + 1, bq), lambda b_, n_, i, j: (b_, n_, i, 0, 0)),
    ]
  visible = 0.5 if plan.causal else 1.0
  pairs = visible * b * n_heads * (r + 1) * tp * sp  # scored (query, key) pairs
  cost = pl.CostEstimate(
    flops=int(pairs * (2 * d + 2 * dv)),
    transcendentals=int(pairs),
    bytes_accessed=int(
      dtype.itemsize * (b * n_heads * (r + 1) * tp * (d + (1 + save_residuals) * dv))
      + dtype.itemsize * (sum(k.size for k in ks) + v.size) * plan.num_q_blocks * g
    ),
  )
  outs = layout.call(
    functools.partial(_forward_kernel, plan=plan, save_residuals=save_residuals),
    args,
    grid=grid,
    prefetch=prefetch,
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    scratch=[
      pltpu.VMEM((r + 1, bq, 1), jnp.float32),
      pltpu.VMEM((r + 1, bq, 1), jnp.float32),
      pltpu.VMEM((r + 1, bq, dv), jnp.float32),
    ],
    # The last axis carries the online softmax from step to step.
    semantics=("parallel",) * (len(grid) - 1) + ("arbitrary",),
    vmem=diff_fwd.vmem_bytes(bq, bk, d, dv, dtype.itemsize, len(ks), r),
    cost=cost,
    interpret=interpret,
    name="gda_attention_fwd",
  )
  return (*outs, None, None)[:3]
