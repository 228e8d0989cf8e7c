"""The grouped Mosaic GPU kernels (mosaic_gda.py): dispatch, tiles, refusals, and their
numbers in the Mosaic GPU interpreter against gda_v1_reference / gda_v2_reference.

The interpreted cases are the attention test base's (tests/attention_cases.py), on this
process's 8 CPU devices (three warpgroups need three CPU-client threads; see
mosaic_common.check_threads). What the interpreter leaves unchecked (the
in-place wgmma accumulators, registers, timing) is the compiled kernels' to show:
tests/kernels/gpu/test_gpu_compile.py compiles them for an H100 here, and the ``gpu``
tests run them on one.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from attention_cases import GROUPED_GPU_SHAPES, Case
from kernel_checks import normal, rel_err, tolerance
from mosaic_interpret import InterpretedCases

from diffjax import ops
from diffjax.core import op_specs
from diffjax.kernels.gpu import mosaic, mosaic_tiles
from diffjax.kernels.gpu import mosaic_gda as mg
from diffjax.kernels.gpu import mosaic_gda_bwd as gb
from diffjax.kernels.gpu import mosaic_gda_fwd as gf
from diffjax.ops import dispatch


def _gda_v1(dtype=jnp.bfloat16, h=4, n=2, kh=1, d=64, t=128):
  ks = jax.random.split(jax.random.key(0), 5)
  return (
    normal(ks[0], (1, t, h, d), dtype),
    normal(ks[1], (1, t, n, d), dtype),
    normal(ks[2], (1, t, kh, d), dtype),
    normal(ks[3], (1, t, kh, d), dtype),
    normal(ks[4], (1, t, kh, 2 * d), dtype),
    jnp.linspace(0.2, 0.8, h).astype(jnp.float32),
  )


def _gda_v2(dtype=jnp.bfloat16, h=4, n=2, kh=1, d=64, t=128):
  q1, q2, k, _, v, _ = _gda_v1(dtype, h, n, kh, d, t)
  return q1, q2, k, v[..., :d], jax.nn.sigmoid(normal(jax.random.key(3), (1, t, h)))


@pytest.mark.parametrize("capability", [None, (8, 0)])
def test_auto_takes_the_grouped_kernel_on_a_hopper_and_stock_elsewhere(capability):
  kernel = "pallas_gpu" if capability is None else "stock"
  with ops.target_platform("gpu", gpu_capability=capability):
    for spec, example in ((op_specs.GDA_V1, _gda_v1), (op_specs.GDA_V2, _gda_v2)):
      assert dispatch.choose(spec, "auto", example()) == kernel, spec.name
      assert dispatch.choose(spec, "auto", example(jnp.float32)) == "stock", spec.name
      # d 72 is not a multiple of 16: refused with the reason, by name.
      if capability is None:
        with pytest.raises(ValueError, match="pallas_gpu refuses: .*multiples of 16"):
          dispatch.choose(spec, "pallas_gpu", example(d=72))


def test_refusals_name_the_value():
  bf16 = jnp.dtype(jnp.bfloat16)
  with ops.target_platform("gpu"):
    assert mg.refusal([bf16] * 5, 128, 256, 4, False, True) is None
    assert "r=16" in mg.refusal([bf16] * 5, 64, 128, 16, False, True)
    assert "of one dtype" in mg.refusal([bf16, jnp.dtype(jnp.float16)], 64, 128, 2, False, True)
    assert "fit one CTA's shared memory" in mg.refusal([bf16] * 5, 256, 512, 2, False, True)
    # The output leaves through the query tile, d columns at a time.
    assert "multiple of the head dim (128)" in mg.refusal([bf16] * 5, 128, 64, 4, False, True)
  with ops.target_platform("gpu", gpu_capability=(8, 0)):
    assert "sm_80, not a Hopper" in mg.refusal([bf16] * 5, 64, 128, 2, False, True)
  q1, q2, k1, k2, v, lam = _gda_v1()
  with pytest.raises(ValueError, match="block_kv is 64"):
    mg.gda_v1_pallas_gpu(q1, q2, k1, k2, v, lam, block_sizes={"block_kv": 128})
  with pytest.raises(ValueError, match="needs .* bytes of shared memory for d=128"):
    mg.gda_v1_pallas_gpu(*_gda_v1(d=128), block_sizes={"stages": 3})
  with pytest.raises(ValueError, match="dq_parts=3 must split d=64"):
    mg.gda_v1_pallas_gpu(q1, q2, k1, k2, v, lam, block_sizes={"dq_parts": 3})
  with pytest.raises(ValueError, match="Unknown MosaicBlockSizes fields"):
    mg.gda_v1_pallas_gpu(q1, q2, k1, k2, v, lam, block_sizes={"block_q": 64})


def test_r1_runs_the_diff_kernels(monkeypatch):
  # r = 1 is DIFF V1 / V2: the call goes to their kernels (V2 on the interleaved pairs).
  seen = []
  monkeypatch.setattr(mosaic, "diff_v1_pallas_gpu", lambda *a, **k: seen.append(("v1", a)))
  monkeypatch.setattr(mosaic, "diff_v2_pallas_gpu", lambda *a, **k: seen.append(("v2", a)))
  v1 = _gda_v1(h=2, n=2)
  mg.gda_v1_pallas_gpu(*v1)
  q1, q2, k, v, lam = _gda_v2(h=2, n=2)
  mg.gda_v2_pallas_gpu(q1, q2, k, v, lam)
  assert [name for name, _ in seen] == ["v1", "v2"]
  assert all(x is y for x, y in zip(seen[0][1], v1))
  q_pairs = seen[1][1][0]
  assert q_pairs.shape == (1, 128, 4, 64)
  assert bool(jnp.all(q_pairs[:, :, 0::2] == q1)) and bool(jnp.all(q_pairs[:, :, 1::2] == q2))


def test_shared_memory_model_and_stages():
  # Closed form (bf16): Q of both consumers, the K1/K2/V ring, O2 in the input dtype,
  # lambda, log-sum-exps and both segment ids (1 KiB each); 8 bytes a barrier; 2 KiB more.
  kib = 1024
  d, dv, stages = 128, 256, 2
  buffers = (32 + 2 * stages * 16 + stages * 32 + 32 + 1 + 1 + 1 + 1) * kib
  bars = 2 * 2 + 2 + stages * (3 + 1 + 1) + 1
  assert mg.forward_smem_bytes(d, dv, 64, stages, False, True) == buffers + 8 * bars + 2048
  assert mg.forward_stages(128, 256, shared_k=False) == 2
  assert mg.forward_stages(128, 128, shared_k=True) == 3
  assert mg.forward_stages(64, 128, shared_k=False) == 3
  for d, dv, shared in ((64, 128, False), (128, 256, False), (128, 128, True)):
    stages = mg.forward_stages(d, dv, shared)
    assert mg.forward_smem_bytes(d, dv, 64, stages, shared) <= mosaic_tiles.SMEM_BYTES
  # The backward: Q, dO halves and row terms per map, both keys, V halves, the crossing
  # tile and dQ chunks; one ring slot at V1 style d 128 / Dv 256, two below.
  assert gb.blocks(128, 256, True) == (1, 4) and gb.blocks(128, 128, True) == (2, 4)
  assert gb.blocks(64, 128, True) == (2, 2)
  assert gb.smem_bytes(128, 256, 1, 4, True) <= mosaic_tiles.SMEM_BYTES
  assert [gb.key_split(d) for d in (64, 80, 96, 128)] == [(32, 32), (48, 32), (64, 32), (64, 64)]
  assert gb.registers(128, 256) == 184 <= gb.CONSUMER_REGISTERS
  assert 2 * 128 * gb.CONSUMER_REGISTERS + 128 * gb.PRODUCER_REGISTERS == 168 * 384
  # O2's parts: each a column slice of a Q tile (all of it up to d 128), at most 128 columns.
  widths = ((64, 64), (64, 128), (80, 160), (96, 192), (128, 256), (256, 256), (192, 192))
  assert [gf.o2_parts(d, dv) for d, dv in widths] == [1, 2, 2, 2, 2, 2, 3]
  assert gf.o2_parts(128, 64) is None and gf.o2_parts(64, 96) is None
  # Rounds: the noise map and r signal maps over two consumers.
  assert [gf.rounds(r) for r in (2, 3, 4, 8)] == [2, 2, 3, 5]
  assert [gf._item(k, w, 4) for k in range(3) for w in (1, 0)] == [-1, 0, 1, 2, 3, None]


# ----------------------------------------------------------------------------------
# Numbers in the Mosaic GPU interpreter: the attention test base (tests/attention_cases.py).

_S = GROUPED_GPU_SHAPES


class TestPallasGpuGrouped(InterpretedCases):
  """The grouped Mosaic GPU kernels in jax's Mosaic GPU interpreter, on this process's 8 CPU
  devices (three warpgroups need three CPU-client threads; see mosaic_common.check_threads).
  About 30 s a case: the integration tier runs one 64-query block per op (V1 style at r 2,
  the idle round, with a one-token document; V2 style at r 4, three rounds), the slow tier
  (``grid``) the awkward sizes. Measured over the whole array and row by row, the row
  measure shown to fail a broken row of each case."""

  kernels = {"gda_v1": mg.gda_v1_pallas_gpu, "gda_v2": mg.gda_v2_pallas_gpu}
  shapes = GROUPED_GPU_SHAPES
  integration_pinned = (
    Case("gda_v1", _S[0], True, "single", "bfloat16"),
    Case("gda_v2", _S[1], True, "none", "bfloat16"),
  )
  kept = (
    Case("gda_v1", _S[2], True, "single", "bfloat16"),  # r 4, two noise heads a group
    Case("gda_v2", _S[3], False, "none", "bfloat16"),  # r 2, GQA over two kv heads
    Case("gda_v1", _S[4], True, "single", "bfloat16"),  # Dv 256: two slots, O2 in parts
    Case("gda_v2", _S[5], True, "none", "bfloat16"),  # r 3 (no idle round), d 80
    Case("gda_v2", _S[6], True, "single", "bfloat16"),  # d 96: P^T dO through registers
    Case("gda_v1", _S[7], True, "none", "float16"),  # r 3, fp16, a partial block
    Case("gda_v1", _S[8], True, "single", "bfloat16"),  # r 1: the DIFF V1 kernels
    Case("gda_v2", _S[8], True, "single", "bfloat16"),  # r 1: the DIFF V2 kernels
  )


def test_a_wrong_group_fails_the_check():
  # The measure the interpreted cases use fails a kernel that read the wrong noise head:
  # the reference with the noise heads swapped, against itself.
  from diffjax.core import reference as ref

  q1, q2, k1, k2, v, lam = (x.astype(jnp.float32) for x in _gda_v1(h=4, n=2, t=64))
  good = ref.gda_v1_reference(q1, q2, k1, k2, v, lam)
  swapped = ref.gda_v1_reference(q1, q2[:, :, ::-1], k1, k2, v, lam)
  assert rel_err(swapped, good) > 10 * tolerance(jnp.bfloat16)


# ----------------------------------------------------------------------------------
# Decoding (V1 style): the DIFF V1 decode kernel with the noise heads as map 2's rows.


def test_decode_rows_and_dispatch():
  q1, q2, k1, k2, v, lam = _gda_v1(h=8, n=2, kh=1, t=128)
  arrays = (q1[:, :1], q2[:, :1], k1, k2, v, lam, jnp.array([100], jnp.int32))
  with ops.target_platform("gpu"):
    assert dispatch.choose(op_specs.GDA_V1_DECODE, "auto", arrays) == "pallas_gpu"
    v2 = _gda_v2(h=8, n=2, kh=1, t=128)
    v2_arrays = (v2[0][:, :1], v2[1][:, :1], v2[2], v2[3], v2[4][:, :1], arrays[-1])
    assert dispatch.choose(op_specs.GDA_V2_DECODE, "auto", v2_arrays) == "xla"
  with ops.target_platform("gpu", gpu_capability=(8, 0)):
    assert dispatch.choose(op_specs.GDA_V1_DECODE, "auto", arrays) == "xla"


def _interpret_decode_cases(cases):
  """The cases checked in the Mosaic GPU interpreter, in this process: its 8 CPU devices give
  the kernel's warpgroups a CPU-client thread each (mosaic_common.check_threads)."""

  import jax
  import jax.numpy as jnp
  import mosaic_interpret

  mosaic_interpret.install()
  import kernel_checks as kc

  from diffjax.core import op_specs
  from diffjax.kernels.gpu import mosaic_decode as md

  results = []
  for case in cases:
    b, s, h, n, kh, d, splits, lens, dtype = case
    dtype = jnp.dtype(dtype)
    ks = jax.random.split(jax.random.key(0), 6)
    rnd = lambda i, sh: jax.random.normal(ks[i], sh, jnp.float32).astype(dtype)
    args = (
      rnd(0, (b, 1, h, d)),
      rnd(1, (b, 1, n, d)),
      rnd(2, (b, s, kh, d)),
      rnd(3, (b, s, kh, d)),
      rnd(4, (b, s, kh, 2 * d)),
      jnp.linspace(0.2, 0.8, h).astype(jnp.float32),
      jnp.array(lens, jnp.int32),
    )
    out = md.gda_v1_decode_pallas_gpu(*args, interpret=True, block_sizes={"num_splits": splits})
    f = lambda x: x.astype(jnp.float32) if x.dtype == dtype else x
    want = op_specs.GDA_V1_DECODE.reference(*map(f, args))
    assert out.dtype == dtype and out.shape == want.shape
    err = kc.errors(out, want)
    bad = not (err[0] <= kc.tolerance(dtype) and err[1] <= kc.tolerance(dtype, True))
    results.append({"case": case, "errors": err, "bad": bad})
  return json.loads(json.dumps(results))  # as the JSON it was


@pytest.mark.integration
@pytest.mark.parametrize(
  "case",
  [
    # batch, cache slots, signal heads, noise heads, kv heads, head dim, splits, kv_len
    # per row, dtype
    (1, 128, 8, 2, 1, 64, 2, [100], "bfloat16"),  # r 4, two noise heads a kv group
    pytest.param((2, 200, 8, 2, 1, 64, 2, [150, 77], "bfloat16"), marks=pytest.mark.slow),
    pytest.param((1, 256, 8, 4, 2, 128, 3, [256], "bfloat16"), marks=pytest.mark.slow),
  ],
)
def test_decode_matches_reference_in_interpreter(case):
  (result,) = _interpret_decode_cases([case])
  print(result["case"], result["errors"])
  assert not result["bad"], result
