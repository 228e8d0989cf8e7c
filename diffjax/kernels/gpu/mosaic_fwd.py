"""The forward kernel of the DIFF pair on Mosaic GPU (Hopper, sm_90).

``out = softmax(qa Ka^T s) V - lam softmax(qb Kb^T s) V``, saving O2 and both log-sum-exps for
:mod:`.mosaic_bwd`. Design: docs/kernels_gpu.md, "The kernels" (Forward).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from diffjax.core import validation as _v
from diffjax.kernels.gpu import mosaic_common as mc
from diffjax.kernels.gpu import mosaic_tiles as tiles
from diffjax.kernels.gpu import pair_common as pc
from diffjax.kernels.gpu.pair_common import LOG2E, NEG, kv_blocks


def tile_mask(cfg: mc.MosaicConfig, q_start, kv_start, shape, qseg=None, kvseg=None):
  """Visible (query, key) pairs of a [queries, keys] tile, in the wgmma layout."""
  kpos = kv_start + mc.iota(shape, 1)
  mask = kpos < cfg.kv_len
  if cfg.causal:
    qpos = q_start + cfg.offset + mc.iota(shape, 0)
    mask = jnp.logical_and(mask, kpos <= qpos)
  if cfg.segments:
    mask = jnp.logical_and(mask, mc.bcast_rows(qseg, shape) == mc.bcast_cols(kvseg, shape))
  return mask


def _scratch(cfg: mc.MosaicConfig, dtype, d: int, dv: int, stages: int, width: int, parts: int):
  """The forward kernel's shared-memory buffers and barriers, in the order the kernel
  unpacks them (None for those a call without segment ids, V2 or one O2 part does without)."""
  v1, seg = cfg.variant == "v1", cfg.segments
  bq, bk = mc.BLOCK_Q, cfg.block_kv
  smem = lambda shape, width, dt=dtype: mc.smem_tile(shape, width, dt)
  bars = mc.barriers
  return [
    smem((mc.COMPUTE_WGS, bq, d), d),  # q_smem
    smem((stages, bk, d), d),  # ka_smem
    smem((stages, bk, d), d) if v1 else None,  # kb_smem
    smem((stages, bk, dv), dv),  # v_smem
    smem((bq, width), width, jnp.float32),  # x_smem: O2 for warpgroup 0
    plgpu.SMEM((bq,), jnp.float32),  # lam_smem
    plgpu.SMEM((mc.COMPUTE_WGS, bq), jnp.float32),  # lse_smem
    plgpu.SMEM((mc.COMPUTE_WGS, bq), jnp.int32) if seg else None,  # qseg_smem
    plgpu.SMEM((stages, bk), jnp.int32) if seg else None,  # kvseg_smem
    bars(mc.COMPUTE_WGS),  # q_bar
    bars(mc.COMPUTE_WGS),  # row_bar
    bars(stages),  # ka_bar
    bars(stages) if v1 else None,  # kb_bar
    bars(stages),  # v_bar
    bars(stages) if seg else None,  # kvseg_bar
    bars(stages, mc.COMPUTE_WGS),  # consumed
    bars(),  # x_bar
    bars() if parts > 1 else None,  # x_free
    bars(),  # o_free: warpgroup 1 may stage O2 in the V ring
  ]


def forward(cfg: mc.MosaicConfig, qs, ks, v, lam_BxHxT, q_seg, kv_seg):
  """Runs the forward kernel.

  ``qs`` = (q1, q2) for V1, (q,) for V2 (heads 2i, 2i+1 form pair i); ``ks`` likewise.
  Lengths are padded (queries to 64, keys to ``block_kv``). Returns (out, o2) in the
  query dtype [B, T, H, Dv] and (lse_a, lse_b) float32 [B, H, T], base 2.
  """
  # One function: the kernel's warpgroups are closures over the sizes set here.
  b, t, _, d = qs[0].shape
  s, dv = ks[0].shape[1], v.shape[3]
  h = lam_BxHxT.shape[1]
  dtype = qs[0].dtype
  bq, bk = mc.BLOCK_Q, cfg.block_kv
  stages = max(1, min(cfg.stages, s // bk))  # never more slots than key blocks
  c = cfg.scale * LOG2E
  v1 = cfg.variant == "v1"
  parts = tiles.exchange_parts(dv)
  width = dv // parts

  def kernel(*refs):
    # One function: the producer and both consumers close over the refs unpacked here.
    it = iter(refs)
    qa_ref, qb_ref, ka_ref, kb_ref = mc.pair_refs(it, v1)
    v_ref, lam_ref = next(it), next(it)
    qseg_ref, kvseg_ref = (next(it), next(it)) if cfg.segments else (None, None)
    o_ref, o2_ref, lse_a_ref, lse_b_ref = next(it), next(it), next(it), next(it)
    (
      q_smem,
      ka_smem,
      kb_smem,
      v_smem,
      x_smem,
      lam_smem,
      lse_smem,
      qseg_smem,
      kvseg_smem,
      q_bar,
      row_bar,
      ka_bar,
      kb_bar,
      v_bar,
      kvseg_bar,
      consumed,
      x_bar,
      x_free,
      o_free,
    ) = it

    bi = lax.axis_index("batch")
    hi = lax.axis_index("heads")
    q_start = lax.axis_index("q_seq") * bq
    kvh = lax.div(hi, jnp.int32(cfg.group))
    n_full, n_end = kv_blocks(cfg, q_start, bq, bk)
    kb_smem = kb_smem if v1 else ka_smem
    kb_bar = kb_bar if v1 else ka_bar

    def consumer(w: int):
      # One function: the key loop and the exchange of O2 share this warpgroup's registers.
      # Registers: 2 x 128 consumer threads at 232 and 128 producer threads at 40 use
      # 64,512 of the SM's 65,536; a consumer holds a [64, Dv] float32 accumulator
      # (128 registers a thread at Dv = 256) next to the [64, 64] score tile.
      plgpu.set_max_registers(tiles.CONSUMER_REGISTERS, action="increase")
      q_ref, k_smem, k_bar = (qa_ref, ka_smem, ka_bar) if w == 0 else (qb_ref, kb_smem, kb_bar)
      head = hi if v1 else 2 * hi + w
      plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(q_start, bq), head], q_smem.at[w], q_bar.at[w])
      if cfg.segments:
        plgpu.copy_gmem_to_smem(qseg_ref.at[bi, pl.ds(q_start, bq)], qseg_smem.at[w], row_bar.at[w])
      elif w == 0:
        plgpu.copy_gmem_to_smem(lam_ref.at[bi, hi, pl.ds(q_start, bq)], lam_smem, row_bar.at[0])
      plgpu.barrier_wait(q_bar.at[w])
      qseg = None
      if cfg.segments:
        plgpu.barrier_wait(row_bar.at[w])
        qseg = mc.row(qseg_smem.at[w][...])

      def step(j, carry, masked: bool):
        slot = lax.rem(j, jnp.int32(stages))
        plgpu.barrier_wait(k_bar.at[slot])
        sc = mc.product((bq, bk), q_smem.at[w], k_smem.at[slot].transpose((1, 0))) * c
        if masked:
          kvseg = None
          if cfg.segments:
            plgpu.barrier_wait(kvseg_bar.at[slot])
            kvseg = mc.col(kvseg_smem.at[slot][...])
          sc = jnp.where(tile_mask(cfg, q_start, j * bk, (bq, bk), qseg, kvseg), sc, NEG)
        return mc.softmax_step(
          carry, sc, v_smem.at[slot], v_bar.at[slot], consumed.at[slot], cfg, dtype, masked=masked
        )

      carry = lax.fori_loop(
        0, n_full, functools.partial(step, masked=False), mc.softmax_start(bq, dv)
      )
      carry = lax.fori_loop(n_full, n_end, functools.partial(step, masked=True), carry)
      out, lse = mc.softmax_finish(*carry)
      lse_smem.at[w][...] = lse
      plgpu.commit_smem()
      lse_ref = lse_a_ref if w == 0 else lse_b_ref
      plgpu.copy_smem_to_gmem(lse_smem.at[w], lse_ref.at[bi, hi, pl.ds(q_start, bq)])
      rows = (bi, pl.ds(q_start, bq), hi)
      # O and O2 leave through the V ring, which is free once both consumers are done
      # with their loops, by TMA copies of whole tiles (Mosaic GPU stores 16-bit values
      # from the wgmma layout to global memory in partial 32-byte sectors, which jax 0.12
      # refuses). O is staged in slot 0 by warpgroup 0, after O2's first chunk has
      # crossed (warpgroup 1 is then done with the ring); O2 in the last slot by
      # warpgroup 1 once warpgroup 0 is done with the ring (o_free), or with one slot
      # once O has been read out of it.
      stage = lambda slot: v_smem.at[slot, pl.ds(0, bq)]
      o2_slot = stages - 1
      # O2 goes to warpgroup 0 in float32, ``parts`` column chunks at a time through
      # one chunk of shared memory (x_bar: a chunk is written; x_free: it was read).
      if w == 1:
        for part in range(parts):
          if part:
            plgpu.barrier_wait(x_free)
          x_smem[...] = out[:, part * width : (part + 1) * width]
          plgpu.barrier_arrive(x_bar)
        plgpu.barrier_wait(o_free)
        mc.store_out(out.astype(dtype), stage(o2_slot), o2_ref.at[rows])
      else:
        if o2_slot:
          plgpu.barrier_arrive(o_free)
        if cfg.segments:  # the lambda copy was issued after the segment ids
          plgpu.copy_gmem_to_smem(lam_ref.at[bi, hi, pl.ds(q_start, bq)], lam_smem, row_bar.at[0])
        plgpu.barrier_wait(row_bar.at[0])
        lam = mc.row(lam_smem[...])
        for part in range(parts):
          plgpu.barrier_wait(x_bar)
          o2 = plgpu.layout_cast(x_smem[...], plgpu.Layout.WGMMA)
          if part + 1 < parts:
            plgpu.barrier_arrive(x_free)
          o1 = out[:, part * width : (part + 1) * width]
          chunk = stage(0).at[:, pl.ds(part * width, width)] if parts > 1 else stage(0)
          chunk[...] = (o1 - mc.bcast_rows(lam, o1.shape) * o2).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(stage(0), o_ref.at[rows])
        if not o2_slot:
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          plgpu.barrier_arrive(o_free)
      plgpu.wait_smem_to_gmem(0)

    def producer():
      plgpu.set_max_registers(tiles.PRODUCER_REGISTERS, action="decrease")

      def load(j, slot):
        keys = (bi, pl.ds(j * bk, bk), kvh)
        plgpu.copy_gmem_to_smem(ka_ref.at[keys], ka_smem.at[slot], ka_bar.at[slot])
        if v1:
          plgpu.copy_gmem_to_smem(kb_ref.at[keys], kb_smem.at[slot], kb_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_bar.at[slot])
        if cfg.segments:
          plgpu.copy_gmem_to_smem(
            kvseg_ref.at[bi, pl.ds(j * bk, bk)], kvseg_smem.at[slot], kvseg_bar.at[slot]
          )

      mc.producer_ring(load, n_end, stages, consumed)

    mc.run_warpgroups(consumer, producer)

  scratch = _scratch(cfg, dtype, d, dv, stages, width, parts)
  seg = cfg.segments
  q_args = list(qs)
  args = q_args + list(ks) + [v, lam_BxHxT] + ([q_seg, kv_seg] if seg else [])
  out_type = [jax.ShapeDtypeStruct((b, t, h, dv), dtype)] * 2 + [
    jax.ShapeDtypeStruct((b, h, t), jnp.float32)
  ] * 2
  return plgpu.kernel(
    lambda *refs: kernel(*refs[: len(args) + 4], *mc.scratch_refs(refs[len(args) + 4 :], scratch)),
    out_type=out_type,
    scratch_types=[x for x in scratch if x is not None],
    grid=(h, t // bq, b),
    grid_names=("heads", "q_seq", "batch"),
    num_threads=mc.COMPUTE_WGS + 1,
    thread_name="wg",
    kernel_name=f"diff_{cfg.variant}_fwd_mgpu",
    **cfg.kernel_kwargs(),
  )(*args)


def forward_padded(
  variant: str,
  qs,
  ks,
  v,
  lam_BxHxT,
  q_seg=None,
  kv_seg=None,
  *,
  causal: bool = True,
  scale: float | None = None,
  block_sizes=None,
  interpret: bool = False,
):
  """:func:`forward` on unpadded inputs: pads the lengths, runs, slices the padding off.

  Args are as in :func:`forward`, with any lengths T and S; ``lam_BxHxT`` is float32
  [B, H, T] (H: DIFF heads for V1, pairs for V2). ``block_sizes``: None (the default
  for these widths), a :class:`~diffjax.kernels.gpu.mosaic_tiles.MosaicBlockSizes` or a
  dict of its fields. Returns (out, o2, lse_a, lse_b) for the true lengths.
  """
  tiles.check_inputs(variant, qs, ks, v)
  b, t, _, d = qs[0].shape
  s, dv = ks[0].shape[1], v.shape[3]
  h = lam_BxHxT.shape[1]
  itemsize = jnp.dtype(qs[0].dtype).itemsize
  segments = q_seg is not None
  blocks = _v.resolve_fields(
    block_sizes,
    tiles.MosaicBlockSizes.default(d, dv, variant, segments, itemsize),
    tiles.MosaicBlockSizes,
  )
  blocks.check(d, dv, variant, q_seg is not None, itemsize)
  block_kv, stages = blocks.block_kv, blocks.stages
  tp, sp = pc.round_up(t, mc.BLOCK_Q), pc.round_up(s, block_kv)
  cfg = mc.MosaicConfig(
    variant=variant,
    causal=bool(causal),
    scale=float(scale) if scale is not None else d**-0.5,
    q_len=t,
    kv_len=s,
    group=h // ks[0].shape[2],
    segments=q_seg is not None,
    block_kv=block_kv,
    stages=stages,
    interpret=bool(interpret),
  )
  qs = tuple(pc.pad_axis(q, 1, tp) for q in qs)
  ks = tuple(pc.pad_axis(k, 1, sp) for k in ks)
  q_seg, kv_seg = pc.pad_segment_ids(q_seg, kv_seg, tp, sp)
  o, o2, lse_a, lse_b = forward(
    cfg,
    qs,
    ks,
    pc.pad_axis(v, 1, sp),
    pc.pad_axis(lam_BxHxT.astype(jnp.float32), 2, tp),
    q_seg,
    kv_seg,
  )
  return o[:, :t], o2[:, :t], lse_a[:, :, :t], lse_b[:, :, :t]
