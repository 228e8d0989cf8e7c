"""TPU Pallas kernels and the splash-based stock TPU paths, checked against the reference.

Without a TPU, the kernels run in the TPU interpreter (``interpret=True`` maps to
``pltpu.InterpretParams()``, which simulates VMEM, SMEM, DMAs and semaphores), and the
Mosaic compiler is exercised by ahead-of-time compiles for a v5e topology (libtpu,
no TPU needed). ``slow`` tests widen the product of shapes (``pytest -m slow``).

Tolerances: errors are ``max|kernel - reference| / max|reference|`` per output and per
gradient, against the float32 reference on the same (rounded) inputs. float32: 2e-5
(observed about 1e-6). bfloat16: 2e-2 (observed up to about 6e-3; the reference run in
bfloat16 is off by about 5e-3 itself).
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
  GROUPED_TILED_SHAPES,
  TILED_SHAPES,
  AttentionCases,
  Case,
  Shape,
  mask_kwargs,
)
from jax.experimental.pallas import tpu as pltpu
from kernel_checks import TOL, assert_like_inputs  # noqa: E402
from kernel_checks import check as _check
from kernel_checks import normal as _normal
from kernel_checks import packed_segment_ids as _segments
from kernel_checks import rel_err as _rel_err
from kernel_checks import slow_case as _slow
from kernel_checks import value_and_vjp as _value_and_vjp

from diffjax import ops
from diffjax.aot import without_persistent_cache
from diffjax.kernels import tpu as kt
from diffjax.ops import reference as ref

V1_GRADS = ("dq1", "dq2", "dk1", "dk2", "dv", "dlam")
V2_GRADS = ("dq", "dk", "dv", "dlam")
# Several query and key tiles per sequence, and backward tiles unlike the forward's.
SMALL = kt.BlockSizes(block_q=64, block_kv=128, block_q_bwd=32, block_kv_bwd=128)
WIDE = kt.BlockSizes(block_q=128, block_kv=256, block_q_bwd=128, block_kv_bwd=128)
TILES = {"small": SMALL, "wide": WIDE, "default": None}


def _v1_inputs(b, t, s, h, kh, d, dtype, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  return (
    _normal(ks[0], (b, t, h, d), dtype),
    _normal(ks[1], (b, t, h, d), dtype),
    _normal(ks[2], (b, s, kh, d), dtype),
    _normal(ks[3], (b, s, kh, d), dtype),
    _normal(ks[4], (b, s, kh, 2 * d), dtype),
    jax.random.uniform(ks[5], (h,), jnp.float32, 0.1, 0.9),
  )


def _v2_inputs(b, t, s, h, kh, d, dtype, seed=1):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  return (
    _normal(ks[0], (b, t, 2 * h, d), dtype),
    _normal(ks[1], (b, s, kh, d), dtype),
    _normal(ks[2], (b, s, kh, d), dtype),
    jax.nn.sigmoid(_normal(ks[3], (b, t, h))),
  )


def _run(
  version,
  t,
  s,
  rep,
  d,
  causal,
  seg,
  dtype,
  *,
  b=2,
  kh=2,
  blocks=SMALL,
  unmatched=False,
  fn=None,
  interpret=True,
):
  """Compares output and every gradient of a V1/V2 fast path with the reference."""
  h = kh * rep
  q_seg, kv_seg = _segments(b, t, s, unmatched_row=unmatched) if seg else (None, None)
  segs = None if q_seg is None else (q_seg, kv_seg)
  if version == 1:
    args, names, dv = _v1_inputs(b, t, s, h, kh, d, dtype), V1_GRADS, 2 * d
    fn = fn or kt.diff_v1_pallas_tpu
    refn = lambda *a: ref.diff_v1_reference(*a, causal=causal, segment_ids=segs)
  else:
    args, names, dv = _v2_inputs(b, t, s, h, kh, d, dtype), V2_GRADS, d
    fn = fn or kt.diff_v2_pallas_tpu
    refn = lambda *a: ref.diff_v2_reference(*a, causal=causal, segment_ids=segs)
  kern = lambda *a: fn(
    *a,
    causal=causal,
    q_segment_ids=q_seg,
    kv_segment_ids=kv_seg,
    block_sizes=blocks,
    interpret=interpret,
  )
  ct = _normal(jax.random.PRNGKey(7), (b, t, h, dv), dtype)
  out, grads = _value_and_vjp(kern, args, ct)
  ref_out, ref_grads = _value_and_vjp(
    refn, [a.astype(jnp.float32) for a in args], ct.astype(jnp.float32)
  )
  assert_like_inputs(out, grads, args, (b, t, h, dv), dtype)
  _check([("out", out, ref_out)] + list(zip(names, grads, ref_grads)), dtype)
  # Rows that see no key give exact zeros (output and dq), not a tolerance-sized value.
  if unmatched:
    np.testing.assert_array_equal(np.asarray(out[0, 0]), 0.0)
    np.testing.assert_array_equal(np.asarray(grads[0][0, 0]), 0.0)
  if causal and t > s:
    np.testing.assert_array_equal(np.asarray(out[:, : t - s]), 0.0)
  return out, grads


def _tiled(t, s, rep, d, tiles, b=2, kh=2):
  return Shape(b, t, s, kh, rep, d, tiles=tiles)


def _case(version, t, s, rep, d, causal, seg, dtype, tiles):
  return Case(f"diff_v{version}", _tiled(t, s, rep, d, tiles), causal, seg, dtype)


class TestPallasTpu(AttentionCases):
  """The fused kernels in the TPU interpreter (interpreted: a few cases a tier). Unit tier:
  DIFF V1 with T != S, a query row that matches no key, GQA 2, float32, small tiles. The
  integration tier adds DIFF V2 with segment ids, GQA 3 and bfloat16, and a sample of the
  rest. The slow tier adds sequence 384, GQA 4, the wide and default tiles,
  T > S and documents ending inside tiles, each in float32 and bfloat16."""

  ops = ("diff_v1", "diff_v2")
  dtypes = ("float32", "bfloat16")
  shapes = TILED_SHAPES
  pinned = (_case(1, 130, 300, 2, 16, True, "unmatched", "float32", "small"),)
  sampled = 0
  integration_pinned = (
    _case(2, 150, 230, 3, 8, True, "packed", "bfloat16", "small"),  # three pairs per kv head
  )
  integration_sampled = 6
  kept = (
    _case(1, 200, 200, 1, 16, True, "none", "float32", "small"),
    _case(1, 384, 384, 2, 8, True, "packed", "float32", "small"),
    _case(1, 200, 200, 4, 16, True, "packed", "float32", "wide"),
    _case(1, 384, 384, 1, 24, False, "none", "float32", "default"),
    _case(1, 200, 200, 2, 16, False, "packed", "bfloat16", "small"),
    _case(1, 200, 200, 2, 16, True, "packed", "bfloat16", "small"),
    _case(1, 384, 384, 4, 16, True, "none", "bfloat16", "wide"),
    # Three query heads per kv head; T off every tile; documents end inside tiles.
    _case(1, 150, 150, 3, 16, True, "packed", "float32", "small"),
    _case(2, 200, 200, 1, 16, True, "none", "float32", "small"),
    _case(2, 384, 384, 2, 16, True, "packed", "float32", "wide"),
    _case(2, 200, 384, 4, 8, False, "unmatched", "float32", "small"),
    _case(2, 200, 136, 2, 16, True, "none", "float32", "small"),  # T > S: 64 rows see no key
    _case(2, 200, 200, 2, 16, True, "packed", "bfloat16", "default"),
    _case(2, 384, 384, 1, 24, True, "none", "bfloat16", "small"),
  )

  def supports(self, case):
    return case.shape.ratio == 1 and case.shape.b == 2

  def call(self, case, *arrays):
    fn = kt.diff_v1_pallas_tpu if case.op == "diff_v1" else kt.diff_v2_pallas_tpu
    return fn(*arrays, **mask_kwargs(case), block_sizes=TILES[case.shape.tiles], interpret=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("causal,seg", [(True, False), (True, True), (False, True), (False, False)])
@pytest.mark.parametrize("rep", [1, 2, 4])
@pytest.mark.parametrize("t", [200, 384])
@pytest.mark.parametrize("version", [1, 2])
def test_product_slow(version, t, rep, causal, seg, dtype):
  _run(version, t, t, rep, 16, causal, seg, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("version", [1, 2])
def test_paper_head_dims_slow(version, d, dtype):
  _run(version, 384, 384, 2, d, True, True, dtype, b=1, blocks=None)


@pytest.mark.slow
@pytest.mark.parametrize(
  "blocks",
  [
    kt.BlockSizes(block_q=8, block_kv=128, block_q_bwd=8, block_kv_bwd=128),
    kt.BlockSizes(block_q=128, block_kv=128, block_q_bwd=16, block_kv_bwd=256),
    {"block_q": 40, "block_kv_bwd": 384},
  ],
)
@pytest.mark.parametrize("version", [1, 2])
def test_block_size_sweep_slow(version, blocks):
  _run(version, 300, 300, 2, 16, True, True, jnp.float32, blocks=blocks)
  _run(version, 150, 400, 2, 16, True, False, jnp.float32, blocks=blocks)


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_rows_without_visible_keys_slow(version):
  _run(version, 96, 160, 2, 16, True, True, jnp.float32, unmatched=True)
  _run(version, 200, 136, 1, 16, True, False, jnp.float32, b=1)
  _run(version, 40, 72, 1, 16, True, True, jnp.bfloat16, unmatched=True)


# ----------------------------------------------------------------------------------
# Query chunks of the backward: each call keeps its chunk's dQ in VMEM and hands float32
# dK/dV partial sums to the next. Small shapes take one chunk by themselves (every case
# above); these force several, with padded tiles, S != T and two heads per kv group.


def _chunked(dq_chunk, tiles=SMALL):
  return kt.BlockSizes(**{**vars(tiles), "dq_chunk": dq_chunk})


CHUNK_CASES = [
  # version, dq_chunk, t, s, causal, seg, dtype
  # T = 130 pads to 5 tiles of 32: chunks of 2, 2, 1 tiles seeing 2, 3, 3 key tiles.
  pytest.param(1, 64, 130, 300, True, True, jnp.float32, marks=pytest.mark.integration),
  # The chunk loop is the same for V2; V2's own paths (shared K, per-token lambda) run
  # in the default V2 cases above.
  _slow(2, 96, 136, 264, True, True, jnp.float32),
  _slow(1, 32, 200, 136, True, False, jnp.bfloat16),  # T > S, one tile per chunk
  _slow(2, 64, 200, 136, True, False, jnp.bfloat16),
  _slow(1, 96, 150, 400, False, True, jnp.float32),
  _slow(2, 32, 150, 400, False, False, jnp.float32),
]


@pytest.mark.parametrize("version,dq_chunk,t,s,causal,seg,dtype", CHUNK_CASES)
def test_query_chunks_match_reference(version, dq_chunk, t, s, causal, seg, dtype):
  # One batch row and two kv groups of two heads: the dQ block moves on once per chunk.
  _run(version, t, s, 2, 16, causal, seg, dtype, b=1, kh=2, blocks=_chunked(dq_chunk))


def _bwd_plan(t, heads=12, kv_heads=12, d=128, causal=True, s=None, **kw):
  from diffjax.kernels.tpu import _layout as layout  # pylint: disable=g-import-not-at-top

  bs = kt.resolve_block_sizes(kw, d)
  return layout.make_plan(
    q_len=t,
    kv_len=s or t,
    block_q=bs.block_q_bwd,
    block_kv=bs.block_kv_bwd,
    causal=causal,
    segmented=False,
    scale=1.0,
    shared_k=False,
    lam_rows=False,
    heads=heads,
    kv_heads=kv_heads,
    dq_chunk=bs.dq_chunk,
  )


def test_chunk_rule():
  """One chunk while dQ fits the budget: the paper's 3B layer (12 heads of d = 128, one
  per kv group) up to T = 12288 in bfloat16; longer sequences take balanced chunks."""
  from diffjax.kernels.tpu import _backward as bwd  # pylint: disable=g-import-not-at-top
  from diffjax.kernels.tpu import _layout as layout  # pylint: disable=g-import-not-at-top

  rows = lambda plan, itemsize=2: bwd.chunk_rows(plan, 128, itemsize)
  assert bwd.dq_row_bytes(1, 128, 2) == 2 * 128 * (4 + 4)
  assert bwd.dq_row_bytes(2, 16, 4) == 2 * 2 * 128 * (4 + 8)  # D on 128 lanes
  for t in (4096, 8192, 12288):
    assert rows(_bwd_plan(t)) == t
  assert rows(_bwd_plan(12288), itemsize=4) == 6144  # float32 output buffers: 12 B / elem
  assert rows(_bwd_plan(12289)) == 6656  # 12800 padded rows in two chunks
  assert rows(_bwd_plan(32768)) == 11264  # three chunks: 11264, 11264, 10240
  assert rows(_bwd_plan(8192, heads=24)) == 4096  # two heads per kv group
  assert rows(_bwd_plan(1024, dq_chunk=512)) == 512
  assert rows(_bwd_plan(1024, dq_chunk=4096)) == 1024
  plan = _bwd_plan(32768)
  got = [
    (c.first, c.num_q_blocks, c.num_kv_blocks, c.prev_kv_blocks, c.final)
    for c in bwd.chunks(plan, rows(plan))
  ]
  assert got == [(0, 22, 44, 0, False), (22, 22, 88, 44, False), (44, 20, 128, 88, True)]
  full = _bwd_plan(1000, causal=False, dq_chunk=512)
  assert [c.num_kv_blocks for c in bwd.chunks(full, 512)] == [4, 4]
  # The VMEM limit the kernel asks for stays within what v5e, v5p and v6e have.
  assert layout.vmem_limit(2 * bwd.DQ_VMEM_BUDGET) <= 64 * 2**20
  with pytest.raises(ValueError, match="must be a multiple of the backward query tile"):
    bwd.chunk_rows(layout.dataclasses.replace(plan, dq_chunk=100), 128, 2)


def _brute_visible(t, s, bq, bk):
  """bool [Tp / bq, Sp / bk]: tiles where some real query attends some real key
  (queries are the last T of S positions), or the first key tile (always visited)."""
  tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
  q_pos = np.arange(tp) + s - t
  k_pos = np.arange(sp)
  seen = (k_pos[None, :] <= q_pos[:, None]) & (np.arange(tp)[:, None] < t) & (k_pos < s)
  tiles = seen.reshape(tp // bq, bq, sp // bk, bk).any(axis=(1, 3))
  tiles[:, 0] = True
  return tiles


@pytest.mark.parametrize(
  "t,s,bq,bk,heads,kv_heads,dq_chunk",
  [
    (4096, 4096, 512, 512, 1, 1, None),  # the forward's default tiles at 4K: 36 of 64
    (4096, 4096, 512, 256, 1, 1, None),  # the backward's at d = 128: 72 of 128
    (200, 200, 64, 128, 2, 1, None),  # T off the tile
    (200, 456, 32, 128, 3, 1, 64),  # S > T (the offset), several chunks, three heads
    (456, 200, 64, 128, 1, 1, 128),  # T > S: leading query tiles see only key tile 0
    (1000, 1300, 128, 256, 2, 2, 256),
  ],
)
def test_causal_grids_visit_only_tiles_with_visible_keys(t, s, bq, bk, heads, kv_heads, dq_chunk):
  from diffjax.kernels.tpu import _backward as bwd  # pylint: disable=g-import-not-at-top
  from diffjax.kernels.tpu import _layout as layout  # pylint: disable=g-import-not-at-top

  plan = layout.make_plan(
    q_len=t,
    kv_len=s,
    block_q=bq,
    block_kv=bk,
    causal=True,
    segmented=False,
    scale=1.0,
    shared_k=False,
    lam_rows=False,
    heads=heads,
    kv_heads=kv_heads,
    dq_chunk=dq_chunk,
  )
  want = _brute_visible(t, s, plan.block_q, plan.block_kv)
  if t == s == 4096:
    assert (want.size, want.sum()) == {512: (64, 36), 256: (128, 72)}[bk]
  # Forward: the visible tiles row by row; a query tile starts on key tile 0 and ends
  # on its last visible one.
  q_steps, kv_steps = plan.forward_steps()
  j, first, last = (np.asarray(x) for x in layout.unpack_kv_step(jnp.asarray(kv_steps)))
  assert sorted(zip(q_steps.tolist(), j.tolist())) == list(zip(*np.nonzero(want)))
  assert len(q_steps) == want.sum()
  np.testing.assert_array_equal(first, j == 0)
  np.testing.assert_array_equal(
    last, j == want.shape[1] - 1 - np.argmax(want[q_steps, ::-1], axis=1)
  )
  # Backward: per call, key tile outer, the group's heads, then the chunk's visible query
  # tiles; the first and last step of each key tile flagged.
  g = heads // kv_heads
  total = 0
  for chunk in bwd.chunks(plan, bwd.chunk_rows(plan, 16, 4)):
    t_steps, kv_steps = bwd.chunk_steps(plan, chunk)
    j, first, last = (np.asarray(x) for x in layout.unpack_kv_step(jnp.asarray(kv_steps)))
    i = chunk.first + t_steps % chunk.num_q_blocks
    assert np.all(want[i, j]) and np.all(np.diff(j) >= 0)
    sub = want[chunk.first : chunk.first + chunk.num_q_blocks, : chunk.num_kv_blocks]
    assert len(t_steps) == g * sub.sum()
    assert len(set(zip(t_steps.tolist(), j.tolist()))) == len(t_steps)
    starts = np.flatnonzero(np.diff(j, prepend=-1))
    np.testing.assert_array_equal(np.flatnonzero(first), starts)
    np.testing.assert_array_equal(np.flatnonzero(last), np.append(starts[1:] - 1, len(j) - 1))
    total += len(t_steps)
  assert total == g * want.sum()


# ----------------------------------------------------------------------------------
# Race detection in the TPU interpreter (two simulated cores take the parallel grid
# axis; the dQ block is written back when a core's leading index moves on, and a chunk
# reads the dK/dV partial sums the previous call wrote).


def _races_found() -> bool:
  """Whether the interpreter's race detector found a race; fails if it did not run at all."""
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc  # pylint: disable=g-import-not-at-top

  assert ipc.races is not None, "the interpreter ran without race detection"
  return bool(ipc.races.races_found)


