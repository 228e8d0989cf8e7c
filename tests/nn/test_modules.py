"""The Flax NNX modules: RoPE, lambda, the three attention modules from their weights.

Each attention module is re-implemented in NumPy float64 from the brief's definitions
and its own stored weights (kernels [E, H, 2, d] etc.), so a wrong head pairing, RoPE
convention, norm or scale shows up as a numeric mismatch.
"""

from __future__ import annotations

import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from numpy_modules import _np, np_attention_module, np_diff_v1_module, np_diff_v2_module, np_rope

from diffjax import ops
from diffjax.model import DecoderLM, ModelConfig
from diffjax.nn import Attention, AttentionOptions, DiffV1Attention, DiffV2Attention, apply_rope

# --------------------------------------------------------------------------------------
# RoPE.
# --------------------------------------------------------------------------------------

STYLES = ["interleaved", "half"]


@pytest.mark.parametrize("style", STYLES)
def test_rope_matches_the_rotation_formula(style):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 5, 3, 16)).astype(np.float32)
  pos = np.array([[0, 1, 2, 3, 4], [7, 100, 31, 250, 0]], np.int32)
  out = apply_rope(jnp.asarray(x), jnp.asarray(pos), style=style)
  chex.assert_shape(out, x.shape)
  chex.assert_type(out, jnp.float32)
  chex.assert_trees_all_close(_np(out), np_rope(x, pos, style=style), atol=1e-4, rtol=1e-4)
  # Position 0 is the identity.
  np.testing.assert_allclose(np.asarray(out)[0, 0], x[0, 0], atol=1e-6)


@pytest.mark.parametrize("style", STYLES)
def test_rope_preserves_norms(style):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, 6, 2, 32)).astype(np.float32)
  pos = rng.integers(0, 2000, (2, 6)).astype(np.int32)
  out = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), style=style))
  np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
  assert np.abs(out - x).max() > 0.1  # it did rotate


@pytest.mark.parametrize("style", STYLES)
def test_rope_scores_depend_only_on_relative_position(style):
  rng = np.random.default_rng(2)
  d = 16
  q = rng.standard_normal(d).astype(np.float32)
  k = rng.standard_normal(d).astype(np.float32)
  # (query position, key position) pairs; rows of a column share the offset m - n.
  pairs = [
    [(5, 2), (8, 5), (40, 37), (103, 100)],
    [(3, 3), (0, 0), (77, 77), (12, 12)],
    [(2, 9), (10, 17), (50, 57), (0, 7)],
  ]

  def score(m, n):
    qm = apply_rope(jnp.asarray(q)[None, None, None], jnp.full((1, 1), m), style=style)
    kn = apply_rope(jnp.asarray(k)[None, None, None], jnp.full((1, 1), n), style=style)
    return float(jnp.sum(qm * kn))

  scores = np.array([[score(m, n) for m, n in row] for row in pairs])
  for row in scores:
    np.testing.assert_allclose(row, row[0], atol=2e-4, rtol=2e-4)
  # ... and different offsets give different scores.
  assert abs(scores[0, 0] - scores[1, 0]) > 1e-2 and abs(scores[0, 0] - scores[2, 0]) > 1e-2


def test_rope_interleaved_is_half_conjugated_by_the_pair_permutation():
  """interleaved(x) == P^-1 half(P x), P moving pair (2i, 2i+1) to (i, i + D/2)."""
  rng = np.random.default_rng(3)
  d = 12
  x = rng.standard_normal((2, 4, 3, d)).astype(np.float32)
  pos = rng.integers(0, 500, (2, 4)).astype(np.int32)
  perm = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])  # (P x)[j] = x[perm[j]]
  inv = np.argsort(perm)
  half = np.asarray(apply_rope(jnp.asarray(x[..., perm]), jnp.asarray(pos), style="half"))
  inter = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), style="interleaved"))
  np.testing.assert_allclose(half[..., inv], inter, atol=1e-5)
  assert np.abs(half - inter).max() > 1e-2  # the two conventions do differ


