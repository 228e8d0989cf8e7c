"""Mosaic GPU kernels (Hopper) checked on a CPU.

* The tests' additions to jax's Mosaic GPU interpreter (``mosaic_interpret.py`` beside
  this file, installed before any kernel is interpreted) against numpy.
* The tiles and their budgets (:mod:`diffjax.kernels.gpu.mosaic_tiles`): shared memory
  recomputed here in closed form from the tile sizes and dtypes, the byte model behind
  the backward's design, block-size validation. (What Mosaic GPU and ptxas make of the
  kernels, compiled for an H100, is tests/kernels/gpu/test_gpu_compile.py.)
* The forward and every gradient of :func:`diffjax.kernels.gpu.mosaic.diff_v1_pallas_gpu`
  / ``diff_v2_pallas_gpu`` (the attention test base, :class:`TestPallasGpu`), and V1
  decoding, against the float32 reference in jax's Mosaic GPU interpreter, on this
  process's eight CPU devices (``mosaic_common.check_threads``): one small case per variant
  in the integration tier, the wider product under ``slow``. Each output is measured over
  the whole array and row by row, with per-dtype tolerances (``kernel_checks``); V1's d
  lambda against a tolerance derived from its own terms. The checks are shown to fail on
  broken results.
* ``gpu``-marked tests run the compiled kernels on a Hopper.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

import mosaic_interpret as mi  # noqa: E402  (beside this file)
from attention_cases import GPU_SHAPES, Case, segment_ids  # noqa: E402
from kernel_checks import abstract_hopper  # noqa: E402

from diffjax import hardware  # noqa: E402
from diffjax.core import reference as ref  # noqa: E402
from diffjax.kernels.gpu import mosaic  # noqa: E402
from diffjax.kernels.gpu import mosaic_bwd as mb  # noqa: E402
from diffjax.kernels.gpu import mosaic_common as mc  # noqa: E402
from diffjax.kernels.gpu import mosaic_decode as md  # noqa: E402
from diffjax.kernels.gpu import mosaic_fwd as mf  # noqa: E402
from diffjax.kernels.gpu import mosaic_tiles as tiles  # noqa: E402
from diffjax.kernels.gpu.pair_common import EMPTY_LSE, LOG2E  # noqa: E402

KIB = 1024


@pytest.fixture(autouse=True)
def _fresh_interpreter():
  mi.reset()
  yield
  mi.reset()


def _operands(m=64, k=64, n=64):
  a = jax.random.normal(jax.random.key(0), (m, k)).astype(jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, k)).astype(jnp.bfloat16)
  return a, b


def test_interpreter_layout_cast_is_identity():
  @functools.partial(
    plgpu.kernel, out_type=jax.ShapeDtypeStruct((64, 32), jnp.float32), interpret=mi.params()
  )
  def kernel(x_ref, o_ref):
    o_ref[...] = plgpu.layout_cast(x_ref[...], plgpu.Layout.WGMMA) * 2.0

  x = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32)
  np.testing.assert_array_equal(kernel(x), 2.0 * np.asarray(x))


@pytest.mark.parametrize("a_in_registers", [False, True])
def test_interpreter_wgmma_transposed_and_register_operands(a_in_registers):
  a, b = _operands()
  tr = mc.smem_transforms(64, jnp.bfloat16)

  @functools.partial(
    plgpu.kernel,
    out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
    scratch_types=[
      plgpu.SMEM((64, 64), jnp.bfloat16, transforms=tr),
      plgpu.SMEM((2, 64, 64), jnp.bfloat16, transforms=tr),
    ],
    interpret=mi.params(),
  )
  def kernel(a_ref, b_ref, o_ref, a_smem, b_smem):
    a_smem[...] = a_ref[...]
    b_smem[1] = b_ref[...]
    plgpu.commit_smem()
    lhs = plgpu.layout_cast(a_ref[...], plgpu.Layout.WGMMA) if a_in_registers else a_smem

    def body(acc_ref):
      plgpu.wgmma(acc_ref, lhs, b_smem.at[1].transpose((1, 0)))
      plgpu.wgmma(acc_ref, lhs, b_smem.at[1].transpose((1, 0)))
      return acc_ref[...]

    o_ref[...] = pl.run_scoped(body, plgpu.ACC((64, 64), jnp.float32))

  want = 2.0 * (np.asarray(a, np.float32) @ np.asarray(b, np.float32).T)
  np.testing.assert_allclose(kernel(a, b), want, rtol=1e-6, atol=1e-5)


def test_interpreter_reduce_add_copies_sum_every_cta():
  # Four CTAs add their tile into the same rows of a float32 array (aliased through a
  # ref, as the backward's dQ is): the result is the initial value plus all four.
  x = jax.random.normal(jax.random.key(2), (4, 64, 32), jnp.float32)
  scratch = [plgpu.SMEM((64, 32), jnp.float32), plgpu.Barrier(num_barriers=1)]

  def kernel(x_ref, acc_ref, smem, bar):
    i = jax.lax.axis_index("g")
    plgpu.copy_gmem_to_smem(x_ref.at[i], smem, bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    plgpu.copy_smem_to_gmem(smem, acc_ref.at[0], reduction_op="add")
    plgpu.wait_smem_to_gmem(0)

  @jax.jit
  def run(x):
    acc = jax.new_ref(jnp.ones((1, 64, 32), jnp.float32), memory_space=plgpu.GMEM)
    pl.kernel(
      lambda *refs: pl.run_scoped(lambda *scr: kernel(*refs, *scr), *scratch),
      out_type=(),
      mesh=plgpu.Mesh(grid=(4,), grid_names=("g",)),
      interpret=mi.params(),
    )(x, acc)
    return acc[...]

  np.testing.assert_allclose(run(x)[0], 1.0 + np.asarray(x).sum(0), rtol=1e-6, atol=1e-6)


def test_smem_transforms_pick_the_widest_swizzle():
  swizzle = lambda w, cap=128: mc.smem_transforms(w, jnp.bfloat16, cap)[1].swizzle
  # Rows of 128, 160, 192, 256 and 512 bytes.
  assert [swizzle(w) for w in (64, 80, 96, 128, 256)] == [128, 32, 64, 128, 128]
  # The backward's cap (32-query sub-tiles of bf16: 64 bytes).
  assert [swizzle(w, 64) for w in (64, 80, 96, 128)] == [64, 32, 64, 64]
  with pytest.raises(ValueError, match="multiple of 16"):
    mc.smem_transforms(8, jnp.bfloat16)


def test_interpreter_thread_check(monkeypatch):
  monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
  monkeypatch.setattr(jax, "devices", lambda *_: [object()])
  with pytest.raises(RuntimeError, match="xla_force_host_platform_device_count=8"):
    mc.check_threads(3)
  mc.check_threads(2)
  monkeypatch.setattr(jax, "devices", lambda *_: [object()] * 8)
  mc.check_threads(3)


def test_forward_padded_rejects_what_the_kernels_do_not_take():
  q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
  v = jnp.zeros((1, 64, 2, 128), jnp.bfloat16)
  lam = jnp.zeros((1, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match="bfloat16 or float16.*implementation='stock'"):
    mf.forward_padded("v1", (q.astype(jnp.float32),) * 2, (q,) * 2, v, lam)
  with pytest.raises(ValueError, match="variant='v3'"):
    mf.forward_padded("v3", (q,), (q,), v, lam)
  with pytest.raises(ValueError, match=r"v1 takes \(q1, q2\)"):
    mf.forward_padded("v1", (q,), (q,), v, lam)
  with pytest.raises(ValueError, match="value dim 120 must be a multiple of 16"):
    mf.forward_padded("v1", (q,) * 2, (q,) * 2, v[..., :120], lam)


def _align(n):
  return -(-n // KIB) * KIB


def _forward_smem(d, dv, stages, v1, seg, item=2):
  """The forward's shared memory in closed form: Q of both maps, the K (K1, K2) and V
  ring, O2 crossing in float32 (in 128-column halves from Dv 256), lambda and both
  log-sum-exps, segment ids; each buffer at a 1 KiB boundary; 8 bytes a barrier; the
  2 KiB plgpu.kernel adds."""
  half = 2 if dv >= 256 else 1
  bufs = [
    2 * 64 * d * item,
    stages * 64 * d * item,
    stages * 64 * dv * item,
    64 * dv // half * 4,
    64 * 4,
    2 * 64 * 4,
  ]
  bufs += [stages * 64 * d * item] if v1 else []
  bufs += [2 * 64 * 4, stages * 64 * 4] if seg else []
  bars = 2 + 2 + stages + (stages if v1 else 0) + stages + (stages if seg else 0) + stages
  bars += 2 + (half > 1)  # O2 crossed (and read, in halves); the ring free for O2 (o_free)
  return sum(map(_align, bufs)) + 8 * bars + 2 * KIB


def _backward_smem(d, dv, stages, parts, v1, seg, item=2):
  """The backward's: K_a (K_b) and the V halves once; per ring slot Q of both maps, the
  dO halves, five row terms and query ids; key ids; the dP halves (float32, 32-query
  sub-tile) and P / dS (64 queries) crossing; the dQ chunk; an int per warpgroup."""
  half = dv // 2  # the halves of the cases below are equal
  bufs = [
    (2 if v1 else 1) * 64 * d * item,
    64 * half * item,
    64 * half * item,
    stages * 64 * d * item,
    stages * 64 * d * item,
    stages * 64 * half * item,
    stages * 64 * half * item,
    stages * 5 * 64 * 4,
    2 * 64 * 32 * 4,
    2 * 64 * 64 * item,
    2 * 64 * (d // parts) * 4,
    2 * 4,
  ]
  bufs += [stages * 64 * 4, 64 * 4] if seg else []
  bars = 5 + 2 * stages + 2 * stages + stages + (stages if seg else 0) + stages + 2
  return sum(map(_align, bufs)) + 8 * bars


@pytest.mark.parametrize(
  "d,v1,seg,itemsize",
  [
    (128, True, True, 2),
    (128, False, True, 2),
    (64, True, False, 2),
    (96, True, True, 2),
    (128, True, False, 2),
  ],
)
def test_shared_memory_models_in_closed_form(d, v1, seg, itemsize):
  dv = 2 * d if v1 else d
  variant = "v1" if v1 else "v2"
  bk, stages = tiles.forward_blocks(d, dv, variant, seg, itemsize)
  assert tiles.forward_smem_bytes(d, dv, bk, stages, variant, seg, itemsize) == _forward_smem(
    d, dv, stages, v1, seg, itemsize
  )
  b_stages, parts = tiles.backward_blocks(d, dv, variant, seg, itemsize)
  assert tiles.backward_smem_bytes(
    d, dv, b_stages, parts, variant, seg, itemsize
  ) == _backward_smem(d, dv, b_stages, parts, v1, seg, itemsize)


def test_default_tiles_follow_from_the_budget():
  # The deepest forward ring within 227 KiB, from the closed form: V1 d 128 (Dv 256)
  # keeps 2 slots (3 would need more), V2 d 128 and V1 d 64 keep 3.
  limit = 227 * KIB
  for d, v1, want in [(128, True, 2), (128, False, 3), (64, True, 3)]:
    dv = 2 * d if v1 else d
    fits = [s for s in (3, 2, 1) if _forward_smem(d, dv, s, v1, True) <= limit]
    assert fits[0] == want
    assert tiles.forward_blocks(d, dv, "v1" if v1 else "v2") == (64, want)
  # The backward: dQ in 32-column chunks where d allows (d 128: 4; d 80: whole), the
  # deepest ring that fits: V1 d 128 one slot, V2 d 128 two.
  assert [tiles.dq_parts(d) for d in (64, 80, 96, 128)] == [2, 1, 3, 4]
  assert (
    _backward_smem(128, 256, 2, 4, True, True) > limit >= _backward_smem(128, 256, 1, 4, True, True)
  )
  assert tiles.backward_blocks(128, 256, "v1") == (1, 4)
  assert _backward_smem(128, 128, 2, 4, False, True) <= limit
  assert tiles.backward_blocks(128, 128, "v2") == (2, 4)
  assert tiles.MosaicBlockSizes.default(128, 256, "v1") == tiles.MosaicBlockSizes(64, 2, 1, 4)
  assert tiles.value_split(256) == (128, 128) and tiles.value_split(80) == (48, 32)
  with pytest.raises(ValueError, match="at least 32"):
    tiles.value_split(16)
  with pytest.raises(ValueError, match="No backward tiling fits shared memory"):
    tiles.backward_blocks(256, 512, "v1")
  # The register estimate the backward's tiling is kept within (ptxas has the last
  # word: tests/kernels/gpu/test_gpu_compile.py fails on any spill).
  assert tiles.backward_registers(128, 256) == 64 + 64 + 3 * 16 + 40 <= tiles.BWD_REGISTERS


def test_budgets_are_the_hopper_gpus_of_the_hardware_table():
  h100, h200 = hardware.get("h100"), hardware.get("h200")
  assert tiles.SMEM_BYTES == h100.smem_per_block == h200.smem_per_block == 227 * KIB
  # The warpgroups' register splits (set_max_registers: two consumers and a producer of
  # 128 threads each) fit one SM's registers, each within the per-thread limit.
  for consumer, producer in [
    (tiles.CONSUMER_REGISTERS, tiles.PRODUCER_REGISTERS),
    (tiles.BWD_REGISTERS, tiles.BWD_PRODUCER_REGISTERS),
  ]:
    used = 128 * (mc.COMPUTE_WGS * consumer + producer)
    assert used == 64_512 <= tiles.REGISTERS_PER_SM == h100.registers_per_sm == 65_536
    assert max(consumer, producer) <= hardware.MAX_REGISTERS_PER_THREAD
    assert consumer % 8 == producer % 8 == 0  # setmaxnreg takes multiples of 8


def test_block_sizes_validate_against_the_budgets():
  # Backward fields left None are filled from the budget, around the ones given.
  assert tiles.MosaicBlockSizes(64, 2).resolved(128, 256, "v1") == tiles.MosaicBlockSizes(
    64, 2, 1, 4
  )
  assert tiles.MosaicBlockSizes(dq_parts=1).resolved(64, 128, "v1").bwd_stages == 2
  with pytest.raises(ValueError, match="the backward needs .* bytes"):
    tiles.MosaicBlockSizes(64, 2, bwd_stages=2).resolved(128, 256, "v1")
  with pytest.raises(ValueError, match="dq_parts=5 must be 1, 2, 3 or 4"):
    tiles.MosaicBlockSizes(dq_parts=5)
  with pytest.raises(ValueError, match="dq_parts=2 must split d=80"):
    tiles.MosaicBlockSizes(64, 2, 1, 2).check(80, 160, "v1")
  for bad, match in [
    (dict(block_kv=96), "block_kv=96 must be 64, 128"),
    (dict(block_kv=320), "block_kv=320"),
    (dict(stages=0), r"stages=0 must be in \[1, 4\]"),
    (dict(stages=True), "stages=True must be an int"),
  ]:
    with pytest.raises(ValueError, match=match):
      tiles.MosaicBlockSizes(**bad)
  with pytest.raises(ValueError, match="shared memory for d=128, dv=256.*default here is"):
    tiles.MosaicBlockSizes(64, 3).check(128, 256, "v1")
  with pytest.raises(ValueError, match="registers a consumer thread at dv=256"):
    tiles.MosaicBlockSizes(256, 1).check(64, 256, "v2")
  tiles.MosaicBlockSizes(128, 2).check(64, 64, "v2")
  q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="Unknown MosaicBlockSizes fields"):
    mf.forward_padded("v2", (q,), (q,), q, jnp.zeros((1, 1, 64)), block_sizes={"bq": 1})


def test_backward_byte_model_behind_the_design():
  # Per step of 64 queries x 64 keys, from the tile sizes: the key-major loop reads
  # Q_a, Q_b (64 x d each) and dO (64 x Dv) in bf16 and 5 float32 row terms, and
  # reduce-adds both maps' float32 dQ (2 x 64 x d x 4); the query-major loop reads K_a,
  # K_b and V (64 x (2d + Dv), bf16) and reduce-adds them in float32.
  def model(d, dv, keys):
    q_reads = 64 * (2 * d + dv) * 2 + 5 * 64 * 4
    kv_reads = 64 * (keys * d + dv) * 2
    return {
      "key_major": q_reads + 2 * 64 * d * 4,
      "two_pass": q_reads + kv_reads,
      "query_major": kv_reads + 64 * (keys * d + dv) * 4,
    }

  v1 = tiles.backward_step_bytes(128, 256, "v1")
  assert {k: v1[k] for k in ("key_major", "two_pass", "query_major")} == model(128, 256, 2)
  # For V1 the one-pass key-major loop moves the bytes of a two-pass backward and fewer
  # than a query-major loop, at 20d instead of 28d backward FLOPs; for V2 a query-major
  # loop would move fewer.
  assert v1["key_major"] == v1["two_pass"] < v1["query_major"]
  assert v1["two_pass_flops"] / v1["one_pass_flops"] == 28 / 20
  v2 = tiles.backward_step_bytes(128, 128, "v2")
  assert {k: v2[k] for k in ("key_major", "query_major")} == {
    k: model(128, 128, 1)[k] for k in ("key_major", "query_major")
  }
  assert v2["query_major"] < v2["key_major"]


def test_backward_over_shared_memory_is_refused_by_the_lowering():
  # The budget is real: two ring slots at V1 d 128 do not fit, and Mosaic GPU says so
  # (the tiling choice avoids exactly this).
  t = 256
  cfg = mc.MosaicConfig(
    variant="v1",
    causal=True,
    scale=0.1,
    q_len=t,
    kv_len=t,
    group=1,
    segments=False,
    block_kv=64,
    stages=2,
    interpret=False,
  )
  S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
  q, v = S((1, t, 1, 128), bf), S((1, t, 1, 256), bf)
  rows = S((1, 1, 5, t), jnp.float32)
  fn = jax.jit(
    lambda q1, q2, k1, k2, v, do, rows: mb.backward(
      cfg, (q1, q2), (k1, k2), v, do, rows, None, None, stages=2, dq_parts=1
    )
  )
  assert tiles.backward_smem_bytes(128, 256, 2, 1, "v1", False) > tiles.SMEM_BYTES
  with abstract_hopper(), pytest.raises(Exception, match="exceeds available shared memory"):
    fn.trace(q, q, q, q, v, v, rows).lower(lowering_platforms=("cuda",))


def test_mosaic_entry_points_reject_bad_input():
  q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
  v = jnp.zeros((1, 64, 2, 128), jnp.bfloat16)
  f32 = lambda x: x.astype(jnp.float32)
  # What the kernels cannot take they refuse (the dispatcher then takes the next path).
  with pytest.raises(NotImplementedError, match="bfloat16 or float16.*'stock'"):
    mosaic.diff_v1_pallas_gpu(f32(q), f32(q), f32(q), f32(q), f32(v), 0.5)
  with pytest.raises(ValueError, match="share one dtype"):
    mosaic.diff_v1_pallas_gpu(q, q, q, f32(q), v, 0.5)
  with pytest.raises(ValueError, match="Pass both q_segment_ids"):
    mosaic.diff_v2_pallas_gpu(
      jnp.zeros((1, 64, 4, 64), jnp.bfloat16),
      q,
      q,
      jnp.zeros((1, 64, 2)),
      q_segment_ids=jnp.zeros((1, 64), int),
    )
  with pytest.raises(ValueError, match="Unknown MosaicBlockSizes fields"):
    mosaic.diff_v1_pallas_gpu(q, q, q, q, v, 0.5, block_sizes={"block_q": 64})


# ----------------------------------------------------------------------------------
# Numbers in the Mosaic GPU interpreter: the attention test base (tests/attention_cases.py).


def _v1_dlam_check(case, args, ct, got, want):
  """V1's d lambda per head is -sum_i dO_i O2_i over every token and channel. The kernel's O2
  carries one rounding of the input dtype (unit u; the P V product rounds P once more):
  |err| <= 2u sum_i |dO_i O2_i| |delta_i|-style sums of independent roundings, whose spread
  is 2u sqrt(sum_i (dO_i O2_i)^2). Allowed: four of those, per head. The bound is shown to
  fail a zero and a negated d lambda on the same numbers."""
  f32 = lambda x: x.astype(jnp.float32)
  q2, k2, v = args[1], args[3], args[4]
  seg = segment_ids(case)
  o2 = ref.diff_v1_reference(
    *map(f32, (q2, q2, k2, k2, v)), 0.0, causal=case.causal, segment_ids=seg
  )
  terms = jnp.transpose(f32(ct) * o2, (2, 0, 1, 3)).reshape(case.heads, -1)
  u = 2.0 ** -(8 if case.dtype == "bfloat16" else 11)
  tol = 4 * 2 * u * np.sqrt(np.sum(np.asarray(terms, np.float64) ** 2, axis=1))
  within = lambda dlam: np.abs(np.asarray(dlam, np.float64) - np.asarray(want, np.float64)) <= tol
  err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
  assert np.all(within(got)), f"dlam of {case}: error / bound {np.max(err / tol):.2f}"
  for mutant in (jnp.zeros_like(got), -got):
    assert not np.all(within(mutant)), f"dlam of {case}: a broken dlam passed"


def _gpu_case(op, shape, causal, segments, dtype="bfloat16"):
  return Case(op, shape, causal, segments, dtype)


class TestPallasGpu(mi.InterpretedCases):
  """The Mosaic GPU kernels (``diff_v1_pallas_gpu`` / ``diff_v2_pallas_gpu``) in jax's Mosaic
  GPU interpreter, on this process's 8 CPU devices (a CPU-client thread per warpgroup, see
  ``mosaic_common.check_threads``). About 40 s a case, so none in the unit tier; the
  integration tier runs one 64-query block per op (causal, a one-token document, d 64: two
  32-column dQ chunks, two query sub-tiles); the slow tier (``grid``) the awkward sizes. Each
  output is measured over the whole array and row by row, the row measure shown to fail a
  broken row of each case, and V1's d lambda against a bound derived from its own terms."""

  kernels = {"diff_v1": mosaic.diff_v1_pallas_gpu, "diff_v2": mosaic.diff_v2_pallas_gpu}
  shapes = GPU_SHAPES
  integration_pinned = (
    _gpu_case("diff_v1", GPU_SHAPES[0], True, "single"),
    _gpu_case("diff_v2", GPU_SHAPES[0], True, "single"),
  )
  kept = (
    _gpu_case("diff_v1", GPU_SHAPES[1], True, "none"),
    _gpu_case("diff_v1", GPU_SHAPES[2], True, "none"),  # GQA 3, causal block skipping
    _gpu_case("diff_v1", GPU_SHAPES[3], True, "single"),  # Dv 256: one slot, dQ in four chunks
    _gpu_case("diff_v1", GPU_SHAPES[4], False, "single"),  # d 80 unpadded (32-byte swizzle)
    _gpu_case("diff_v1", GPU_SHAPES[5], True, "single"),  # d 96: three dQ chunks
    _gpu_case("diff_v2", GPU_SHAPES[6], True, "single"),
    _gpu_case("diff_v2", GPU_SHAPES[7], True, "none"),  # Dv 80: halves of 48 and 32
    _gpu_case("diff_v2", GPU_SHAPES[8], False, "none"),
    _gpu_case("diff_v1", GPU_SHAPES[9], True, "none", "float16"),  # queries after a prefix
    _gpu_case("diff_v2", GPU_SHAPES[3], True, "single", "float16"),
    _gpu_case("diff_v2", GPU_SHAPES[10], True, "none"),
  )

  def own_checks(self, case):
    return {"dlam": _v1_dlam_check} if case.op == "diff_v1" else {}


