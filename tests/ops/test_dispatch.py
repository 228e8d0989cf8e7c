"""The dispatch table says which kernel runs where; kernels load without the ops.

Expectations are written out here, not read back from the table: which function each
(op, implementation, platform) names, what "auto" picks per platform and input, and
why a GPU input is refused by the Mosaic GPU kernels. (That no package imports a layer
above it is checked for the whole package in tests/project/test_layering.py.)
"""

from __future__ import annotations

import importlib
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffjax import ops, sharding
from diffjax.ops import dispatch

ROOT = pathlib.Path(__file__).resolve().parents[2]

# (op, implementation, platform) -> "module.function" of what must run there.
EXPECTED_TABLE = {
  ("mha", "xla_cpu", "cpu"): "diffjax.kernels.cpu.mha_xla_cpu",
  ("diff_v1", "xla_cpu", "cpu"): "diffjax.kernels.cpu.diff_v1_xla_cpu",
  ("diff_v2", "xla_cpu", "cpu"): "diffjax.kernels.cpu.diff_v2_xla_cpu",
  ("mha", "stock", "tpu"): "diffjax.kernels.tpu.mha_stock_tpu",
  ("diff_v1", "pallas_tpu", "tpu"): "diffjax.kernels.tpu.diff_v1_pallas_tpu",
  ("diff_v1", "stock", "tpu"): "diffjax.kernels.tpu.diff_v1_stock_tpu",
  ("diff_v2", "pallas_tpu", "tpu"): "diffjax.kernels.tpu.diff_v2_pallas_tpu",
  ("diff_v2", "stock", "tpu"): "diffjax.kernels.tpu.diff_v2_stock_tpu",
  ("diff_v1_decode", "pallas_tpu", "tpu"): "diffjax.kernels.tpu.diff_v1_decode_pallas_tpu",
  ("mha", "stock", "gpu"): "diffjax.kernels.gpu.stock.mha_stock_gpu",
  ("diff_v1", "stock", "gpu"): "diffjax.kernels.gpu.stock.diff_v1_stock_gpu",
  ("diff_v2", "stock", "gpu"): "diffjax.kernels.gpu.stock.diff_v2_stock_gpu",
  ("diff_v1", "pallas_gpu", "gpu"): "diffjax.kernels.gpu.mosaic.diff_v1_pallas_gpu",
  ("diff_v2", "pallas_gpu", "gpu"): "diffjax.kernels.gpu.mosaic.diff_v2_pallas_gpu",
  (
    "diff_v1_decode",
    "pallas_gpu",
    "gpu",
  ): "diffjax.kernels.gpu.mosaic_decode.diff_v1_decode_pallas_gpu",
}


def _qualified(fn) -> str:
  import importlib

  name = fn.__name__
  # A package may re-export a function of one of its modules: accept the package's name
  # when that is where the table's entry is spelled.
  for spelled in EXPECTED_TABLE.values():
    mod, _, attr = spelled.rpartition(".")
    if attr == name and getattr(importlib.import_module(mod), attr, None) is fn:
      return spelled
  return f"{fn.__module__}.{name}"


def test_a_kernel_package_imports_first_in_a_fresh_interpreter():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  code = (
    "import diffjax.kernels.tpu as kt, diffjax.kernels.gpu as kg\n"
    "from diffjax.ops import dispatch\n"
    "assert dispatch.lookup('diff_v1', 'pallas_tpu', 'tpu', False).fn is "
    "kt.diff_v1_pallas_tpu\n"
    "assert dispatch.lookup('diff_v1', 'pallas_gpu', 'gpu', False).fn is "
    "kg.diff_v1_pallas_gpu\n"
    "print('OK')\n"
  )
  proc = subprocess.run(
    [sys.executable, "-c", code],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
    cwd=ROOT,
  )
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_the_table_names_the_expected_function_for_every_op_and_platform():
  got = {}
  for op, implementation, platform, fn in dispatch.BUILTIN_KERNELS:
    assert fn is not None, f"{op}/{implementation}/{platform} is missing here"
    assert (op, implementation, platform) not in got, "a row appears twice"
    got[(op, implementation, platform)] = _qualified(fn)
    # What the registry answers for the row is the same function.
    assert dispatch.lookup(op, implementation, platform, False).fn is fn
  assert got == EXPECTED_TABLE
  # No Triton kernel is left anywhere in the GPU package.
  gpu_dir = ROOT / "diffjax" / "kernels" / "gpu"
  for path in gpu_dir.glob("*.py"):
    assert "pallas import triton" not in path.read_text(), path