def test_rope_errors():
  x = jnp.ones((1, 2, 1, 6))
  pos = jnp.zeros((1, 2), jnp.int32)
  with pytest.raises(ValueError, match="neox"):
    apply_rope(x, pos, style="neox")
  with pytest.raises(ValueError, match=r"\b5\b"):
    apply_rope(jnp.ones((1, 2, 1, 5)), pos)
  with pytest.raises(ValueError, match="neox"):
    AttentionOptions(rope_style="neox")
  # A misspelt implementation is refused when the options are made, not at the first call.
  with pytest.raises(ValueError, match="'palas'.*'pallas_tpu'"):
    AttentionOptions(implementation="palas")


# --------------------------------------------------------------------------------------
# lambda.
# --------------------------------------------------------------------------------------


def test_lambda_init_schedule():
  values = [ops.lambda_init_for_layer(i) for i in range(4)]
  np.testing.assert_allclose(values, [0.2, 0.3555, 0.4707, 0.5561], atol=5e-5)
  assert abs(ops.lambda_init_for_layer(1000) - 0.8) < 1e-9


@pytest.mark.parametrize("layer_index", [0, 3])
def test_diff_v1_lambda_at_init(layer_index):
  m = DiffV1Attention(64, 2, 2, 128, layer_index=layer_index, rngs=nnx.Rngs(4))
  assert m.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * layer_index))
  lq1, lk1, lq2, lk2 = (_np(p[...]) for p in (m.lambda_q1, m.lambda_k1, m.lambda_q2, m.lambda_k2))
  expected = math.exp(lq1 @ lk1) - math.exp(lq2 @ lk2) + m.lambda_init
  lam = m.lambda_value()
  chex.assert_shape(lam, ())
  chex.assert_type(lam, jnp.float32)
  assert float(lam) == pytest.approx(expected, abs=1e-6)
  # The four vectors are float32 of length d, drawn N(0, 0.1^2); the gain starts at ones.
  vecs = np.stack([lq1, lk1, lq2, lk2])
  assert vecs.shape == (4, 128) and m.lambda_q1[...].dtype == jnp.float32
  assert 0.085 < vecs.std() < 0.115 and abs(vecs.mean()) < 0.02
  np.testing.assert_array_equal(np.asarray(m.norm_scale[...]), np.ones(256))


def test_diff_v2_lambda_projection_uses_torch_linear_init():
  e = 256
  m = DiffV2Attention(e, 8, 2, 8, rngs=nnx.Rngs(5))
  w = np.asarray(m.w_lambda[...])
  chex.assert_shape(w, (e, 8))
  bound = 1.0 / math.sqrt(e)
  assert np.abs(w).max() <= bound and np.abs(w).max() > 0.95 * bound
  assert abs(w.std() - bound / math.sqrt(3.0)) < 0.1 * bound


# --------------------------------------------------------------------------------------
# The modules against NumPy from their weights.
# --------------------------------------------------------------------------------------

E, T, B = 16, 6, 2
PACKED_POS = np.array([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]], np.int32)
PACKED_SEG = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]], np.int32)
CASES = [(False, "interleaved"), (True, "half")]


def _inputs(seed):
  rng = np.random.default_rng(seed)
  return rng.standard_normal((B, T, E)).astype(np.float32)


@nnx.jit
def _apply(m, x, pos, seg):
  return m(x, pos, seg)


def _call(m, x, packed):
  if packed:
    return _apply(m, jnp.asarray(x), jnp.asarray(PACKED_POS), jnp.asarray(PACKED_SEG))
  return _apply(m, jnp.asarray(x), None, None)


def _np_args(packed):
  if packed:
    return PACKED_POS, PACKED_SEG
  return np.broadcast_to(np.arange(T), (B, T)), None


