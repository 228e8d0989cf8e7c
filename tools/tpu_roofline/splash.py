"""The roofline of the splash-attention paths: the Transformer's ``mha_stock_tpu`` and the
stock DIFF compositions ``diff_v1_stock_tpu`` and ``diff_v2_stock_tpu``.

Splash attention (jax 0.10 ``splash_attention_kernel``), as the stock wrappers call it:
tiles of 512 (``Tiles.splash``); every call carries segment ids (zeros when none are
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
"""

from __future__ import annotations

import numpy as np

from tools.tpu_roofline.model import (
  F32,
  I32,
  KERNEL,
  LANES,
  LAYOUT,
  SUBLANES,
  Op,
  Shape,
  Tiles,
  count_fetches,
  fwd_tile_flops,
  splash_bwd_tile_flops,
  splash_cols,
  splash_rows,
  splash_tiles,
  visited_tiles,
  xla_op,
)


def splash_inputs_ops(shape: Shape, tiles: Tiles) -> tuple[list[Op], list[Op]]:
  """The int32 segment-id and position broadcasts XLA writes for splash's kernels:
  (forward ones, which the dQ kernel reuses; dK/dV ones)."""
  _, tp, sp = splash_tiles(shape.seq, tiles.splash)
  b = shape.batch
  fwd = b * (tp * LANES + SUBLANES * sp) * I32 + tp * LANES * I32
  dkv = b * (SUBLANES * tp + sp * LANES) * I32 + SUBLANES * tp * I32
  return (
    [xla_op("splash segment ids and positions (fwd, dQ)", 0, fwd)],
    [xla_op("splash segment ids and positions (dK/dV)", 0, dkv)],
  )


