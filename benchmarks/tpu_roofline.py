"""HBM traffic and MXU FLOPs of the TPU attention kernels, and the time they bound.

This is a MODEL, not a timing: nothing runs on a TPU. For one attention layer at a
given shape and tile sizes it counts the bytes every kernel and every XLA op around it
moves in HBM and the matmul FLOPs the MXU executes, then prints, per TPU generation,
the roofline lower bound sum over ops of max(bytes / HBM bandwidth, FLOPs / bf16 peak).
Real kernels are slower (pipeline bubbles, VPU and EUP work, the exp of every score,
DMA descriptors); the bound says how far apart two designs must be at best.

  python benchmarks/tpu_roofline.py                       # T = 4K, 8K, 32K, 3B shapes
  python benchmarks/tpu_roofline.py --seq 1024 --json /tmp/roofline.json
  python benchmarks/tpu_roofline.py --cross-check         # + AOT compile at T = 1024

Arms, for B sequences of T tokens and DIFF heads H of component width d (d_model =
2 H d): the Transformer has 2H heads of width d; DIFF V1 has H heads (Q1, Q2, K1, K2
of width d, V of width 2d); DIFF V2 has 2H pairs (2 query heads of width d sharing one
key and one value of width d). Self-attention (S = T), kv heads equal to heads.

  Transformer, splash   ``mha_stock_tpu``: one splash-attention call over 2H heads.
  V1 / V2 stock         ``diff_v1_stock_tpu`` (two splash calls with the 2d-wide value)
                        and ``diff_v2_stock_tpu`` (one call over the 4H query heads),
                        then the lambda combination in XLA.
  V1 / V2 fused before  the fused kernels as of commit 99978ee (dQ round trip in HBM).
  V1 / V2 fused today   ``diff_v1_pallas_tpu`` / ``diff_v2_pallas_tpu``.
  V1 / V2 fused target  a design target that no kernel implements yet (see below).

What is counted (from the code in ``diffjax/kernels/tpu`` and jax's splash attention):

  * A Pallas kernel moves a block between HBM and VMEM only when the block index of an
    operand changes from one grid step to the next (the pipeline skips the copy of an
    unchanged block). The fetch counts come from walking each kernel's index maps over
    its grid, the causal clamps and splash's shrunk mask tables included, so a masked
    step that keeps the previous block moves nothing.
  * Grid steps are counted separately: every step costs a fixed overhead even when it
    skips its compute (``--step-overhead-us``, 0.35 us by default, an assumption, not a
    measured figure). The per-generation columns leave it out; the ``step us`` column
    is steps x overhead, serial (a megacore chip splits parallel grid axes over its two
    cores).
  * MXU FLOPs are the matmuls executed per visited tile, at tile granularity (a diagonal
    tile of a causal mask computes all of its scores), 2 FLOPs per multiply-add.
  * Every XLA op around the kernels is one pass that reads its inputs and writes its
    output once in HBM (XLA fuses element-wise chains; it may also fold a transpose
    into a producer's layout or keep a small buffer in VMEM, which only lowers the
    real figure).
  * A float32 array whose minor dimension is small is stored with that dimension padded
    to 128 lanes (the (8, 128) tiling the TPU compiler gave before's ``lse [B, H, T, 2]``
    and ``stats [B, H, T, 8]``). A DMA of a ``(block, 8)`` tile of such an array moves
    ``block x 128`` words. Today's lane-dense slabs ``[B, H, T / block, R, block]`` are
    counted with R rounded up to 8 sublanes and the block to 128 lanes (``--cross-check``
    prints the layouts the compiler chose for both). V2's lambda argument [B, T, H] is
    counted lane-dense: the compiler chose such a layout for it in the cross-check.
  * Tiles: the fused kernels' defaults for the head width (``BlockSizes.get_default``,
    what ``block_sizes=None`` resolves to: 512 x 512 forward, 512 x 256 backward at
    d = 128; the dataclass's own field defaults, all 512, are not what runs), shrunk to
    the sequence as ``_layout.make_plan`` does; ``--block-*`` overrides them.

Splash attention (jax 0.10 ``splash_attention_kernel``), as the stock wrappers call it:
tiles of 512 (``--splash-block``); every call carries segment ids (zeros when none are
given) and the causal mask is computed from a position array, so each kernel also
reads int32 segment and position tiles ((block, 128) or (8, block) broadcasts that XLA
writes per call). Its shrunk grid has the width of the longest row of the block mask,
which for a causal square is the full width: it visits every (q tile, kv tile) step
too. Forward: Q once per (head, q tile), K and V per visible tile, O and a
lane-broadcast float32 logsumexp [heads, T, 128] written. Backward: XLA computes
``di = rowsum(O dO)`` and reshapes logsumexp and di for the kernels ([heads, 1, T] for
dQ; [heads, 8, T] broadcasts for dK/dV); the dK/dV kernel walks key tiles outermost
and reads Q, dO, logsumexp and di per visible tile; the dQ kernel walks query tiles
outermost and reads K and V per visible tile; dQ, dK and dV are written once, in the
input dtype. Each backward kernel recomputes the scores and dP, so the executed
backward is 14 d per visible query-key pair for a head of width d (the 10 d usually
quoted counts each product once). Splash's constant-index scratch outputs (a few
hundred KiB per call) are left out.

Fused kernels today (``_forward.py``, ``_backward.py``, ``_core.py``,
``diff_attention.py``); the code was checked against each item:

  * Forward grid (B H, visited tiles) when causal: the (q tile, kv tile) pairs holding a
    visible key (``Plan.visited_tiles``; the first key tile of every q tile always),
    row by row from scalar-prefetched step tables, so masked tiles cost no step; (B H,
    T / block_q, S / block_kv) otherwise. Q read once per (head, q tile);
    K (two components for V1, one for V2) and V per visible tile. Training saves
    residuals: out, o2 (the second map's output, in the input dtype) and lse as
    lane-dense float32 slabs (2, block_q) per query tile. V2 reads lambda as (1,
    block_q) slabs; V1's lambda sits in SMEM.
  * Backward: the queries are split into chunks of whole tiles, one kernel call each
    (``_backward.chunks`` and ``chunk_rows``, imported here; ``--dq-chunk`` overrides the
    rows): the fewest chunks whose dQ (a float32 accumulator and two output buffers in
    the input dtype, [2, rows, d] per head) fits 24 MiB of VMEM, so one chunk up to
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
  * Before (rows "fused before"; the kernels of commit 99978ee, kept as a
    computed baseline): the same kernels, except that the backward was one call whose
    dQ lived in HBM as float32: every visible step read the 2 x block_q x d tile and
    wrote it back, except that the first key tile (always visible) wrote without
    reading; XLA then converted dQ to the input dtype. Both grids visited every (q tile,
    kv tile) step of a causal square, a masked step skipping its compute (the forward
    keeping the last visible key tile, the backward prefetching the first visible query
    tile, so no extra DMA) but paying the step. Row statistics were [B, H, Tp, R]
    float32 (lse R = 2, stats 8, V2's lambda 1) padded to 128 lanes, and XLA sliced lse
    to T after the forward when T was padded.
  * Wrapper layout passes (rows of their own): the public functions take [B, T, heads,
    d] and the kernels [B, heads, T, d], one array per component (before: V1's Q1/Q2
    and K1/K2 stacked into one); forward: Q, K, V and V2's lambda transposed in, the
    output back; backward: dO in, dQ, dK, dV (and V2's dlambda) back. Padding to the
    tiles, when T is not a multiple of them, rides on these passes. Each is counted as a
    full pass, an upper bound: the TPU compiler lays a [B, T, heads, d] array with few
    heads out heads-major, and then a transpose is a bitcast (``--cross-check`` counts
    the XLA ops left in the compiled programs; compiled for a v5e chip with 6 DIFF heads,
    the 3B layer over two model shards, today's V1 forward has none at T = 4096).
  * Query segment ids ([B, Tp, 1] int32, padded to 128 lanes) only with
    ``--segment-ids``; the stock paths always pass them to splash.

Fused target (a design target, not an implementation): the same two-map kernels with
dQ accumulated in VMEM for a whole (batch, head) at every length and written once in
the input dtype (today's kernel does so per query chunk, with dK/dV partials between);
causal grids that visit only tiles holding a real visible key (today's do, but keep the
first key tile of every query tile); row statistics of exactly k float32 per row (lse 2,
stats 4 for V1 and 5 for V2; today's slabs hold 8 per row); kernels reading and
writing the [B, T, heads, d] layout directly (as today's do at d = 128). The row terms
stay one XLA pass.

Generations: per-chip HBM bandwidth and dense bf16 peak FLOP/s as Google publishes
them. A float32 run (``--dtype f32``) still divides by the bf16 peak, so its compute
bound stays a lower bound.

``--cross-check`` compiles the fused V1 and V2 forward and forward+backward for one
layer at ``--cross-check-seq`` (1024) for one chip of a v5e:2x2 topology (libtpu, no
TPU needed) and prints, next to the model's figures at that shape, what the compiled
executable reports: argument, output and temporary sizes (``memory_analysis()``) and
``cost_analysis()`` bytes accessed and FLOPs (for a Pallas call XLA takes the kernel's
own declared CostEstimate), plus the layouts of the row-statistics arrays. Every figure
there is marked "modelled" or "read from the compiler".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from diffjax.kernels.tpu import _backward as bwd_kernel  # noqa: E402
from diffjax.kernels.tpu import _layout as kernel_layout  # noqa: E402
from diffjax.kernels.tpu.block_sizes import BlockSizes  # noqa: E402

LANES = 128
SUBLANES = 8
F32 = 4
I32 = 4


@dataclasses.dataclass(frozen=True)
class Chip:
  hbm_bytes_per_s: float
  bf16_flops_per_s: float


# Google's published per-chip figures (Cloud TPU system architecture pages): HBM
# bandwidth and peak dense bf16 compute of one chip.
GENERATIONS: dict[str, Chip] = {
    "v5e": Chip(hbm_bytes_per_s=819e9, bf16_flops_per_s=197e12),
    "v5p": Chip(hbm_bytes_per_s=2765e9, bf16_flops_per_s=459e12),
    "v6e": Chip(hbm_bytes_per_s=1640e9, bf16_flops_per_s=918e12),
}

TRANSFORMER = "Transformer, splash"
V1_STOCK = "DIFF V1, stock"
V2_STOCK = "DIFF V2, stock"
V1_BEFORE = "DIFF V1, fused before"
V2_BEFORE = "DIFF V2, fused before"
V1_FUSED = "DIFF V1, fused today"
V2_FUSED = "DIFF V2, fused today"
V1_TARGET = "DIFF V1, fused target*"
V2_TARGET = "DIFF V2, fused target*"
ARMS = (TRANSFORMER, V1_STOCK, V2_STOCK, V1_BEFORE, V2_BEFORE, V1_FUSED, V2_FUSED, V1_TARGET,
        V2_TARGET)

KERNEL, XLA, LAYOUT = "kernels", "XLA ops", "wrapper layout passes"
PARTS = (KERNEL, XLA, LAYOUT)


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def lanes(n: int) -> int:
  """Minor dimension of n float32 words as stored in HBM (padded to the lane count)."""
  return round_up(n, LANES)


@dataclasses.dataclass(frozen=True)
class Shape:
  """One attention layer: B sequences of T tokens, H DIFF heads of width d."""
  batch: int
  diff_heads: int
  head_dim: int
  seq: int
  itemsize: int = 2
  causal: bool = True
  segmented: bool = False


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Fused forward and backward tiles (as BlockSizes), the backward's query rows per call
  (``BlockSizes.dq_chunk``: None lets the kernel's rule decide) and splash's tile."""
  block_q: int
  block_kv: int
  block_q_bwd: int
  block_kv_bwd: int
  splash: int = 512
  dq_chunk: int | None = None


