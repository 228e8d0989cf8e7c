"""The dispatch table says which kernel runs where; kernels load without the ops.

"auto" is checked by what runs: each op's example inputs traced under a target platform,
recording the implementation that ran; the Mosaic GPU kernels refuse what they cannot take
and say why. (That no package imports a layer above it is checked for the whole package in
tests/project/test_layering.py; that each kernel computes its op, in tests/kernels.)
"""

from __future__ import annotations

import importlib
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import kernel_checks
import numpy as np
import pytest
from helpers import WAIT_LIMIT_S

from diffjax import ops, sharding
from diffjax.core import op_specs
from diffjax.kernels.gpu import measured as gpu_measured
from diffjax.kernels.gpu import mosaic
from diffjax.ops import dispatch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_a_kernel_package_imports_first_in_a_fresh_interpreter():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  code = (
    "import diffjax.kernels.tpu as kt, diffjax.kernels.gpu as kg\n"
    "from diffjax.ops import dispatch\n"
    "fns = {r.name: r.fn for r in dispatch.rows('diff_v1')}\n"
    "assert fns['pallas_tpu'] is kt.diff_v1_pallas_tpu\n"
    "assert fns['pallas_gpu'] is kg.diff_v1_pallas_gpu\n"
    "print('OK')\n"
  )
  proc = subprocess.run(
    [sys.executable, "-c", code],
    env=env,
    capture_output=True,
    text=True,
    timeout=WAIT_LIMIT_S,
    check=False,
    cwd=ROOT,
  )
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_every_row_names_an_importable_function_once():
  seen = set()
  for row in dispatch.BUILTIN_KERNELS:
    key = (row.op, row.name, row.platforms)
    assert key not in seen, f"{key} appears twice"
    seen.add(key)
    module, name = row.qualified_name.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is row.fn
    assert row.op in dispatch.OPS and row in dispatch.rows(row.op)
    # Pallas kernels run in an interpreter off their platform; the stock and CPU paths not.
    assert row.interpretable == row.name.startswith("pallas_")
  # No Triton kernel is left anywhere in the GPU package.
  for path in (ROOT / "diffjax" / "kernels" / "gpu").glob("*.py"):
    assert "pallas import triton" not in path.read_text(), path


def test_the_docs_dispatch_table_is_the_code_s():
  """docs/architecture.md shows the table :func:`dispatch.markdown_table` writes."""
  assert dispatch.markdown_table() in (ROOT / "docs" / "architecture.md").read_text()


def _example(spec, dtype=jnp.bfloat16, d=64, group=2):
  return spec.example(dtype, d, group, 128)


PLATFORMS = ("cpu", "gpu", "tpu")


def _first_row(op: str, platform: str) -> str:
  """The platform's first row of ``op`` in the table, or the XLA math when it has none."""
  names = [r.name for r in dispatch.rows(op) if platform in r.platforms]
  return names[0] if names else "xla"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_auto_runs_the_platform_s_first_row_on_ordinary_inputs(platform):
  # Inputs no kernel refuses (bf16, widths the Mosaic GPU kernels tile, a Hopper): "auto"
  # takes the platform's first row of the table (docs/architecture.md); an explicit mask
  # or float64 inputs take the XLA math everywhere.
  for op, spec in dispatch.OPS.items():
    with ops.target_platform(platform):
      assert dispatch.choose(spec, "auto", _example(spec)) == _first_row(op, platform), op
      if spec.decode:
        continue
      mask = jnp.ones((128, 128), bool)
      assert dispatch.choose(spec, "auto", _example(spec), mask=mask) == "xla"
  with ops.target_platform(platform), jax.enable_x64(True):
    f64 = _example(op_specs.DIFF_V2, jnp.float64)
    assert dispatch.choose(op_specs.DIFF_V2, "auto", f64) == "xla"


