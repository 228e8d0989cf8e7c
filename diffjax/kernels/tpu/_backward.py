"""Backward kernel: one pass over the tiles for every gradient of both maps.

With P_c the probabilities of map c, dO the output cotangent and the row terms
D_1 = rowsum(dO * O_1), D_2 = rowsum(dO * O_2) (computed by the wrapper):

  dP   = dO V^T                              one matmul shared by both maps
  dV   = (P_1 - lam P_2)^T dO                one matmul on the signed probabilities
  dS_1 = P_1 * (dP - D_1)
  dS_2 = -lam P_2 * (dP - D_2)               (dP_2 = -lam dP)
  dQ_c = scale dS_c K_c,   dK_c = scale dS_c^T Q_c

Grid (B * K, Sp / block_kv, G * Tp / block_q): the key tile j is the outer
sequential axis, and the inner axis walks every query tile of every head of the
kv group, so dK_c and dV accumulate in VMEM over the group's heads (GQA) and are
written once per key tile. dQ needs a sum over key tiles instead, and is float32
[B, H, 2, Tp, D]. It is kept in one of two places (:func:`resident_dq`):

  * VMEM (when both pipeline buffers of the group's block fit DQ_VMEM_BUDGET, e.g.
    up to T = 12288 at D = 128 with one head per group): the output block is the kv
    group's whole [G, 2, Tp, D], its index depends only on the leading grid axis, so
    the pipeline keeps it in VMEM over the group's (j, t) sweep and writes it to HBM
    once, when the leading index moves on. Each step adds into the rows of its query
    tile; the first key tile (always visited) writes instead of adding.
  * HBM (longer sequences): each visited step reads the dQ tile with an explicit
    DMA, adds and writes it back, double-buffered so that the copies overlap the
    matmuls; the first key tile writes without reading, so dQ needs no
    initialisation either.

V2 pairs share one key: both dS_c^T Q_c land in one dK.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from diffjax.kernels.tpu import _layout as L

# SMEM bookkeeping for the dQ copies: active-step counter (picks the buffer slot),
# a pending-write flag per slot, and the dQ tile written by the previous step.
_STEP, _PENDING0, _PENDING1, _PREV_TILE = 0, 1, 2, 3
# Columns of the row-statistics input.
_LSE1, _LSE2, _D1, _D2, _LAM = 0, 1, 2, 3, 4
ROW_STATS = 8

# VMEM for a resident dQ block: both pipeline buffers of the float32 [G, 2, Tp, D]
# block must fit in this (with the step's tiles, about 32 MiB in all at D = 128, under
# the 64 MiB limit `_layout.vmem_limit` may request), else dQ stays in HBM.
DQ_VMEM_BUDGET = 24 * 2**20
_LANES = 128


def dq_block_bytes(group: int, q_len_padded: int, head_dim: int) -> int:
  """VMEM bytes of one buffer of the resident dQ block, float32 [G, 2, Tp, D] with D
  on (padded to) the 128 lanes."""
  return group * 2 * q_len_padded * L.round_up(head_dim, _LANES) * 4


def dq_fits_vmem(group: int, q_len_padded: int, head_dim: int) -> bool:
  """The automatic choice: the block's two pipeline buffers fit DQ_VMEM_BUDGET."""
  return 2 * dq_block_bytes(group, q_len_padded, head_dim) <= DQ_VMEM_BUDGET


def resident_dq(plan: L.Plan, head_dim: int) -> bool:
  """True when the backward for ``plan`` keeps dQ in VMEM (``plan.dq_in_vmem``, or the
  budget when that is None)."""
  if plan.dq_in_vmem is not None:
    return plan.dq_in_vmem
  return dq_fits_vmem(plan.group, plan.q_len_padded, head_dim)