@dataclasses.dataclass
class Op:
  """One kernel or XLA op: HBM bytes read and written, MXU FLOPs, grid steps."""
  name: str
  part: str
  read: int = 0
  written: int = 0
  flops: int = 0
  steps: int = 0
  detail: dict[str, int] = dataclasses.field(default_factory=dict)

  @property
  def bytes(self) -> int:
    return self.read + self.written

  def bound_s(self, chip: Chip) -> float:
    return max(self.bytes / chip.hbm_bytes_per_s, self.flops / chip.bf16_flops_per_s)


def _xla(name: str, read: int, written: int, part: str = XLA) -> Op:
  return Op(name, part, read=int(read), written=int(written))


# ----------------------------------------------------------------------------------
# Tiles, visibility and block fetches.


def fused_tiles(seq: int, block_q: int, block_kv: int) -> tuple[int, int, int, int]:
  """(block_q, block_kv, Tp, Sp) of a fused pass: tiles shrink to the sequence
  (16-row and 128-lane granularity, as ``_layout.make_plan``) and T pads to them."""
  bq = min(block_q, round_up(seq, 16))
  bk = min(block_kv, round_up(seq, LANES))
  return bq, bk, round_up(seq, bq), round_up(seq, bk)


def splash_tiles(seq: int, block: int) -> tuple[int, int, int]:
  """(block_q = block_kv, Tp, Sp) of the stock wrappers' splash call."""
  padded = round_up(seq, LANES)
  b = min(block, padded)
  return b, round_up(padded, b), round_up(padded, b)


