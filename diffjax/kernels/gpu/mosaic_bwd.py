"""The fused backward of the DIFF pair on Mosaic GPU (Hopper, sm_90): every gradient at 32d.

Design: docs/kernels_gpu.md, "The kernels" (Backward), "No register spills, and what it cost".
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from diffjax.kernels.gpu.mosaic_common import (
  BLOCK_Q,
  COMPUTE_WGS,
  MosaicConfig,
  accumulate,
  barriers,
  bcast_cols,
  bcast_rows,
  col,
  pair_refs,
  producer_ring,
  product,
  row,
  run_warpgroups,
  scratch_refs,
  smem_transforms,
  store_out,
)
from diffjax.kernels.gpu.mosaic_tiles import (
  BLOCK_KV_BWD,
  BWD_PRODUCER_REGISTERS,
  BWD_Q_SUB,
  BWD_REGISTERS,
  ROWS,
  bwd_swizzle_cap,
  value_split,
)
from diffjax.kernels.gpu.pair_common import LOG2E, NEG, q_blocks


def _mask_scores_t(cfg: MosaicConfig, s_t, q_start, kv_start, qseg=None, kvseg=None):
  """``s_t`` (a transposed [keys, queries] score tile) with invisible pairs set to NEG.

  Each condition is built from a per-key (row) and a per-query (column) vector and
  applied by its own select: full [keys, queries] index tiles would be loop-invariant
  (kept in registers across the query loop), and a combined mask would hold several
  predicates per element at once.
  """
  bk, bq = s_t.shape
  kpos = kv_start + row(lax.broadcasted_iota(jnp.int32, (bk,), 0))
  if cfg.segments:
    s_t = jnp.where(bcast_rows(kvseg, s_t.shape) == bcast_cols(qseg, s_t.shape), s_t, NEG)
  if cfg.causal:
    qpos = q_start + cfg.offset + col(lax.broadcasted_iota(jnp.int32, (bq,), 0))
    s_t = jnp.where(bcast_rows(kpos, s_t.shape) <= bcast_cols(qpos, s_t.shape), s_t, NEG)
  return jnp.where(bcast_rows(kpos < cfg.kv_len, s_t.shape), s_t, NEG)


def _scratch(cfg: MosaicConfig, dtype, d: int, widths, stages: int, q_width: int) -> list:
  """The backward kernel's shared-memory buffers and barriers, in the order the kernel
  unpacks them (None for those a call without segment ids or V2 does without)."""
  v1, seg = cfg.variant == "v1", cfg.segments
  bq, bk, sub = BLOCK_Q, BLOCK_KV_BWD, BWD_Q_SUB
  # The V and dO halves are TMA boxes inside rows of Dv: one swizzle tile must divide
  # both halves (and so Dv and the second half's offset).
  v_tile = math.gcd(*widths)
  # Sub-tiles of 32 queries are the K extent of the MN-major dO and Q operands of the
  # dV and dK products, and one swizzle serves both operands of a wgmma: every tile
  # then takes at most a 64-byte swizzle (32 bf16 elements).
  cap = bwd_swizzle_cap(jnp.dtype(dtype).itemsize)
  smem = lambda shape, width, dt=dtype: plgpu.SMEM(
    shape, dt, transforms=smem_transforms(width, dt, cap if dt == dtype else 128)
  )
  bars = barriers
  return [
    smem((2 if v1 else 1, bk, d), d),  # k_smem
    [smem((1, bk, w), v_tile) for w in widths],  # v_smem halves
    # One buffer per warpgroup (and per V/dO half below) rather than a stacked
    # one: a constant index in a wgmma operand breaks jax 0.11's run_state lowering.
    [smem((stages, bq, d), d) for _ in range(COMPUTE_WGS)],  # q_smem
    [smem((stages, bq, w), v_tile) for w in widths],  # do_smem halves
    plgpu.SMEM((stages, ROWS, bq), jnp.float32),  # rows_smem
    plgpu.SMEM((stages, bq), jnp.int32) if seg else None,  # qseg_smem
    plgpu.SMEM((bk,), jnp.int32) if seg else None,  # kvseg_smem
    smem((COMPUTE_WGS, bk, sub), sub, jnp.float32),  # xdp_smem
    # xp_smem holds P for the swap, then dS^T, the A operand of dQ = dS K: its swizzle
    # must be K's (the widest that divides a row of d).
    plgpu.SMEM((COMPUTE_WGS, bk, bq), dtype, transforms=smem_transforms(d, dtype, cap)),
    smem((COMPUTE_WGS, bq, q_width), q_width, jnp.float32),  # dq_smem
    plgpu.SMEM((COMPUTE_WGS,), jnp.int32),  # zero_smem
    bars(5),  # res_bar
    bars(COMPUTE_WGS * stages),  # q_bar [w * stages + slot]
    bars(COMPUTE_WGS * stages),  # do_bar
    bars(stages),  # row_bar
    bars(stages) if seg else None,  # qseg_bar
    bars(stages, arrivals=COMPUTE_WGS),  # consumed
    bars(arrivals=COMPUTE_WGS),  # x_bar
    bars(arrivals=COMPUTE_WGS),  # r_bar
  ]


def backward(cfg: MosaicConfig, qs, ks, v, do, rows, q_seg, kv_seg, *, stages: int, dq_parts: int):
  """All gradients of the pair on padded inputs.

  Args:
    cfg: the forward's config (lengths, mask, scale, variant, interpret).
    qs, ks, v: as in :func:`~diffjax.kernels.gpu.mosaic_fwd.forward` (T a multiple of
      64, S a multiple of 64).
    do: dOut, [B, T, H, Dv] in the input dtype (zero on padded query rows).
    rows: float32 [B, H, 5, T]: lse_a, lse_b, d_a, d_b, lam. A padded query row has a
      zero dO, so zero d_a, d_b and dS: it contributes nothing to any gradient.
    q_seg, kv_seg: int32 [B, T], [B, S] or None.
    stages, dq_parts: from :func:`~diffjax.kernels.gpu.mosaic_tiles.backward_blocks`.
  Returns:
    (dqs, dks, dv): dqs float32 like qs; V1 dks = (dK1, dK2) in the input dtype, V2
    dks = (float32 partial of warpgroup 0, of warpgroup 1); dv in the input dtype.
  """
  # One function: the kernel's warpgroups are closures over the sizes set here.
  v1 = cfg.variant == "v1"
  b, t, _, d = qs[0].shape
  s, kh, dv = ks[0].shape[1], ks[0].shape[2], v.shape[3]
  dtype = qs[0].dtype
  bq, bk = BLOCK_Q, BLOCK_KV_BWD
  if t % bq or s % bk:
    raise ValueError(f"backward wants T ({t}) and S ({s}) padded to multiples of 64.")
  g = cfg.group
  widths = value_split(dv)
  starts = (0, widths[0])
  c = cfg.scale * LOG2E
  q_width = d // dq_parts
  sub = BWD_Q_SUB
  n_sub = bq // sub

  def kernel(*refs):
    # One function: the producer and both consumers close over the refs unpacked here.
    it = iter(refs)
    qa_ref, qb_ref, ka_ref, kb_ref = pair_refs(it, v1)
    v_ref, do_ref, rows_ref = next(it), next(it), next(it)
    qseg_ref, kvseg_ref = (next(it), next(it)) if cfg.segments else (None, None)
    dqa_ref = next(it)
    dqb_ref = next(it) if v1 else dqa_ref
    dka_ref, dkb_ref, dv_ref = next(it), next(it), next(it)
    (
      k_smem,
      v_smem,
      q_smem,
      do_smem,
      rows_smem,
      qseg_smem,
      kvseg_smem,
      xdp_smem,
      xp_smem,
      dq_smem,
      zero_smem,
      res_bar,
      q_bar,
      do_bar,
      row_bar,
      qseg_bar,
      consumed,
      x_bar,
      r_bar,
    ) = it

    kvh = lax.axis_index("kv_heads")
    kv_start = lax.axis_index("kv_seq") * bk
    bi = lax.axis_index("batch")
    i_start, _, n_q = q_blocks(cfg, kv_start, bq, bk)
    # Keys past the true length, causal and segment masks; with none of them no step
    # needs a mask.
    masked = cfg.causal or cfg.segments or cfg.kv_len % bk != 0
    per_head = n_q - i_start
    total = g * per_head
    keys = (bi, pl.ds(kv_start, bk), kvh)

    def q_head(hl, w):
      """(query array, head index) of map w for local head hl of this kv group."""
      head = kvh * g + hl
      if v1:
        return (qa_ref, qb_ref)[w], head
      return qa_ref, 2 * head + w

    def consumer(w: int):
      # One function: the step body and its sub-tiles share this warpgroup's buffers.
      # 2 x 128 consumer threads at 240 registers and 128 producer threads at 24 use
      # 64,512 of the SM's 65,536 (see backward_registers).
      plgpu.set_max_registers(BWD_REGISTERS, action="increase")
      do_w, width_w = do_smem[w], widths[w]
      plgpu.barrier_wait(res_bar.at[w if v1 else 0])
      plgpu.barrier_wait(res_bar.at[2 + w])
      kvseg = None
      if cfg.segments:
        plgpu.barrier_wait(res_bar.at[4])
        kvseg = row(kvseg_smem[...])
      dq_out = dqa_ref if w == 0 else dqb_ref
      zero_smem[w] = jnp.int32(0)

      def step(n, carry, hl, i, masked: bool):
        dk, dv_acc = carry
        # A zero the compiler cannot see through: with it every shared-memory
        # operand's wgmma descriptor is formed in the step that uses it. Constant
        # descriptors (all of them with one ring slot) are otherwise hoisted out of
        # the loop and held in registers across it.
        zero = zero_smem[w]
        slot = lax.rem(n, jnp.int32(stages)) + zero
        k_w = k_smem.at[(w if v1 else 0) + zero]
        v_w = v_smem[w].at[zero]
        q_start = i * bq
        plgpu.barrier_wait(q_bar.at[w * stages + slot])
        plgpu.barrier_wait(row_bar.at[slot])
        if masked and cfg.segments:
          plgpu.barrier_wait(qseg_bar.at[slot])
        q_w, do_q = q_smem[w].at[slot], do_w.at[slot]
        tile = lambda ref: plgpu.layout_cast(ref[...], plgpu.Layout.WGMMA)
        # The step's 64 queries in sub-tiles of ``sub``: the score, probability and
        # dP tiles of one sub-tile are all a thread holds next to dK and dV.
        for h in range(n_sub):
          cols = pl.ds(h * sub, sub)
          terms = lambda r: col(rows_smem.at[slot, r, cols][...])
          s_t = product((bk, sub), k_w, q_w.at[cols].transpose((1, 0))) * c
          if masked:
            qseg = col(qseg_smem.at[slot, cols][...]) if cfg.segments else None
            s_t = _mask_scores_t(cfg, s_t, q_start + h * sub, kv_start, qseg, kvseg)
          p_t = jnp.exp2(s_t - bcast_cols(terms(w), s_t.shape))
          # V1's lambda is one number per head; V2's one per query (a column vector).
          lam = bcast_cols(terms(4), p_t.shape)
          # Map b keeps lam P_b (its dS is -lam P_b (dP - d_b)); P_b dies here.
          mine = p_t if w == 0 else lam * p_t
          xp_smem.at[w, :, cols][...] = mine.astype(dtype)
          if h == 0:
            plgpu.barrier_wait(do_bar.at[w * stages + slot])
          xdp_smem[w] = product((bk, sub), v_w, do_q.at[cols].transpose((1, 0)))
          # Swap dP halves and probabilities with the other warpgroup (x_bar: both
          # written; r_bar: both read, so each may reuse its own buffers). Both are
          # read back from shared memory, so only ``mine`` lives in registers across
          # the swap, and dV is accumulated before dP is formed.
          plgpu.barrier_arrive(x_bar)
          plgpu.barrier_wait(x_bar)
          p_comb = tile(xp_smem.at[0, :, cols]).astype(jnp.float32) - tile(
            xp_smem.at[1, :, cols]
          ).astype(jnp.float32)  # P_a - lam P_b
          dv_acc = accumulate(dv_acc, p_comb.astype(dtype), do_q.at[cols], cfg)
          dp_t = tile(xdp_smem.at[0]) + tile(xdp_smem.at[1])
          plgpu.barrier_arrive(r_bar)
          ds_t = mine * (dp_t - bcast_cols(terms(2 + w), p_t.shape))
          ds_t = (ds_t * (cfg.scale if w == 0 else -cfg.scale)).astype(dtype)
          dk = accumulate(dk, ds_t, q_w.at[cols], cfg)
          plgpu.barrier_wait(r_bar)
          xp_smem.at[w, :, cols][...] = ds_t
        plgpu.commit_smem()
        head = q_head(hl, w)[1]
        for part in range(dq_parts):
          # dQ = dS K one column chunk at a time: q_width / 2 accumulator registers
          # a thread next to dK and dV.
          dq = product(
            (bq, q_width),
            xp_smem.at[w + zero].transpose((1, 0)),
            k_w.at[:, pl.ds(part * q_width, q_width)],
          )
          if part + 1 == dq_parts:
            plgpu.barrier_arrive(consumed.at[slot])
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          dq_smem[w] = dq
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(
            dq_smem.at[w],
            dq_out.at[bi, pl.ds(q_start, bq), head, pl.ds(part * q_width, q_width)],
            reduction_op="add",
          )
        return dk, dv_acc

      # One loop over every (head, query block) the CTA visits, in the producer's
      # order, with one step body: a second, unmasked copy of the body for the steps
      # that need no mask would make the register allocation cover both.
      def visit(n, carry):
        hl = lax.div(n, per_head)
        return step(n, carry, hl, i_start + lax.rem(n, per_head), masked)

      zeros = lambda n: plgpu.layout_cast(jnp.zeros((bk, n), jnp.float32), plgpu.Layout.WGMMA)
      dk, dv_acc = lax.fori_loop(0, total, visit, (zeros(d), zeros(width_w)))
      # The gradients leave through shared memory by TMA (store_out): dV through this
      # warpgroup's V half and V1's dK through its K tile, which no one reads after its
      # loop; V2's float32 dK partial through its dQ tile, a chunk at a time.
      dk_ref = dka_ref if w == 0 else dkb_ref
      store_out(
        dv_acc.astype(dv_ref.dtype), v_smem[w].at[0], dv_ref.at[(*keys, pl.ds(starts[w], width_w))]
      )
      if v1:
        store_out(dk.astype(dk_ref.dtype), k_smem.at[w], dk_ref.at[keys])
      else:
        for part in range(dq_parts):
          cols = pl.ds(part * q_width, q_width)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          store_out(
            dk[:, part * q_width : (part + 1) * q_width], dq_smem.at[w], dk_ref.at[(*keys, cols)]
          )
      plgpu.wait_smem_to_gmem(0)

    def producer():
      plgpu.set_max_registers(BWD_PRODUCER_REGISTERS, action="decrease")
      plgpu.copy_gmem_to_smem(ka_ref.at[keys], k_smem.at[0], res_bar.at[0])
      if v1:
        plgpu.copy_gmem_to_smem(kb_ref.at[keys], k_smem.at[1], res_bar.at[1])
      for w in range(COMPUTE_WGS):
        plgpu.copy_gmem_to_smem(
          v_ref.at[(*keys, pl.ds(starts[w], widths[w]))], v_smem[w].at[0], res_bar.at[2 + w]
        )
      if cfg.segments:
        plgpu.copy_gmem_to_smem(kvseg_ref.at[bi, pl.ds(kv_start, bk)], kvseg_smem, res_bar.at[4])

      def load(n, slot):
        hl = lax.div(n, per_head)
        i = i_start + lax.rem(n, per_head)
        rows_q = pl.ds(i * bq, bq)
        for w in range(COMPUTE_WGS):
          q_ref, head = q_head(hl, w)
          plgpu.copy_gmem_to_smem(
            q_ref.at[bi, rows_q, head], q_smem[w].at[slot], q_bar.at[w * stages + slot]
          )
          plgpu.copy_gmem_to_smem(
            do_ref.at[bi, rows_q, kvh * g + hl, pl.ds(starts[w], widths[w])],
            do_smem[w].at[slot],
            do_bar.at[w * stages + slot],
          )
        plgpu.copy_gmem_to_smem(
          rows_ref.at[bi, kvh * g + hl, pl.ds(0, ROWS), rows_q],
          rows_smem.at[slot],
          row_bar.at[slot],
        )
        if cfg.segments:
          plgpu.copy_gmem_to_smem(qseg_ref.at[bi, rows_q], qseg_smem.at[slot], qseg_bar.at[slot])

      producer_ring(load, total, stages, consumed)

    run_warpgroups(consumer, producer)

  scratch = _scratch(cfg, dtype, d, widths, stages, q_width)
  seg = cfg.segments
  args = list(qs) + list(ks) + [v, do, rows] + ([q_seg, kv_seg] if seg else [])
  dk_type = (
    jax.ShapeDtypeStruct(ks[0].shape, dtype)
    if v1
    else jax.ShapeDtypeStruct(ks[0].shape, jnp.float32)
  )
  out_type = [dk_type, dk_type, jax.ShapeDtypeStruct(v.shape, dtype)]
  dq_refs = [jax.new_ref(jnp.zeros(q.shape, jnp.float32), memory_space=plgpu.GMEM) for q in qs]

  def body(*refs):
    pl.run_scoped(
      lambda *scr: kernel(*refs, *scratch_refs(list(scr), scratch)),
      *[x for x in scratch if x is not None],
      collective_axes="wg",
    )

  mesh = plgpu.Mesh(
    grid=(kh, s // bk, b),
    grid_names=("kv_heads", "kv_seq", "batch"),
    num_threads=COMPUTE_WGS + 1,
    thread_name="wg",
  )
  dka, dkb, dvv = pl.kernel(
    body, out_type=out_type, mesh=mesh, name=f"diff_{cfg.variant}_bwd_mgpu", **cfg.kernel_kwargs()
  )(*args, *dq_refs)
  dqs = tuple(r[...] for r in dq_refs)
  return dqs, (dka, dkb), dvv
