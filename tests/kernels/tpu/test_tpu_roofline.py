"""The TPU roofline model (tools/tpu_roofline, printed by
benchmarks/tpu_roofline.py): FLOP counts, the fused backward's dQ traffic (resident in
VMEM per query chunk), the target's grid and traffic, and the printed section. No TPU
compile."""

from __future__ import annotations

import json

import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from diffjax.kernels.tpu import _backward as backward
from diffjax.kernels.tpu import _layout as layout
from tools import tpu_roofline as roofline


def _tiles(bq=512, bk=512, bq_bwd=512, bk_bwd=256, splash=512, dq_chunk=None):
  return roofline.Tiles(
    block_q=bq,
    block_kv=bk,
    block_q_bwd=bq_bwd,
    block_kv_bwd=bk_bwd,
    splash=splash,
    dq_chunk=dq_chunk,
  )


def _kernel(ops, name):
  return next(o for o in ops if o.part == roofline.KERNEL and o.name.endswith(name))


# ----------------------------------------------------------------------------------
# (a) FLOPs against hand counts.


def test_transformer_forward_flops_non_causal_and_causal():
  b, h, d, t = 2, 2, 64, 1024  # 2 DIFF heads -> 4 Transformer heads
  shape = roofline.Shape(batch=b, diff_heads=h, head_dim=d, seq=t, causal=False)
  fwd = _kernel(roofline.transformer_ops(shape, _tiles(splash=256))["fwd"], "splash fwd")
  assert fwd.flops == 4 * b * (2 * h) * t * t * d  # Q K^T and P V, 2 FLOPs per MAC

  # Causal at T = 32K with 512 tiles: 64 * 65 / 2 of 64 * 64 tiles are computed.
  full = roofline.Shape(batch=1, diff_heads=12, head_dim=128, seq=32768, causal=False)
  causal = roofline.Shape(batch=1, diff_heads=12, head_dim=128, seq=32768, causal=True)
  ratio = (
    _kernel(roofline.transformer_ops(causal, _tiles())["fwd"], "splash fwd").flops
    / _kernel(roofline.transformer_ops(full, _tiles())["fwd"], "splash fwd").flops
  )
  assert ratio == pytest.approx(65 / 128)
  assert 0.5 < ratio < 0.51


def test_fused_and_splash_backward_flops_per_pair():
  b, h, d, t = 1, 3, 64, 512
  shape = roofline.Shape(batch=b, diff_heads=h, head_dim=d, seq=t, causal=False)
  tiles = _tiles(bq=128, bk=128, bq_bwd=128, bk_bwd=128, splash=128)
  pairs = b * t * t
  v1 = roofline.fused_ops(shape, tiles, 1)
  # V1 per DIFF head: forward 2 maps x (2d + 2 x 2d); backward 12d + 4 x 2d.
  assert _kernel(v1["fwd"], "diff_attention_fwd").flops == h * pairs * 12 * d
  assert _kernel(v1["bwd"], "diff_attention_bwd").flops == h * pairs * 20 * d
  v2 = roofline.fused_ops(shape, tiles, 2)  # 2H pairs, value width d
  assert _kernel(v2["fwd"], "diff_attention_fwd").flops == 2 * h * pairs * 8 * d
  assert _kernel(v2["bwd"], "diff_attention_bwd").flops == 2 * h * pairs * 16 * d
  mha = roofline.transformer_ops(shape, tiles)["bwd"]
  # Splash recomputes Q K^T and dP in both backward kernels: 8d + 6d per head.
  assert _kernel(mha, "splash dK/dV").flops == 2 * h * pairs * 8 * d
  assert _kernel(mha, "splash dQ").flops == 2 * h * pairs * 6 * d