# ----------------------------------------------------------------------------------
# DIFF V1 decoding.


def test_decode_tiles_and_merge():
  assert md.decode_stages(128, 256) == 2 and md.decode_stages(64, 128) == 4
  # Shared memory in closed form: both maps' 64-row query tiles, the K1, K2 and V ring,
  # the log-sum-exps and the 32 lengths, each at 1 KiB; 8 bytes a barrier; 2 KiB more.
  for d, stages in [(64, 4), (128, 2)]:
    bufs = (
      [64 * d * 2] * 2 + [stages * 64 * d * 2] * 2 + [stages * 64 * 2 * d * 2, 2 * 64 * 4, 32 * 4]
    )
    bars = 2 + 2 * stages + stages + 1 + stages
    assert md.decode_smem_bytes(d, 2 * d, stages) == sum(map(_align, bufs)) + 8 * bars + 2 * KIB
    assert md.decode_smem_bytes(d, 2 * d, stages) <= tiles.SMEM_BYTES
  assert md.num_splits(8, 12, 4096) == 2 and md.num_splits(1, 1, 100) == 2
  # Merging normalised split results by their log-sum-exps equals one softmax over all
  # keys; an empty split (EMPTY_LSE) and an all-empty row drop out.
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(1, 1, 3, 2, 64))  # [B, K, splits, rows, keys]
  vals = rng.normal(size=(1, 1, 3, 64, 8))
  logits[:, :, 1] = -np.inf  # an empty split
  logits[:, :, :, 1] = -np.inf  # an all-empty row
  with np.errstate(invalid="ignore", divide="ignore"):
    top = np.max(logits, -1, keepdims=True)
    p = np.nan_to_num(np.exp(logits - top))
    o = np.einsum("bksrn,bksnd->bksrd", p, vals) / np.maximum(p.sum(-1), 1e-30)[..., None]
    lse = np.log(p.sum(-1)) + top[..., 0]
  lse = np.where(np.isfinite(lse), lse * LOG2E, EMPTY_LSE)
  got = np.asarray(jax.jit(md._merge)(o.astype(np.float32), lse.astype(np.float32)))
  flat = logits[0, 0, :, 0].reshape(-1)  # row 0 over all 3 x 64 keys
  flat_v = vals[0, 0].reshape(-1, 8)
  flat, flat_v = flat[np.isfinite(flat)], flat_v[np.isfinite(flat)]
  w = np.exp(flat - flat.max())
  np.testing.assert_allclose(got[0, 0, 0], (w / w.sum()) @ flat_v, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got[:, :, 1], 0.0)


