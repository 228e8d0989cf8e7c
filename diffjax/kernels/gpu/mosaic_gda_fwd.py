"""The forward kernel of grouped differential attention on Mosaic GPU: the noise map once per group.

A CTA per (noise head, 64 queries, batch) runs the group's r + 1 maps over one K/V ring.
Design: docs/kernels_gpu.md, "Grouped differential attention".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from diffjax.kernels.gpu import mosaic_common as mc
from diffjax.kernels.gpu import mosaic_tiles as tiles
from diffjax.kernels.gpu.mosaic_fwd import tile_mask
from diffjax.kernels.gpu.pair_common import LOG2E, NEG, kv_blocks

# Signal heads per noise head the kernel unrolls its rounds for (Motif-2: 4).
MAX_GROUP = 8


def rounds(r: int) -> int:
  """Rounds of the forward for r signal heads a noise head: ceil((r + 1) / 2)."""
  return (r + 2) // 2


def _item(k: int, w: int, r: int) -> int | None:
  """The map warpgroup w runs in round k: -1 the noise head, j >= 0 signal head j of the
  group, None idle. Warpgroup 1 runs the noise map first, so warpgroup 0's first signal
  head waits for it only at its end."""
  i = 2 * k + (1 - w)
  return None if i > r else i - 1


def o2_parts(d: int, dv: int, itemsize: int = 2) -> int | None:
  """Column parts in which O2 is kept and combined into a signal head, or None if Dv is not
  a multiple of d (the kernel refuses those widths).

  A signal head's output leaves through its consumer's [64, d] Q tile, one tile of d columns
  at a time (a TMA copy reads a whole tile), so a part is a column slice of that tile: all
  of it up to d 128, else the widest slice of at most 128 columns (64 float32 registers a
  thread beside the [64, Dv] accumulator) of whole swizzle tiles. d 128 / Dv 256 -> 2;
  d 64 / Dv 128 -> 2; Dv = d <= 128 -> 1; d = Dv = 256 -> 2 (two parts a tile).
  """
  if dv % d:
    return None
  tile = mc.swizzle_bytes(d, itemsize) // itemsize
  for per_tile in range(1, d // 16 + 1):
    width = d // per_tile
    if d % per_tile == 0 and width <= 128 and (per_tile == 1 or width % tile == 0):
      return dv // width
  return None


def forward_smem_bytes(
  d: int,
  dv: int,
  block_kv: int,
  stages: int,
  shared_k: bool,
  segments: bool = True,
  itemsize: int = 2,
) -> int:
  """Shared memory the grouped forward kernel is launched with, in bytes."""
  keys = tiles._buffers(stages * block_kv * d * itemsize) * (1 if shared_k else 2)
  buffers = keys + tiles._buffers(
    mc.COMPUTE_WGS * mc.BLOCK_Q * d * itemsize,  # Q of each consumer's map
    stages * block_kv * dv * itemsize,  # V ring
    mc.BLOCK_Q * dv * itemsize,  # O2, kept for the group
    mc.COMPUTE_WGS * mc.BLOCK_Q * 4,  # lambda per consumer
    mc.COMPUTE_WGS * mc.BLOCK_Q * 4,  # log-sum-exps
    mc.COMPUTE_WGS * mc.BLOCK_Q * 4 if segments else 0,  # query segment ids
    stages * block_kv * 4 if segments else 0,  # key segment ids
  )
  bars = (
    2 * mc.COMPUTE_WGS
    + (mc.COMPUTE_WGS if segments else 0)
    + stages * (3 + (not shared_k) + segments)
    + 1
  )
  return buffers + bars * tiles.BARRIER_BYTES + tiles.KERNEL_SMEM_EXTRA


def forward_stages(
  d: int, dv: int, shared_k: bool, segments: bool = True, itemsize: int = 2
) -> int:
  """Ring slots of the grouped forward (64-key steps): the deepest of 3, 2, 1 that fits.

  Examples (bf16): V1 style d 128 / Dv 256 -> 2; V2 style d 128 -> 3; d 64 -> 3.
  """
  for stages in (3, 2, 1):
    if forward_smem_bytes(d, dv, 64, stages, shared_k, segments, itemsize) <= tiles.SMEM_BYTES:
      return stages
  raise ValueError(
    f"No ring fits shared memory for d={d}, dv={dv}: one slot needs "
    f"{forward_smem_bytes(d, dv, 64, 1, shared_k, segments, itemsize)} bytes of "
    f"{tiles.SMEM_BYTES}."
  )


def _scratch(cfg: mc.MosaicConfig, dtype, d, dv, stages, shared_k, parts):
  seg = cfg.segments
  bq, bk, wgs = mc.BLOCK_Q, cfg.block_kv, mc.COMPUTE_WGS
  width = dv // parts
  smem = lambda shape, width, dt=dtype: mc.smem_tile(shape, width, dt)
  bars = mc.barriers
  return [
    smem((wgs, bq, d), d),  # q_smem
    smem((stages, bk, d), d),  # ka_smem (K1, or the one K)
    None if shared_k else smem((stages, bk, d), d),  # kb_smem (K2)
    smem((stages, bk, dv), dv),  # v_smem
    smem((parts, bq, width), width),  # x_smem: O2 of the group
    plgpu.SMEM((wgs, bq), jnp.float32),  # lam_smem
    plgpu.SMEM((wgs, bq), jnp.float32),  # lse_smem
    plgpu.SMEM((wgs, bq), jnp.int32) if seg else None,  # qseg_smem
    plgpu.SMEM((stages, bk), jnp.int32) if seg else None,  # kvseg_smem
    bars(wgs),  # q_bar
    bars(wgs),  # lam_bar
    bars(wgs) if seg else None,  # row_bar (query segment ids)
    bars(stages),  # ka_bar
    None if shared_k else bars(stages),  # kb_bar
    bars(stages),  # v_bar
    bars(stages) if seg else None,  # kvseg_bar
    bars(stages, wgs),  # consumed
    bars(),  # x_bar: O2 is in shared memory
  ]


def forward(cfg: mc.MosaicConfig, q1, q2, ks, v, lam_BxHxT, q_seg, kv_seg):
  """Runs the grouped forward kernel on padded inputs.

  Args:
    cfg: ``noise_group`` r > 1; ``block_kv`` 64.
    q1 [B, T, H, D], q2 [B, T, N, D] (H = N r); ks: (K1, K2) or (K,), [B, S, K, D];
    v [B, S, K, Dv]; lam_BxHxT float32; segment ids int32 [B, T], [B, S] or None.
  Returns:
    (out [B, T, H, Dv], o2 [B, T, N, Dv]) in the input dtype and (lse1 [B, H, T],
    lse2 [B, N, T]) float32, base 2.
  """
  # One function: the kernel's warpgroups are closures over the sizes set here.
  b, t, h, d = q1.shape
  n_noise = q2.shape[2]
  s, kh, dv = ks[0].shape[1], ks[0].shape[2], v.shape[3]
  r = cfg.noise_group
  per_kv = n_noise // kh
  dtype = q1.dtype
  bq, bk = mc.BLOCK_Q, cfg.block_kv
  stages = max(1, min(cfg.stages, s // bk))
  c = cfg.scale * LOG2E
  shared_k = len(ks) == 1
  parts = o2_parts(d, dv, jnp.dtype(dtype).itemsize)
  if parts is None:
    raise ValueError(f"value dim {dv} must be a multiple of the head dim {d}.")
  width = dv // parts
  per_tile = d // width  # parts of O2 a Q tile of the output holds
  n_rounds = rounds(r)
  seg = cfg.segments

  def kernel(*refs):
    # One function: the producer and both consumers close over the refs unpacked here.
    it = iter(refs)
    q1_ref, q2_ref, ka_ref = next(it), next(it), next(it)
    kb_ref = ka_ref if shared_k else next(it)
    v_ref, lam_ref = next(it), next(it)
    qseg_ref, kvseg_ref = (next(it), next(it)) if seg else (None, None)
    o_ref, o2_ref, lse1_ref, lse2_ref = next(it), next(it), next(it), next(it)
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
      lam_bar,
      row_bar,
      ka_bar,
      kb_bar,
      v_bar,
      kvseg_bar,
      consumed,
      x_bar,
    ) = it

    bi = lax.axis_index("batch")
    ni = lax.axis_index("heads")
    q_start = lax.axis_index("q_seq") * bq
    kvh = lax.div(ni, jnp.int32(per_kv))
    _, n_end = kv_blocks(cfg, q_start, bq, bk)
    any_mask = cfg.causal or seg or cfg.kv_len % bk != 0

    def consumer(w: int):
      # One function: a round's maps and the output share this warpgroup's registers and
      # buffers. Registers as the pair kernel's consumers (tiles.CONSUMER_REGISTERS).
      plgpu.set_max_registers(tiles.CONSUMER_REGISTERS, action="increase")
      qseg = None
      if seg:
        plgpu.copy_gmem_to_smem(qseg_ref.at[bi, pl.ds(q_start, bq)], qseg_smem.at[w], row_bar.at[w])
        plgpu.barrier_wait(row_bar.at[w])
        qseg = mc.row(qseg_smem.at[w][...])
      o2_ready = False
      for k in range(n_rounds):
        j = _item(k, w, r)
        base = k * n_end  # the ring's step count at the start of this round
        if j is None:
          # Idle: release each slot once it is loaded, so the other consumer's steps
          # complete; waiting every barrier keeps this warpgroup's phases in step.
          def idle(i, carry, base=base):
            slot = lax.rem(base + i, jnp.int32(stages))
            plgpu.barrier_wait(ka_bar.at[slot])
            if seg:
              plgpu.barrier_wait(kvseg_bar.at[slot])
            plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_arrive(consumed.at[slot])
            return carry

          lax.fori_loop(0, n_end, idle, None)
          continue
        noise = j < 0
        head = ni if noise else ni * r + j
        rows = (bi, pl.ds(q_start, bq), head)
        if k:  # the last round's output and log-sum-exps were read out of shared memory
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.copy_gmem_to_smem((q2_ref if noise else q1_ref).at[rows], q_smem.at[w], q_bar.at[w])
        if not noise:
          plgpu.copy_gmem_to_smem(
            lam_ref.at[bi, head, pl.ds(q_start, bq)], lam_smem.at[w], lam_bar.at[w]
          )
        plgpu.barrier_wait(q_bar.at[w])
        use_kb = noise and not shared_k
        k_smem = kb_smem if use_kb else ka_smem

        def step(i, carry, masked: bool, base=base, use_kb=use_kb, k_smem=k_smem):
          slot = lax.rem(base + i, jnp.int32(stages))
          plgpu.barrier_wait(ka_bar.at[slot])  # waited by both, used by the K1 maps
          if use_kb:
            plgpu.barrier_wait(kb_bar.at[slot])
          sc = mc.product((bq, bk), q_smem.at[w], k_smem.at[slot].transpose((1, 0))) * c
          if masked:
            kvseg = None
            if seg:
              plgpu.barrier_wait(kvseg_bar.at[slot])
              kvseg = mc.col(kvseg_smem.at[slot][...])
            sc = jnp.where(tile_mask(cfg, q_start, i * bk, (bq, bk), qseg, kvseg), sc, NEG)
          return mc.softmax_step(
            carry, sc, v_smem.at[slot], v_bar.at[slot], consumed.at[slot], cfg, dtype, masked=masked
          )

        # One loop a round with one step body, masked whenever the call has a mask: the
        # rounds are unrolled, and an unmasked copy of the body beside the masked one in
        # each round made ptxas spill (d 96, r 2 and 4).
        carry = lax.fori_loop(
          0, n_end, functools.partial(step, masked=any_mask), mc.softmax_start(bq, dv)
        )
        out, lse = mc.softmax_finish(*carry)
        lse_smem.at[w][...] = lse
        plgpu.commit_smem()
        lse_ref = lse2_ref if noise else lse1_ref
        plgpu.copy_smem_to_gmem(lse_smem.at[w], lse_ref.at[bi, head, pl.ds(q_start, bq)])
        # The outputs are 16-bit and leave by TMA copies from shared memory: Mosaic GPU
        # stores them from the wgmma layout to global memory in partial 32-byte sectors,
        # which jax 0.12 refuses. O2 leaves from where the group keeps it, after the last
        # round (copied here, the copies made jax 0.10's lowering spill at d 128).
        if noise:
          for part in range(parts):
            x_smem.at[part][...] = out[:, part * width : (part + 1) * width].astype(dtype)
          plgpu.commit_smem()
          plgpu.barrier_arrive(x_bar)
          continue
        plgpu.barrier_wait(lam_bar.at[w])
        lam = mc.row(lam_smem.at[w][...])
        if not o2_ready:
          plgpu.barrier_wait(x_bar)
          o2_ready = True
        # A signal head's output d columns at a time through this consumer's Q tile, free
        # until the next round's Q (each tile read out before the next is written).
        for i in range(dv // d):
          if i:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          for piece in range(per_tile):
            part = i * per_tile + piece
            o2 = plgpu.layout_cast(x_smem.at[part][...], plgpu.Layout.WGMMA).astype(jnp.float32)
            o1 = out[:, part * width : (part + 1) * width]
            cols = pl.ds(piece * width, width)
            stage = q_smem.at[w, :, cols] if per_tile > 1 else q_smem.at[w]
            stage[...] = (o1 - mc.bcast_rows(lam, o1.shape) * o2).astype(dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(q_smem.at[w], o_ref.at[(*rows, pl.ds(i * d, d))])
      if w == 1:  # warpgroup 1 runs the noise map (round 0)
        for part in range(parts):
          cols = pl.ds(part * width, width)
          plgpu.copy_smem_to_gmem(x_smem.at[part], o2_ref.at[bi, pl.ds(q_start, bq), ni, cols])
      plgpu.wait_smem_to_gmem(0)

    def producer():
      plgpu.set_max_registers(tiles.PRODUCER_REGISTERS, action="decrease")

      def load(g, slot):
        j = lax.rem(g, n_end)
        keys = (bi, pl.ds(j * bk, bk), kvh)
        plgpu.copy_gmem_to_smem(ka_ref.at[keys], ka_smem.at[slot], ka_bar.at[slot])
        if not shared_k:  # K2 only for the first round's noise map

          @pl.when(g < n_end)
          def _():
            plgpu.copy_gmem_to_smem(kb_ref.at[keys], kb_smem.at[slot], kb_bar.at[slot])

        plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_bar.at[slot])
        if seg:
          plgpu.copy_gmem_to_smem(
            kvseg_ref.at[bi, pl.ds(j * bk, bk)], kvseg_smem.at[slot], kvseg_bar.at[slot]
          )

      mc.producer_ring(load, n_rounds * n_end, stages, consumed)

    mc.run_warpgroups(consumer, producer)

  scratch = _scratch(cfg, dtype, d, dv, stages, shared_k, parts)
  args = [q1, q2, *ks, v, lam_BxHxT] + ([q_seg, kv_seg] if seg else [])
  out_type = [
    jax.ShapeDtypeStruct((b, t, h, dv), dtype),
    jax.ShapeDtypeStruct((b, t, n_noise, dv), dtype),
    jax.ShapeDtypeStruct((b, h, t), jnp.float32),
    jax.ShapeDtypeStruct((b, n_noise, t), jnp.float32),
  ]
  n_args = len(args) + len(out_type)
  return plgpu.kernel(
    lambda *refs: kernel(*refs[:n_args], *mc.scratch_refs(refs[n_args:], scratch)),
    out_type=out_type,
    scratch_types=[x for x in scratch if x is not None],
    grid=(n_noise, t // bq, b),
    grid_names=("heads", "q_seq", "batch"),
    num_threads=mc.COMPUTE_WGS + 1,
    thread_name="wg",
    kernel_name=f"gda_{cfg.variant}_fwd_mgpu",
    **cfg.kernel_kwargs(),
  )(*args)