def _backward_kernel(*refs, plan: L.Plan, dq_in_vmem: bool):
  refs = list(refs)
  lam_ref = None if plan.lam_rows else refs.pop(0)
  q_seg_ref, kv_seg_ref = (refs.pop(0), refs.pop(0)) if plan.segmented else (None, None)
  q_ref, k_ref, v_ref, do_ref, stats_ref, dk_ref, dv_ref, dq_ref, dk_acc, dv_acc = refs[:10]
  # dq_ref: the group's VMEM block [G, 2, Tp, D], or the whole HBM array [B, H, 2, Tp, D].
  dq_buf, read_sem, write_sem, state = (None,) * 4 if dq_in_vmem else refs[10:]

  bg, j, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  b, g = bg // plan.kv_heads, bg % plan.kv_heads
  nq = plan.num_q_blocks
  inner = plan.group * nq
  h = g * plan.group + t // nq
  i = t % nq
  rows = pl.ds(pl.multiple_of(i * plan.block_q, plan.block_q), plan.block_q)

  @pl.when(t == 0)
  def _init_kv_accumulators():
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
    dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

  def gradients(apply_mask: bool):
    """Accumulates dK and dV of tile (i, j); returns its dQ_1, dQ_2 [block_q, D]."""
    keep = plan.mask(i, j, q_seg_ref, kv_seg_ref) if apply_mask else None
    stats = stats_ref[...]
    lam = stats[:, _LAM:_LAM + 1] if plan.lam_rows else lam_ref[h]
    q1, q2 = q_ref[0], q_ref[1]
    k1, k2 = k_ref[0], k_ref[0 if plan.shared_k else 1]
    v, do = v_ref[...], do_ref[...]

    def probs(q, k, lse):
      s = L.dot_nt(q, k) * plan.scale
      if keep is not None:
        s = jnp.where(keep, s, L.MASK_VALUE)
      return jnp.exp(s - lse)  # masked entries and fully masked rows give 0

    p1 = probs(q1, k1, stats[:, _LSE1:_LSE1 + 1])
    p2 = probs(q2, k2, stats[:, _LSE2:_LSE2 + 1])
    dp = L.dot_nt(do, v)
    dv_acc[...] += L.dot_tn((p1 - lam * p2).astype(do.dtype), do)
    ds1 = (p1 * (dp - stats[:, _D1:_D1 + 1])).astype(q1.dtype)
    ds2 = ((-lam) * p2 * (dp - stats[:, _D2:_D2 + 1])).astype(q2.dtype)
    if plan.shared_k:
      dk_acc[0] += L.dot_tn(ds1, q1) + L.dot_tn(ds2, q2)
    else:
      dk_acc[0] += L.dot_tn(ds1, q1)
      dk_acc[1] += L.dot_tn(ds2, q2)
    return L.dot_nn(ds1, k1) * plan.scale, L.dot_nn(ds2, k2) * plan.scale

  if dq_in_vmem:
    head = t // nq  # the head's place in the group's block

    def step(apply_mask: bool):
      dq1, dq2 = gradients(apply_mask)

      # Key tile 0 is the first visited one of every query tile (Plan.block_visible).
      @pl.when(j == 0)
      def _():
        dq_ref[head, 0, rows, :] = dq1
        dq_ref[head, 1, rows, :] = dq2

      @pl.when(j > 0)
      def _():
        dq_ref[head, 0, rows, :] += dq1
        dq_ref[head, 1, rows, :] += dq2

    finish = lambda: None
  else:
    step, finish = _dma_update(plan, gradients, dq_ref, dq_buf, read_sem, write_sem, state,
                               b=b, h=h, i=i, j=j, t=t, rows=rows)

  for condition, apply_mask in plan.tile_cases(i, j):
    pl.when(condition)(functools.partial(step, apply_mask))

  @pl.when(t == inner - 1)
  def _write_kv_grads():
    dk_ref[...] = (dk_acc[...] * plan.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)

  finish()