@pytest.mark.parametrize(
  "version,t,s,rep,dq_chunk,d",
  [
    pytest.param(1, 64, 384, 1, None, 8, marks=pytest.mark.integration),  # one chunk, head-major
    # Several heads and query tiles per group, causal skipping, two chunks.
    pytest.param(2, 200, 256, 2, 128, 8, marks=pytest.mark.slow),
    pytest.param(2, 200, 256, 2, None, 8, marks=pytest.mark.slow),
    # The paper's head width.
    pytest.param(1, 200, 256, 2, 128, 128, marks=pytest.mark.slow),
  ],
)
def test_no_races_in_interpreter(version, t, s, rep, dq_chunk, d):
  params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
  pltpu.reset_tpu_interpret_mode_state()
  blocks = kt.BlockSizes(
    block_q=64, block_kv=128, block_q_bwd=64, block_kv_bwd=128, dq_chunk=dq_chunk
  )
  _run(
    version,
    t,
    s,
    rep,
    d,
    True,
    version == 2,
    jnp.float32,
    b=2,
    kh=1,
    blocks=blocks,
    interpret=params,
  )
  assert not _races_found()


# ----------------------------------------------------------------------------------
# Block sizes.


def test_block_sizes_validation_names_values():
  with pytest.raises(ValueError, match="block_q=12 must be a positive multiple of 8"):
    kt.BlockSizes(block_q=12)
  with pytest.raises(ValueError, match="block_kv=100 must be a positive multiple of 128"):
    kt.BlockSizes(block_kv=100)
  with pytest.raises(ValueError, match="block_q_bwd=0 must be a positive multiple of 8"):
    kt.BlockSizes(block_q_bwd=0)
  with pytest.raises(ValueError, match="block_kv_bwd='256' must be a positive multiple"):
    kt.BlockSizes(block_kv_bwd="256")
  with pytest.raises(
    ValueError,
    match=r"dq_chunk=100 must be None \(decided from the "
    r"sequence length\) or a positive multiple of block_q_bwd=64",
  ):
    kt.BlockSizes(block_q_bwd=64, dq_chunk=100)
  with pytest.raises(ValueError, match="dq_chunk=True must be None"):
    kt.BlockSizes(dq_chunk=True)
  args = _v1_inputs(1, 32, 32, 2, 2, 16, jnp.float32)
  with pytest.raises(ValueError, match=r"Unknown BlockSizes fields \['block_z'\]"):
    kt.diff_v1_pallas_tpu(*args, block_sizes={"block_z": 32}, interpret=True)
  with pytest.raises(TypeError, match="block_sizes must be None, a BlockSizes or a dict"):
    kt.diff_v1_pallas_tpu(*args, block_sizes=(64, 64), interpret=True)
  with pytest.raises(ValueError, match="dq_chunk=0 must be None"):
    kt.diff_v1_pallas_tpu(*args, block_sizes={"dq_chunk": 0}, interpret=True)
  with pytest.raises(ValueError, match="Pass both q_segment_ids and kv_segment_ids"):
    kt.diff_v1_pallas_tpu(*args, q_segment_ids=jnp.zeros((1, 32), jnp.int32), interpret=True)


