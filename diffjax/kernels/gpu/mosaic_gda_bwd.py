"""The backward of grouped differential attention on Mosaic GPU: the noise map once per group.

Every map's flash backward once, each noise map with ``-sum_j lam_j dO_j`` over its group.
Design: docs/kernels_gpu.md, "Grouped differential attention".
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from diffjax.kernels.gpu import mosaic_tiles as tiles
from diffjax.kernels.gpu.mosaic_bwd import _mask_scores_t
from diffjax.kernels.gpu.mosaic_common import (
  BLOCK_Q,
  COMPUTE_WGS,
  MosaicConfig,
  accumulate,
  barriers,
  bcast_cols,
  col,
  producer_ring,
  product,
  row,
  run_warpgroups,
  scratch_refs,
  smem_transforms,
  store_out,
  swizzle_bytes,
)
from diffjax.kernels.gpu.pair_common import LOG2E, q_blocks

ROWS = 2  # per-row terms of a map: its log-sum-exp and its softmax-backward row term
# Registers a thread (set_max_registers): 2 x 128 consumer threads at 232 and 128 producer
# threads at 40 use the 64,512 the kernel launches with. The producer walks two passes
# of two maps a step (more indices than the pair backward's, whose producer has 24).
CONSUMER_REGISTERS = 232
PRODUCER_REGISTERS = 40


def key_split(d: int, itemsize: int = 2) -> tuple[int, int]:
  """Column widths of dK held by warpgroups 0 and 1: the first a whole number of the Q
  tile's swizzle rows (it is a column slice of Q in the dK product). d 128 -> (64, 64);
  d 96 -> (64, 32); d 80 -> (48, 32)."""
  swizzle = swizzle_bytes(d, itemsize, tiles.bwd_swizzle_cap(itemsize)) // itemsize
  first = -(-(d // 2) // swizzle) * swizzle
  if first >= d or (d - first) % 16:
    raise ValueError(f"head dim {d} does not split into two dK halves of whole swizzle rows.")
  return first, d - first


def registers(d: int, dv: int, itemsize: int = 2) -> int:
  """Estimated registers per consumer thread: the dK half (d / 2 columns: d / 4), the dV
  half (Dv / 4), a 32-query sub-tile's score, dP and dS tiles (16 each) and 40 of
  indices and addresses. d 128 / Dv 256: 32 + 64 + 48 + 40 = 184 of 232."""
  return key_split(d, itemsize)[0] // 2 + tiles.value_split(dv)[0] // 2 + 3 * 16 + 40


def smem_bytes(d: int, dv: int, stages: int, parts: int, segments: bool, itemsize: int = 2) -> int:
  """Shared memory the grouped backward kernel is launched with, in bytes."""
  bq, bk, wgs = BLOCK_Q, tiles.BLOCK_KV_BWD, COMPUTE_WGS
  widths = tiles.value_split(dv)
  buffers = tiles._buffers(
    2 * bk * d * itemsize,  # K1, K2 loaded once
    *(bk * w * itemsize for w in widths),  # V halves
    *(stages * bq * d * itemsize for _ in range(wgs)),  # Q ring per warpgroup's map
    *(stages * bq * w * itemsize for _ in range(wgs) for w in widths),  # dO halves per map
    *(stages * ROWS * bq * 4 for _ in range(wgs)),  # row terms per map
    *((stages * bq * 4 for _ in range(wgs)) if segments else ()),  # query segment ids
    bk * 4 if segments else 0,  # key segment ids
    wgs * bk * bq * itemsize,  # P crossing, then dS^T
    wgs * bq * (d // parts) * 4,  # dQ chunk on its way to HBM
    wgs * 4,  # an opaque zero per warpgroup
  )
  bars = 5 + stages * wgs * (1 + 2 + 1 + segments) + stages + 3
  return buffers + bars * tiles.BARRIER_BYTES


def blocks(d: int, dv: int, segments: bool, itemsize: int = 2) -> tuple[int, int]:
  """(stages, dq_parts): the deepest Q/dO ring (2 or 1) within shared memory."""
  parts = tiles.dq_parts(d, itemsize)
  for stages in (2, 1):
    if smem_bytes(d, dv, stages, parts, segments, itemsize) <= tiles.SMEM_BYTES:
      return stages, parts
  raise ValueError(
    f"No grouped backward tiling fits shared memory for d={d}, dv={dv}: the smallest needs "
    f"{smem_bytes(d, dv, 1, parts, segments, itemsize)} bytes of {tiles.SMEM_BYTES}."
  )


def _chunk(width: int, q_width: int, itemsize: int = 4) -> int | None:
  """Columns of a float32 [64, width] gradient a copy through the [64, q_width] dQ tile
  carries: q_width where it divides the width, the whole width where narrower and a whole
  number of the tile's swizzle tiles, else None."""
  if width % q_width == 0:
    return q_width
  tile = swizzle_bytes(q_width, itemsize) // itemsize
  return width if width < q_width and width % tile == 0 else None