@pytest.mark.parametrize("packed,style", CASES)
def test_attention_module_matches_numpy(packed, style):
  opts = AttentionOptions(rope_style=style, init_std=0.3)
  m = Attention(E, 4, 2, 8, options=opts, rngs=nnx.Rngs(6))
  chex.assert_shape(
    [m.q[...], m.k[...], m.v[...], m.o[...]], [(E, 4, 8), (E, 2, 8), (E, 2, 8), (4, 8, E)]
  )
  x = _inputs(7)
  y = _call(m, x, packed)
  chex.assert_shape(y, (B, T, E))
  pos, seg = _np_args(packed)
  chex.assert_trees_all_close(
    _np(y), np_attention_module(m, x, pos, seg, style), atol=1e-4, rtol=1e-4
  )


@pytest.mark.parametrize("packed,style", CASES)
def test_diff_v1_module_matches_numpy(packed, style):
  opts = AttentionOptions(rope_style=style, init_std=0.3)
  m = DiffV1Attention(E, 2, 1, 4, layer_index=2, options=opts, rngs=nnx.Rngs(8))
  chex.assert_shape(
    [m.q[...], m.k[...], m.v[...], m.o[...], m.norm_scale[...]],
    [(E, 2, 2, 4), (E, 1, 2, 4), (E, 1, 8), (2, 8, E), (8,)],
  )
  rng = np.random.default_rng(9)
  m.norm_scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, 8), jnp.float32)
  x = _inputs(10)
  y = _call(m, x, packed)
  chex.assert_shape(y, (B, T, E))
  pos, seg = _np_args(packed)
  chex.assert_trees_all_close(
    _np(y), np_diff_v1_module(m, x, pos, seg, style, layer_index=2), atol=1e-4, rtol=1e-4
  )


@pytest.mark.parametrize("packed,style", CASES)
def test_diff_v2_module_matches_numpy(packed, style):
  opts = AttentionOptions(rope_style=style, init_std=0.3)
  m = DiffV2Attention(E, 4, 2, 4, options=opts, rngs=nnx.Rngs(11))
  chex.assert_shape(
    [m.q[...], m.k[...], m.v[...], m.o[...], m.w_lambda[...]],
    [(E, 4, 2, 4), (E, 2, 4), (E, 2, 4), (4, 4, E), (E, 4)],
  )
  x = _inputs(12)
  y = _call(m, x, packed)
  chex.assert_shape(y, (B, T, E))
  pos, seg = _np_args(packed)
  chex.assert_trees_all_close(
    _np(y), np_diff_v2_module(m, x, pos, seg, style), atol=1e-4, rtol=1e-4
  )


def test_diff_v1_module_ablations():
  """use_norm=False drops the norm (and its gain); fixed_lambda replaces the formula."""
  opts = AttentionOptions(init_std=0.3)
  x = _inputs(13)
  full = DiffV1Attention(E, 2, 1, 4, layer_index=1, options=opts, rngs=nnx.Rngs(14))
  fixed = DiffV1Attention(
    E, 2, 1, 4, layer_index=1, options=opts, fixed_lambda=0.5, rngs=nnx.Rngs(14)
  )
  assert float(fixed.lambda_value()) == 0.5
  assert abs(float(full.lambda_value()) - 0.5) > 1e-3
  assert np.abs(np.asarray(_call(full, x, False)) - np.asarray(_call(fixed, x, False))).max() > 1e-4
  no_norm = DiffV1Attention(
    E, 2, 1, 4, layer_index=1, options=opts, use_norm=False, rngs=nnx.Rngs(14)
  )
  no_norm.norm_scale[...] = jnp.full((8,), 3.0)  # a gain has no effect without the norm
  assert (
    np.abs(np.asarray(_call(full, x, False)) - np.asarray(_call(no_norm, x, False))).max() > 1e-4
  )
  twice = DiffV1Attention(
    E, 2, 1, 4, layer_index=1, options=opts, use_norm=False, rngs=nnx.Rngs(14)
  )
  chex.assert_trees_all_close(_call(no_norm, x, False), _call(twice, x, False), atol=1e-6)