def test_block_sizes_defaults_and_dict_overrides():
  for d in (64, 96, 128, 256):
    bs = kt.BlockSizes.get_default(d)
    # Forward float32 accumulators of both maps stay well inside VMEM for Dv = 2 D.
    assert 2 * bs.block_q * 2 * d * 4 <= 2 * 2**20, (d, bs)
  assert kt.resolve_block_sizes({"block_q": 16}, 128) == kt.BlockSizes(
    block_q=16, **{k: v for k, v in vars(kt.BlockSizes.get_default(128)).items() if k != "block_q"}
  )
  assert kt.resolve_block_sizes(None, 64) == kt.BlockSizes.get_default(64)


def test_block_sizes_per_generation_fit_the_vmem_budget():
  from diffjax.kernels.tpu import _backward as bwd  # pylint: disable=g-import-not-at-top
  from diffjax.kernels.tpu import _forward as fwd  # pylint: disable=g-import-not-at-top
  from diffjax.kernels.tpu import _layout as layout  # pylint: disable=g-import-not-at-top
  from diffjax.kernels.tpu import block_sizes as tpu_block_sizes  # pylint: disable=g-import-not-at-top

  base = {d: kt.BlockSizes.get_default(d, "v4") for d in (64, 128, 256, 512)}
  # Off a TPU and for a generation not in the table: the generation-free tiles.
  assert base[128] == kt.BlockSizes(block_q=512, block_kv=512, block_q_bwd=512, block_kv_bwd=256)
  assert kt.BlockSizes.get_default(128) == base[128]
  assert tpu_block_sizes.tpu_generation() is None
  kinds = {
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5p": "v5p",
    "TPU v5": "v5p",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
    "TPU v4": None,
  }
  assert {k: tpu_block_sizes.tpu_generation(k) for k in kinds} == kinds
  fwd_budget = 64 * 2**20 / 1.5  # the most _layout.vmem_limit grants, over its headroom
  assert (
    layout.vmem_limit(fwd_budget) <= 64 * 2**20 and layout.vmem_limit(fwd_budget + 8) == 64 * 2**20
  )
  bwd_budget = fwd_budget - bwd.DQ_VMEM_BUDGET
  for gen, mxu in (("v5e", 128), ("v5p", 128), ("v6e", 256)):
    for d in (64, 96, 128, 256, 512, 1024):
      bs = kt.BlockSizes.get_default(d, gen)
      # The kernels' own estimates in the widest case (V1, value 2 d, float32, partials).
      assert fwd.vmem_bytes(bs.block_q, bs.block_kv, d, 2 * d, 4, 2) <= fwd_budget, (gen, d)
      assert (
        bwd.step_vmem_bytes(
          bs.block_q_bwd, bs.block_kv_bwd, d, 2 * d, 4, 2, out_item=4, partials_in=True
        )
        <= bwd_budget
      ), (gen, d)
      if d <= 256:  # the base tiles fit every generation and are MXU-aligned
        assert bs == kt.BlockSizes.get_default(d, "v4"), (gen, d)
        assert all(getattr(bs, f) % mxu == 0 for f in ("block_kv", "block_kv_bwd"))
  # A wide head shrinks the backward key tile (the base 256x256 does not fit).
  assert bwd.step_vmem_bytes(256, 256, 512, 1024, 4, 2, out_item=4, partials_in=True) > bwd_budget
  assert kt.BlockSizes.get_default(512, "v5e").block_kv_bwd == 128


