"""The units of the TPU roofline model: shapes, tiles, ops, and the counts every
kernel's traffic is built from (visited tiles, block fetches, FLOPs per tile).

See :mod:`tools.tpu_roofline` for what the model counts and why.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from diffjax import hardware

LANES = 128
SUBLANES = 8
F32 = 4
I32 = 4

KERNEL, XLA, LAYOUT = "kernels", "XLA ops", "wrapper layout passes"
PARTS = (KERNEL, XLA, LAYOUT)


# The chips the tables have a column for, with their HBM bandwidth and dense bf16 peak
# from the hardware table (Google's published per-chip figures).
GENERATIONS: dict[str, hardware.Tpu] = {name: hardware.get(name) for name in ("v5e", "v5p", "v6e")}


def round_up(x: int, m: int) -> int:
  """x rounded up to a multiple of m."""
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

  def bound_s(self, chip: hardware.Tpu) -> float:
    return max(self.bytes / chip.hbm_bytes_per_s, self.flops / chip.flops("bfloat16"))


def xla_op(name: str, read: int, written: int, part: str = XLA) -> Op:
  """An XLA op that reads and writes HBM once (a layout pass with ``part=LAYOUT``)."""
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


def splash_rows(mask: np.ndarray) -> tuple[np.ndarray, int]:
  """Splash's shrunk forward / dQ table: for each q tile the visible kv tiles in order,
  padded at the end with tile 0 to the longest row's length; returns (table, width)."""
  width = int(mask.sum(1).max())
  table = np.zeros((mask.shape[0], width), np.int64)
  for i, row in enumerate(mask):
    cols = np.nonzero(row)[0]
    table[i, : len(cols)] = cols
  return table, width


def splash_cols(mask: np.ndarray) -> tuple[np.ndarray, int]:
  """Splash's shrunk dK/dV table: for each kv tile the visible q tiles in order, padded
  at the front with tile 0 to the longest column's length."""
  width = int(mask.sum(0).max())
  table = np.zeros((mask.shape[1], width), np.int64)
  for j in range(mask.shape[1]):
    rows = np.nonzero(mask[:, j])[0]
    table[j, width - len(rows) :] = rows
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