def test_visited_tiles_match_the_kernels_plan():
  for t, bq, bk in ((1000, 256, 128), (2048, 512, 256), (640, 128, 512)):
    plan = layout.make_plan(
      q_len=t,
      kv_len=t,
      block_q=bq,
      block_kv=bk,
      causal=True,
      segmented=False,
      scale=1.0,
      shared_k=False,
      lam_rows=False,
      heads=1,
      kv_heads=1,
    )
    bq_m, bk_m, tp, sp = roofline.fused_tiles(t, bq, bk)
    assert (bq_m, bk_m, tp, sp) == (
      plan.block_q,
      plan.block_kv,
      plan.q_len_padded,
      plan.kv_len_padded,
    )
    want = np.array(
      [
        [bool(plan.block_visible(i, j)) for j in range(plan.num_kv_blocks)]
        for i in range(plan.num_q_blocks)
      ]
    )
    np.testing.assert_array_equal(roofline.visited_tiles(tp, sp, bq_m, bk_m, True), want)


def test_count_fetches():
  assert roofline.count_fetches([0, 0, 1, 1, 0]) == 3
  assert roofline.count_fetches([0, 0, 0], [0, 1, 1]) == 2
  assert roofline.count_fetches([]) == 0


# ----------------------------------------------------------------------------------
# (b) The backward's dQ: per query chunk from VMEM, written once.


def test_chunks_follow_the_kernels_rule():
  for t in (1000, 4096, 8192, 12288, 12289, 16384, 32768):
    plan = layout.make_plan(
      q_len=t,
      kv_len=t,
      block_q=512,
      block_kv=256,
      causal=True,
      segmented=False,
      scale=1.0,
      shared_k=False,
      lam_rows=False,
      heads=12,
      kv_heads=12,
    )
    shape = roofline.Shape(batch=1, diff_heads=12, head_dim=128, seq=t)
    want = backward.chunks(plan, backward.chunk_rows(plan, 128, 2))
    assert roofline.bwd_chunks(shape, _tiles(), 1) == want, t
  n = lambda t, **kw: len(roofline.bwd_chunks(roofline.Shape(1, 12, 128, t), _tiles(**kw), 1))
  assert n(4096) == n(8192) == n(12288) == 1 and n(32768) == 3
  assert n(4096, dq_chunk=1024) == 4


def test_dq_written_once_in_one_chunk_by_hand():
  d = 128
  shape = roofline.Shape(batch=2, diff_heads=3, head_dim=d, seq=1000, causal=True)
  tiles = _tiles()  # backward 512 x 256: T = 1000 pads to 1024 rows
  for version, heads in ((1, 3), (2, 6)):
    ops = roofline.fused_ops(shape, tiles, version)["bwd"]
    op = _kernel(ops, "diff_attention_bwd")
    # Each (batch, kv group of one head) writes its [2, 1024, d] block once, in bf16.
    want = 2 * heads * 2 * 1024 * d * 2
    assert op.detail["dQ (once, input dtype)"] == want
    assert not any("tile" in name or "partial" in name for name in op.detail)
    assert op.written == op.detail["dK,dV"] + want
    # XLA only slices the padded rows off: no float32 dQ to convert.
    assert not any(o.name.startswith("dQ float32") for o in ops)
    sliced = next(o for o in ops if o.name.startswith("dQ chunks"))
    assert (sliced.read, sliced.written) == (want, 2 * heads * 2 * 1000 * d * 2)


def test_chunked_backward_by_hand():
  d, t = 128, 1024
  shape = roofline.Shape(batch=1, diff_heads=1, head_dim=d, seq=t, causal=True)
  tiles = _tiles(bq_bwd=256, bk_bwd=256, dq_chunk=512)
  # Two chunks of two 256-row tiles: chunk 0 sees key tiles 0, 1, chunk 1 all four.
  chunks = roofline.bwd_chunks(shape, tiles, 1)
  assert [(c.first, c.num_q_blocks, c.num_kv_blocks, c.final) for c in chunks] == [
    (0, 2, 2, False),
    (2, 2, 4, True),
  ]
  op = _kernel(roofline.fused_ops(shape, tiles, 1)["bwd"], "diff_attention_bwd")
  kv_tile = 256 * (2 * d + 2 * d)  # K1, K2 and the 2d-wide V of one key tile
  assert op.detail["K,V"] == (2 + 4) * kv_tile * 2
  assert op.detail["dK,dV f32 partials written"] == 2 * kv_tile * 4
  assert op.detail["dK,dV f32 partials read"] == 2 * kv_tile * 4
  assert op.detail["dK,dV"] == 4 * kv_tile * 2
  assert op.detail["dQ (once, input dtype)"] == 2 * t * d * 2
  # Q-side block per step, key tile outer, raised to the key tile's first visible query
  # tile: chunk 0 reads tiles 0, 1 | 1, 1 (2 fetches), chunk 1 2, 3 | 2, 3 | 2, 3 | 3, 3
  # (6 fetches).
  assert op.detail["Q"] == (2 + 6) * 2 * 256 * d * 2
  # Only the visited tiles are grid steps: chunk 0 (0, 0), (1, 0), (1, 1); chunk 1 the
  # three of tile 2 and the four of tile 3 (not every step, 2 x 2 + 2 x 4).
  assert op.steps == 3 + 7
  concat = next(
    o for o in roofline.fused_ops(shape, tiles, 1)["bwd"] if o.name.startswith("dQ chunks")
  )
  assert concat.read == concat.written == 2 * t * d * 2


