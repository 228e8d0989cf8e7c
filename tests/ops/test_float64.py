"""float64 end to end, or a clear refusal.

With 64-bit JAX on, ``dtype=float64`` runs every step in float64: projections, RoPE,
the softmax, lambda, the norms and the logits, so a model can be checked against
NumPy or by finite differences. Without 64-bit JAX, JAX would silently make the
arrays float32, so asking for float64 is refused with the fix in the message. The
fused kernels accumulate in float32: ``"auto"`` takes the XLA path for float64
inputs and a named kernel refuses them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from numpy_modules import (  # the NumPy float64 definitions of the modules
  np_attention_module,
  np_diff_v1_module,
  np_diff_v2_module,
)

from diffjax import ops
from diffjax.model import DecoderLM, ModelConfig
from diffjax.nn import Attention, AttentionOptions, DiffV1Attention, DiffV2Attention

X64_HINT = r"jax\.config\.update\('jax_enable_x64', True\)"


def test_float64_without_64_bit_jax_is_refused_in_options_and_config():
  assert not jax.config.jax_enable_x64, "the test suite runs with 64-bit JAX off"
  for make, name in (
    (lambda: AttentionOptions(dtype=jnp.float64), "dtype"),
    (lambda: AttentionOptions(param_dtype=np.float64), "param_dtype"),
    (lambda: ModelConfig(dtype="float64"), "dtype"),
    (lambda: ModelConfig(param_dtype="float64"), "param_dtype"),
  ):
    with pytest.raises(ValueError, match=f"{name}=float64 .*{X64_HINT}"):
      make()


@pytest.mark.parametrize("arm", ["transformer", "diff_v1", "diff_v2"])
def test_float64_modules_match_numpy_to_rounding(arm):
  e, b, t = 16, 2, 6
  pos = np.array([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]], np.int32)
  seg = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]], np.int32)
  x = np.random.default_rng(0).standard_normal((b, t, e))
  with jax.enable_x64(True):
    opts = AttentionOptions(dtype=jnp.float64, param_dtype=jnp.float64, init_std=0.3)
    if arm == "transformer":
      m = Attention(e, 4, 2, 8, options=opts, rngs=nnx.Rngs(1))
      want = lambda: np_attention_module(m, x, pos, seg, "interleaved")
    elif arm == "diff_v1":
      m = DiffV1Attention(e, 2, 1, 4, layer_index=2, options=opts, rngs=nnx.Rngs(1))
      m.norm_scale[...] = jnp.linspace(0.5, 1.5, 8)
      want = lambda: np_diff_v1_module(m, x, pos, seg, "interleaved", layer_index=2)
    else:
      m = DiffV2Attention(e, 4, 2, 4, options=opts, rngs=nnx.Rngs(1))
      want = lambda: np_diff_v2_module(m, x, pos, seg, "interleaved")
    assert all(p.dtype == jnp.float64 for p in jax.tree.leaves(nnx.state(m, nnx.Param)))
    y = nnx.jit(lambda m, *a: m(*a))(m, jnp.asarray(x), jnp.asarray(pos), jnp.asarray(seg))
    assert y.dtype == jnp.float64
    # float32 anywhere on the way would leave errors near 1e-7.
    np.testing.assert_allclose(np.asarray(y), want(), rtol=1e-12, atol=1e-12)


# The arms share every line but the attention, which the test above covers for all
# three; here the DIFF arms, whose lambda paths have the most float32 to avoid.
# DIFF V1 (the slower compile) runs with -m slow; its float64 path is also checked against
# numpy above.
@pytest.mark.parametrize("arm", [pytest.param("diff_v1", marks=pytest.mark.slow), "diff_v2"])
def test_float64_lm_gradient_matches_finite_differences(arm):
  with jax.enable_x64(True):
    cfg = ModelConfig(
      attention=arm,
      vocab_size=32,
      d_model=16,
      num_layers=2,
      num_heads=2,
      num_kv_heads=1,
      head_dim=8,
      mlp_dim=32,
      dtype="float64",
      param_dtype="float64",
    )
    graphdef, params = nnx.split(DecoderLM(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(1)
    tokens_BxT = jnp.asarray(rng.integers(0, 32, (2, 12)), jnp.int32)
    targets_BxT = jnp.asarray(rng.integers(0, 32, (2, 12)), jnp.int32)

    @jax.jit
    def loss(p):
      logits_BxTxV = nnx.merge(graphdef, p)(tokens_BxT)
      return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT))

    # A random direction through every parameter, lambda's included, at about the
    # parameters' own scale (larger steps make the O(eps^2) term dominate).
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    u = jax.tree.unflatten(
      treedef, [0.05 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    )
    step = lambda s: jax.tree.map(lambda p, d: p + s * d, params, u)
    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert value.dtype == jnp.float64
    analytic = sum(
      float(jnp.vdot(g, d)) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(u))
    )
    eps = 1e-5
    numeric = (float(loss(step(eps))) - float(loss(step(-eps)))) / (2 * eps)
    # Central differences are exact to O(eps^2), about 1e-9 here; rounding in float64
    # adds ~1e-16 / eps. One float32 step on the way would add ~1e-7 / eps ~ 1e-2.
    assert abs(analytic - numeric) <= 1e-7 * abs(analytic), (analytic, numeric)


def test_kernels_leave_float64_to_xla():
  b, t, h, d = 1, 16, 2, 8
  with jax.enable_x64(True):
    ks = jax.random.split(jax.random.key(0), 5)
    q1, q2, k1, k2 = (jax.random.normal(k, (b, t, h, d), jnp.float64) for k in ks[:4])
    v = jax.random.normal(ks[4], (b, t, h, 2 * d), jnp.float64)
    want = ops.diff_v1_attention_core(q1, q2, k1, k2, v, 0.3, implementation="xla")
    assert want.dtype == jnp.float64
    # "auto" on a GPU or TPU would pick a kernel for float32; float64 stays on XLA.
    for platform in ("gpu", "tpu"):
      with ops.target_platform(platform):
        got = ops.diff_v1_attention_core(q1, q2, k1, k2, v, 0.3)
      np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="pallas_gpu refuses: it computes in float32"):
      ops.diff_v1_attention_core(
        q1, q2, k1, k2, v, 0.3, implementation="pallas_gpu", interpret=True
      )