def test_the_docs_dispatch_table_is_the_table():
  """docs/architecture.md lists the same rows, each naming the function by its import path."""
  text = (ROOT / "docs" / "architecture.md").read_text()
  rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \| (\w+) \| `([\w.]+)`", text, re.M)
  documented = {(op, impl, platform): path for op, impl, platform, path in rows}
  assert len(documented) == len(rows) == len(EXPECTED_TABLE)
  assert documented.keys() == EXPECTED_TABLE.keys()
  for key, path in documented.items():
    module, name = path.rsplit(".", 1)
    fn = getattr(importlib.import_module(module), name)
    assert dispatch.lookup(*key, False).fn is fn, (key, path)


# What "auto" runs, per platform, for inputs no kernel refuses (on a GPU: Mosaic GPU
# takes them; see the next test for inputs it refuses).
AUTO = {
  "cpu": {"mha": "xla_cpu", "diff_v1": "xla_cpu", "diff_v2": "xla_cpu"},
  "tpu": {
    "mha": "stock",
    "diff_v1": "pallas_tpu",
    "diff_v2": "pallas_tpu",
    "diff_v1_decode": "pallas_tpu",
  },
  "gpu": {
    "mha": "stock",
    "diff_v1": "pallas_gpu",
    "diff_v2": "pallas_gpu",
    "diff_v1_decode": "pallas_gpu",
  },
}


@pytest.mark.parametrize("platform", sorted(AUTO))
def test_auto_picks_the_platform_kernel(platform):
  for op, want in AUTO[platform].items():
    with ops.target_platform(platform):
      assert dispatch.resolve(op, "auto", has_mask=False, interpret=False, mosaic=True) == want, op
      # An explicit mask or float64 inputs need the XLA path everywhere.
      assert dispatch.resolve(op, "auto", has_mask=True, interpret=False) == "xla"
      assert dispatch.resolve(op, "auto", has_mask=False, interpret=False, float64=True) == "xla"


def _v1_arrays(dtype, d=64, dv=None, h=4, kh=2, t=128):
  q = jax.ShapeDtypeStruct((1, t, h, d), dtype)
  k = jax.ShapeDtypeStruct((1, t, kh, d), dtype)
  return (q, q, k, k, jax.ShapeDtypeStruct((1, t, kh, dv or 2 * d), dtype), 0.3)


@pytest.mark.parametrize(
  "case,refusal",
  [
    (dict(dtype=jnp.bfloat16), None),
    (dict(dtype=jnp.float16, d=128), None),
    (dict(dtype=jnp.float32), "not all bfloat16 or all float16"),
    (dict(dtype=jnp.bfloat16, d=72), "multiples of 16"),
    (dict(dtype=jnp.bfloat16, d=256), "fit one CTA's shared memory"),
    (dict(dtype=jnp.bfloat16, capability=(8, 0)), "sm_80, not a Hopper"),
  ],
)
def test_gpu_inputs_the_mosaic_kernels_refuse_take_the_stock_path(case, refusal):
  case = dict(case)
  capability = case.pop("capability", None)
  arrays = _v1_arrays(**case)
  with ops.target_platform("gpu", gpu_capability=capability):
    got = dispatch.mosaic_gpu_refusal("diff_v1", arrays, segments=True)
    takes = dispatch.mosaic_gpu_takes("diff_v1", arrays, segments=True)
    auto = dispatch.resolve("diff_v1", "auto", has_mask=False, interpret=False, mosaic=takes)
  if refusal is None:
    assert got is None and takes and auto == "pallas_gpu"
  else:
    assert refusal in got and not takes and auto == "stock", got
  # Mixed dtypes are refused too.
  q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
  mixed = (
    q,
    q,
    q,
    jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.float16),
    jax.ShapeDtypeStruct((1, 64, 2, 128), jnp.bfloat16),
    0.3,
  )
  with ops.target_platform("gpu"):
    assert not dispatch.mosaic_gpu_takes("diff_v1", mixed, segments=False)


def test_pallas_gpu_by_name_on_another_gpu_names_the_fix():
  with ops.target_platform("gpu", gpu_capability=(8, 0)):
    with pytest.raises(ValueError, match="sm_80.*'auto' or 'stock'"):
      dispatch.resolve("diff_v2", "pallas_gpu", has_mask=False, interpret=False)
    assert (
      dispatch.resolve("diff_v1_decode", "auto", has_mask=False, interpret=False, mosaic=False)
      == "xla"
    )
  with ops.target_platform("gpu"):
    assert (
      dispatch.resolve("diff_v2", "pallas_gpu", has_mask=False, interpret=False) == "pallas_gpu"
    )


def test_a_registered_implementation_runs_in_place_of_the_builtin(monkeypatch):
  monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
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
  # The GPU and TPU stock entries are kept next to the new CPU one.
  from diffjax.kernels.gpu import stock

  assert dispatch.lookup("mha", "stock", "gpu", False).fn is stock.mha_stock_gpu


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