def test_headline_ratios_at_the_3b_layer():
  """Fused V1 within 1.3x of splash's bytes and the target's backward below the fused
  one's, at T = 4K, 8K and 32K."""
  for t in (4096, 8192, 32768):
    shape = roofline.Shape(batch=1, diff_heads=12, head_dim=128, seq=t)
    rat = roofline.ratios(roofline.arm_ops(shape, _tiles()))
    assert rat["fused_v1_over_splash_transformer"] <= 1.3, (t, rat)
    assert rat["fused_v1_over_splash_transformer_kernels_only"] <= 1.3, (t, rat)
    assert rat["target_v1_bwd_over_fused_v1_bwd"] < 1, (t, rat)
    assert rat["target_v2_bwd_over_fused_v2_bwd"] < 1, (t, rat)


def test_lane_dense_row_statistics_by_hand():
  d, t = 128, 1000
  shape = roofline.Shape(batch=2, diff_heads=3, head_dim=d, seq=t, causal=False)
  tiles = _tiles(bq=256, bq_bwd=128)  # T pads to 1024: 4 forward, 8 backward tiles
  for version, heads in ((1, 3), (2, 6)):
    fused = roofline.fused_ops(shape, tiles, version)
    fwd = _kernel(fused["fwd"], "diff_attention_fwd")
    # lse: a (2, 256) slab per (batch, head, q tile), 2 rows on 8 sublanes, not
    # [B, H, Tp, 2] padded to 128 lanes.
    assert fwd.detail["lse"] == 2 * heads * 4 * 8 * 256 * 4 < 2 * heads * 1024 * 128 * 4
    if version == 2:
      assert fwd.detail["lambda rows"] == 2 * heads * 4 * 8 * 256 * 4
    bwd = _kernel(fused["bwd"], "diff_attention_bwd")
    # Without a mask each (key tile, q tile) step fetches the (8, 128) stats slab.
    steps = 2 * heads * 8 * 4  # 8 q tiles x 4 key tiles of 256
    assert bwd.detail["stats"] == steps * 8 * 128 * 4
    stats = next(o for o in fused["bwd"] if o.name.startswith("stats slabs"))
    assert stats.written == 2 * heads * 8 * 8 * 128 * 4
    assert stats.read == (
      2 * heads * 4 * 8 * 256 * 4
      + 2 * 2 * heads * t * 4
      + (2 * heads * t * 4 if version == 2 else 0)
    )
    # The forward's lse slabs are not sliced to T after the kernel; o2 is.
    assert any(o.name == "o2 sliced to T" for o in fused["fwd"])
    assert not any("lse" in o.name and "sliced" in o.name for o in fused["fwd"])


# ----------------------------------------------------------------------------------
# (c) The target against the fused kernels.