def test_the_fused_kernels_come_first_on_accelerators():
  # What the table is for: on a TPU and a GPU every differential op trains through the
  # platform's fused Pallas kernel (the baseline through the stock flash kernel), and
  # DIFF V1 (and grouped V1) decoding reads its cache with one; the CPU runs XLA's own.
  for platform in ("gpu", "tpu"):
    for op in ("diff_v1", "diff_v2", "gda_v1", "gda_v2", "diff_v1_decode", "gda_v1_decode"):
      assert _first_row(op, platform) == f"pallas_{platform}", (op, platform)
    assert _first_row("mha", platform) == "stock"
  for op, spec in dispatch.OPS.items():
    assert _first_row(op, "cpu") == ("xla" if spec.decode else "xla_cpu"), op


def _rows_compute_their_op(op: str, run_here: tuple[str, ...]) -> None:
  """Every row of ``op`` traced under its platform gives the op's output shape and dtype and
  records itself as what ran; the rows named in ``run_here`` also run (the TPU kernels in the
  Pallas interpreter) and equal the reference math."""
  spec = dispatch.OPS[op]
  dtype = jnp.bfloat16
  arrays = spec.example(dtype, 64, 2, 128)
  f32 = tuple(a.astype(jnp.float32) if a.dtype == dtype else a for a in arrays)
  want = spec.reference(*f32) if spec.decode else spec.reference(*f32, causal=True)
  for row in dispatch.rows(op):
    with ops.target_platform(row.platforms[0]):
      call = lambda *a, row=row: dispatch.run(spec, row.name, a, interpret=True)
      with dispatch.recording() as ran:
        shape = jax.eval_shape(call, *arrays)
      assert ran == [row.name], (row.name, ran)
      assert (shape.shape, shape.dtype) == (want.shape, dtype), (row.name, shape)
      if row.name in run_here:
        err = kernel_checks.rel_err(call(*arrays), want)
        assert err <= kernel_checks.tolerance(dtype), (row.name, err)


@pytest.mark.parametrize("op", sorted(dispatch.OPS))
def test_every_row_computes_its_op(op):
  # A row wired to the wrong function (another op's kernel, a function of other arity) fails
  # here, whatever its platform: every row is traced, and the CPU rows run. The Mosaic GPU
  # rows take about 40 s each in their interpreter (tests/kernels/gpu checks them) and the
  # stock rows call cuDNN or splash kernels that run on their device only.
  _rows_compute_their_op(op, ("xla_cpu",))


@pytest.mark.integration
@pytest.mark.parametrize("op", sorted(op for op in dispatch.OPS if dispatch.rows(op)))
def test_every_tpu_kernel_row_computes_its_op_in_the_interpreter(op):
  _rows_compute_their_op(op, ("xla_cpu", "pallas_tpu"))


@pytest.mark.parametrize(
  "case,refusal",
  [
    (dict(dtype=jnp.bfloat16), None),
    (dict(dtype=jnp.float16, d=128), None),
    (dict(dtype=jnp.float32), "bfloat16 or float16 inputs of one dtype"),
    (dict(dtype=jnp.bfloat16, d=72), "multiples of 16"),
    (dict(dtype=jnp.bfloat16, d=256), "fit one CTA's shared memory"),
    (dict(dtype=jnp.bfloat16, capability=(8, 0)), "sm_80, not a Hopper"),
  ],
)
def test_gpu_inputs_the_mosaic_kernels_refuse_take_the_stock_path(case, refusal):
  case = dict(case)
  capability = case.pop("capability", None)
  arrays = _example(op_specs.DIFF_V1, **case)
  seg = jnp.ones((1, 128), jnp.int32)
  with ops.target_platform("gpu", gpu_capability=capability):
    got = mosaic.refusal(
      "v1", [x.dtype for x in arrays[:5]], arrays[0].shape[-1], arrays[4].shape[-1], True
    )
    auto = dispatch.choose(op_specs.DIFF_V1, "auto", arrays, segment_ids=seg)
    if refusal is not None:
      # Asked for by name, the kernel says why in one line.
      with pytest.raises(ValueError, match="pallas_gpu refuses: .*" + refusal) as info:
        dispatch.choose(op_specs.DIFF_V1, "pallas_gpu", arrays, segment_ids=seg)
      assert "\n" not in str(info.value) and "implementation='auto'" in str(info.value)
  if refusal is None:
    assert got is None and auto == "pallas_gpu"
  else:
    assert refusal in got and auto == "stock", got
  # Mixed dtypes are refused too.
  bf16, f16 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
  with ops.target_platform("gpu"):
    assert "of one dtype" in mosaic.refusal("v1", [bf16, bf16, f16], 64, 128, False)