def _dma_update(plan: L.Plan, gradients, dq_hbm, dq_buf, read_sem, write_sem, state, *,
                b, h, i, j, t, rows):
  """The HBM variant of the dQ update. Emits the copy bookkeeping's initialisation and
  returns (step, finish): the step of one visible tile, and what the kernel emits last
  (after the grid's last step, wait for the writes still in flight)."""
  nq = plan.num_q_blocks
  inner = plan.group * nq

  def dq_copy(slot, to_hbm: bool):
    tile = dq_hbm.at[b, h, :, rows, :]
    if to_hbm:
      return pltpu.make_async_copy(dq_buf.at[slot], tile, write_sem.at[slot])
    return pltpu.make_async_copy(tile, dq_buf.at[slot], read_sem.at[slot])

  @pl.when(jnp.logical_and(j == 0, t == 0))
  def _init_copy_state():
    state[_STEP] = 0
    state[_PENDING0] = 0
    state[_PENDING1] = 0
    state[_PREV_TILE] = -1

  def wait_write(slot):
    @pl.when(state[_PENDING0 + slot] == 1)
    def _():
      dq_copy(slot, to_hbm=True).wait()
      state[_PENDING0 + slot] = 0

  def step(apply_mask: bool):
    slot = state[_STEP] % 2
    tile_id = h * nq + i
    # The slot's buffer must be free, and a write of the same dQ tile still in
    # flight from the other slot must land before the tile is read back (consecutive
    # visible steps share a tile when a key tile sees one query tile of the group).
    for s in range(2):
      @pl.when(slot == s)
      def _(s=s):
        wait_write(s)
        @pl.when(state[_PREV_TILE] == tile_id)
        def _():
          wait_write(1 - s)

    @pl.when(j > 0)
    def _():
      dq_copy(slot, to_hbm=False).start()

    dq1, dq2 = gradients(apply_mask)

    @pl.when(j == 0)
    def _():
      dq_buf[slot, 0] = dq1
      dq_buf[slot, 1] = dq2

    @pl.when(j > 0)
    def _():
      dq_copy(slot, to_hbm=False).wait()
      dq_buf[slot, 0] += dq1
      dq_buf[slot, 1] += dq2

    dq_copy(slot, to_hbm=True).start()
    for s in range(2):
      @pl.when(slot == s)
      def _(s=s):
        state[_PENDING0 + s] = 1
    state[_PREV_TILE] = tile_id
    state[_STEP] = state[_STEP] + 1

  def finish():
    @pl.when(jnp.logical_and(j == plan.num_kv_blocks - 1, t == inner - 1))
    def _drain():
      wait_write(0)
      wait_write(1)

  return step, finish


