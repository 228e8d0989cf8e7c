"""The roofline of the fused DIFF kernels (``diff_v1_pallas_tpu``, ``diff_v2_pallas_tpu``) and
of a design target that no kernel implements yet.

The fused kernels (``_forward.py``, ``_backward.py``, ``_core.py``, ``diff_attention.py``);
the code was checked against each item:

  * Forward grid (B H, visited tiles) when causal: the (q tile, kv tile) pairs holding a
    visible key (``Plan.visited_tiles``; the first key tile of every q tile always),
    row by row from scalar-prefetched step tables, so masked tiles cost no step; (B H,
    T / block_q, S / block_kv) otherwise. Q read once per (head, q tile);
    K (two components for V1, one for V2) and V per visible tile. Training saves
    residuals: out, o2 (the second map's output, in the input dtype) and lse as
    lane-dense float32 slabs (2, block_q) per query tile. V2 reads lambda as (1,
    block_q) slabs; V1's lambda sits in SMEM.
  * Backward: the queries are split into chunks of whole tiles, one kernel call each
    (``_backward.chunks`` and ``chunk_rows``, imported here; ``Tiles.dq_chunk`` overrides
    the rows): the fewest chunks whose dQ (a float32 accumulator and two output buffers
    in the input dtype, [2, rows, d] per head) fits 24 MiB of VMEM, so one chunk up to
    T = 12288 at d = 128 in bf16 and three at 32K. Grid of a call (B K, key tiles the
    chunk sees, G chunk / block_q_bwd); causal: (B K, visited steps), key tile outer,
    then the group's heads, then the query tiles that see the key tile
    (``_backward.chunk_steps``). K and V are read and dK, dV written once per key tile
    and call; Q, dO and the stats slab (8, block_q) float32 (lse_1, lse_2, D_1, D_2,
    lambda, padding) are read per visible step. dQ leaves VMEM once per (batch, kv
    group, chunk), in the input dtype. Every chunk but the last writes float32 dK/dV
    partial sums over the key tiles it sees, which the next chunk reads.
  * XLA around the backward kernel: the row terms D_1, D_2 (reading dO, out and o2),
    the stats assembly (reading the lse slabs, writing the stats slabs), and with
    several chunks (or T padded to the tile) one pass joining dQ's chunks.
  * Wrapper layout passes (rows of their own): the public functions take [B, T, heads,
    d] and the kernels [B, heads, T, d], one array per component; forward: Q, K, V and
    V2's lambda transposed in, the output back; backward: dO in, dQ, dK, dV (and V2's
    dlambda) back. Padding to the tiles, when T is not a multiple of them, rides on
    these passes. Each is counted as a full pass, an upper bound: the TPU compiler lays
    a [B, T, heads, d] array with few heads out heads-major, and then a transpose is a
    bitcast (the cross-check counts the XLA ops left in the compiled programs; compiled
    for a v5e chip with 6 DIFF heads, the 3B layer over two model shards, the V1
    forward has none at T = 4096).
  * Query segment ids ([B, Tp, 1] int32, padded to 128 lanes) only with
    ``Shape.segmented``; the stock paths always pass them to splash.

Fused target (a design target, not an implementation): the same two-map kernels with
dQ accumulated in VMEM for a whole (batch, head) at every length and written once in
the input dtype (the kernel does so per query chunk, with dK/dV partials between);
causal grids that visit only tiles holding a real visible key (the kernels do, but keep
the first key tile of every query tile); row statistics of exactly k float32 per row
(lse 2, stats 4 for V1 and 5 for V2; the kernels' slabs hold 8 per row); kernels reading
and writing the [B, T, heads, d] layout directly (as the kernels do at d = 128). The row
terms stay one XLA pass.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from diffjax.kernels.tpu import _backward as bwd_kernel
from diffjax.kernels.tpu import _layout as kernel_layout
from tools.tpu_roofline.model import (
  F32,
  I32,
  KERNEL,
  LAYOUT,
  SUBLANES,
  Op,
  Shape,
  Tiles,
  count_fetches,
  fused_bwd_tile_flops,
  fused_tiles,
  fwd_tile_flops,
  lanes,
  round_up,
  tiles_with_visible_keys,
  visited_tiles,
  xla_op,
)


@dataclasses.dataclass(frozen=True)
class Flavour:
  """V1 (two key components, value 2d, lambda per head) or V2 (one key, value d,
  lambda per row, 2H pairs)."""

  version: int
  heads: int  # DIFF heads (V1) or pairs (V2)
  key_components: int
  dv: int


def flavour(version: int, shape: Shape) -> Flavour:
  d = shape.head_dim
  if version == 1:
    return Flavour(1, shape.diff_heads, 2, 2 * d)
  return Flavour(2, 2 * shape.diff_heads, 1, d)


def slab_bytes(tiles_: int, rows: int, block: int) -> int:
  """HBM bytes of ``tiles_`` lane-dense float32 slabs (rows, block): rows on 8 sublanes,
  the block on 128 lanes."""
  return tiles_ * round_up(rows, SUBLANES) * lanes(block) * F32


def fused_fwd_kernel(shape: Shape, tiles: Tiles, version: int, *, target: bool = False) -> Op:
  """The forward kernel with residuals (training); ``target`` visits only tiles with a
  visible key and writes lse with 2 words per row."""
  fl = flavour(version, shape)
  s, b, d, h = shape.itemsize, shape.batch, shape.head_dim, fl.heads
  bq, bk, tp, sp = fused_tiles(shape.seq, tiles.block_q, tiles.block_kv)
  nq, nkv = tp // bq, sp // bk
  if target:
    mask = tiles_with_visible_keys(shape.seq, bq, bk, shape.causal)
    kv_per_head = count_fetches(np.nonzero(mask)[1])  # row-major: the grid's order
  else:
    mask = visited_tiles(tp, sp, bq, bk, shape.causal)
    i = np.arange(nq)[:, None]
    j = np.broadcast_to(np.arange(nkv)[None, :], (nq, nkv))
    last_visible = np.clip((i * bq + bq - 1) // bk, 0, nkv - 1)
    # The causal grid visits the visible tiles row by row; the masked ones it leaves out
    # would have kept the last visible K/V block, so clamping counts the same fetches.
    kv_index = np.minimum(j, last_visible) if shape.causal else j
    kv_per_head = count_fetches(kv_index)  # the K/V block index does not hold i
  steps = b * h * int(mask.sum())
  kv_fetch = b * h * kv_per_head
  rows = b * h * tp
  detail = {
    "Q": rows * 2 * d * s,
    "K,V": kv_fetch * bk * (fl.key_components * d + fl.dv) * s,
    "out": rows * fl.dv * s,
    "o2": rows * fl.dv * s,
    "lse": rows * 2 * F32 if target else slab_bytes(b * h * nq, 2, bq),
  }
  reads = ["Q", "K,V"]
  if version == 2:
    detail["lambda rows"] = rows * F32 if target else slab_bytes(b * h * nq, 1, bq)
    reads.append("lambda rows")
  else:
    detail["lambda (SMEM)"] = h * F32
    reads.append("lambda (SMEM)")
  if shape.segmented:
    detail["segment ids"] = b * h * tp * (1 if target else lanes(1)) * I32 + kv_fetch * bk * I32
    reads.append("segment ids")
  flops = b * h * int(mask.sum()) * fwd_tile_flops(bq, bk, d, fl.dv, 2)
  return Op(
    f"V{version}: diff_attention_fwd" + (" (target)" if target else ""),
    KERNEL,
    read=sum(detail[k] for k in reads),
    written=sum(v for k, v in detail.items() if k not in reads),
    flops=flops,
    steps=steps,
    detail=detail,
  )


def bwd_plan(shape: Shape, tiles: Tiles, version: int) -> Any:
  """The backward's ``_layout.Plan`` at this shape (kv heads equal to heads)."""
  fl = flavour(version, shape)
  return kernel_layout.make_plan(
    q_len=shape.seq,
    kv_len=shape.seq,
    block_q=tiles.block_q_bwd,
    block_kv=tiles.block_kv_bwd,
    causal=shape.causal,
    segmented=shape.segmented,
    scale=1.0,
    shared_k=version == 2,
    lam_rows=version == 2,
    heads=fl.heads,
    kv_heads=fl.heads,
    dq_chunk=tiles.dq_chunk,
  )