def test_decode_errors_name_the_value():
  bf = jnp.bfloat16
  q = jnp.zeros((2, 1, 4, 64), bf)
  k = jnp.zeros((2, 128, 2, 64), bf)
  v = jnp.zeros((2, 128, 2, 128), bf)
  n = jnp.array([5, 7])
  with pytest.raises(NotImplementedError, match="bfloat16 or float16.*'xla'"):
    f = lambda x: x.astype(jnp.float32)
    md.diff_v1_decode_pallas_gpu(f(q), f(q), f(k), f(k), f(v), 0.5, n)
  with pytest.raises(ValueError, match="num_splits=0 must be a positive int"):
    md.diff_v1_decode_pallas_gpu(q, q, k, k, v, 0.5, n, block_sizes={"num_splits": 0})
  with pytest.raises(ValueError, match="Unknown MosaicDecodeBlockSizes fields"):
    md.diff_v1_decode_pallas_gpu(q, q, k, k, v, 0.5, n, block_sizes={"block_kv": 64})


def _interpret_decode_cases(cases):
  """The cases checked in the Mosaic GPU interpreter, in this process: its 8 CPU devices give
  the kernel's warpgroups a CPU-client thread each (mosaic_common.check_threads)."""
  import json  # pylint: disable=import-outside-toplevel

  import jax
  import jax.numpy as jnp
  import mosaic_interpret

  from diffjax.kernels.gpu import decode
  from diffjax.kernels.gpu import mosaic_decode as md

  mosaic_interpret.install()
  import kernel_checks as kc

  results = []
  for case in cases:
    b, s, h, kh, d, splits, lens, dtype = case
    dtype = jnp.dtype(dtype)
    ks = jax.random.split(jax.random.key(0), 6)
    n = lambda i, sh: jax.random.normal(ks[i], sh, jnp.float32).astype(dtype)
    q1, q2 = n(0, (b, 1, h, d)), n(1, (b, 1, h, d))
    k1, k2, v = n(2, (b, s, kh, d)), n(3, (b, s, kh, d)), n(4, (b, s, kh, 2 * d))
    lam = jnp.linspace(0.2, 0.8, h)
    kv_len = jnp.array(lens, jnp.int32)
    out = md.diff_v1_decode_pallas_gpu(
      q1, q2, k1, k2, v, lam, kv_len, interpret=True, block_sizes={"num_splits": splits}
    )
    f = lambda x: x.astype(jnp.float32)
    want = decode.diff_v1_decode_reference(f(q1), f(q2), f(k1), f(k2), f(v), lam, kv_len)
    assert out.dtype == dtype and out.shape == want.shape
    err = kc.errors(out, want)
    # A row with kv_len 0 sees nothing: zero.
    empty = all(float(abs(out[i]).max()) == 0.0 for i in range(b) if lens[i] == 0)
    bad = not (err[0] <= kc.tolerance(dtype) and err[1] <= kc.tolerance(dtype, True))
    results.append({"case": case, "errors": err, "bad": bad or not empty})
  return json.loads(json.dumps(results))  # as the JSON it was