def backward(plan: L.Plan, q, k, v, lam, q_seg, kv_seg, do, stats, *, interpret):
  """Runs the backward kernel on padded head-major arrays.

  Args:
    q, k, v, lam, q_seg, kv_seg: as for :func:`diffjax.kernels.tpu._forward.forward`
      (lam float32 [H] for V1; for V2 lambda travels in ``stats`` instead).
    do: [B, H, Tp, Dv] output cotangent in q's dtype.
    stats: float32 [B, H, Tp, 8], columns lse_1, lse_2, D_1, D_2, lambda (V2), 0...
  Returns:
    dq float32 [B, H, 2, Tp, D], dk [B, K, C, Sp, D] and dv [B, K, Sp, Dv] in the
    dtype of k and v.
  """
  b, h, _, tp, d = q.shape
  n_kv, n_kv_comp, sp = k.shape[1], k.shape[2], k.shape[3]
  dv_width = v.shape[-1]
  bq, bk, g, nq = plan.block_q, plan.block_kv, plan.group, plan.num_q_blocks
  assert tp == plan.q_len_padded and sp == plan.kv_len_padded, (q.shape, k.shape, plan)

  def _spec(block_shape, index_map):
    # Batch and kv groups share the leading parallel axis (see the forward).
    return pl.BlockSpec(block_shape,
                        lambda bg, j, t: index_map(bg // n_kv, bg % n_kv, j, t))

  def q_block(j, t):
    i = t % nq
    # Skipped steps fetch the first visible tile of this head ahead of time.
    return jnp.maximum(i, plan.first_visible_q_block(j)) if plan.causal else i

  def head(g_, t):
    return g_ * g + t // nq

  in_specs, args = [], []
  if not plan.lam_rows:
    in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    args.append(lam)
  if plan.segmented:
    in_specs += [_spec((None, bq, 1), lambda b_, g_, j, t: (b_, q_block(j, t), 0)),
                 _spec((None, 1, bk), lambda b_, g_, j, t: (b_, 0, j))]
    args += [q_seg, kv_seg]
  in_specs += [
      _spec((None, None, 2, bq, d),
                   lambda b_, g_, j, t: (b_, head(g_, t), 0, q_block(j, t), 0)),
      _spec((None, None, n_kv_comp, bk, d), lambda b_, g_, j, t: (b_, g_, 0, j, 0)),
      _spec((None, None, bk, dv_width), lambda b_, g_, j, t: (b_, g_, j, 0)),
      _spec((None, None, bq, dv_width),
                   lambda b_, g_, j, t: (b_, head(g_, t), q_block(j, t), 0)),
      _spec((None, None, bq, ROW_STATS),
                   lambda b_, g_, j, t: (b_, head(g_, t), q_block(j, t), 0)),
  ]
  args += [q, k, v, do, stats]
  dq_in_vmem = resident_dq(plan, d)
  if dq_in_vmem:
    # The kv group's heads over the whole padded sequence: the index moves only with
    # the leading axis, so the block stays in VMEM over the (j, t) sweep.
    dq_spec = _spec((None, g, 2, tp, d), lambda b_, g_, j, t: (b_, g_, 0, 0, 0))
  else:
    dq_spec = pl.BlockSpec(memory_space=pl.ANY)
  out_specs = [
      _spec((None, None, n_kv_comp, bk, d), lambda b_, g_, j, t: (b_, g_, 0, j, 0)),
      _spec((None, None, bk, dv_width), lambda b_, g_, j, t: (b_, g_, j, 0)),
      dq_spec,
  ]
  out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype),
               jax.ShapeDtypeStruct(v.shape, v.dtype),
               jax.ShapeDtypeStruct((b, h, 2, tp, d), jnp.float32)]
  scratch = [
      pltpu.VMEM((n_kv_comp, bk, d), jnp.float32),
      pltpu.VMEM((bk, dv_width), jnp.float32),
  ]
  if not dq_in_vmem:
    scratch += [
        pltpu.VMEM((2, 2, bq, d), jnp.float32),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.SMEM((4,), jnp.int32),
    ]

  itemsize = q.dtype.itemsize
  tiles = 2 * itemsize * (2 * bq * d + n_kv_comp * bk * d + bk * dv_width + bq * dv_width
                          + n_kv_comp * bk * d + bk * dv_width) + 2 * 4 * bq * 128
  vmem = tiles + 4 * (n_kv_comp * bk * d + bk * dv_width + 8 * bq * bk)
  vmem += 2 * dq_block_bytes(g, tp, d) if dq_in_vmem else 4 * 4 * bq * d
  visible = 0.5 if plan.causal else 1.0
  # dQ: written once (VMEM), or a float32 tile read and written per visible step (HBM).
  dq_bytes = 4 * q.size if dq_in_vmem else 8 * q.size * plan.num_kv_blocks * visible
  cost = pl.CostEstimate(
      flops=int(visible * b * h * tp * sp * (12 * d + 4 * dv_width)),
      transcendentals=int(visible * b * h * tp * sp * 2),
      bytes_accessed=int(itemsize * (k.size + v.size) * 2 + dq_bytes
                         + (itemsize * (q.size + do.size) + 4 * stats.size)
                         * plan.num_kv_blocks * visible))
  dk, dv, dq = pl.pallas_call(
      functools.partial(_backward_kernel, plan=plan, dq_in_vmem=dq_in_vmem),
      grid=(b * n_kv, plan.num_kv_blocks, g * nq),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary"),
          vmem_limit_bytes=L.vmem_limit(vmem)),
      cost_estimate=cost,
      interpret=interpret,
      name="diff_attention_bwd",
  )(*args)
  return dq, dk, dv