def _scratch(cfg: MosaicConfig, dtype, d: int, widths, stages: int, q_width: int) -> list:
  seg = cfg.segments
  bq, bk, wgs = BLOCK_Q, tiles.BLOCK_KV_BWD, COMPUTE_WGS
  v_tile = math.gcd(*widths)
  cap = tiles.bwd_swizzle_cap(jnp.dtype(dtype).itemsize)
  smem = lambda shape, width, dt=dtype: plgpu.SMEM(
    shape, dt, transforms=smem_transforms(width, dt, cap if dt == dtype else 128)
  )
  bars = barriers
  return [
    smem((2, bk, d), d),  # k_smem: K1, K2
    [smem((1, bk, w), v_tile) for w in widths],  # v_smem halves
    [smem((stages, bq, d), d) for _ in range(wgs)],  # q_smem per warpgroup
    [[smem((stages, bq, w), v_tile) for w in widths] for _ in range(wgs)],  # do_smem[map][half]
    [plgpu.SMEM((stages, ROWS, bq), jnp.float32) for _ in range(wgs)],  # rows_smem
    [plgpu.SMEM((stages, bq), jnp.int32) for _ in range(wgs)] if seg else None,  # qseg_smem
    plgpu.SMEM((bk,), jnp.int32) if seg else None,  # kvseg_smem
    plgpu.SMEM((wgs, bk, bq), dtype, transforms=smem_transforms(d, dtype, cap)),  # xp_smem
    smem((wgs, bq, q_width), q_width, jnp.float32),  # dq_smem
    plgpu.SMEM((wgs,), jnp.int32),  # zero_smem
    bars(5),  # res_bar: K1, K2, V halves, key segment ids
    bars(wgs * stages),  # q_bar [w * stages + slot]
    bars(wgs * 2 * stages),  # do_bar [(w * 2 + half) * stages + slot]
    bars(wgs * stages),  # row_bar
    bars(wgs * stages) if seg else None,  # qseg_bar
    bars(stages, arrivals=wgs),  # consumed
    bars(arrivals=wgs),  # x_bar
    bars(arrivals=wgs),  # r_bar
    bars(arrivals=wgs),  # y_bar
  ]


