"""The stock GPU paths (``jax.nn.dot_product_attention`` calls), against the reference.

Every GPU, dtype and width the Mosaic GPU kernels do not take runs these (float32, an
A100, head dims that are not multiples of 16). On a CPU they are checked through
``jax.nn.dot_product_attention``'s XLA implementation; ``gpu``-marked tests run them on
a GPU (cuDNN where it accepts the call). The Mosaic GPU kernels are checked in
tests/kernels/gpu/test_kernels_mosaic_gpu.py and compiled for GPUs in tests/kernels/gpu/test_gpu_compile.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from attention_cases import (
  GROUPED_SMALL_SHAPES,
  OPS,
  SMALL_SHAPES,
  AttentionCases,
  Case,
  mask_kwargs,
)
from kernel_checks import normal, rel_err, rel_err_rows, tolerance

from diffjax import ops
from diffjax.kernels import gpu as kg
from diffjax.ops import reference as ref


def _segments(b, t, s):
  """kv ids: three segments of uneven length; q ids are the last T of them."""
  pos = jnp.arange(s)
  kv = (pos >= s // 3).astype(jnp.int32) + (pos >= (2 * s) // 3 + 5).astype(jnp.int32)
  kv = jnp.stack([kv, jnp.roll(kv, 7)])[:b]
  return kv[:, s - t :], kv


def _v1_inputs(b, t, s, h, kh, d, dv, dtype, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  return (
    normal(ks[0], (b, t, h, d), dtype),
    normal(ks[1], (b, t, h, d), dtype),
    normal(ks[2], (b, s, kh, d), dtype),
    normal(ks[3], (b, s, kh, d), dtype),
    normal(ks[4], (b, s, kh, dv), dtype),
    jnp.linspace(0.15, 0.85, h).astype(jnp.float32),
  )


def _v2_inputs(b, t, s, h, kh, d, dtype, seed=1):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  return (
    normal(ks[0], (b, t, 2 * h, d), dtype),
    normal(ks[1], (b, s, kh, d), dtype),
    normal(ks[2], (b, s, kh, d), dtype),
    jax.nn.sigmoid(normal(ks[3], (b, t, h))),
  )


@pytest.mark.parametrize(
  "t,s,seg",
  [
    pytest.param(64, 64, False, marks=pytest.mark.slow),
    # TestStockGpu checks each path alone in the unit tier.
    pytest.param(40, 64, True, marks=pytest.mark.integration),
  ],
)
def test_stock_paths_compose_like_the_reference(t, s, seg):
  b = 2
  q_seg, kv_seg = _segments(b, t, s) if seg else (None, None)
  kw = dict(causal=True, q_segment_ids=q_seg, kv_segment_ids=kv_seg, implementation="xla")
  segs = None if q_seg is None else (q_seg, kv_seg)
  q1, q2, k1, k2, v, lam = _v1_inputs(b, t, s, 4, 2, 16, 32, jnp.float32)
  q, k, v2, lam2 = _v2_inputs(b, t, s, 4, 2, 16, jnp.float32)

  @jax.jit
  def run():
    return {
      "v1": (
        kg.diff_v1_stock_gpu(q1, q2, k1, k2, v, lam, **kw),
        ref.diff_v1_reference(q1, q2, k1, k2, v, lam, segment_ids=segs),
      ),
      "v2": (
        kg.diff_v2_stock_gpu(q, k, v2, lam2, **kw),
        ref.diff_v2_reference(q, k, v2, lam2, segment_ids=segs),
      ),
      "mha": (kg.mha_stock_gpu(q, k, v2, **kw), ref.mha_reference(q, k, v2, segment_ids=segs)),
    }

  results = run()
  errs = {
    name: (rel_err(got, want), rel_err_rows(got, want)) for name, (got, want) in results.items()
  }
  assert all(max(e) <= tolerance(jnp.float32) for e in errs.values()), errs
  # The check can fail: V1 with the second map's sign flipped (lambda -> -lambda).
  flipped = kg.diff_v1_stock_gpu(q1, q2, k1, k2, v, -lam, **kw)
  assert rel_err(flipped, results["v1"][1]) > 10 * tolerance(jnp.float32)


def test_stock_is_refused_on_cpu():
  q1, q2, k1, k2, v, lam = _v1_inputs(1, 16, 16, 2, 2, 16, 32, jnp.float32)
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU refusal")
  with pytest.raises(ValueError, match="runs on \\[.*'gpu'.*\\], but the current backend is 'cpu'"):
    ops.diff_v1_attention_core(q1, q2, k1, k2, v, lam, implementation="stock")


_needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


@pytest.mark.gpu
@_needs_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gpu_stock_paths_match_reference(dtype):
  args = _v1_inputs(2, 1024, 1024, 4, 2, 128, 256, dtype)
  got = jax.jit(kg.diff_v1_stock_gpu)(*args)
  want = ref.diff_v1_reference(*[a.astype(jnp.float32) for a in args])
  assert rel_err(got, want) <= tolerance(dtype), rel_err(got, want)
  q, k, v, lam = _v2_inputs(2, 1024, 1024, 4, 2, 128, dtype)
  got = jax.jit(kg.diff_v2_stock_gpu)(q, k, v, lam)
  want = ref.diff_v2_reference(*[a.astype(jnp.float32) for a in (q, k, v, lam)])
  assert rel_err(got, want) <= tolerance(dtype), rel_err(got, want)


def _gda_inputs(b, t, s, h, n, kh, d, dv, dtype, seed=2):
  """Grouped inputs: H signal heads, N noise heads, K kv groups; V1 lambda per head and
  V2 lambda per token and head."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)
  return (
    normal(ks[0], (b, t, h, d), dtype),
    normal(ks[1], (b, t, n, d), dtype),
    normal(ks[2], (b, s, kh, d), dtype),
    normal(ks[3], (b, s, kh, d), dtype),
    normal(ks[4], (b, s, kh, dv), dtype),
    jnp.linspace(0.15, 0.85, h).astype(jnp.float32),
    jax.nn.sigmoid(normal(ks[5], (b, t, h))),
  )