def test_the_decode_kernel_refuses_another_gpu_and_decoding_takes_xla():
  arrays = _example(op_specs.DIFF_V1_DECODE)
  with ops.target_platform("gpu", gpu_capability=(8, 0)):
    assert dispatch.choose(op_specs.DIFF_V1_DECODE, "auto", arrays) == "xla"
    with pytest.raises(ValueError, match="sm_80, not a Hopper.*'auto'"):
      dispatch.choose(op_specs.DIFF_V1_DECODE, "pallas_gpu", arrays)
  with ops.target_platform("gpu"):
    assert dispatch.choose(op_specs.DIFF_V1_DECODE, "pallas_gpu", arrays) == "pallas_gpu"


def test_a_kernel_off_its_platform_names_the_fix():
  arrays = _example(op_specs.DIFF_V2, jnp.float32)
  with pytest.raises(ValueError, match="runs on \\['tpu'\\].*interpret=True"):
    dispatch.choose(op_specs.DIFF_V2, "pallas_tpu", arrays)
  with pytest.raises(ValueError, match="the backend is 'cpu'.*'pallas_tpu' or 'pallas_gpu'"):
    dispatch.choose(op_specs.DIFF_V2, "pallas", arrays)
  assert dispatch.choose(op_specs.DIFF_V2, "pallas_tpu", arrays, interpret=True) == "pallas_tpu"


def test_a_registered_implementation_runs_in_place_of_the_builtin(monkeypatch):
  monkeypatch.setattr(dispatch, "_TABLE", {k: list(v) for k, v in dispatch._TABLE.items()})
  calls = []

  def mine(q, k, v, **kwargs):
    calls.append(sorted(kwargs))
    return jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype)

  ops.register_implementation("mha", "stock", mine, platforms=("cpu",))
  q = jnp.ones((1, 4, 2, 8))
  out = ops.dot_product_attention(q, q, q, implementation="stock")
  np.testing.assert_array_equal(out, 0.0)
  assert calls == [
    ["block_sizes", "causal", "interpret", "kv_segment_ids", "q_segment_ids", "scale"]
  ]
  # The GPU and TPU stock rows are kept next to the new CPU one.
  from diffjax.kernels.gpu import stock

  assert [r.fn for r in dispatch.rows("mha") if r.platforms == ("gpu",)] == [stock.mha_stock_gpu]

  # A row that refuses hands "auto" on to the next one: the CPU row now refuses, so the stock
  # row registered above runs.
  def refuses(*args, **kwargs):
    raise NotImplementedError("not these")

  ops.register_implementation("mha", "xla_cpu", refuses, platforms=("cpu",))
  with dispatch.recording() as ran:
    ops.dot_product_attention(q, q, q)
  assert ran == ["stock"] and len(calls) == 2


def test_register_rejects_unknown_names():
  with pytest.raises(ValueError, match="Unknown op 'attn'"):
    ops.register_implementation("attn", "stock", lambda *a, **k: None, platforms=("cpu",))
  with pytest.raises(ValueError, match="Cannot register implementation 'xla'"):
    ops.register_implementation("mha", "xla", lambda *a, **k: None, platforms=("cpu",))