def bwd_chunks(shape: Shape, tiles: Tiles, version: int) -> list[Any]:
  """The backward's calls (``_backward.chunks`` with the kernel's own rule)."""
  plan = bwd_plan(shape, tiles, version)
  return bwd_kernel.chunks(plan, bwd_kernel.chunk_rows(plan, shape.head_dim, shape.itemsize))


def _bwd_q_index(nq: int, nkv: int, first: int, bq: int, bk: int, causal: bool) -> np.ndarray:
  """[nkv, nq] the Q-side block index of one head's grid steps (key tile outer): the
  chunk's query tiles from ``first``, raised to the first visible one when causal."""
  j = np.arange(nkv)[:, None]
  i = np.broadcast_to(first + np.arange(nq)[None, :], (nkv, nq))
  first_visible = np.clip((j * bk) // bq, 0, None)
  return np.maximum(i, first_visible) if causal else i


def fused_bwd_kernel(shape: Shape, tiles: Tiles, version: int, *, target: bool = False) -> Op:
  """The backward kernel: dQ, dK, dV of both maps in one pass over the tiles (one call
  per query chunk, summed here)."""
  fl = flavour(version, shape)
  s, b, d, h = shape.itemsize, shape.batch, shape.head_dim, fl.heads
  bq, bk, tp, sp = fused_tiles(shape.seq, tiles.block_q_bwd, tiles.block_kv_bwd)
  nkv = sp // bk
  kv_tile = bk * (fl.key_components * d + fl.dv)  # elements of one key tile's K and V
  partial = {}
  if target:
    mask = tiles_with_visible_keys(shape.seq, bq, bk, shape.causal)
    q_per_head = count_fetches(np.nonzero(mask.T)[1])  # key tile outer, query tile inner
    kv_per_head = int(mask.any(0).sum())
    steps = b * h * int(mask.sum())
    stat_words = 4 if version == 1 else 5
  else:
    mask = visited_tiles(tp, sp, bq, bk, shape.causal)
    calls = bwd_chunks(shape, tiles, version)
    q_per_head = sum(
      count_fetches(_bwd_q_index(c.num_q_blocks, c.num_kv_blocks, c.first, bq, bk, shape.causal))
      for c in calls
    )
    kv_per_head = sum(c.num_kv_blocks for c in calls)
    # The kernel's own step tables: only the visited tiles of each call (causal).
    plan = bwd_plan(shape, tiles, version)
    steps = (
      b
      * h
      * sum(
        len(bwd_kernel.chunk_steps(plan, c)[0])
        if shape.causal
        else c.num_q_blocks * c.num_kv_blocks
        for c in calls
      )
    )
    stat_words = 8 * lanes(bq) / bq
    # Every chunk but the last writes float32 partial dK, dV over its key tiles; the
    # next reads them back.
    partial_tiles = sum(c.num_kv_blocks for c in calls if not c.final)
    if partial_tiles:
      partial = {
        "dK,dV f32 partials written": b * h * partial_tiles * kv_tile * F32,
        "dK,dV f32 partials read": b * h * partial_tiles * kv_tile * F32,
      }
  q_fetch = b * h * q_per_head
  detail = {
    "K,V": b * h * kv_per_head * kv_tile * s,
    "Q": q_fetch * 2 * bq * d * s,
    "dO": q_fetch * bq * fl.dv * s,
    "stats": int(q_fetch * bq * stat_words * F32),
  }
  if version == 1:
    detail["lambda (SMEM)"] = h * F32
  if shape.segmented:
    detail["segment ids"] = (
      q_fetch * bq * (1 if target else lanes(1)) * I32 + b * h * kv_per_head * bk * I32
    )
  if "dK,dV f32 partials read" in partial:
    detail["dK,dV f32 partials read"] = partial["dK,dV f32 partials read"]
  read = sum(detail.values())
  detail["dK,dV"] = b * h * nkv * kv_tile * s
  if partial:
    detail["dK,dV f32 partials written"] = partial["dK,dV f32 partials written"]
  # The target writes dQ at the real length; a chunk's [2, rows, d] block leaves VMEM
  # once per (batch, kv group), padded rows included.
  detail["dQ (once, input dtype)"] = b * h * 2 * (shape.seq if target else tp) * d * s
  written = sum(detail.values()) - read
  flops = b * h * int(mask.sum()) * fused_bwd_tile_flops(bq, bk, d, fl.dv)
  return Op(
    f"V{version}: diff_attention_bwd" + (" (target)" if target else ""),
    KERNEL,
    read=read,
    written=written,
    flops=flops,
    steps=steps,
    detail=detail,
  )


def fused_ops(shape: Shape, tiles: Tiles, version: int) -> dict[str, list[Op]]:
  """The fused path: kernels, the XLA ops of ``_core`` and the wrapper layouts."""
  fl = flavour(version, shape)
  s, b, t, d, h, dv = (shape.itemsize, shape.batch, shape.seq, shape.head_dim, fl.heads, fl.dv)
  bqf, _, tpf, spf = fused_tiles(t, tiles.block_q, tiles.block_kv)
  bqb, _, tpb, spb = fused_tiles(t, tiles.block_q_bwd, tiles.block_kv_bwd)
  rows = b * h * t
  q_in, k_in = b * t * h * 2 * d, b * t * h * fl.key_components * d
  v_in = b * t * h * dv
  row_f32 = rows * F32  # one float32 per query row: D1, D2, V2's lambda

  # lse as the forward writes it, per (batch, head).
  lse_bytes = slab_bytes(b * h * tpf // bqf, 2, bqf)
  fwd = [fused_fwd_kernel(shape, tiles, version)]
  pad = lambda full, padded: full * padded // t  # elements once padded along T
  layout_f = [
    xla_op("q (each component) to [B, H, T, d]", q_in * s, pad(q_in, tpf) * s, LAYOUT),
    xla_op(
      "k components to [B, H, C, S, d]" if version == 1 else "k to [B, H, S, d]",
      k_in * s,
      pad(k_in, spf) * s,
      LAYOUT,
    ),
    xla_op("v to [B, H, S, dv]", v_in * s, pad(v_in, spf) * s, LAYOUT),
    xla_op("out to [B, T, H, dv]", v_in * s, v_in * s, LAYOUT),
  ]
  if version == 2:
    layout_f.append(xla_op("lam to [B, H, T]", row_f32, row_f32, LAYOUT))
    fwd.append(
      xla_op("lam rows to lane-dense slabs", row_f32, slab_bytes(b * h * tpf // bqf, 1, bqf))
    )
  if tpf != t:
    fwd.append(xla_op("o2 sliced to T", b * h * tpf * dv * s, rows * dv * s))

  bwd = [
    xla_op("row terms D1, D2 = rowsum(dO out, dO o2)", 3 * rows * dv * s, 2 * row_f32),
    xla_op(
      "stats slabs [B, H, Tp / block_q, 8, block_q]",
      lse_bytes + 2 * row_f32 + (row_f32 if version == 2 else 0),
      slab_bytes(b * h * tpb // bqb, 8, bqb),
    ),
  ]
  if tpb != t:
    bwd.append(
      xla_op("q, dO padded to the backward tile", (q_in + v_in) * s, pad(q_in + v_in, tpb) * s)
    )
  if spb != t:
    bwd.append(
      xla_op("k, v padded to the backward tile", (k_in + v_in) * s, pad(k_in + v_in, spb) * s)
    )
  bwd.append(fused_bwd_kernel(shape, tiles, version))
  dq_elements = b * h * 2 * d
  if len(bwd_chunks(shape, tiles, version)) > 1 or tpb != t:
    bwd.append(
      xla_op("dQ chunks concatenated (and sliced to T)", dq_elements * tpb * s, dq_elements * t * s)
    )
  layout_b = [
    xla_op("dO to [B, H, T, dv]", v_in * s, v_in * s, LAYOUT),
    xla_op(
      "dq back to [B, T, H, d]" + (" x2" if version == 1 else " (4H heads)"),
      q_in * s,
      q_in * s,
      LAYOUT,
    ),
    xla_op("dk back", k_in * s, k_in * s, LAYOUT),
    xla_op("dv back", v_in * s, v_in * s, LAYOUT),
  ]
  if version == 2:
    layout_b.append(xla_op("dlam to [B, T, H]", row_f32, row_f32, LAYOUT))
  return {"fwd": fwd + layout_f, "bwd": bwd + layout_b}


def target_ops(shape: Shape, tiles: Tiles, version: int) -> dict[str, list[Op]]:
  """The design target: see the module docstring. No kernel implements it yet."""
  fl = flavour(version, shape)
  s, b, t, h, dv = shape.itemsize, shape.batch, shape.seq, fl.heads, fl.dv
  _, _, tpb, _ = fused_tiles(t, tiles.block_q_bwd, tiles.block_kv_bwd)
  rows = b * h * t
  stat_words = 4 if version == 1 else 5
  stats = xla_op(
    "row terms and lane-dense stats",
    3 * rows * dv * s + rows * 2 * F32 + (rows * F32 if version == 2 else 0),
    b * h * tpb * stat_words * F32,
  )
  return {
    "fwd": [fused_fwd_kernel(shape, tiles, version, target=True)],
    "bwd": [stats, fused_bwd_kernel(shape, tiles, version, target=True)],
  }