class TestStockGpu(AttentionCases):
  """Every op's stock GPU path through ``jax.nn.dot_product_attention``'s XLA implementation,
  on the small shapes (the grouped ops at r 2-4, one and three kv groups, T != S)."""

  ops = OPS
  shapes = SMALL_SHAPES + GROUPED_SMALL_SHAPES
  pinned = (
    Case("gda_v1", GROUPED_SMALL_SHAPES[0], True, "none", "float32"),
    Case("gda_v2", GROUPED_SMALL_SHAPES[0], True, "none", "float32"),
    Case("gda_v1", GROUPED_SMALL_SHAPES[3], True, "packed", "float32"),
    Case("gda_v2", GROUPED_SMALL_SHAPES[3], True, "packed", "float32"),
  )
  sampled = 2
  _FUNCTIONS = {
    "mha": kg.mha_stock_gpu,
    "diff_v1": kg.diff_v1_stock_gpu,
    "diff_v2": kg.diff_v2_stock_gpu,
    "gda_v1": kg.gda_v1_stock_gpu,
    "gda_v2": kg.gda_v2_stock_gpu,
  }

  def call(self, case, *arrays):
    return self._FUNCTIONS[case.op](*arrays, **mask_kwargs(case), implementation="xla")


def test_grouped_stock_reads_each_group_s_noise_map():
  # The checks above can fail on a wiring error: the noise map of the wrong group.
  b, t, s, h, n, kh, d = 2, 40, 64, 8, 2, 2, 16
  q1, q2, k1, k2, v, lam, _ = _gda_inputs(b, t, s, h, n, kh, d, 2 * d, jnp.float32)
  kw = dict(causal=True, implementation="xla")
  want = ref.gda_v1_reference(q1, q2, k1, k2, v, lam)
  got = jax.jit(lambda *a: kg.gda_v1_stock_gpu(*a, **kw))(q1, q2, k1, k2, v, lam)
  assert rel_err(got, want) <= tolerance(jnp.float32)
  swapped = jax.jit(lambda *a: kg.gda_v1_stock_gpu(*a, **kw))(q1, q2[:, :, ::-1], k1, k2, v, lam)
  assert rel_err(swapped, want) > 10 * tolerance(jnp.float32)