@pytest.mark.slow
@pytest.mark.parametrize(
  "case",
  [
    # batch, cache slots, heads, kv heads, head dim, splits, kv_len per row, dtype
    (2, 200, 4, 2, 64, 2, [150, 0], "bfloat16"),  # padded cache, an empty row
    (2, 256, 3, 1, 128, 3, [256, 70], "bfloat16"),  # GQA 3, Dv 256, uneven splits
    (1, 320, 2, 2, 64, 1, [193], "float16"),
  ],
)
def test_decode_matches_reference_in_interpreter(case):
  (result,) = _interpret_decode_cases([case])
  print(result["case"], result["errors"])
  assert not result["bad"], result


# ----------------------------------------------------------------------------------
# A Hopper GPU: compile and run (pytest -m gpu). Timings are the benchmark's.


def _on_hopper() -> bool:
  if jax.default_backend() != "gpu":
    return False
  return all(str(getattr(d, "compute_capability", "")) == "9.0" for d in jax.devices())


_needs_hopper = pytest.mark.skipif(not _on_hopper(), reason="needs an H100/H200 (sm_90)")


@pytest.mark.gpu
@_needs_hopper
@pytest.mark.parametrize(
  "variant,d,n_rep,segments,dtype",
  [
    ("v1", 128, 1, True, "bfloat16"),
    ("v1", 64, 2, False, "bfloat16"),
    ("v1", 80, 3, True, "bfloat16"),
    ("v1", 96, 1, True, "float16"),
    ("v2", 128, 1, True, "bfloat16"),
    ("v2", 64, 2, False, "bfloat16"),
    ("v2", 80, 1, False, "float16"),
  ],
)
def test_hopper_kernels_match_reference(variant, d, n_rep, segments, dtype):
  from kernel_checks import check, value_and_vjp

  from diffjax.core import reference as ref

  b, t, kh = 2, 1000, 2
  h = kh * n_rep
  dt, f32 = jnp.dtype(dtype), jnp.float32
  keys = jax.random.split(jax.random.key(4), 8)
  n = lambda i, shape: jax.random.normal(keys[i], shape, f32).astype(dt)
  seg = None
  if segments:
    seg = jnp.stack([jnp.arange(t) // 300, jnp.arange(t) // 700]).astype(jnp.int32)
  kw = dict(q_segment_ids=seg, kv_segment_ids=seg)
  if variant == "v1":
    args = [
      n(0, (b, t, h, d)),
      n(1, (b, t, h, d)),
      n(2, (b, t, kh, d)),
      n(3, (b, t, kh, d)),
      n(4, (b, t, kh, 2 * d)),
      jnp.linspace(0.2, 0.8, h),
    ]
    kern = lambda *a: mosaic.diff_v1_pallas_gpu(*a, **kw)
    want = lambda *a: ref.diff_v1_reference(*[x.astype(f32) for x in a], segment_ids=seg)
    names = ["out", "dq1", "dq2", "dk1", "dk2", "dv", "dlam"]
  else:
    args = [
      n(0, (b, t, 2 * h, d)),
      n(2, (b, t, kh, d)),
      n(4, (b, t, kh, d)),
      jax.nn.sigmoid(jax.random.normal(keys[5], (b, t, h))),
    ]
    kern = lambda *a: mosaic.diff_v2_pallas_gpu(*a, **kw)
    want = lambda *a: ref.diff_v2_reference(*[x.astype(f32) for x in a], segment_ids=seg)
    names = ["out", "dq", "dk", "dv", "dlam"]
  ct = n(6, (b, t, h, 2 * d if variant == "v1" else d))
  out, grads = value_and_vjp(kern, args, ct)
  out_r, grads_r = value_and_vjp(want, args, ct.astype(f32))
  outputs = (out, *grads)
  assert len(names) == len(outputs) == len(args) + 1
  triples = list(zip(names, outputs, (out_r, *grads_r)))
  if variant == "v1":
    # V1's d lambda, one number per head summed over every token, against its own
    # size: the interpreter test derives the bound; here 4 u of its terms' spread.
    o2 = ref.diff_v1_reference(
      *[x.astype(f32) for x in (args[1], args[1], args[3], args[3], args[4])], 0.0, segment_ids=seg
    )
    terms = jnp.transpose(ct.astype(f32) * o2, (2, 0, 1, 3)).reshape(h, -1)
    u = 2.0 ** -(8 if dt == jnp.bfloat16 else 11)
    tol = 8 * u * np.sqrt(np.sum(np.asarray(terms, np.float64) ** 2, axis=1))
    assert np.all(np.abs(np.asarray(grads[5], np.float64) - np.asarray(grads_r[5])) <= tol)
    triples = triples[:-1]
  check(triples, dt, rows=True)


@pytest.mark.gpu
@_needs_hopper
def test_hopper_decode_matches_reference():
  from kernel_checks import rel_err, tolerance

  from diffjax.kernels.gpu import decode

  b, s, kh, h, d = 2, 32768, 4, 8, 128
  bf = jnp.bfloat16
  keys = jax.random.split(jax.random.key(5), 5)
  n = lambda i, shape: jax.random.normal(keys[i], shape, jnp.float32).astype(bf)
  q1, q2 = n(0, (b, 1, h, d)), n(1, (b, 1, h, d))
  k1, k2, v = n(2, (b, s, kh, d)), n(3, (b, s, kh, d)), n(4, (b, s, kh, 2 * d))
  lam = jnp.linspace(0.2, 0.8, h)
  kv_len = jnp.array([s, 5000], jnp.int32)
  out = jax.jit(md.diff_v1_decode_pallas_gpu)(q1, q2, k1, k2, v, lam, kv_len)
  want = decode.diff_v1_decode_reference(
    *[x.astype(jnp.float32) for x in (q1, q2, k1, k2, v)], lam, kv_len
  )
  assert rel_err(out, want) <= tolerance(bf)


# ----------------------------------------------------------------------------------
# The kernels as one block of the context-parallel ring.


def _interpret_ring_blocks(cases):
  """The cases checked in the Mosaic GPU interpreter, in this process: its 8 CPU devices give
  the kernel's warpgroups a CPU-client thread each (mosaic_common.check_threads)."""
  import json  # pylint: disable=import-outside-toplevel

  import jax
  import jax.numpy as jnp
  import mosaic_interpret

  from diffjax.kernels.gpu import mosaic
  from diffjax.kernels.gpu import mosaic_ring as mr

  mosaic_interpret.install()
  import kernel_checks as kc

  results = []
  for variant in cases:
    b, t, h, kh, d = 1, 128, 2, 1, 64
    dt = jnp.bfloat16
    keys = jax.random.split(jax.random.key(3), 8)
    n = lambda i, shape: jax.random.normal(keys[i], shape, jnp.float32).astype(dt)
    if variant == "v1":
      dv = 2 * d
      qs, ks = (n(0, (b, t, h, d)), n(1, (b, t, h, d))), (n(2, (b, t, kh, d)), n(3, (b, t, kh, d)))
      lam_h = jnp.array([0.3, 0.6], jnp.float32)
      lam_bht = jnp.broadcast_to(lam_h[None, :, None], (b, h, t))
      whole = lambda *a: mosaic.diff_v1_pallas_gpu(*a, interpret=True)
      extra = lam_h
    else:
      dv = d
      qs, ks = (n(0, (b, t, 2 * h, d)),), (n(2, (b, t, kh, d)),)
      extra = jax.nn.sigmoid(jax.random.normal(keys[5], (b, t, h)))
      lam_bht = jnp.transpose(extra, (0, 2, 1))
      whole = lambda *a: mosaic.diff_v2_pallas_gpu(*a, interpret=True)
    v, ct = n(4, (b, t, kh, dv)), n(6, (b, t, h, dv))
    out, grads = kc.value_and_vjp(whole, [*qs, *ks, v, extra], ct)
    plan = mr.block_config(
      version=int(variant[1]),
      t=t,
      s=t,
      d=d,
      dv=dv,
      heads=h,
      kv_heads=kh,
      causal=True,
      segmented=False,
      scale=d**-0.5,
      interpret=True,
    )

    @jax.jit
    def one_block(qs, ks, v, lam_bht, ct):
      o1, o2, lse = mr.block_forward(plan, qs, ks, v, lam_bht, None, None)
      lam = jnp.transpose(lam_bht, (0, 2, 1))[..., None]
      d1 = jnp.einsum("bthd,bthd->bht", ct.astype(jnp.float32), o1)
      d2 = jnp.einsum("bthd,bthd->bht", ct.astype(jnp.float32), o2)
      return o1 - lam * o2, mr.block_backward(plan, qs, ks, v, lam_bht, None, None, ct, lse, d1, d2)

    comb, (dqs, dks, dvv) = one_block(qs, ks, v, lam_bht, ct)
    got = [comb, *dqs, *dks, dvv]
    errs = [kc.errors(g, w) for g, w in zip(got, [out, *grads[: len(got) - 1]])]
    results.append(
      {"case": variant, "errors": errs, "bad": [e for e in errs if not e[0] <= kc.tolerance(dt)]}
    )
  return json.loads(json.dumps(results))  # as the JSON it was


@pytest.mark.slow  # about 90 s a variant in the interpreter
def test_one_ring_block_is_the_whole_attention():
  # A single block that sees every key (its own log-sum-exps and row terms) gives the
  # whole attention's output and gradients: the protocol the ring merges blocks with.
  for result in _interpret_ring_blocks(["v1", "v2"]):
    print(result["case"], result["errors"])
    assert not result["bad"], result