@pytest.mark.parametrize("op", ["diff_v1", "diff_v2"])
def test_kernels_run_under_shard_map_when_a_mesh_is_active(op):
  # Under activation_sharding the ops wrap the kernel in shard_map with the specs of
  # diffjax.sharding.kernel_specs (segment ids included); on one device it must give
  # the XLA path's result. (The TPU kernels in their interpreter: the wrapping is the
  # dispatcher's, the same for every platform.)
  b, t, h, kh, d = 2, 128, 2, 1, 128
  ks = jax.random.split(jax.random.key(0), 6)
  n = lambda i, shape: jax.random.normal(ks[i], shape, jnp.float32)
  seg = jnp.stack([jnp.arange(t) // 80, jnp.arange(t) // 36]).astype(jnp.int32)
  if op == "diff_v1":
    args = (
      n(0, (b, t, h, d)),
      n(1, (b, t, h, d)),
      n(2, (b, t, kh, d)),
      n(3, (b, t, kh, d)),
      n(4, (b, t, kh, 2 * d)),
      0.3,
    )
    fn = ops.diff_v1_attention_core
  else:
    args = (
      n(0, (b, t, 2 * h, d)),
      n(2, (b, t, kh, d)),
      n(4, (b, t, kh, d)),
      jax.nn.sigmoid(n(5, (b, t, h))),
    )
    fn = ops.diff_v2_attention
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  with sharding.activation_sharding(mesh, sharding.DEFAULT_RULES):
    jaxpr = str(
      jax.make_jaxpr(
        lambda *a: fn(*a, segment_ids=seg, implementation="pallas_tpu", interpret=True)
      )(*args)
    )
    got = fn(*args, segment_ids=seg, implementation="pallas_tpu", interpret=True)
  want = fn(*args, segment_ids=seg, implementation="xla")
  assert "shard_map" in jaxpr
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def _operand_chain(lowered, operand: int) -> list[str]:
  """The ops between the program's arguments and ``operand`` of its Mosaic GPU call.

  [] when the operand is an argument of the program itself (read in place); else the
  names of the ops that produce it, nearest first (a copy, pad or transpose shows).
  Calls between the program's functions are followed both ways (into a callee's
  return, out of a callee's argument to its call site) and are not counted.
  """
  from jaxlib.mlir import ir

  module = lowered.compiler_ir("stablehlo")

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for child in block.operations:
          yield child
          yield from walk(child)

  ops_ = list(walk(module.operation))
  name_of = lambda op: ir.StringAttr(op.operation.attributes["sym_name"]).value
  funcs = {name_of(op): op for op in ops_ if op.operation.name == "func.func"}
  callee_of = lambda op: ir.FlatSymbolRefAttr(op.operation.attributes["callee"]).value
  calls = [
    op
    for op in ops_
    if op.operation.name == "stablehlo.custom_call"
    and ir.StringAttr(op.operation.attributes["call_target_name"]).value.startswith("mosaic_gpu")
  ]
  assert len(calls) == 1, len(calls)

  def enclosing_func(block):
    op = block.owner.operation
    while op.name != "func.func":
      op = op.parent.operation
    return op

  chain, value, entered = [], calls[0].operation.operands[operand], []
  for _ in range(100):
    if isinstance(value, ir.BlockArgument):
      func = enclosing_func(value.owner)
      fname = ir.StringAttr(func.attributes["sym_name"]).value
      if fname == "main":
        return chain
      if entered:  # back out through the call we came in by
        site = entered.pop()
      else:
        sites = [
          op.operation for op in ops_ if op.operation.name == "func.call" and callee_of(op) == fname
        ]
        assert len(sites) == 1, (fname, len(sites))
        site = sites[0]
      value = site.operands[value.arg_number]
      continue
    owner = value.owner
    owner = owner.operation if hasattr(owner, "operation") else owner
    if owner.name == "func.call":
      callee = funcs[ir.FlatSymbolRefAttr(owner.attributes["callee"]).value]
      ret = list(callee.regions[0].blocks[0].operations)[-1]
      index = list(owner.results).index(value)
      entered.append(owner)
      value = ret.operation.operands[index]
      continue
    chain.append(owner.name)
    value = owner.operands[0]
  raise AssertionError(f"no program argument behind operand {operand}: {chain}")


@pytest.mark.parametrize("s,in_place", [(256, True), (200, False)])
def test_decode_reads_the_cache_in_place(s, in_place):
  # The Mosaic GPU decode call's K1, K2 and V operands are the program's own cache
  # arguments when the cache length is a multiple of 64: no pad, copy or transpose
  # between them. A length off the 64 grid is padded, and the check sees it.
  from kernel_checks import abstract_hopper

  bf = jnp.bfloat16
  b, h, kh, d = 2, 4, 2, 64
  token = jax.ShapeDtypeStruct((b, 1, h, d), bf)
  cache_k = jax.ShapeDtypeStruct((b, s, kh, d), bf)
  cache_v = jax.ShapeDtypeStruct((b, s, kh, 2 * d), bf)
  lens = jax.ShapeDtypeStruct((b,), jnp.int32)
  decode = lambda q1, q2, k1, k2, v, n: ops.diff_v1_attention_decode(
    q1, q2, k1, k2, v, 0.3, n, implementation="pallas_gpu"
  )
  with ops.target_platform("gpu"), abstract_hopper():
    lowered = (
      jax.jit(decode)
      .trace(token, token, cache_k, cache_k, cache_v, lens)
      .lower(lowering_platforms=("cuda",))
    )
  chains = [_operand_chain(lowered, i) for i in (2, 3, 4)]  # k1, k2, v of the call
  if in_place:
    assert chains == [[], [], []], chains
  else:
    assert all("stablehlo.pad" in c for c in chains), chains
  # The query rows are re-laid out to 64-row tiles (a copy of B x H x d), so the
  # same trace through operand 0 is not empty: the check does see ops.
  assert _operand_chain(lowered, 0), "the query operand should be re-laid out"


def test_auto_on_a_gpu_follows_the_measured_figures_of_the_device():
  # The packaged figures (an H200, bf16, d 128): V2's stock path beat the fused kernels in a
  # forward+backward call at T 4096 and 8192, V1's fused kernels won at 4096 and lost at 8192.
  def auto(spec, seq, kind, dtype=jnp.bfloat16, name="auto"):
    arrays = spec.example(dtype, 128, 2, seq)
    with ops.target_platform("gpu", device_kind=kind):
      return dispatch.choose(spec, name, arrays)

  assert auto(op_specs.DIFF_V2, 4096, "NVIDIA H200") == "stock"
  assert auto(op_specs.DIFF_V2, 128, "NVIDIA H200") == "stock"  # the nearest row: T 4096
  assert auto(op_specs.DIFF_V1, 4096, "NVIDIA H200") == "pallas_gpu"
  assert auto(op_specs.DIFF_V1, 8192, "NVIDIA H200") == "stock"
  # Asked for by name, or on a device without figures (and ahead of time), the table's order.
  assert auto(op_specs.DIFF_V2, 4096, "NVIDIA H200", name="pallas_gpu") == "pallas_gpu"
  assert auto(op_specs.DIFF_V2, 4096, "NVIDIA H100 80GB HBM3") == "pallas_gpu"
  assert auto(op_specs.DIFF_V2, 4096, None) == "pallas_gpu"
  # A path measured slower than one that cannot take the inputs still runs: at T 4096 V1's
  # stock path lost to the fused kernels, which refuse float32, so float32 takes stock, not
  # the XLA math.
  assert auto(op_specs.DIFF_V1, 4096, "NVIDIA H200", dtype=jnp.float32) == "stock"
  with ops.target_platform("gpu", device_kind="NVIDIA H200"):
    arrays = op_specs.DIFF_V2.example(jnp.bfloat16, 128, 2, 4096)
    with dispatch.recording() as ran:
      jax.eval_shape(lambda *a: dispatch.run(op_specs.DIFF_V2, "auto", a), *arrays)
  assert ran == ["stock"]


def test_a_call_that_is_not_differentiated_follows_the_forward_figures():
  # The packaged H200 figures: at T 8192 V1's fused forward beat the stock one (2.71 ms
  # against 3.60) while its forward+backward lost (12.49 against 11.96); at T 4096 the fused
  # kernels won both; V2's stock path won both.
  def both(spec, seq):
    arrays = spec.example(jnp.bfloat16, 128, 2, seq)
    with ops.target_platform("gpu", device_kind="NVIDIA H200"):
      return tuple(
        dispatch.choose(spec, "auto", arrays, pass_=p) for p in ("forward", "forward+backward")
      )

  assert both(op_specs.DIFF_V1, 8192) == ("pallas_gpu", "stock")
  assert both(op_specs.DIFF_V1, 4096) == ("pallas_gpu", "pallas_gpu")
  assert both(op_specs.DIFF_V2, 8192) == ("stock", "stock")
  arrays = op_specs.DIFF_V1.example(jnp.bfloat16, 128, 2, 8192)
  with ops.target_platform("gpu", device_kind="NVIDIA H200"):
    with dispatch.recording() as forward_only:
      jax.eval_shape(lambda *a: dispatch.run(op_specs.DIFF_V1, "auto", a), *arrays)
    loss = lambda *a: dispatch.run(op_specs.DIFF_V1, "auto", a).astype(jnp.float32).sum()  # noqa: E731
    with dispatch.recording() as differentiated:
      jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), *arrays)
  assert forward_only == ["pallas_gpu"]
  assert differentiated == ["stock"]  # the forward path is not traced at all
  with pytest.raises(ValueError, match="pass_='backward' is not one of"):
    dispatch.choose(op_specs.DIFF_V1, "auto", arrays, pass_="backward")
  # Without forward rows for the device (an H100 here), one path for both.
  with ops.target_platform("gpu", device_kind="NVIDIA H100 80GB HBM3"):
    assert dispatch.choose(op_specs.DIFF_V1, "auto", arrays, pass_="forward") == "pallas_gpu"