# ----------------------------------------------------------------------------------
# Dispatcher and stock paths.


@pytest.mark.integration  # the interpreted kernel through the ops API
def test_dispatcher_pallas_tpu_equals_xla():
  q1, q2, k1, k2, v, _ = _v1_inputs(2, 72, 72, 4, 2, 16, jnp.float32)
  seg = jnp.stack([jnp.arange(72) // 30, jnp.arange(72) // 50]).astype(jnp.int32)
  kw = dict(causal=True, segment_ids=seg)

  def v1_loss(lam, impl, **extra):
    out = ops.diff_v1_attention_core(q1, q2, k1, k2, v, lam, implementation=impl, **kw, **extra)
    return jnp.sum(out**2), out

  # The dispatcher broadcasts a scalar lambda to [H]; its gradient must come back.
  run = lambda impl, **e: jax.jit(
    jax.value_and_grad(lambda l: v1_loss(l, impl, **e), has_aux=True)
  )(jnp.float32(0.4))
  (_, got), dlam = run("pallas_tpu", interpret=True)
  (_, want), dlam_want = run("xla")
  assert _rel_err(got, want) <= TOL[jnp.float32]
  assert _rel_err(dlam, dlam_want) <= TOL[jnp.float32]
  # Without differentiation the forward kernel skips its residual outputs.
  primal = ops.diff_v1_attention_core(
    q1, q2, k1, k2, v, 0.4, implementation="pallas_tpu", interpret=True, **kw
  )
  assert _rel_err(primal, want) <= TOL[jnp.float32]
  q, k, v2, lam = _v2_inputs(2, 72, 72, 2, 1, 16, jnp.float32)
  a = ops.diff_v2_attention(q, k, v2, lam, implementation="pallas_tpu", interpret=True, **kw)
  b = ops.diff_v2_attention(q, k, v2, lam, implementation="xla", **kw)
  assert _rel_err(a, b) <= TOL[jnp.float32]


def test_pallas_tpu_needs_interpret_off_tpu():
  if jax.default_backend() == "tpu":
    pytest.skip("checks the refusal on other backends")
  args = _v1_inputs(1, 16, 16, 2, 2, 16, jnp.float32)
  with pytest.raises(ValueError, match="interpret=True"):
    ops.diff_v1_attention_core(*args, implementation="pallas_tpu")


STOCK = {
  "diff_v1": kt.diff_v1_stock_tpu,
  "diff_v2": kt.diff_v2_stock_tpu,
  "gda_v1": kt.gda_v1_stock_tpu,
  "gda_v2": kt.gda_v2_stock_tpu,
}


class TestStockTpu(AttentionCases):
  """The splash-based stock paths in splash's interpreter: two splash calls with the
  2D-wide value (V1) or one over 2H heads (V2), and the grouped forms, at splash's own tiles.
  Splash leaves a row that sees no key undefined (docs/kernels_tpu.md), so no such row."""

  ops = tuple(STOCK)
  segments = ("none", "packed")
  shapes = (Shape(1, 200, 200, 2, 2, 16),) + GROUPED_TILED_SHAPES[-2:]
  pinned = (Case("diff_v2", shapes[0], True, "packed", "float32"),)
  sampled = 0
  integration_sampled = 3
  kept = (
    Case("diff_v1", shapes[0], True, "none", "float32"),
    Case("gda_v1", shapes[1], True, "packed", "float32"),
    Case("gda_v2", shapes[2], True, "none", "float32"),
  )

  def supports(self, case):
    return case.shape.tiles == "default" and case.shape.for_grouped_ops == case.grouped

  def call(self, case, *arrays):
    return STOCK[case.op](*arrays, **mask_kwargs(case), block_sizes=None, interpret=True)


# ----------------------------------------------------------------------------------
# Mosaic compiles for a real TPU topology (libtpu, no TPU) and shard_map.


def _v5e_mesh():
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  # Compiling for a described topology touches no TPU; let a concurrent libtpu user
  # (another test process) not hold this one off with its lock file.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    topo = topologies.get_topology_desc("v5e:2x2", "tpu")
  except Exception as e:  # pylint: disable=broad-except
    pytest.skip(f"no TPU compiler here (install jax[tpu] / libtpu): {e}")
  return jax.sharding.Mesh(np.array(topo.devices).reshape(2, 2), ("data", "model"))


@pytest.mark.integration  # an AOT compile gate
def test_aot_compile_v5e_fwd_bwd():
  """Forward + backward of both kernels compile with Mosaic inside shard_map on v5e."""
  mesh = _v5e_mesh()
  P = jax.sharding.PartitionSpec
  sds = lambda shape, spec, dt=jnp.bfloat16: jax.ShapeDtypeStruct(
    shape, dt, sharding=jax.sharding.NamedSharding(mesh, spec)
  )
  b, t, h, d = 2, 640, 4, 128  # 640: padded and masked key tail with 256-wide tiles
  one_chunk = kt.BlockSizes(block_q=256, block_kv=256, block_q_bwd=128, block_kv_bwd=256)
  for version in (1, 2):
    # V2's backward in three query chunks (256, 256, 128 rows) with dK/dV partials.
    blocks = one_chunk if version == 1 else kt.BlockSizes(**{**vars(one_chunk), "dq_chunk": 256})
    if version == 1:
      in_specs, out_spec = kt.diff_v1_partition_specs("data", "model", segment_ids=True)
      x = sds((b, t, h, d), in_specs[0])
      args = (x, x, x, x, sds((b, t, h, 2 * d), in_specs[4]), sds((h,), in_specs[5], jnp.float32))
      fn = kt.diff_v1_pallas_tpu
    else:
      in_specs, out_spec = kt.diff_v2_partition_specs("data", "model", segment_ids=True)
      args = (
        sds((b, t, 2 * h, d), in_specs[0]),
        sds((b, t, h, d), in_specs[1]),
        sds((b, t, h, d), in_specs[2]),
        sds((b, t, h), in_specs[3], jnp.float32),
      )
      fn = kt.diff_v2_pallas_tpu
    seg = sds((b, t), P("data", None), jnp.int32)

    def per_device(*a, fn=fn, blocks=blocks):
      *xs, q_seg, kv_seg = a
      return fn(*xs, causal=True, q_segment_ids=q_seg, kv_segment_ids=kv_seg, block_sizes=blocks)

    sharded = jax.shard_map(
      per_device, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False
    )
    loss = lambda *a: jnp.sum(sharded(*a).astype(jnp.float32))
    n = len(args)
    grad = jax.jit(jax.grad(loss, argnums=tuple(range(n))))
    with without_persistent_cache():
      compiled = grad.lower(*args, seg, seg).compile()
    text = compiled.as_text()
    assert "diff_attention_fwd" in text and "diff_attention_bwd" in text, version


# Compiles of about 30 s each: slow (the grouped kernels' numbers are checked in the interpreter
# in the default tier).
@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_aot_compile_gda_motif_layer(version):
  """Grouped differential attention at a Motif-2-12.7B layer (32 signal heads, 8 noise
  heads, 8 kv groups, d = 128, sequence 4096, bfloat16; r = 4), forward and backward with
  the default tiles, compiles with Mosaic for one v5e chip: the tiles and the group's
  r + 1 maps fit VMEM, and the noise residual stays per noise head."""
  mesh = _v5e_mesh()
  device = mesh.devices.flat[0]
  sds = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(
    shape, dt, sharding=jax.sharding.SingleDeviceSharding(device)
  )
  b, t, h, n, kh, d = 1, 4096, 32, 8, 8, 128
  q1, q2, k = sds((b, t, h, d)), sds((b, t, n, d)), sds((b, t, kh, d))
  if version == 1:
    dv, fn = 2 * d, kt.gda_v1_pallas_tpu
    args = (q1, q2, k, k, sds((b, t, kh, dv)), sds((h,), jnp.float32))
  else:
    dv, fn = d, kt.gda_v2_pallas_tpu
    args = (q1, q2, k, k, sds((b, t, h), jnp.float32))
  loss = lambda *a: jnp.sum(fn(*a, causal=True).astype(jnp.float32))
  grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
  with jax.default_device(device), without_persistent_cache():
    text = grad.lower(*args).compile().as_text()
  assert "gda_attention_fwd" in text and "gda_attention_bwd" in text
  # The forward's residual o2 is [B, N, T, Dv]: the noise output once per group.
  assert re.search(rf"bf16\[{b},{n},{t},{dv}\]", text)


@pytest.mark.integration  # an AOT compile gate
def test_aot_v1_forward_needs_no_layout_passes():
  """The wrappers' per-component transposes compile to bitcasts: the V1 forward for one v5e
  chip (6 DIFF heads of d = 128, the 3B layer over two model shards) has no XLA op
  around the kernel."""
  mesh = _v5e_mesh()
  device = mesh.devices.flat[0]
  sds = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(
    shape, dt, sharding=jax.sharding.SingleDeviceSharding(device)
  )
  b, t, h, d = 1, 1024, 6, 128
  args = (sds((b, t, h, d)),) * 4 + (sds((b, t, h, 2 * d)), sds((h,), jnp.float32))
  fn = jax.jit(lambda *a: kt.diff_v1_pallas_tpu(*a, causal=True))
  with jax.default_device(device), without_persistent_cache():
    text = fn.lower(*args).compile().as_text()
  entry = text[text.find("ENTRY") :]
  assert "diff_attention_fwd" in entry
  assert not re.findall(r"= \S+ (?:copy|transpose|fusion|concatenate)\(", entry), entry


@pytest.mark.slow  # the kernels under shard_map also run in tests/ops/test_dispatch.py
def test_shard_map_on_four_cpu_devices():
  # 4 of the test process's 8 CPU devices (tests/conftest.py), as a 2x2 mesh.
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
  rel = lambda a, b: float(
    np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b)))
  )
  ks = jax.random.split(jax.random.PRNGKey(0), 8)
  n = lambda k, s: jax.random.normal(k, s, jnp.float32)
  b, t, h, kh, d = 2, 136, 4, 2, 8
  seg = (jnp.arange(t)[None, :] >= jnp.array([[40], [90]])).astype(jnp.int32)
  blocks = dict(block_q=64, block_kv=128, block_q_bwd=32, block_kv_bwd=128)
  errs = {}
  for version in (1, 2):
    if version == 1:
      args = (
        n(ks[0], (b, t, h, d)),
        n(ks[1], (b, t, h, d)),
        n(ks[2], (b, t, kh, d)),
        n(ks[3], (b, t, kh, d)),
        n(ks[4], (b, t, kh, 2 * d)),
        jnp.linspace(0.2, 0.8, h),
      )
      specs, out_spec = kt.diff_v1_partition_specs("data", "model", segment_ids=True)
      fn, refn = kt.diff_v1_pallas_tpu, ref.diff_v1_reference
    else:
      args = (
        n(ks[0], (b, t, 2 * h, d)),
        n(ks[2], (b, t, kh, d)),
        n(ks[4], (b, t, kh, d)),
        jax.nn.sigmoid(n(ks[5], (b, t, h))),
      )
      specs, out_spec = kt.diff_v2_partition_specs("data", "model", segment_ids=True)
      fn, refn = kt.diff_v2_pallas_tpu, ref.diff_v2_reference

    def per_device(*a, fn=fn):
      *xs, q_seg, kv_seg = a
      return fn(
        *xs,
        causal=True,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        block_sizes=blocks,
        interpret=True,
      )

    sharded = jax.shard_map(
      per_device, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=False
    )
    loss = lambda *a: jnp.sum(jnp.sin(sharded(*a, seg, seg)))
    ref_loss = lambda *a: jnp.sum(jnp.sin(refn(*a, causal=True, segment_ids=seg)))
    got = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args)))))(*args)
    want = jax.jit(jax.value_and_grad(ref_loss, argnums=tuple(range(len(args)))))(*args)
    errs[f"v{version}"] = max(
      rel(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
    )
  assert all(e < 2e-5 for e in errs.values()), errs