# --------------------------------------------------------------------------------------
# Gradients.
# --------------------------------------------------------------------------------------


@nnx.jit
@nnx.grad
def _grad_of_projection(m, x, cot):
  return jnp.sum(m(x) * cot)


def _grads(m, x, seed):
  cot = jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, E)), jnp.float32)
  return _grad_of_projection(m, jnp.asarray(x), cot)


def test_gradients_reach_diff_v1_lambda_and_norm_gain():
  m = DiffV1Attention(
    E, 2, 1, 4, layer_index=1, options=AttentionOptions(init_std=0.3), rngs=nnx.Rngs(15)
  )
  g = _grads(m, _inputs(16), 17)
  for name in (
    "lambda_q1",
    "lambda_k1",
    "lambda_q2",
    "lambda_k2",
    "norm_scale",
    "q",
    "k",
    "v",
    "o",
  ):
    arr = np.asarray(g[name][...])
    assert np.isfinite(arr).all(), name
    assert np.abs(arr).min() > 0, f"{name} has zero gradient entries: {arr}"
  # Chain rule through lambda = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init:
  # dL/dlq1 = dL/dlam exp(lq1.lk1) lk1 and dL/dlq2 = -dL/dlam exp(lq2.lk2) lk2.
  lq1, lk1, lq2, lk2 = (_np(p[...]) for p in (m.lambda_q1, m.lambda_k1, m.lambda_q2, m.lambda_k2))
  dlam_1 = _np(g["lambda_q1"][...]) / (math.exp(lq1 @ lk1) * lk1)
  dlam_2 = -_np(g["lambda_q2"][...]) / (math.exp(lq2 @ lk2) * lk2)
  dlam_3 = _np(g["lambda_k1"][...]) / (math.exp(lq1 @ lk1) * lq1)
  np.testing.assert_allclose(dlam_1, dlam_1[0], rtol=1e-3)
  np.testing.assert_allclose(dlam_2, dlam_1[0], rtol=1e-3)
  np.testing.assert_allclose(dlam_3, dlam_1[0], rtol=1e-3)


def test_gradients_reach_diff_v2_lambda_projection():
  m = DiffV2Attention(E, 4, 2, 4, options=AttentionOptions(init_std=0.3), rngs=nnx.Rngs(18))
  g = _grads(m, _inputs(19), 20)
  w = np.asarray(g["w_lambda"][...])
  assert np.isfinite(w).all() and np.abs(w).min() > 0
  # Both query heads of every pair get gradient (the second through the subtracted map).
  gq = np.asarray(g["q"][...])
  assert (np.abs(gq).reshape(E, 4, 2, 4).max(axis=(0, 3)) > 0).all()


# --------------------------------------------------------------------------------------
# Logical axis names.
# --------------------------------------------------------------------------------------

LOGICAL_NAMES = {"embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "norm"}

EXPECTED_NAMES = {
  "transformer": {
    "q": ("embed", "heads", "head_dim"),
    "k": ("embed", "kv_heads", "head_dim"),
    "v": ("embed", "kv_heads", "head_dim"),
    "o": ("heads", "head_dim", "embed"),
  },
  "diff_v1": {
    "q": ("embed", "heads", None, "head_dim"),
    "k": ("embed", "kv_heads", None, "head_dim"),
    "v": ("embed", "kv_heads", "head_dim"),
    "o": ("heads", "head_dim", "embed"),
  },
  "diff_v2": {
    "q": ("embed", "heads", None, "head_dim"),
    "k": ("embed", "kv_heads", "head_dim"),
    "v": ("embed", "kv_heads", "head_dim"),
    "o": ("heads", "head_dim", "embed"),
    "w_lambda": ("embed", "heads"),
  },
}
EXPECTED_LM_NAMES = {
  ("embed", "embedding"): ("vocab", "embed"),
  ("lm_head",): ("embed", "vocab"),
  ("final_norm", "scale"): ("norm",),
  ("attn_norm", "scale"): ("norm",),
  ("mlp_norm", "scale"): ("norm",),
  ("mlp", "w_gate"): ("embed", "mlp"),
  ("mlp", "w_up"): ("embed", "mlp"),
  ("mlp", "w_down"): ("mlp", "embed"),
}


def _tiny_lm(arm):
  cfg = ModelConfig(
    attention=arm,
    vocab_size=11,
    d_model=16,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    mlp_dim=24,
  )
  return nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))  # metadata, no values