def test_by_pass_takes_the_value_from_one_path_and_the_gradients_from_the_other():
  spec = op_specs.DIFF_V1
  arrays = spec.example(jnp.float32, 16, 2, 24)
  ref = lambda *a, **k: spec.reference(*a, causal=k["causal"], scale=k["scale"])  # noqa: E731
  forward = dispatch.Implementation(spec.name, "stock", ref, ("gpu",), False, None, {})
  scaled = lambda *a, **k: 3.0 * ref(*a, **k)  # noqa: E731
  train = dispatch.Implementation(spec.name, "pallas_gpu", scaled, ("gpu",), True, None, {})
  call = (True, None, 16**-0.5, None, False)
  out = dispatch._by_pass(spec, forward, train, arrays, call)
  want = spec.reference(*arrays, causal=True, scale=16**-0.5)
  np.testing.assert_allclose(out, want, rtol=1e-6)  # the value: the forward path's
  grads = jax.grad(lambda *a: dispatch._by_pass(spec, forward, train, a, call).sum(), (0, 4))(
    *arrays
  )
  want_grads = jax.grad(lambda *a: 3.0 * spec.reference(*a, causal=True).sum(), (0, 4))(*arrays)
  for g, w in zip(grads, want_grads):  # the gradients: the training path's (3x here)
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  segs = jnp.array([[0] * 12 + [1] * 12])
  seg_call = (True, segs, 16**-0.5, None, False)
  seg_grads = jax.grad(lambda *a: dispatch._by_pass(spec, forward, train, a, seg_call).sum())(
    *arrays
  )
  np.testing.assert_allclose(seg_grads, want_grads[0], rtol=1e-5, atol=1e-6)