def backward(
  cfg: MosaicConfig, q1, q2, k1, k2, v, do, g, rows1, rows2, q_seg, kv_seg, *, stages, dq_parts
):
  """Every gradient of grouped differential attention on padded inputs.

  Args:
    cfg: the forward's config (``group``: signal heads a kv group; ``noise_group``: r).
    q1 [B, T, H, d], q2 [B, T, N, d]; k1, k2 [B, S, K, d] (V2 style: K twice); v
      [B, S, K, Dv]; T and S multiples of 64.
    do: dOut [B, T, H, Dv]; g: ``-sum_j lam_j dO_j`` per noise head [B, T, N, Dv], both in
      the input dtype (zero on padded query rows).
    rows1 [B, H, 2, T], rows2 [B, N, 2, T]: float32 (log-sum-exp base 2, row term) per map.
  Returns:
    (dq1, dq2) float32; (dk1, dk2) float32 [B, S, K, d]; dv float32, or in the input dtype
    where its halves do not split into the dQ tile's chunks (the caller casts it).
  """
  # One function: the kernel's warpgroups are closures over the sizes set here.
  b, t, h, d = q1.shape
  n_noise = q2.shape[2]
  s, kh, dv = k1.shape[1], k1.shape[2], v.shape[3]
  dtype = q1.dtype
  bq, bk = BLOCK_Q, tiles.BLOCK_KV_BWD
  if t % bq or s % bk:
    raise ValueError(f"backward wants T ({t}) and S ({s}) padded to multiples of 64.")
  heads = (h // kh, n_noise // kh)  # maps a pass walks per query block: signal, noise
  widths = tiles.value_split(dv)
  starts = (0, widths[0])
  k_widths = key_split(d, jnp.dtype(dtype).itemsize)
  itemsize, cap = jnp.dtype(dtype).itemsize, tiles.bwd_swizzle_cap(jnp.dtype(dtype).itemsize)
  p_from_smem = swizzle_bytes(d, itemsize, cap) == swizzle_bytes(math.gcd(*widths), itemsize, cap)
  k_starts = (0, k_widths[0])
  c = cfg.scale * LOG2E
  q_width = d // dq_parts
  # The float32 gradients leave through the [64, q_width] dQ tile (store_out), in chunks of
  # q_width, or whole where narrower: dK's halves always, dV's halves where their widths
  # allow (V2 style at d 96 has halves of 48 against chunks of 32), else through the V
  # halves in the input dtype (a bf16 store there made ptxas spill at V1 style d 128).
  k_chunks = tuple(_chunk(kw, q_width) for kw in k_widths)
  v_chunks = tuple(_chunk(w, q_width) for w in widths)
  dv_f32 = None not in v_chunks
  assert None not in k_chunks, (d, k_widths, q_width)
  sub = tiles.BWD_Q_SUB
  n_sub = bq // sub
  wgs = COMPUTE_WGS

  def kernel(*refs):
    # One function: the producer and both consumers close over the refs unpacked here.
    it = iter(refs)
    q1_ref, q2_ref, k1_ref, k2_ref, v_ref, do_ref, g_ref, rows1_ref, rows2_ref = (
      next(it) for _ in range(9)
    )
    qseg_ref, kvseg_ref = (next(it), next(it)) if cfg.segments else (None, None)
    dq1_ref, dq2_ref, dk1_ref, dk2_ref, dv_ref = (next(it) for _ in range(5))
    (
      k_smem,
      v_smem,
      q_smem,
      do_smem,
      rows_smem,
      qseg_smem,
      kvseg_smem,
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
      y_bar,
    ) = it

    kvh = lax.axis_index("kv_heads")
    kv_start = lax.axis_index("kv_seq") * bk
    bi = lax.axis_index("batch")
    i_start, _, n_q = q_blocks(cfg, kv_start, bq, bk)
    masked = cfg.causal or cfg.segments or cfg.kv_len % bk != 0
    per_head = n_q - i_start
    maps = tuple(hp * per_head for hp in heads)  # maps of each pass
    steps = tuple(lax.div(m + 1, 2) for m in maps)  # pairs of maps
    keys = (bi, pl.ds(kv_start, bk), kvh)
    pass_refs = ((q1_ref, do_ref, rows1_ref, dq1_ref), (q2_ref, g_ref, rows2_ref, dq2_ref))

    def map_of(p: int, n, w: int):
      """(head, query block, weight) of warpgroup w's map in step n of pass p; a step past
      an odd count of maps repeats the pass's last map at weight 0."""
      m, count = 2 * n + w, heads[p] * per_head  # few loop invariants: per_head, kvh
      weight = jnp.where(m < count, 1.0, 0.0).astype(jnp.float32)
      m = jnp.minimum(m, count - 1)
      hl = lax.div(m, per_head)
      return kvh * heads[p] + hl, i_start + lax.rem(m, per_head), weight

    def consumer(w: int):
      # One function: the step body and its sub-tiles share this warpgroup's buffers.
      plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
      for x in range(4):
        plgpu.barrier_wait(res_bar.at[x])
      kvseg = None
      if cfg.segments:
        plgpu.barrier_wait(res_bar.at[4])
        kvseg = row(kvseg_smem[...])
      zero_smem[w] = jnp.int32(0)
      tile = lambda ref: plgpu.layout_cast(ref[...], plgpu.Layout.WGMMA)

      def step(n, carry, p: int, base):
        # One function: a key block's sub-tiles pass registers to each other in order.
        dk, dv_acc = carry
        zero = zero_smem[w]  # opaque: keeps each wgmma descriptor inside its step
        slot = lax.rem(base + n, jnp.int32(stages)) + zero
        head, i, weight = map_of(p, n, w)
        k_w = k_smem.at[p + zero]
        q_w = q_smem[w].at[slot]
        q_start = i * bq
        plgpu.barrier_wait(q_bar.at[w * stages + slot])
        plgpu.barrier_wait(row_bar.at[w * stages + slot])
        if masked and cfg.segments:
          plgpu.barrier_wait(qseg_bar.at[w * stages + slot])
        for h_ in range(n_sub):
          cols = pl.ds(h_ * sub, sub)
          terms = lambda r: col(rows_smem[w].at[slot, r, cols][...])
          s_t = product((bk, sub), k_w, q_w.at[cols].transpose((1, 0))) * c
          if masked:
            qseg = col(qseg_smem[w].at[slot, cols][...]) if cfg.segments else None
            s_t = _mask_scores_t(cfg, s_t, q_start + h_ * sub, kv_start, qseg, kvseg)
          p_t = jnp.exp2(s_t - bcast_cols(terms(0), s_t.shape)) * weight
          xp_smem.at[w, :, cols][...] = p_t.astype(dtype)
          plgpu.commit_smem()  # the other warpgroup's wgmma reads it
          if h_ == 0:
            plgpu.barrier_wait(do_bar.at[(w * 2) * stages + slot])
            plgpu.barrier_wait(do_bar.at[(w * 2 + 1) * stages + slot])
            plgpu.barrier_wait(do_bar.at[((1 - w) * 2 + w) * stages + slot])
          # Both maps' P reach both warpgroups (x_bar: both written; r_bar: both read).
          plgpu.barrier_arrive(x_bar)
          plgpu.barrier_wait(x_bar)
          for x in range(wgs):
            # P^T dO with P straight from shared memory where its swizzle is dO's (a wgmma
            # takes one swizzle for both operands), else through registers.
            # At an opaque index: jax 0.11 lowers no in-place product reading a literal index.
            p_x = xp_smem.at[x + zero, :, cols]
            dv_acc = accumulate(
              dv_acc, p_x if p_from_smem else tile(p_x), do_smem[x][w].at[slot].at[cols], cfg
            )
          plgpu.barrier_arrive(r_bar)
          # dP = dO V^T of this warpgroup's map, over both V halves.
          dp_t = product(
            (bk, sub), v_smem[0].at[zero], do_smem[w][0].at[slot].at[cols].transpose((1, 0))
          )
          dp_t = accumulate(
            dp_t, v_smem[1].at[zero], do_smem[w][1].at[slot].at[cols].transpose((1, 0)), cfg
          )
          # P comes back from shared memory (as the other warpgroup read it): nothing of
          # the probabilities stays in registers across the crossing and the products.
          p_w = tile(xp_smem.at[w, :, cols]).astype(jnp.float32)
          ds_t = (p_w * (dp_t - bcast_cols(terms(1), dp_t.shape)) * cfg.scale).astype(dtype)
          plgpu.barrier_wait(r_bar)
          xp_smem.at[w, :, cols][...] = ds_t
          plgpu.commit_smem()
          # dS crosses as P did (y_bar: both written): each warpgroup adds both maps'
          # dS^T Q to its column half of dK.
          plgpu.barrier_arrive(y_bar)
          plgpu.barrier_wait(y_bar)
          for x in range(wgs):
            dk = accumulate(
              dk,
              xp_smem.at[x + zero, :, cols],
              q_smem[x].at[slot].at[cols, pl.ds(k_starts[w], k_widths[w])],
              cfg,
            )
        plgpu.commit_smem()
        dq_out = pass_refs[p][3]
        for part in range(dq_parts):
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

      def leave(value, chunk, ref, start):
        """A float32 [64, width] gradient to ``ref``'s columns from ``start``, ``chunk``
        columns at a time through this warpgroup's dQ tile (once the last copy read it)."""
        for i in range(value.shape[1] // chunk):
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          cols = pl.ds(start + i * chunk, chunk)
          store_out(value[:, i * chunk : (i + 1) * chunk], dq_smem.at[w], ref.at[(*keys, cols)])

      zeros = lambda n: plgpu.layout_cast(jnp.zeros((bk, n), jnp.float32), plgpu.Layout.WGMMA)
      dv_acc = zeros(widths[w])
      base = jnp.int32(0)
      for p, dk_ref in enumerate((dk1_ref, dk2_ref)):
        dk, dv_acc = lax.fori_loop(
          0,
          steps[p],
          lambda n, carry, p=p, base=base: step(n, carry, p, base),
          (zeros(k_widths[w]), dv_acc),
        )
        leave(dk, k_chunks[w], dk_ref, k_starts[w])
        base = base + steps[p]
      if dv_f32:
        leave(dv_acc, v_chunks[w], dv_ref, starts[w])
      else:  # through this warpgroup's V half, which the other one last read before y_bar
        dv_cols = pl.ds(starts[w], widths[w])
        store_out(dv_acc.astype(dv_ref.dtype), v_smem[w].at[0], dv_ref.at[(*keys, dv_cols)])
      plgpu.wait_smem_to_gmem(0)

    def producer():
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
      plgpu.copy_gmem_to_smem(k1_ref.at[keys], k_smem.at[0], res_bar.at[0])
      plgpu.copy_gmem_to_smem(k2_ref.at[keys], k_smem.at[1], res_bar.at[1])
      for x in range(wgs):
        plgpu.copy_gmem_to_smem(
          v_ref.at[(*keys, pl.ds(starts[x], widths[x]))], v_smem[x].at[0], res_bar.at[2 + x]
        )
      if cfg.segments:
        plgpu.copy_gmem_to_smem(kvseg_ref.at[bi, pl.ds(kv_start, bk)], kvseg_smem, res_bar.at[4])

      def load_pass(p: int, n, slot):
        q_ref, dout_ref, rows_ref, _ = pass_refs[p]
        for w in range(wgs):
          head, i, _ = map_of(p, n, w)
          rows_q = pl.ds(i * bq, bq)
          plgpu.copy_gmem_to_smem(
            q_ref.at[bi, rows_q, head], q_smem[w].at[slot], q_bar.at[w * stages + slot]
          )
          for half in range(2):
            plgpu.copy_gmem_to_smem(
              dout_ref.at[bi, rows_q, head, pl.ds(starts[half], widths[half])],
              do_smem[w][half].at[slot],
              do_bar.at[(w * 2 + half) * stages + slot],
            )
          plgpu.copy_gmem_to_smem(
            rows_ref.at[bi, head, pl.ds(0, ROWS), rows_q],
            rows_smem[w].at[slot],
            row_bar.at[w * stages + slot],
          )
          if cfg.segments:
            plgpu.copy_gmem_to_smem(
              qseg_ref.at[bi, rows_q], qseg_smem[w].at[slot], qseg_bar.at[w * stages + slot]
            )

      def load(n, slot):
        pl.when(n < steps[0])(lambda: load_pass(0, n, slot))
        pl.when(n >= steps[0])(lambda: load_pass(1, n - steps[0], slot))

      producer_ring(load, steps[0] + steps[1], stages, consumed)

    run_warpgroups(consumer, producer)

  scratch = _scratch(cfg, dtype, d, widths, stages, q_width)
  flat = [x for x in scratch if x is not None]
  args = [q1, q2, k1, k2, v, do, g, rows1, rows2] + ([q_seg, kv_seg] if cfg.segments else [])
  dk_type = jax.ShapeDtypeStruct(k1.shape, jnp.float32)
  out_type = [dk_type, dk_type, jax.ShapeDtypeStruct(v.shape, jnp.float32 if dv_f32 else dtype)]
  dq_refs = [
    jax.new_ref(jnp.zeros(q.shape, jnp.float32), memory_space=plgpu.GMEM) for q in (q1, q2)
  ]

  def body(*refs):
    pl.run_scoped(
      lambda *scr: kernel(*refs, *scratch_refs(list(scr), scratch)), *flat, collective_axes="wg"
    )

  mesh = plgpu.Mesh(
    grid=(kh, s // bk, b),
    grid_names=("kv_heads", "kv_seq", "batch"),
    num_threads=wgs + 1,
    thread_name="wg",
  )
  dk1p, dk2p, dvv = pl.kernel(
    body, out_type=out_type, mesh=mesh, name=f"gda_{cfg.variant}_bwd_mgpu", **cfg.kernel_kwargs()
  )(*args, *dq_refs)
  return (dq_refs[0][...], dq_refs[1][...]), (dk1p, dk2p), dvv