def splash_call_ops(
  shape: Shape, tiles: Tiles, *, q_heads: int, kv_heads: int, dv: int, label: str
) -> tuple[list[Op], list[Op]]:
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
  rows, width = splash_rows(mask)
  h_idx = np.broadcast_to(heads[:, None, None] // group, (q_heads, nq, width))
  kv_fetch = b * count_fetches(h_idx, np.broadcast_to(rows, (q_heads, nq, width)))
  row_fetch = b * q_heads * nq  # Q, O, dO, lse, segment and position rows per (h, i)
  kv_tile = bk * (d + dv) * s
  seg_rows = 2 * bq * LANES * I32  # q segment ids and q positions, (bq, 128) int32
  # kv segment ids, (8, bk) int32, indexed by the table alone (no head).
  kv_seg = b * count_fetches(np.broadcast_to(rows, (q_heads, nq, width))) * SUBLANES * bk * I32
  fwd_flops = b * q_heads * visible * fwd_tile_flops(bq, bk, d, dv, 1)
  fwd = Op(f"{label}: splash fwd", KERNEL, flops=fwd_flops, steps=b * q_heads * nq * width)
  fwd.detail = {
    "Q": row_fetch * bq * d * s,
    "K,V": kv_fetch * kv_tile,
    "segment ids, positions": row_fetch * seg_rows + kv_seg,
    "O": b * q_heads * tp * dv * s,
    "logsumexp (128 lanes)": b * q_heads * tp * LANES * F32,
  }
  fwd.read = fwd.detail["Q"] + fwd.detail["K,V"] + fwd.detail["segment ids, positions"]
  fwd.written = fwd.detail["O"] + fwd.detail["logsumexp (128 lanes)"]

  lse_padded = b * q_heads * tp * LANES * F32
  rows_f32 = b * q_heads * tp * F32
  di = xla_op(f"{label}: di = rowsum(O dO)", 2 * b * q_heads * tp * dv * s, rows_f32)
  reshape = xla_op(
    f"{label}: logsumexp, di reshaped for the backward kernels",
    2 * lse_padded + rows_f32,
    2 * rows_f32 + 2 * SUBLANES * rows_f32,
  )

  # dK/dV kernel: grid (kv tile, head, w); Q-side index (head, table), K/V (head // g, j).
  cols, width_dkv = splash_cols(mask)
  j_idx = np.broadcast_to(np.arange(nkv)[:, None, None], (nkv, q_heads, width_dkv))
  h3 = np.broadcast_to(heads[None, :, None], (nkv, q_heads, width_dkv))
  q_side = np.broadcast_to(cols[:, None, :], (nkv, q_heads, width_dkv))
  q_fetch = b * count_fetches(h3, q_side)
  seg_fetch = b * count_fetches(q_side)  # q segment ids and positions: no head index
  kv_once = b * count_fetches(h3 // group, j_idx)
  dkv_flops, dq_flops = splash_bwd_tile_flops(bq, bk, d, dv)
  dkv = Op(
    f"{label}: splash dK/dV",
    KERNEL,
    flops=b * q_heads * visible * dkv_flops,
    steps=b * nkv * q_heads * width_dkv,
  )
  dkv.detail = {
    "K,V": kv_once * kv_tile,
    "Q, dO": q_fetch * bq * (d + dv) * s,
    "lse, di (8 rows)": q_fetch * 2 * SUBLANES * bq * F32,
    "segment ids, positions": seg_fetch * 2 * SUBLANES * bq * I32 + b * nkv * bk * LANES * I32,
    "dK, dV": kv_once * kv_tile,
  }
  dkv.read = sum(v for k, v in dkv.detail.items() if k != "dK, dV")
  dkv.written = dkv.detail["dK, dV"]

  dq = Op(
    f"{label}: splash dQ",
    KERNEL,
    flops=b * q_heads * visible * dq_flops,
    steps=b * q_heads * nq * width,
  )
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


def _transpose(name: str, elements: int, itemsize: int, n_in: int = 1, padded: float = 1.0) -> Op:
  """A layout pass: reads ``n_in`` arrays of ``elements`` and writes one, ``padded``
  times longer when the pass also pads T to the tile."""
  return xla_op(name, n_in * elements * itemsize, int(elements * padded) * itemsize, LAYOUT)


def transformer_ops(shape: Shape, tiles: Tiles) -> dict[str, list[Op]]:
  """``mha_stock_tpu``: one splash call over 2H heads of width d."""
  s, b, t, d = shape.itemsize, shape.batch, shape.seq, shape.head_dim
  heads = 2 * shape.diff_heads
  n = b * t * heads * d
  pad = splash_tiles(t, tiles.splash)[1] / t
  seg_f, seg_b = splash_inputs_ops(shape, tiles)
  fwd, bwd = splash_call_ops(shape, tiles, q_heads=heads, kv_heads=heads, dv=d, label="attn")
  layout_f = [
    _transpose("q (x scale) to [B, H, T, d]", n, s, padded=pad),
    _transpose("k to [B, H, T, d]", n, s, padded=pad),
    _transpose("v to [B, H, T, d]", n, s, padded=pad),
    _transpose("out to [B, T, H, d]", n, s),
  ]
  layout_b = [
    _transpose("dO to [B, H, T, d]", n, s, padded=pad),
    _transpose("dq (x scale) to [B, T, H, d]", n, s),
    _transpose("dk to [B, T, H, d]", n, s),
    _transpose("dv to [B, T, H, d]", n, s),
  ]
  return {"fwd": seg_f + fwd + layout_f, "bwd": seg_b + bwd + layout_b}


def v1_stock_ops(shape: Shape, tiles: Tiles) -> dict[str, list[Op]]:
  """``diff_v1_stock_tpu``: two splash calls with the 2d-wide value, then out = o1 - lam o2."""
  s, b, t, h, d = shape.itemsize, shape.batch, shape.seq, shape.diff_heads, shape.head_dim
  nq, nv = b * t * h * d, b * t * h * 2 * d
  pad = splash_tiles(t, tiles.splash)[1] / t
  seg_f, seg_b = splash_inputs_ops(shape, tiles)
  f1, b1 = splash_call_ops(shape, tiles, q_heads=h, kv_heads=h, dv=2 * d, label="map 1")
  f2, b2 = splash_call_ops(shape, tiles, q_heads=h, kv_heads=h, dv=2 * d, label="map 2")
  combine_f = xla_op("out = o1 - lam o2, to [B, T, H, 2d]", 2 * nv * s, nv * s)
  combine_b = xla_op(
    "do1 = dO, do2 = -lam dO, dlam = -sum(dO o2)", 2 * nv * s, int(2 * nv * pad) * s
  )
  layout_f = [
    _transpose("q1, q2 (x scale) to head-major", 2 * nq, s, padded=pad),
    _transpose("k1, k2 to head-major", 2 * nq, s, padded=pad),
    _transpose("v to head-major (shared by both calls)", nv, s, padded=pad),
  ]
  layout_b = [
    _transpose("dq1, dq2 (x scale) back", 2 * nq, s),
    _transpose("dk1, dk2 back", 2 * nq, s),
    _transpose("dv = dv1 + dv2, back", nv, s, n_in=2),
  ]
  return {
    "fwd": seg_f + f1 + f2 + [combine_f] + layout_f,
    "bwd": seg_b + [combine_b] + b1 + b2 + layout_b,
  }


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
  fwd, bwd = splash_call_ops(shape, tiles, q_heads=2 * pairs, kv_heads=pairs, dv=d, label="pairs")
  combine_f = xla_op("out = o_even - lam o_odd, to [B, T, H, d]", 2 * n * s + lam_rows, n * s)
  combine_b = xla_op(
    "do_even = dO, do_odd = -lam dO, dlam = -sum(dO o_odd)",
    2 * n * s + lam_rows,
    int(2 * n * pad) * s + lam_rows,
  )
  layout_f = [
    _transpose("q (x scale) to head-major", 2 * n, s, padded=pad),
    _transpose("k to head-major", n, s, padded=pad),
    _transpose("v to head-major", n, s, padded=pad),
    xla_op("lam to [B, H, T]", lam_user, lam_rows, LAYOUT),
  ]
  layout_b = [
    _transpose("dq (x scale) back", 2 * n, s),
    _transpose("dk back", n, s),
    _transpose("dv back", n, s),
    xla_op("dlam to [B, T, H]", lam_rows, lam_user, LAYOUT),
  ]
  return {"fwd": seg_f + fwd + [combine_f] + layout_f, "bwd": seg_b + [combine_b] + bwd + layout_b}