def test_measured_rows_are_checked_merged_and_found_by_device(tmp_path):
  path = str(tmp_path / "measured.json")
  row = dict(device="H200", op="diff_v2", seq=4096, dtype="bfloat16", head_dim=128)
  gpu_measured.record(
    [{**row, "pass": "forward+backward", "ms": {"pallas_gpu": 9.0, "stock": 6.0}}], path
  )
  gpu_measured.record(
    [{**row, "pass": "forward+backward", "ms": {"pallas_gpu": 5.0, "stock": 6.0}}], path
  )
  gpu_measured.record([{**row, "pass": "forward", "ms": {"pallas_gpu": 2.0, "stock": 1.0}}], path)
  rows = gpu_measured.load(path)
  assert len(rows) == 2  # the second forward+backward row replaced the first
  slower = lambda impl, kind, alts: gpu_measured.slower(  # noqa: E731
    "diff_v2", impl, kind, 4096, "bfloat16", 128, alts, rows
  )
  assert slower("pallas_gpu", "NVIDIA H200", ("stock",)) is None  # now the faster one
  assert "measured slower than pallas_gpu" in slower("stock", "NVIDIA H200", ("pallas_gpu",))
  assert slower("stock", "NVIDIA H200", ()) is None  # nothing after it to give way to
  assert slower("stock", "NVIDIA H100", ("pallas_gpu",)) is None
  with open(path, "w", encoding="utf-8") as f:
    f.write('{"rows": [{"device": "H200", "op": "diff_v2"}]}')
  with pytest.raises(ValueError, match="--record"):
    gpu_measured.load(path)