def _param_specs(model):
  """{path tuple: (logical names, shape)} of every Param, via nnx.get_partition_spec."""
  state = nnx.state(model, nnx.Param)
  specs = nnx.get_partition_spec(state)
  out = {}
  for (path, var), (_, spec) in zip(nnx.to_flat_state(state), nnx.to_flat_state(specs)):
    spec = spec if isinstance(spec, jax.sharding.PartitionSpec) else spec.get_value()
    names = tuple(spec)
    meta = var.get_metadata()
    meta_names = meta.get("out_sharding", meta.get("sharding_names"))
    assert tuple(meta_names) == names, (path, meta_names, names)
    out[tuple(str(p) for p in path)] = (names, tuple(var.get_value().shape))
  return out


@pytest.mark.parametrize("arm", ["transformer", "diff_v1", "diff_v2"])
def test_params_carry_documented_logical_axis_names(arm):
  specs = _param_specs(_tiny_lm(arm))
  attn_seen = set()
  lm_seen = set()
  for path, (names, shape) in specs.items():
    assert len(names) == len(shape), f"{path}: names {names} for shape {shape}"
    assert set(names) <= LOGICAL_NAMES | {None}, f"{path}: unknown names {names}"
    if "attn" in path:
      leaf = path[-1]
      if leaf in EXPECTED_NAMES[arm]:
        assert names == EXPECTED_NAMES[arm][leaf], f"{path}: {names}"
        attn_seen.add(leaf)
    for suffix, expected in EXPECTED_LM_NAMES.items():
      if path[-len(suffix) :] == suffix:
        assert names == expected, f"{path}: {names}"
        lm_seen.add(suffix)
  assert attn_seen == set(EXPECTED_NAMES[arm])
  assert lm_seen == set(EXPECTED_LM_NAMES)


@pytest.mark.parametrize("arm", ["transformer", "diff_v1", "diff_v2"])
def test_every_param_has_a_logical_axis_name(arm):
  """A Param whose axes are all None escapes the sharding rules table."""
  specs = _param_specs(_tiny_lm(arm))
  unnamed = {"/".join(p): n for p, (n, _) in specs.items() if all(a is None for a in n)}
  assert not unnamed, f"Params without any logical axis name: {unnamed}"


# --------------------------------------------------------------------------------------
# Errors.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [Attention, DiffV1Attention, DiffV2Attention])
def test_module_rejects_heads_not_a_multiple_of_kv_heads(cls):
  kw = {"layer_index": 0} if cls is DiffV1Attention else {}
  with pytest.raises(ValueError) as info:
    cls(16, 3, 2, 4, rngs=nnx.Rngs(0), **kw)
  msg = str(info.value)
  assert re.search(r"num_heads\W+3\b", msg) and re.search(r"num_kv_heads\W+2\b", msg), msg
  with pytest.raises(ValueError, match=r"head_dim=0"):
    cls(16, 2, 2, 0, rngs=nnx.Rngs(0), **kw)


def test_diff_v1_module_rejects_a_negative_layer_index():
  with pytest.raises(ValueError, match="-2"):
    DiffV1Attention(16, 2, 2, 4, layer_index=-2, rngs=nnx.Rngs(0))