@pytest.mark.parametrize("t", [1000, 4096, 8192])
def test_target_grid_visits_only_tiles_with_visible_keys(t):
  bq, bk = 512, 256
  shape = roofline.Shape(batch=2, diff_heads=3, head_dim=128, seq=t, causal=True)
  tiles = _tiles(bq_bwd=bq, bk_bwd=bk)
  nq, nkv = -(-t // bq), -(-t // bk)
  q_pos, k_pos = np.arange(nq * bq)[:, None], np.arange(nkv * bk)[None, :]
  dense = (k_pos <= q_pos) & (q_pos < t) & (k_pos < t)
  any_visible = int(dense.reshape(nq, bq, nkv, bk).any(axis=(1, 3)).sum())
  for version, heads in ((1, 3), (2, 6)):
    fused = _kernel(roofline.fused_ops(shape, tiles, version)["bwd"], "diff_attention_bwd")
    target = _kernel(roofline.target_ops(shape, tiles, version)["bwd"], "(target)")
    assert target.steps == 2 * heads * any_visible
    # The kernels' causal grids visit the same tiles (self-attention: the first key tile
    # holds a visible key for every query tile), not every step of the square.
    assert fused.steps == target.steps < 2 * heads * nq * nkv
    fwd = _kernel(roofline.fused_ops(shape, tiles, version)["fwd"], "diff_attention_fwd")
    fwd_target = _kernel(roofline.target_ops(shape, tiles, version)["fwd"], "(target)")
    assert fwd.steps == fwd_target.steps < 2 * heads * nq * nkv * 2
    assert target.flops <= fused.flops
    total = lambda ops: sum(o.bytes for o in ops)
    assert total(roofline.target_ops(shape, tiles, version)["bwd"]) < total(
      roofline.fused_ops(shape, tiles, version)["bwd"]
    )
    assert target.bytes < fused.bytes


def test_target_moves_fewer_bytes_without_a_mask_too():
  shape = roofline.Shape(batch=1, diff_heads=2, head_dim=128, seq=2048, causal=False)
  for version in (1, 2):
    fused = sum(o.bytes for o in roofline.fused_ops(shape, _tiles(), version)["bwd"])
    target = sum(o.bytes for o in roofline.target_ops(shape, _tiles(), version)["bwd"])
    assert target < fused


# ----------------------------------------------------------------------------------
# (d) The printed section.


def test_section_prints_every_generation_and_arm():
  shape = roofline.Shape(batch=1, diff_heads=12, head_dim=128, seq=1024)
  text, figures = roofline.seq_section(shape, _tiles(), step_us=0.35)
  assert text.startswith("\n## T = 1024\n")
  header = next(line for line in text.splitlines() if line.startswith("| arm |"))
  for gen in roofline.GENERATIONS:
    assert f"| {gen} us" in header
  for arm in roofline.ARMS:
    assert f"| {arm} | fwd+bwd | total |" in text
  assert "fused DIFF V1 fwd+bwd / splash Transformer fwd+bwd" in text
  assert "runs 1 query chunk at this length" in text
  assert "target / fused backward" in text and "before" not in text
  saved = json.loads(json.dumps(figures, default=str))
  assert saved["ratios"] == roofline.ratios(roofline.arm_ops(shape, _tiles()))
  assert {row["arm"] for row in saved["rows"]} == set(roofline.ARMS)


def test_splash_tables_match_splash_mask_info():
  t, block = 1024, 256
  blocks = splash.BlockSizes(
    block_q=block,
    block_kv=block,
    block_kv_compute=block,
    block_q_dkv=block,
    block_kv_dkv=block,
    block_kv_dkv_compute=block,
    block_q_dq=block,
    block_kv_dq=block,
  )
  kernel = splash.make_splash_mha(
    splash.MultiHeadMask([splash.CausalMask((t, t))] * 2),
    block_sizes=blocks,
    head_shards=1,
    q_seq_shards=1,
  )
  mask = roofline.visited_tiles(t, t, block, block, True)
  rows, width = roofline.splash_rows(mask)
  cols, _ = roofline.splash_cols(mask)
  assert width == t // block  # a causal square keeps the full grid width
  np.testing.assert_array_equal(np.asarray(kernel.fwd_mask_info.data_next[0]), rows)
  np.testing.assert_array_equal(np.asarray(kernel.dq_mask_info.data_next[0]), rows)
  np.testing.assert_array_equal(np.asarray(kernel.dkv_mask_info.data_next[0]).T, cols)