def visited_tiles(tp: int, sp: int, bq: int, bk: int, causal: bool) -> np.ndarray:
  """[nq, nkv] bool: the tiles the fused kernels compute (``Plan.block_visible``).

  A tile is computed when its last query position reaches its first key; the first key
  tile always is. Self-attention: the causal offset S - T is 0. Splash's causal block
  mask over its padded square is the same set.
  """
  i = np.arange(tp // bq)[:, None]
  j = np.arange(sp // bk)[None, :]
  if not causal:
    return np.ones((tp // bq, sp // bk), bool)
  return (j == 0) | (j * bk <= i * bq + bq - 1)


def tiles_with_visible_keys(seq: int, bq: int, bk: int, causal: bool) -> np.ndarray:
  """[nq, nkv] bool: tiles holding at least one real (query, key) pair that attends."""
  nq, nkv = round_up(seq, bq) // bq, round_up(seq, bk) // bk
  i = np.arange(nq)[:, None]
  j = np.arange(nkv)[None, :]
  last_q = np.minimum(i * bq + bq, seq) - 1
  seen = (i * bq < seq) & (j * bk < seq)
  if causal:
    seen = seen & (j * bk <= last_q)
  return np.broadcast_to(seen, (nq, nkv))


def count_fetches(*indices) -> int:
  """Block copies a Pallas pipeline issues for an operand whose block index, step by
  step in grid order, is given by the arrays (one per index component): one copy for
  the first step and one for every step whose index differs from the previous step's."""
  idx = np.stack([np.asarray(c, np.int64).ravel() for c in indices])
  if idx.shape[1] == 0:
    return 0
  return int(1 + np.count_nonzero(np.any(idx[:, 1:] != idx[:, :-1], axis=0)))


def _splash_rows(mask: np.ndarray) -> tuple[np.ndarray, int]:
  """Splash's shrunk forward / dQ table: for each q tile the visible kv tiles in order,
  padded at the end with tile 0 to the longest row's length; returns (table, width)."""
  width = int(mask.sum(1).max())
  table = np.zeros((mask.shape[0], width), np.int64)
  for i, row in enumerate(mask):
    cols = np.nonzero(row)[0]
    table[i, :len(cols)] = cols
  return table, width


def _splash_cols(mask: np.ndarray) -> tuple[np.ndarray, int]:
  """Splash's shrunk dK/dV table: for each kv tile the visible q tiles in order, padded
  at the front with tile 0 to the longest column's length."""
  width = int(mask.sum(0).max())
  table = np.zeros((mask.shape[1], width), np.int64)
  for j in range(mask.shape[1]):
    rows = np.nonzero(mask[:, j])[0]
    table[j, width - len(rows):] = rows
  return table, width


# ----------------------------------------------------------------------------------
# MXU FLOPs per tile.


def fwd_tile_flops(bq: int, bk: int, d: int, dv: int, maps: int) -> int:
  """Q K^T and P V of ``maps`` softmax maps on one [bq, bk] tile."""
  return maps * 2 * bq * bk * (d + dv)


def fused_bwd_tile_flops(bq: int, bk: int, d: int, dv: int) -> int:
  """The fused backward on one tile: Q_c K_c^T (2), dP = dO V^T and dV (shared by the
  maps), dK_c and dQ_c (2 each): (12 d + 4 dv) bq bk."""
  return bq * bk * (12 * d + 4 * dv)


def splash_bwd_tile_flops(bq: int, bk: int, d: int, dv: int) -> tuple[int, int]:
  """(dK/dV kernel, dQ kernel) per tile: both recompute Q K^T and dP = dO V^T."""
  dkv = 2 * bq * bk * (2 * d + 2 * dv)  # QK^T, dP, dV, dK
  dq = 2 * bq * bk * (2 * d + dv)  # QK^T, dP, dQ
  return dkv, dq


# ----------------------------------------------------------------------------------
# Splash attention (the Transformer and the stock DIFF paths).


def splash_inputs_ops(shape: Shape, tiles: Tiles) -> tuple[list[Op], list[Op]]:
  """The int32 segment-id and position broadcasts XLA writes for splash's kernels:
  (forward ones, which the dQ kernel reuses; dK/dV ones)."""
  _, tp, sp = splash_tiles(shape.seq, tiles.splash)
  b = shape.batch
  fwd = b * (tp * LANES + SUBLANES * sp) * I32 + tp * LANES * I32
  dkv = b * (SUBLANES * tp + sp * LANES) * I32 + SUBLANES * tp * I32
  return ([_xla("splash segment ids and positions (fwd, dQ)", 0, fwd)],
          [_xla("splash segment ids and positions (dK/dV)", 0, dkv)])


def splash_call_ops(shape: Shape, tiles: Tiles, *, q_heads: int, kv_heads: int, dv: int,
                    label: str) -> tuple[list[Op], list[Op]]:
  """Forward and backward ops of one splash call (kernels and their XLA helpers)."""
  s, b, d = shape.itemsize, shape.batch, shape.head_dim
  bq, tp, sp = splash_tiles(shape.seq, tiles.splash)
  bk = bq
  nq, nkv = tp // bq, sp // bk
  group = q_heads // kv_heads
  mask = visited_tiles(tp, sp, bq, bk, shape.causal)
  visible = int(mask.sum())
  heads = np.arange(q_heads)

  # Forward and dQ kernels: grid (head, q tile, w), K/V index (head // group, table).
  rows, width = _splash_rows(mask)
  h_idx = np.broadcast_to(heads[:, None, None] // group, (q_heads, nq, width))
  kv_fetch = b * count_fetches(h_idx, np.broadcast_to(rows, (q_heads, nq, width)))
  row_fetch = b * q_heads * nq  # Q, O, dO, lse, segment and position rows per (h, i)
  kv_tile = bk * (d + dv) * s
  seg_rows = 2 * bq * LANES * I32  # q segment ids and q positions, (bq, 128) int32
  # kv segment ids, (8, bk) int32, indexed by the table alone (no head).
  kv_seg = b * count_fetches(np.broadcast_to(rows, (q_heads, nq, width))) * SUBLANES * bk * I32
  fwd_flops = b * q_heads * visible * fwd_tile_flops(bq, bk, d, dv, 1)
  fwd = Op(f"{label}: splash fwd", KERNEL, flops=fwd_flops,
           steps=b * q_heads * nq * width)
  fwd.detail = {"Q": row_fetch * bq * d * s, "K,V": kv_fetch * kv_tile,
                "segment ids, positions": row_fetch * seg_rows + kv_seg,
                "O": b * q_heads * tp * dv * s,
                "logsumexp (128 lanes)": b * q_heads * tp * LANES * F32}
  fwd.read = fwd.detail["Q"] + fwd.detail["K,V"] + fwd.detail["segment ids, positions"]
  fwd.written = fwd.detail["O"] + fwd.detail["logsumexp (128 lanes)"]

  lse_padded = b * q_heads * tp * LANES * F32
  rows_f32 = b * q_heads * tp * F32
  di = _xla(f"{label}: di = rowsum(O dO)", 2 * b * q_heads * tp * dv * s, rows_f32)
  reshape = _xla(f"{label}: logsumexp, di reshaped for the backward kernels",
                 2 * lse_padded + rows_f32, 2 * rows_f32 + 2 * SUBLANES * rows_f32)

  # dK/dV kernel: grid (kv tile, head, w); Q-side index (head, table), K/V (head // g, j).
  cols, width_dkv = _splash_cols(mask)
  j_idx = np.broadcast_to(np.arange(nkv)[:, None, None], (nkv, q_heads, width_dkv))
  h3 = np.broadcast_to(heads[None, :, None], (nkv, q_heads, width_dkv))
  q_side = np.broadcast_to(cols[:, None, :], (nkv, q_heads, width_dkv))
  q_fetch = b * count_fetches(h3, q_side)
  seg_fetch = b * count_fetches(q_side)  # q segment ids and positions: no head index
  kv_once = b * count_fetches(h3 // group, j_idx)
  dkv_flops, dq_flops = splash_bwd_tile_flops(bq, bk, d, dv)
  dkv = Op(f"{label}: splash dK/dV", KERNEL, flops=b * q_heads * visible * dkv_flops,
           steps=b * nkv * q_heads * width_dkv)
  dkv.detail = {
      "K,V": kv_once * kv_tile,
      "Q, dO": q_fetch * bq * (d + dv) * s,
      "lse, di (8 rows)": q_fetch * 2 * SUBLANES * bq * F32,
      "segment ids, positions": seg_fetch * 2 * SUBLANES * bq * I32
                                + b * nkv * bk * LANES * I32,
      "dK, dV": kv_once * kv_tile,
  }
  dkv.read = sum(v for k, v in dkv.detail.items() if k != "dK, dV")
  dkv.written = dkv.detail["dK, dV"]

  dq = Op(f"{label}: splash dQ", KERNEL, flops=b * q_heads * visible * dq_flops,
          steps=b * q_heads * nq * width)
  dq.detail = {
      "Q, dO": row_fetch * bq * (d + dv) * s,
      "lse, di": row_fetch * 2 * bq * F32,
      "segment ids, positions": row_fetch * seg_rows + kv_seg,
      "K,V": kv_fetch * kv_tile,
      "dQ": b * q_heads * tp * d * s,
  }
  dq.read = sum(v for k, v in dq.detail.items() if k != "dQ")
  dq.written = dq.detail["dQ"]
  return [fwd], [di, reshape, dkv, dq]


def _transpose(name: str, elements: int, itemsize: int, n_in: int = 1,
               padded: float = 1.0) -> Op:
  """A layout pass: reads ``n_in`` arrays of ``elements`` and writes one, ``padded``
  times longer when the pass also pads T to the tile."""
  return _xla(name, n_in * elements * itemsize, int(elements * padded) * itemsize, LAYOUT)


def transformer_ops(shape: Shape, tiles: Tiles) -> dict[str, list[Op]]:
  """``mha_stock_tpu``: one splash call over 2H heads of width d."""
  s, b, t, d = shape.itemsize, shape.batch, shape.seq, shape.head_dim
  heads = 2 * shape.diff_heads
  n = b * t * heads * d
  pad = splash_tiles(t, tiles.splash)[1] / t
  seg_f, seg_b = splash_inputs_ops(shape, tiles)
  fwd, bwd = splash_call_ops(shape, tiles, q_heads=heads, kv_heads=heads, dv=d, label="attn")
  layout_f = [_transpose("q (x scale) to [B, H, T, d]", n, s, padded=pad),
              _transpose("k to [B, H, T, d]", n, s, padded=pad),
              _transpose("v to [B, H, T, d]", n, s, padded=pad),
              _transpose("out to [B, T, H, d]", n, s)]
  layout_b = [_transpose("dO to [B, H, T, d]", n, s, padded=pad),
              _transpose("dq (x scale) to [B, T, H, d]", n, s),
              _transpose("dk to [B, T, H, d]", n, s), _transpose("dv to [B, T, H, d]", n, s)]
  return {"fwd": seg_f + fwd + layout_f, "bwd": seg_b + bwd + layout_b}


def v1_stock_ops(shape: Shape, tiles: Tiles) -> dict[str, list[Op]]:
  """``diff_v1_stock_tpu``: two splash calls with the 2d-wide value, then out = o1 - lam o2."""
  s, b, t, h, d = shape.itemsize, shape.batch, shape.seq, shape.diff_heads, shape.head_dim
  nq, nv = b * t * h * d, b * t * h * 2 * d
  pad = splash_tiles(t, tiles.splash)[1] / t
  seg_f, seg_b = splash_inputs_ops(shape, tiles)
  f1, b1 = splash_call_ops(shape, tiles, q_heads=h, kv_heads=h, dv=2 * d, label="map 1")
  f2, b2 = splash_call_ops(shape, tiles, q_heads=h, kv_heads=h, dv=2 * d, label="map 2")
  combine_f = _xla("out = o1 - lam o2, to [B, T, H, 2d]", 2 * nv * s, nv * s)
  combine_b = _xla("do1 = dO, do2 = -lam dO, dlam = -sum(dO o2)", 2 * nv * s,
                   int(2 * nv * pad) * s)
  layout_f = [_transpose("q1, q2 (x scale) to head-major", 2 * nq, s, padded=pad),
              _transpose("k1, k2 to head-major", 2 * nq, s, padded=pad),
              _transpose("v to head-major (shared by both calls)", nv, s, padded=pad)]
  layout_b = [_transpose("dq1, dq2 (x scale) back", 2 * nq, s),
              _transpose("dk1, dk2 back", 2 * nq, s),
              _transpose("dv = dv1 + dv2, back", nv, s, n_in=2)]
  return {"fwd": seg_f + f1 + f2 + [combine_f] + layout_f,
          "bwd": seg_b + [combine_b] + b1 + b2 + layout_b}


def v2_stock_ops(shape: Shape, tiles: Tiles) -> dict[str, list[Op]]:
  """``diff_v2_stock_tpu``: one splash call over 4H query heads (2H kv heads), then
  out_i = o_2i - lam_i o_2i+1."""
  s, b, t, d = shape.itemsize, shape.batch, shape.seq, shape.head_dim
  pairs = 2 * shape.diff_heads
  n = b * t * pairs * d
  lam_user = b * t * pairs * F32  # [B, T, pairs] float32, lane-dense (see the docstring)
  lam_rows = b * pairs * t * F32
  pad = splash_tiles(t, tiles.splash)[1] / t
  seg_f, seg_b = splash_inputs_ops(shape, tiles)
  fwd, bwd = splash_call_ops(shape, tiles, q_heads=2 * pairs, kv_heads=pairs, dv=d,
                             label="pairs")
  combine_f = _xla("out = o_even - lam o_odd, to [B, T, H, d]", 2 * n * s + lam_rows, n * s)
  combine_b = _xla("do_even = dO, do_odd = -lam dO, dlam = -sum(dO o_odd)",
                   2 * n * s + lam_rows, int(2 * n * pad) * s + lam_rows)
  layout_f = [_transpose("q (x scale) to head-major", 2 * n, s, padded=pad),
              _transpose("k to head-major", n, s, padded=pad),
              _transpose("v to head-major", n, s, padded=pad),
              _xla("lam to [B, H, T]", lam_user, lam_rows, LAYOUT)]
  layout_b = [_transpose("dq (x scale) back", 2 * n, s), _transpose("dk back", n, s),
              _transpose("dv back", n, s), _xla("dlam to [B, T, H]", lam_rows, lam_user, LAYOUT)]
  return {"fwd": seg_f + fwd + [combine_f] + layout_f,
          "bwd": seg_b + [combine_b] + bwd + layout_b}


# ----------------------------------------------------------------------------------
# The fused kernels, today and the target.


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


def fused_fwd_kernel(shape: Shape, tiles: Tiles, version: int, *, target: bool = False,
                     design: "Design | None" = None) -> Op:
  """The forward kernel with residuals (training); ``target`` visits only tiles with a
  visible key and writes lse with 2 words per row; ``design`` defaults to TODAY."""
  design = design or TODAY
  fl = flavour(version, shape)
  s, b, d, h = shape.itemsize, shape.batch, shape.head_dim, fl.heads
  bq, bk, tp, sp = fused_tiles(shape.seq, tiles.block_q, tiles.block_kv)
  nq, nkv = tp // bq, sp // bk
  if target:
    mask = tiles_with_visible_keys(shape.seq, bq, bk, shape.causal)
    ii, jj = np.nonzero(mask)  # row-major: the visited (i, j) in grid order
    kv_per_head = count_fetches(jj)
    steps = b * h * int(mask.sum())
  else:
    mask = visited_tiles(tp, sp, bq, bk, shape.causal)
    i = np.arange(nq)[:, None]
    j = np.broadcast_to(np.arange(nkv)[None, :], (nq, nkv))
    last_visible = np.clip((i * bq + bq - 1) // bk, 0, nkv - 1)
    kv_index = np.minimum(j, last_visible) if shape.causal else j
    # Before's grid visited every step, a masked one keeping the last visible K/V block;
    # today's causal grid visits the same tiles in the same order, minus the masked steps,
    # so the K/V blocks it fetches are the same.
    kv_per_head = count_fetches(kv_index)  # the K/V block index does not hold i
    steps = b * h * (int(mask.sum()) if design.causal_grid else nq * nkv)
  kv_fetch = b * h * kv_per_head
  rows = b * h * tp
  detail = {
      "Q": rows * 2 * d * s,
      "K,V": kv_fetch * bk * (fl.key_components * d + fl.dv) * s,
      "out": rows * fl.dv * s,
      "o2": rows * fl.dv * s,
      "lse": (rows * 2 * F32 if target else
              slab_bytes(b * h * nq, 2, bq) if design.dense_rows else rows * lanes(2) * F32),
  }
  reads = ["Q", "K,V"]
  if version == 2:
    detail["lambda rows"] = (rows * F32 if target else slab_bytes(b * h * nq, 1, bq)
                             if design.dense_rows else rows * lanes(1) * F32)
    reads.append("lambda rows")
  else:
    detail["lambda (SMEM)"] = h * F32
    reads.append("lambda (SMEM)")
  if shape.segmented:
    detail["segment ids"] = (b * h * tp * (1 if target else lanes(1)) * I32
                             + kv_fetch * bk * I32)
    reads.append("segment ids")
  flops = b * h * int(mask.sum()) * fwd_tile_flops(bq, bk, d, fl.dv, 2)
  label = " (target)" if target else ("" if design is TODAY else f" ({design.name})")
  return Op(f"V{version}: diff_attention_fwd" + label, KERNEL,
            read=sum(detail[k] for k in reads),
            written=sum(v for k, v in detail.items() if k not in reads),
            flops=flops, steps=steps, detail=detail)


@dataclasses.dataclass(frozen=True)
class Design:
  """What a version of the fused kernels does, for the parts that changed.

  Attributes:
    name: "before" (the kernels as of commit 99978ee) or "today".
    dq_chunks: the backward keeps dQ in VMEM per query chunk, writes it once in the
      input dtype and hands float32 dK/dV partial sums between chunks (today); else
      every visible step reads and writes the float32 dQ tile in HBM, converted to the
      input dtype by XLA afterwards (before).
    dense_rows: lse, the backward's stats and V2's lambda rows are lane-dense slabs
      [B, H, Tp / block_q, R, block_q] (R on 8 sublanes; today); else [B, H, Tp, R]
      with R padded to 128 lanes (before).
    causal_grid: a causal grid visits only the tiles ``Plan.visited_tiles`` computes
      (today); else every (query tile, key tile) step, a masked one skipping its compute
      but paying the step (before).
  """
  name: str
  dq_chunks: bool
  dense_rows: bool
  causal_grid: bool = True


BEFORE = Design("before", dq_chunks=False, dense_rows=False, causal_grid=False)
TODAY = Design("today", dq_chunks=True, dense_rows=True, causal_grid=True)


def slab_bytes(tiles_: int, rows: int, block: int) -> int:
  """HBM bytes of ``tiles_`` lane-dense float32 slabs (rows, block): rows on 8 sublanes,
  the block on 128 lanes."""
  return tiles_ * round_up(rows, SUBLANES) * lanes(block) * F32


def bwd_plan(shape: Shape, tiles: Tiles, version: int) -> Any:
  """The backward's ``_layout.Plan`` at this shape (kv heads equal to heads)."""
  fl = flavour(version, shape)
  return kernel_layout.make_plan(
      q_len=shape.seq, kv_len=shape.seq, block_q=tiles.block_q_bwd,
      block_kv=tiles.block_kv_bwd, causal=shape.causal, segmented=shape.segmented,
      scale=1.0, shared_k=version == 2, lam_rows=version == 2, heads=fl.heads,
      kv_heads=fl.heads, dq_chunk=tiles.dq_chunk)


def bwd_chunks(shape: Shape, tiles: Tiles, version: int) -> list[Any]:
  """Today's backward calls (``_backward.chunks`` with the kernel's own rule)."""
  plan = bwd_plan(shape, tiles, version)
  return bwd_kernel.chunks(plan, bwd_kernel.chunk_rows(plan, shape.head_dim, shape.itemsize))


def dq_round_trip(shape: Shape, tiles: Tiles, version: int) -> dict[str, int]:
  """The backward before: the float32 dQ tile (both query components) that each visible
  step reads from HBM (not on the first key tile) and writes back."""
  fl = flavour(version, shape)
  bq, bk, tp, sp = fused_tiles(shape.seq, tiles.block_q_bwd, tiles.block_kv_bwd)
  mask = visited_tiles(tp, sp, bq, bk, shape.causal)
  tile = 2 * bq * shape.head_dim * F32
  per_head_writes = int(mask.sum())
  per_head_reads = int(mask[:, 1:].sum())
  n = shape.batch * fl.heads
  return {"tile_bytes": tile, "writes": n * per_head_writes, "reads": n * per_head_reads,
          "bytes": n * (per_head_writes + per_head_reads) * tile}


def _bwd_q_index(nq: int, nkv: int, first: int, bq: int, bk: int, causal: bool) -> np.ndarray:
  """[nkv, nq] the Q-side block index of one head's grid steps (key tile outer): the
  chunk's query tiles from ``first``, raised to the first visible one when causal."""
  j = np.arange(nkv)[:, None]
  i = np.broadcast_to(first + np.arange(nq)[None, :], (nkv, nq))
  first_visible = np.clip((j * bk) // bq, 0, None)
  return np.maximum(i, first_visible) if causal else i


def fused_bwd_kernel(shape: Shape, tiles: Tiles, version: int, *, target: bool = False,
                     design: Design = TODAY) -> Op:
  """The backward kernel: dQ, dK, dV of both maps in one pass over the tiles (today: one
  call per query chunk, summed here)."""
  fl = flavour(version, shape)
  s, b, d, h = shape.itemsize, shape.batch, shape.head_dim, fl.heads
  bq, bk, tp, sp = fused_tiles(shape.seq, tiles.block_q_bwd, tiles.block_kv_bwd)
  nq, nkv = tp // bq, sp // bk
  kv_tile = bk * (fl.key_components * d + fl.dv)  # elements of one key tile's K and V
  partial = {}
  if target:
    mask = tiles_with_visible_keys(shape.seq, bq, bk, shape.causal)
    jj, ii = np.nonzero(mask.T)  # key tile outer, query tile inner
    q_per_head = count_fetches(ii)
    kv_per_head = int(mask.any(0).sum())
    steps = b * h * int(mask.sum())
    stat_words = 4 if version == 1 else 5
  elif design.dq_chunks:
    mask = visited_tiles(tp, sp, bq, bk, shape.causal)
    calls = bwd_chunks(shape, tiles, version)
    q_per_head = sum(count_fetches(_bwd_q_index(c.num_q_blocks, c.num_kv_blocks, c.first,
                                                bq, bk, shape.causal)) for c in calls)
    kv_per_head = sum(c.num_kv_blocks for c in calls)
    # The kernel's own step tables: only the visited tiles of each call (causal).
    plan = bwd_plan(shape, tiles, version)
    steps = b * h * sum(len(bwd_kernel.chunk_steps(plan, c)[0]) if shape.causal
                        else c.num_q_blocks * c.num_kv_blocks for c in calls)
    stat_words = 8 * lanes(bq) / bq
    # Every chunk but the last writes float32 partial dK, dV over its key tiles; the
    # next reads them back.
    partial_tiles = sum(c.num_kv_blocks for c in calls if not c.final)
    if partial_tiles:
      partial = {"dK,dV f32 partials written": b * h * partial_tiles * kv_tile * F32,
                 "dK,dV f32 partials read": b * h * partial_tiles * kv_tile * F32}
  else:
    mask = visited_tiles(tp, sp, bq, bk, shape.causal)
    q_per_head = count_fetches(_bwd_q_index(nq, nkv, 0, bq, bk, shape.causal))
    kv_per_head = nkv
    steps = b * h * nq * nkv
    stat_words = 8 * lanes(bq) / bq if design.dense_rows else lanes(8)
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
    detail["segment ids"] = (q_fetch * bq * (1 if target else lanes(1)) * I32
                             + b * h * kv_per_head * bk * I32)
  if "dK,dV f32 partials read" in partial:
    detail["dK,dV f32 partials read"] = partial["dK,dV f32 partials read"]
  read = sum(detail.values())
  detail["dK,dV"] = b * h * nkv * kv_tile * s
  if partial:
    detail["dK,dV f32 partials written"] = partial["dK,dV f32 partials written"]
  if target:
    detail["dQ (once, input dtype)"] = b * h * 2 * shape.seq * d * s
  elif design.dq_chunks:
    # Each chunk's [2, rows, d] block leaves VMEM once per (batch, kv group).
    detail["dQ (once, input dtype)"] = b * h * 2 * tp * d * s
  else:
    rt = dq_round_trip(shape, tiles, version)
    detail["dQ f32 tile reads"] = rt["reads"] * rt["tile_bytes"]
    detail["dQ f32 tile writes"] = rt["writes"] * rt["tile_bytes"]
    read += detail["dQ f32 tile reads"]
  written = sum(detail.values()) - read
  flops = b * h * int(mask.sum()) * fused_bwd_tile_flops(bq, bk, d, fl.dv)
  label = " (target)" if target else ("" if design is TODAY else f" ({design.name})")
  return Op(f"V{version}: diff_attention_bwd" + label, KERNEL, read=read, written=written,
            flops=flops, steps=steps, detail=detail)


def fused_ops(shape: Shape, tiles: Tiles, version: int,
              design: Design = TODAY) -> dict[str, list[Op]]:
  """The fused path (today's or before's): kernels, the XLA ops of ``_core`` and the
  wrapper layouts."""
  fl = flavour(version, shape)
  s, b, t, d, h, dv = (shape.itemsize, shape.batch, shape.seq, shape.head_dim, fl.heads,
                       fl.dv)
  _, _, tpf, _ = fused_tiles(t, tiles.block_q, tiles.block_kv)
  _, _, tpb, _ = fused_tiles(t, tiles.block_q_bwd, tiles.block_kv_bwd)
  _, _, _, spf = fused_tiles(t, tiles.block_q, tiles.block_kv)
  _, _, _, spb = fused_tiles(t, tiles.block_q_bwd, tiles.block_kv_bwd)
  rows = b * h * t
  q_in, k_in = b * t * h * 2 * d, b * t * h * fl.key_components * d
  v_in = b * t * h * dv
  row_f32 = rows * F32  # one float32 per query row: D1, D2, V2's lambda

  bqf = fused_tiles(t, tiles.block_q, tiles.block_kv)[0]
  bqb = fused_tiles(t, tiles.block_q_bwd, tiles.block_kv_bwd)[0]
  dense = design.dense_rows
  # lse as the forward writes it, per (batch, head).
  lse_bytes = (slab_bytes(b * h * tpf // bqf, 2, bqf) if dense
               else b * h * tpf * lanes(2) * F32)
  fwd = [fused_fwd_kernel(shape, tiles, version, design=design)]
  pad = lambda full, padded: full * padded // t  # elements once padded along T
  layout_f = [
      _xla("q components stacked, to [B, H, 2, T, d]" if design is BEFORE
           else "q (each component) to [B, H, T, d]", q_in * s, pad(q_in, tpf) * s, LAYOUT),
      _xla("k components to [B, H, C, S, d]" if version == 1 else "k to [B, H, S, d]",
           k_in * s, pad(k_in, spf) * s, LAYOUT),
      _xla("v to [B, H, S, dv]", v_in * s, pad(v_in, spf) * s, LAYOUT),
      _xla("out to [B, T, H, dv]", v_in * s, v_in * s, LAYOUT),
  ]
  if version == 2:
    layout_f.append(_xla("lam to [B, H, T]", row_f32, row_f32, LAYOUT))
    if dense:
      fwd.append(_xla("lam rows to lane-dense slabs", row_f32,
                      slab_bytes(b * h * tpf // bqf, 1, bqf)))
    else:
      fwd.append(_xla("lam rows to [B, H, Tp, 1] (128 lanes)", row_f32,
                      b * h * tpf * lanes(1) * F32))
  if tpf != t and dense:
    fwd.append(_xla("o2 sliced to T", b * h * tpf * dv * s, rows * dv * s))
  elif tpf != t:
    fwd.append(_xla("o2, lse sliced to T", b * h * tpf * (dv * s + lanes(2) * F32),
                    rows * (dv * s + lanes(2) * F32)))

  bwd = [
      _xla("row terms D1, D2 = rowsum(dO out, dO o2)", 3 * rows * dv * s, 2 * row_f32),
      _xla("stats slabs [B, H, Tp / block_q, 8, block_q]" if dense
           else "stats [B, H, Tp, 8] (128 lanes)",
           (lse_bytes if dense else rows * lanes(2) * F32) + 2 * row_f32
           + (row_f32 if version == 2 else 0),
           slab_bytes(b * h * tpb // bqb, 8, bqb) if dense else b * h * tpb * lanes(8) * F32),
  ]
  if tpb != t:
    bwd.append(_xla("q, dO padded to the backward tile",
                    (q_in + v_in) * s, pad(q_in + v_in, tpb) * s))
  if spb != t:
    bwd.append(_xla("k, v padded to the backward tile", (k_in + v_in) * s,
                    pad(k_in + v_in, spb) * s))
  bwd.append(fused_bwd_kernel(shape, tiles, version, design=design))
  dq_elements = b * h * 2 * d
  if not design.dq_chunks:
    bwd.append(_xla("dQ float32 to the input dtype", dq_elements * t * F32,
                    dq_elements * t * s))
  elif len(bwd_chunks(shape, tiles, version)) > 1 or tpb != t:
    bwd.append(_xla("dQ chunks concatenated (and sliced to T)", dq_elements * tpb * s,
                    dq_elements * t * s))
  layout_b = [
      _xla("dO to [B, H, T, dv]", v_in * s, v_in * s, LAYOUT),
      _xla("dq back to [B, T, H, d]" + (" x2" if version == 1 else " (4H heads)"),
           q_in * s, q_in * s, LAYOUT),
      _xla("dk back", k_in * s, k_in * s, LAYOUT),
      _xla("dv back", v_in * s, v_in * s, LAYOUT),
  ]
  if version == 2:
    layout_b.append(_xla("dlam to [B, T, H]", row_f32, row_f32, LAYOUT))
  return {"fwd": fwd + layout_f, "bwd": bwd + layout_b}


def target_ops(shape: Shape, tiles: Tiles, version: int) -> dict[str, list[Op]]:
  """The design target: see the module docstring. No kernel implements it yet."""
  fl = flavour(version, shape)
  s, b, t, h, dv = shape.itemsize, shape.batch, shape.seq, fl.heads, fl.dv
  _, _, tpb, _ = fused_tiles(t, tiles.block_q_bwd, tiles.block_kv_bwd)
  rows = b * h * t
  stat_words = 4 if version == 1 else 5
  stats = _xla("row terms and lane-dense stats",
               3 * rows * dv * s + rows * 2 * F32 + (rows * F32 if version == 2 else 0),
               b * h * tpb * stat_words * F32)
  return {"fwd": [fused_fwd_kernel(shape, tiles, version, target=True)],
          "bwd": [stats, fused_bwd_kernel(shape, tiles, version, target=True)]}


def arm_ops(shape: Shape, tiles: Tiles) -> dict[str, dict[str, list[Op]]]:
  """Every arm's forward and backward ops at one shape."""
  return {
      TRANSFORMER: transformer_ops(shape, tiles),
      V1_STOCK: v1_stock_ops(shape, tiles),
      V2_STOCK: v2_stock_ops(shape, tiles),
      V1_BEFORE: fused_ops(shape, tiles, 1, BEFORE),
      V2_BEFORE: fused_ops(shape, tiles, 2, BEFORE),
      V1_FUSED: fused_ops(shape, tiles, 1),
      V2_FUSED: fused_ops(shape, tiles, 2),
      V1_TARGET: target_ops(shape, tiles, 1),
      V2_TARGET: target_ops(shape, tiles, 2),
  }


# ----------------------------------------------------------------------------------
# Tables.


@dataclasses.dataclass
class Row:
  arm: str
  pass_: str
  part: str
  bytes: int
  flops: int
  steps: int
  bound_us: dict[str, float]

  @property
  def intensity(self) -> float:
    return self.flops / self.bytes if self.bytes else 0.0


def summarize(name: str, pass_: str, part: str, ops: list[Op]) -> Row:
  """Totals of a group of ops; the bound of a sequence of ops is the sum of theirs."""
  return Row(name, pass_, part, sum(o.bytes for o in ops), sum(o.flops for o in ops),
             sum(o.steps for o in ops),
             {g: 1e6 * sum(o.bound_s(c) for o in ops) for g, c in GENERATIONS.items()})


def arm_rows(arm: str, passes: dict[str, list[Op]]) -> list[Row]:
  out = []
  for pass_ in ("fwd", "bwd"):
    ops = passes[pass_]
    for part in PARTS:
      group = [o for o in ops if o.part == part]
      if group:
        out.append(summarize(arm, pass_, part, group))
    out.append(summarize(arm, pass_, "total", ops))
  out.append(summarize(arm, "fwd+bwd", "total", passes["fwd"] + passes["bwd"]))
  return out


def ratios(arms: dict[str, dict[str, list[Op]]]) -> dict[str, float]:
  """The two headline ratios (bytes, all passes) and their kernels-only variants."""
  total = lambda arm, kernels_only=False: sum(
      o.bytes for p in ("fwd", "bwd") for o in arms[arm][p]
      if not kernels_only or o.part == KERNEL)
  bwd = lambda arm: sum(o.bytes for o in arms[arm]["bwd"])
  return {
      "fused_v1_over_splash_transformer": total(V1_FUSED) / total(TRANSFORMER),
      "fused_v1_over_splash_transformer_kernels_only":
          total(V1_FUSED, True) / total(TRANSFORMER, True),
      "fused_v2_over_splash_transformer": total(V2_FUSED) / total(TRANSFORMER),
      "before_v1_over_splash_transformer": total(V1_BEFORE) / total(TRANSFORMER),
      "fused_v1_bwd_over_before": bwd(V1_FUSED) / bwd(V1_BEFORE),
      "fused_v2_bwd_over_before": bwd(V2_FUSED) / bwd(V2_BEFORE),
      "target_v1_bwd_over_fused_v1_bwd": bwd(V1_TARGET) / bwd(V1_FUSED),
      "target_v2_bwd_over_fused_v2_bwd": bwd(V2_TARGET) / bwd(V2_FUSED),
  }


def markdown_table(rows: list[Row], step_us: float) -> str:
  gens = list(GENERATIONS)
  head = (["arm", "pass", "part", "HBM MB", "MXU GFLOP", "FLOP/B", "grid steps", "step us"]
          + [f"{g} us" for g in gens])
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    cells = [r.arm, r.pass_, r.part, f"{r.bytes / 1e6:,.1f}", f"{r.flops / 1e9:,.1f}",
             f"{r.intensity:,.0f}", f"{r.steps:,}", f"{r.steps * step_us:,.0f}"]
    cells += [f"{r.bound_us[g]:,.0f}" for g in gens]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


# ----------------------------------------------------------------------------------
# Cross-check against the TPU compiler.


def _hlo_facts(text: str) -> dict[str, Any]:
  """What the compiled HLO says about the row-statistics layouts and where XLA put the
  ops around the kernels (S(1) is VMEM)."""
  found = re.findall(r"(f32\[[0-9,]+,(?:1|2|8)(?:,[0-9]+)?\])\{[0-9,]+:(T\([0-9,]+\))", text)
  facts: dict[str, Any] = {"row_stat_layouts": sorted({f"{a} {t}" for a, t in found})}
  entry = text[text.find("ENTRY"):]
  # Entry parameters whose layout is not row-major: the compiler picked them, which
  # turns some wrapper transposes into free bitcasts.
  params = re.findall(r"= \w+\[[0-9,]*\]\{([0-9,]+)[:}][^\n]* parameter\(", entry)
  facts["parameters"] = len(params)
  facts["parameters_not_row_major"] = sum(
      [int(x) for x in p.split(",")] != sorted((int(x) for x in p.split(",")), reverse=True)
      for p in params)
  ops = [m.group(1) for m in re.finditer(
      r"= (.*?) (?:fusion|copy|concatenate|transpose|convert)\(", entry)]
  facts["xla_ops_outside_kernels"] = len(ops)
  facts["of_which_in_vmem"] = sum("S(1)" in result for result in ops)
  facts["kernels"] = sorted(set(re.findall(r"(diff_attention_(?:fwd|bwd))", entry)))
  return facts


def compiled_bytes(version: int, shape: Shape, tiles: Tiles, *,
                   topology: str = "v5e:2x2") -> dict[str, dict[str, Any]]:
  """Compiles the fused forward and forward+backward (a VJP with the cotangent as an
  argument) of one layer for one chip of ``topology`` and reads the executables'
  memory and cost analyses. Raises if libtpu or the compile is unavailable."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  from diffjax.kernels import tpu as kt  # pylint: disable=import-outside-toplevel

  device = topologies.get_topology_desc(topology, "tpu").devices[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  dtype = jnp.bfloat16 if shape.itemsize == 2 else jnp.float32
  sds = lambda shp, dt=dtype: jax.ShapeDtypeStruct(shp, dt, sharding=sharding)
  fl = flavour(version, shape)
  b, t, d, h = shape.batch, shape.seq, shape.head_dim, fl.heads
  blocks = dict(block_q=tiles.block_q, block_kv=tiles.block_kv,
                block_q_bwd=tiles.block_q_bwd, block_kv_bwd=tiles.block_kv_bwd,
                dq_chunk=tiles.dq_chunk)
  if version == 1:
    args = (sds((b, t, h, d)),) * 4 + (sds((b, t, h, 2 * d)), sds((h,), jnp.float32))
    fn = lambda *a: kt.diff_v1_pallas_tpu(*a, causal=shape.causal, block_sizes=blocks)
  else:
    args = (sds((b, t, 2 * h, d)), sds((b, t, h, d)), sds((b, t, h, d)),
            sds((b, t, h), jnp.float32))
    fn = lambda *a: kt.diff_v2_pallas_tpu(*a, causal=shape.causal, block_sizes=blocks)
  cotangent = sds((b, t, h, fl.dv))

  def fwd_bwd(*a):
    *xs, ct = a
    out, vjp = jax.vjp(fn, *xs)
    return out, vjp(ct)

  results = {}
  # The Pallas lowering asks the default device which TPU it compiles for.
  with jax.default_device(device):
    for name, program, program_args in (("fwd", fn, args),
                                        ("fwd+bwd", fwd_bwd, args + (cotangent,))):
      start = time.perf_counter()
      compiled = jax.jit(program).lower(*program_args).compile()
      mem = compiled.memory_analysis()
      cost = compiled.cost_analysis()
      cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
      results[name] = {
          "compile_s": time.perf_counter() - start,
          "argument_bytes": getattr(mem, "argument_size_in_bytes", None),
          "output_bytes": getattr(mem, "output_size_in_bytes", None),
          "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
          "alias_bytes": getattr(mem, "alias_size_in_bytes", None),
          "cost_bytes_accessed": cost.get("bytes accessed"),
          "cost_flops": cost.get("flops"),
          **_hlo_facts(compiled.as_text()),
      }
  return results


def _program_ops(version: int, shape: Shape, tiles: Tiles) -> dict[str, list[Op]]:
  """The model's ops of the two compiled programs: the forward alone (no residuals
  written) and the forward with residuals followed by the backward."""
  ops = fused_ops(shape, tiles, version)
  fwd = fused_fwd_kernel(shape, tiles, version)
  fwd.written -= fwd.detail["o2"] + fwd.detail["lse"]  # written only for a backward
  fwd_only = [fwd] + [o for o in ops["fwd"]
                      if o.part != KERNEL and "lse" not in o.name and "o2" not in o.name]
  return {"fwd": fwd_only, "fwd+bwd": ops["fwd"] + ops["bwd"]}


def _modelled_program(version: int, shape: Shape, tiles: Tiles) -> dict[str, dict[str, int]]:
  """The model's figures for the two compiled programs."""
  fl = flavour(version, shape)
  s, b, t, d, h = shape.itemsize, shape.batch, shape.seq, shape.head_dim, fl.heads
  if version == 1:
    inputs = b * t * h * (4 * d + 2 * d) * s + h * F32
  else:
    inputs = b * t * h * (2 * d + 2 * d) * s + b * t * h * F32
  out = b * t * h * fl.dv * s
  sizes = {"fwd": (inputs, out), "fwd+bwd": (inputs + out, out + inputs)}
  return {name: {"argument_bytes": sizes[name][0], "output_bytes": sizes[name][1],
                 "bytes_accessed": sum(o.bytes for o in ops),
                 "flops": sum(o.flops for o in ops)}
          for name, ops in _program_ops(version, shape, tiles).items()}


def cross_check(shape: Shape, tiles: Tiles) -> dict[str, Any]:
  """Prints the compiler's figures next to the model's; returns both (or the reason
  the compile was skipped)."""
  report: dict[str, Any] = {"seq": shape.seq}
  try:
    for version in (1, 2):
      report[f"v{version}"] = {"compiled": compiled_bytes(version, shape, tiles),
                               "modelled": _modelled_program(version, shape, tiles)}
  except Exception as e:  # pylint: disable=broad-except
    reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    print(f"\nCross-check skipped: no TPU compile here ({reason}).")
    report["skipped"] = reason
    return report
  print(f"\n## Cross-check at T = {shape.seq}, B = {shape.batch}, one layer, one v5e chip "
        "(AOT compile, libtpu)\n")
  print("| program | figure | modelled | read from the compiler |")
  print("|---|---|---|---|")
  fmt = lambda x: "n/a" if x is None else f"{x / 1e6:,.2f} MB"
  for version in (1, 2):
    got, want = report[f"v{version}"]["compiled"], report[f"v{version}"]["modelled"]
    want_ops = _program_ops(version, shape, tiles)
    for prog in ("fwd", "fwd+bwd"):
      c, m = got[prog], want[prog]
      name = f"fused V{version} {prog}"
      print(f"| {name} | arguments | {fmt(m['argument_bytes'])} | "
            f"{fmt(c['argument_bytes'])} (memory_analysis) |")
      print(f"| {name} | outputs | {fmt(m['output_bytes'])} | "
            f"{fmt(c['output_bytes'])} (memory_analysis) |")
      print(f"| {name} | temporaries | not modelled | {fmt(c['temp_bytes'])} "
            "(memory_analysis) |")
      print(f"| {name} | HBM bytes accessed | {fmt(m['bytes_accessed'])} | "
            f"{fmt(c['cost_bytes_accessed'])} (cost_analysis; Pallas calls: the kernels' "
            "declared CostEstimate) |")
      flops = c["cost_flops"]
      print(f"| {name} | FLOPs | {m['flops'] / 1e9:,.2f} G (tile granularity) | "
            f"{'n/a' if flops is None else f'{flops / 1e9:,.2f} G'} (cost_analysis; Pallas "
            "calls: declared, half the square when causal) |")
      n_ops = sum(1 for o in want_ops[prog] if o.part != KERNEL)
      print(f"| {name} | XLA ops around the kernels | {n_ops} HBM passes | "
            f"{c['xla_ops_outside_kernels']}, of which {c['of_which_in_vmem']} placed in "
            f"VMEM; {c['parameters_not_row_major']} of {c['parameters']} arguments in a "
            "layout the compiler chose (HLO) |")
    layouts = sorted(set(got["fwd"]["row_stat_layouts"] + got["fwd+bwd"]["row_stat_layouts"]))
    print(f"| fused V{version} | row-statistics layouts | slabs (R, block_q), R on 8 sublanes | "
          f"{'; '.join(layouts) or 'none found'} (HLO) |")
  print("\nModelled figures come from this script's functions at the same shape; the "
        "compiler's come from the executables. A small buffer XLA keeps in VMEM moves no "
        "HBM bytes, so at this size the model overstates the XLA passes.")
  return report


# ----------------------------------------------------------------------------------


def _parse_seqs(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--d-model", type=int, default=3072)
  p.add_argument("--diff-heads", type=int, default=12,
                 help="DIFF heads H; the Transformer has 2H heads of width d")
  p.add_argument("--head-dim", type=int, default=128, help="component width d")
  p.add_argument("--seq", type=_parse_seqs, default=[4096, 8192, 32768],
                 help="comma-separated sequence lengths")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
  p.add_argument("--block-q", type=int, default=None)
  p.add_argument("--block-kv", type=int, default=None)
  p.add_argument("--block-q-bwd", type=int, default=None)
  p.add_argument("--block-kv-bwd", type=int, default=None)
  p.add_argument("--dq-chunk", type=int, default=None,
                 help="query rows per call of today's fused backward (default: the "
                      "kernel's rule)")
  p.add_argument("--splash-block", type=int, default=512,
                 help="splash tile of the stock wrappers (512)")
  p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
  p.add_argument("--segment-ids", action="store_true",
                 help="the fused kernels get segment ids (the stock paths always do)")
  p.add_argument("--step-overhead-us", type=float, default=0.35,
                 help="assumed fixed cost of one grid step, masked or not")
  p.add_argument("--json", default=None, help="write every figure to this path")
  p.add_argument("--cross-check", action="store_true",
                 help="also AOT-compile the fused kernels for a v5e chip (libtpu)")
  p.add_argument("--cross-check-seq", type=int, default=1024)
  a = p.parse_args(argv)

  # The kernels' defaults for this head width (BlockSizes.get_default), unless given.
  resolved = BlockSizes.get_default(a.head_dim)
  tiles = Tiles(block_q=a.block_q or resolved.block_q, block_kv=a.block_kv or resolved.block_kv,
                block_q_bwd=a.block_q_bwd or resolved.block_q_bwd,
                block_kv_bwd=a.block_kv_bwd or resolved.block_kv_bwd, splash=a.splash_block,
                dq_chunk=a.dq_chunk)
  BlockSizes(tiles.block_q, tiles.block_kv, tiles.block_q_bwd, tiles.block_kv_bwd,
             tiles.dq_chunk)  # validate
  itemsize = 2 if a.dtype == "bf16" else 4
  print("# TPU attention roofline: a MODEL of HBM bytes and MXU FLOPs, not a measurement\n")
  print(f"d_model {a.d_model}, {a.diff_heads} DIFF heads (Transformer {2 * a.diff_heads} heads, "
        f"DIFF V2 {2 * a.diff_heads} pairs) of d = {a.head_dim}, batch {a.batch}, {a.dtype}, "
        f"{'causal' if a.causal else 'full'} attention, one layer. Fused tiles fwd "
        f"{tiles.block_q}x{tiles.block_kv}, bwd {tiles.block_q_bwd}x{tiles.block_kv_bwd}; "
        f"splash {tiles.splash}. Step overhead {a.step_overhead_us} us (assumed).")
  if a.d_model != 2 * a.diff_heads * a.head_dim:
    print(f"Note: d_model {a.d_model} != 2 x {a.diff_heads} x {a.head_dim}; the model uses "
          "the heads and d as given.")
  print("Per-generation columns: lower bound sum over ops of max(bytes / HBM bandwidth, "
        "FLOPs / bf16 peak), in us, without the step overhead. "
        + ", ".join(f"{g}: {c.hbm_bytes_per_s / 1e9:,.0f} GB/s, "
                    f"{c.bf16_flops_per_s / 1e12:,.0f} TFLOP/s" for g, c in GENERATIONS.items())
        + ". * fused target: a design target that no kernel implements yet.")

  report: dict[str, Any] = {"config": vars(a) | {"tiles": dataclasses.asdict(tiles)},
                            "generations": {g: dataclasses.asdict(c)
                                            for g, c in GENERATIONS.items()},
                            "results": {}}
  for seq in a.seq:
    shape = Shape(batch=a.batch, diff_heads=a.diff_heads, head_dim=a.head_dim, seq=seq,
                  itemsize=itemsize, causal=a.causal, segmented=a.segment_ids)
    arms = arm_ops(shape, tiles)
    rows = [r for arm in ARMS for r in arm_rows(arm, arms[arm])]
    rat = ratios(arms)
    print(f"\n## T = {seq}\n")
    print(markdown_table(rows, a.step_overhead_us))
    n_calls = len(bwd_chunks(shape, tiles, 1))
    print(f"\nRatios at T = {seq} (HBM bytes, all passes): fused DIFF V1 fwd+bwd / splash "
          f"Transformer fwd+bwd = {rat['fused_v1_over_splash_transformer']:.2f} (kernels "
          f"only {rat['fused_v1_over_splash_transformer_kernels_only']:.2f}; before "
          f"{rat['before_v1_over_splash_transformer']:.2f}), fused DIFF V2 "
          f"= {rat['fused_v2_over_splash_transformer']:.2f}; today's / before's fused "
          f"backward = {rat['fused_v1_bwd_over_before']:.2f} (V1), "
          f"{rat['fused_v2_bwd_over_before']:.2f} (V2); target / today's fused backward "
          f"= {rat['target_v1_bwd_over_fused_v1_bwd']:.2f} (V1), "
          f"{rat['target_v2_bwd_over_fused_v2_bwd']:.2f} (V2). Today's fused V1 backward "
          f"runs {n_calls} query chunk{'s' if n_calls > 1 else ''} at this length.")
    kernel = lambda arm: next(o for o in arms[arm]["bwd"] if o.part == KERNEL)
    by = lambda arm: ", ".join(f"{k} {v / 1e6:,.1f}" for k, v in kernel(arm).detail.items())
    print(f"Fused V1 backward kernel, MB by array: before: {by(V1_BEFORE)}; today: "
          f"{by(V1_FUSED)}; target: {by(V1_TARGET)}.")
    report["results"][str(seq)] = {
        "rows": [dataclasses.asdict(r) | {"flop_per_byte": r.intensity} for r in rows],
        "ops": {arm: {p: [dataclasses.asdict(o) for o in ops] for p, ops in passes.items()}
                for arm, passes in arms.items()},
        "ratios": rat,
    }
  if a.cross_check:
    shape = Shape(batch=a.batch, diff_heads=a.diff_heads, head_dim=a.head_dim,
                  seq=a.cross_check_seq, itemsize=itemsize, causal=a.causal)
    report["cross_check"] = cross_check(shape, tiles)
  if a.json:
    with open(a.json, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=1, default=str)
  return report


if __name__ == "__main__":
  main()
