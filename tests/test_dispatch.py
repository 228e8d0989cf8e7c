"""The dispatch table says which kernel runs where; kernels load without the ops.

(That no package imports a layer above it is checked for the whole package in
tests/test_layering.py.)
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffjax import ops, sharding
from diffjax.ops import dispatch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_kernel_package_imports_first_in_a_fresh_interpreter():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  code = ("import diffjax.kernels.tpu as kt, diffjax.kernels.gpu as kg\n"
          "from diffjax.ops import dispatch\n"
          "assert dispatch.lookup('diff_v1', 'pallas_tpu', 'tpu', False).fn is "
          "kt.diff_v1_pallas_tpu\n"
          "print('OK')\n")
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                        text=True, timeout=300, check=False, cwd=ROOT)
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_every_row_of_the_table_is_what_runs():
  rows = [r for r in dispatch.BUILTIN_KERNELS if r[3] is not None]
  # This installation (jax with Pallas TPU and Triton) has every kernel.
  assert len(rows) == len(dispatch.BUILTIN_KERNELS) == 15
  for op, implementation, platform, fn in rows:
    assert dispatch.lookup(op, implementation, platform, False).fn is fn, (op, implementation)
  # Each (op, implementation, platform) appears once.
  assert len({r[:3] for r in rows}) == len(rows)


@pytest.mark.parametrize("platform,op,want", [
    ("tpu", "mha", "stock"), ("tpu", "diff_v1", "pallas_tpu"), ("tpu", "diff_v2", "pallas_tpu"),
    ("gpu", "mha", "stock"), ("gpu", "diff_v1", "pallas_gpu"), ("gpu", "diff_v2", "pallas_gpu"),
    ("cpu", "mha", "xla_cpu"), ("cpu", "diff_v1", "xla_cpu"), ("cpu", "diff_v2", "xla_cpu"),
])
def test_auto_picks_the_platform_kernel(platform, op, want):
  if want == "pallas_gpu" and dispatch.triton_deprecated():
    want = "stock"  # jax >= 0.11: see test_auto_on_gpu_avoids_the_triton_kernels_...
  with ops.target_platform(platform):
    assert dispatch.resolve(op, "auto", has_mask=False, interpret=False) == want
    # An explicit mask needs the XLA path everywhere.
    assert dispatch.resolve(op, "auto", has_mask=True, interpret=False) == "xla"


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
  assert calls == [["block_sizes", "causal", "interpret", "kv_segment_ids", "q_segment_ids",
                    "scale"]]
  # The GPU and TPU stock entries are kept next to the new CPU one.
  with ops.target_platform("gpu"):
    assert dispatch.lookup("mha", "stock", "gpu", False).fn is dispatch.gpu_stock.mha_stock


def test_register_rejects_unknown_names():
  with pytest.raises(ValueError, match="Unknown op 'attn'"):
    ops.register_implementation("attn", "stock", lambda *a, **k: None, platforms=("cpu",))
  with pytest.raises(ValueError, match="Cannot register implementation 'xla'"):
    ops.register_implementation("mha", "xla", lambda *a, **k: None, platforms=("cpu",))


@pytest.mark.parametrize("op", ["diff_v1", "diff_v2"])
def test_kernels_run_under_shard_map_when_a_mesh_is_active(op):
  # Under activation_sharding the ops wrap the kernel in shard_map with the specs of
  # diffjax.sharding.kernel_specs (segment ids included); on one device it must give
  # the XLA path's result.
  b, t, h, kh, d = 2, 32, 2, 1, 16
  ks = jax.random.split(jax.random.key(0), 6)
  n = lambda i, shape: jax.random.normal(ks[i], shape, jnp.float32)
  seg = jnp.stack([jnp.arange(t) // 20, jnp.arange(t) // 9]).astype(jnp.int32)
  if op == "diff_v1":
    args = (n(0, (b, t, h, d)), n(1, (b, t, h, d)), n(2, (b, t, kh, d)), n(3, (b, t, kh, d)),
            n(4, (b, t, kh, 2 * d)), 0.3)
    fn = ops.diff_v1_attention_core
  else:
    args = (n(0, (b, t, 2 * h, d)), n(2, (b, t, kh, d)), n(4, (b, t, kh, d)),
            jax.nn.sigmoid(n(5, (b, t, h))))
    fn = ops.diff_v2_attention
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  with sharding.activation_sharding(mesh, sharding.DEFAULT_RULES):
    jaxpr = str(jax.make_jaxpr(lambda *a: fn(*a, segment_ids=seg, implementation="pallas_gpu",
                                             interpret=True))(*args))
    got = fn(*args, segment_ids=seg, implementation="pallas_gpu", interpret=True)
  want = fn(*args, segment_ids=seg, implementation="xla")
  assert "shard_map" in jaxpr
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("version,fused", [((0, 10, 2), True), ((0, 11, 2), False)])
def test_auto_on_gpu_avoids_the_triton_kernels_where_jax_deprecates_them(monkeypatch, version,
                                                                         fused):
  # jax 0.11 warns (DeprecationWarning) when a Pallas Triton kernel is lowered; "auto"
  # must not lead a user there. Explicit "pallas_gpu" still runs the Triton kernels.
  monkeypatch.setattr(jax, "__version_info__", version)
  with ops.target_platform("gpu"):
    for op in ("diff_v1", "diff_v2"):
      want = "pallas_gpu" if fused else "stock"
      assert dispatch.resolve(op, "auto", has_mask=False, interpret=False) == want
      assert dispatch.resolve(op, "pallas_gpu", has_mask=False, interpret=False) == \
          "pallas_gpu"
    assert dispatch.resolve("mha", "auto", has_mask=False, interpret=False) == "stock"
    assert dispatch.resolve("diff_v1_decode", "auto", has_mask=False, interpret=False) == \
        ("pallas_gpu" if fused else "xla")
    # Inputs the Mosaic GPU kernels take (bf16/fp16 on a Hopper) run them on any jax.
    for op in ("diff_v1", "diff_v2", "diff_v1_decode"):
      assert dispatch.resolve(op, "auto", has_mask=False, interpret=False,
                              mosaic=True) == "pallas_gpu"
  with ops.target_platform("tpu"):
    assert dispatch.resolve("diff_v1", "auto", has_mask=False, interpret=False) == \
        "pallas_tpu"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_default_gpu_path_lowers_without_deprecation_warnings(dtype):
  # What a GPU user's training step compiles with implementation="auto": forward and
  # every gradient of DIFF V1 and V2, and V1 decoding, lowered for CUDA (an abstract
  # Hopper) here. bf16 runs the Mosaic GPU kernels on every jax; float32 runs the
  # Triton kernels before jax 0.11 and the stock paths (XLA to decode) from 0.11.
  from kernel_checks import abstract_hopper
  dt = jnp.dtype(dtype)
  q = jax.ShapeDtypeStruct((1, 128, 2, 64), dt)
  v = jax.ShapeDtypeStruct((1, 128, 2, 128), dt)
  q2 = jax.ShapeDtypeStruct((1, 128, 4, 64), dt)
  lam = jax.ShapeDtypeStruct((1, 128, 2), jnp.float32)
  cache = jax.ShapeDtypeStruct((2, 256, 2, 64), dt)
  cache_v = jax.ShapeDtypeStruct((2, 256, 2, 128), dt)
  token = jax.ShapeDtypeStruct((2, 1, 2, 64), dt)
  lens = jax.ShapeDtypeStruct((2,), jnp.int32)
  decode = lambda q1, q2, k1, k2, v, n: ops.diff_v1_attention_decode(q1, q2, k1, k2, v, 0.3, n)
  loss_v1 = lambda *a: ops.diff_v1_attention_core(*a, 0.3).astype(jnp.float32).sum()
  loss_v2 = lambda *a: ops.diff_v2_attention(*a).astype(jnp.float32).sum()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with ops.target_platform("gpu"), abstract_hopper():
      texts = [
          jax.jit(jax.grad(loss_v1, argnums=(0, 1, 2, 3, 4))).trace(q, q, q, q, v).lower(
              lowering_platforms=("cuda",)).as_text(),
          jax.jit(jax.grad(loss_v2, argnums=(0, 1, 2, 3))).trace(q2, q, q, lam).lower(
              lowering_platforms=("cuda",)).as_text()]
      text_decode = jax.jit(decode).trace(token, token, cache, cache, cache_v, lens).lower(
          lowering_platforms=("cuda",)).as_text()
  deprecations = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
  assert not deprecations, deprecations
  for text in texts:
    # Forward and backward kernels: two Mosaic GPU calls per op in bf16, none in float32.
    assert text.count("custom_call @mosaic_gpu") == (2 if dtype == "bfloat16" else 0)
  assert text_decode.count("custom_call @mosaic_gpu") == (1 if dtype == "bfloat16" else 0)
