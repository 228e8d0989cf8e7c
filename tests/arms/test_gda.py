"""Grouped differential attention (arms gda_v1 and gda_v2).

r = 1 must be DIFF V1 / V2 bit for bit (ops on every CPU path, forward and gradients;
modules with the same parameters); r > 1 is checked against an independent float64 NumPy
version of the math on 36 shapes (r in 1..4, GQA, odd head counts, causal or not, T != S,
masks), and the CPU rows' forward and every gradient against the plain-JAX reference.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diffjax import arms, ops
from diffjax.model import DecoderLM, ModelConfig, count_params, matched_configs
from diffjax.model.flops import flops_per_token


def _normal(seed, *shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


# ------------------------------------------------------------------------------------------
# An independent float64 NumPy version: one loop over signal heads.


def _np_softmax(s, visible):
  s = np.where(visible, s, -np.inf)
  m = np.max(s, axis=-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  e = np.where(visible, np.exp(s - m), 0.0)
  z = e.sum(-1, keepdims=True)
  return e / np.where(z == 0, 1.0, z)


def np_grouped(q1, q2, k1, k2, v, lam_BxTxH, causal):
  """out[b, t, h] = (A(q1_h, k1_g) - lam[b, t, h] A(q2_{h // r}, k2_g)) v_g, g the kv group."""
  b, t, h, d = q1.shape
  s, kv = k1.shape[1], k1.shape[2]
  n = q2.shape[2]
  r = h // n
  visible = np.ones((t, s), bool)
  if causal:
    visible = np.arange(s)[None, :] <= np.arange(t)[:, None] + (s - t)
  out = np.zeros((b, t, h, v.shape[-1]))
  for hh in range(h):
    noise = hh // r
    g = noise // (n // kv)
    for bb in range(b):
      a1 = _np_softmax(q1[bb, :, hh] @ k1[bb, :, g].T / np.sqrt(d), visible)
      a2 = _np_softmax(q2[bb, :, noise] @ k2[bb, :, g].T / np.sqrt(d), visible)
      out[bb, :, hh] = (a1 - lam_BxTxH[bb, :, hh, None] * a2) @ v[bb, :, g]
  return out


# (signal heads H, r, kv heads K, T, S, causal): 36 shapes, odd counts among them.
SHAPES = [
  (h, r, k, t, s, causal)
  for (h, r, k), (t, s), causal in itertools.product(
    [
      (1, 1, 1),
      (3, 3, 1),
      (6, 2, 3),
      (6, 3, 2),
      (8, 4, 2),
      (9, 3, 3),
      (12, 4, 3),
      (10, 2, 5),
      (4, 4, 1),
    ],
    [(5, 5), (7, 11)],
    [True, False],
  )
]


@pytest.mark.parametrize(
  "h,r,k,t,s,causal",
  [p if i % 3 == 0 else pytest.param(*p, marks=pytest.mark.slow) for i, p in enumerate(SHAPES)],
)
def test_grouped_forms_equal_a_float64_numpy_version(h, r, k, t, s, causal):
  with jax.enable_x64(True):
    n, d, b = h // r, 4, 2
    f64 = lambda i, *shape: _normal(i, *shape, dtype=jnp.float64)
    q1, q2 = f64(0, b, t, h, d), f64(1, b, t, n, d)
    k1, k2 = f64(2, b, s, k, d), f64(3, b, s, k, d)
    v1, v2 = f64(4, b, s, k, 2 * d), f64(5, b, s, k, d)
    lam_h = jnp.linspace(0.1, 0.9, h, dtype=jnp.float64)
    lam_bth = jax.nn.sigmoid(f64(6, b, t, h))
    mask = None if causal else _normal(7, 1, 1, t, s) > -0.8  # some keys hidden
    vis = lambda c: np.ones((t, s), bool) if mask is None else np.asarray(mask[0, 0])
    out1 = ops.gda_v1_attention_core(
      q1, q2, k1, k2, v1, lam_h, causal=causal, mask=mask, implementation="xla"
    )
    out2 = ops.gda_v2_attention(
      q1, q2, k1, v2, lam_bth, causal=causal, mask=mask, implementation="xla"
    )
    assert out1.dtype == jnp.float64 and out1.shape == (b, t, h, 2 * d)
    lam1 = np.broadcast_to(np.asarray(lam_h), (b, t, h))
    args = [np.asarray(x) for x in (q1, q2, k1, k2)]
    if mask is None:
      want1 = np_grouped(*args, np.asarray(v1), lam1, causal)
      want2 = np_grouped(
        args[0], args[1], args[2], args[2], np.asarray(v2), np.asarray(lam_bth), causal
      )
    else:  # the mask only: numpy with causal=False and the mask applied by hand
      want1 = _masked(args, np.asarray(v1), lam1, vis(0))
      want2 = _masked(
        [args[0], args[1], args[2], args[2]], np.asarray(v2), np.asarray(lam_bth), vis(0)
      )
    np.testing.assert_allclose(np.asarray(out1), want1, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(np.asarray(out2), want2, rtol=1e-11, atol=1e-12)


def _masked(args, v, lam, visible):
  q1, q2, k1, k2 = args
  b, t, h, d = q1.shape
  n, kv = q2.shape[2], k1.shape[2]
  r = h // n
  out = np.zeros((b, t, h, v.shape[-1]))
  for hh in range(h):
    noise, g = hh // r, (hh // r) // (n // kv)
    for bb in range(b):
      a1 = _np_softmax(q1[bb, :, hh] @ k1[bb, :, g].T / np.sqrt(d), visible)
      a2 = _np_softmax(q2[bb, :, noise] @ k2[bb, :, g].T / np.sqrt(d), visible)
      out[bb, :, hh] = (a1 - lam[bb, :, hh, None] * a2) @ v[bb, :, g]
  return out


def test_at_least_thirty_shapes():
  assert len(SHAPES) >= 30


# ------------------------------------------------------------------------------------------
# r = 1 is DIFF V1 / V2, bit for bit.


def _v1_inputs(h=6, k=3, t=9, d=8):
  return (
    _normal(0, 2, t, h, d),
    _normal(1, 2, t, h, d),
    _normal(2, 2, t, k, d),
    _normal(3, 2, t, k, d),
    _normal(4, 2, t, k, 2 * d),
    jnp.float32(0.3),
  )


@pytest.mark.parametrize("implementation", ["xla", "auto"])
def test_r1_ops_are_diff_v1_and_v2_bitwise(implementation):
  q1, q2, k1, k2, v, lam = _v1_inputs()
  seg = jnp.asarray(np.repeat([[0, 1]], [4, 5], axis=1).repeat(2, 0), jnp.int32)
  kw = dict(implementation=implementation, segment_ids=seg)
  f_v1 = lambda *a: ops.diff_v1_attention_core(*a, **kw)
  f_g1 = lambda *a: ops.gda_v1_attention_core(*a, **kw)
  args = (q1, q2, k1, k2, v, lam)
  ct = _normal(9, *f_v1(*args).shape)
  for f, g in ((f_v1, f_g1),):  # each under jit: one program, not op by op
    assert bool((jax.jit(f)(*args) == jax.jit(g)(*args)).all())
    ga = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=tuple(range(6))))(*args)
    gb = jax.jit(jax.grad(lambda *a: jnp.sum(g(*a) * ct), argnums=tuple(range(6))))(*args)
    assert all(bool((x == y).all()) for x, y in zip(ga, gb))
  b, t, h, d = q1.shape
  lam_bth = jax.nn.sigmoid(_normal(5, b, t, h))
  pairs = jnp.stack([q1, q2], axis=3).reshape(b, t, 2 * h, d)
  v2 = v[..., :d]
  a = jax.jit(lambda *x: ops.diff_v2_attention(*x, **kw))(pairs, k1, v2, lam_bth)
  g = jax.jit(lambda *x: ops.gda_v2_attention(*x, **kw))(q1, q2, k1, v2, lam_bth)
  assert bool((a == g).all())
  ga = jax.jit(
    jax.grad(lambda p, l: jnp.sum(ops.diff_v2_attention(p, k1, v2, l, **kw) * ct[..., :d]), (0, 1))
  )(pairs, lam_bth)
  gb = jax.jit(
    jax.grad(
      lambda x1, x2, l: jnp.sum(ops.gda_v2_attention(x1, x2, k1, v2, l, **kw) * ct[..., :d]),
      (0, 1, 2),
    )
  )(q1, q2, lam_bth)
  dq = jnp.stack([gb[0], gb[1]], axis=3).reshape(pairs.shape)
  assert bool((ga[0] == dq).all()) and bool((ga[1] == gb[2]).all())


_TOKENS = jax.random.randint(jax.random.key(0), (2, 13), 0, 258)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("base,grouped", [("diff_v1", "gda_v1"), ("diff_v2", "gda_v2")])
def test_r1_models_are_diff_v1_and_v2_bitwise(base, grouped, scan):
  cfg = ModelConfig(
    attention=base,
    num_heads=4,
    num_kv_heads=2,
    d_model=64,
    head_dim=16,
    mlp_dim=96,
    num_layers=3,
    scan_layers=scan,
  )
  m1 = DecoderLM(cfg, rngs=nnx.Rngs(0))
  m2 = DecoderLM(cfg.replace(attention=grouped, gda_ratio=1), rngs=nnx.Rngs(0))
  s1, s2 = jax.tree.leaves(nnx.state(m1)), jax.tree.leaves(nnx.state(m2))
  assert len(s1) == len(s2) and all(bool((x == y).all()) for x, y in zip(s1, s2))
  forward = nnx.jit(lambda m, tokens: m(tokens))  # one program per model, not op by op
  assert bool((forward(m1, _TOKENS) == forward(m2, _TOKENS)).all())


# ------------------------------------------------------------------------------------------
# Models: decoding with a KV cache, matching, FLOPs and bad head counts.


@pytest.mark.parametrize("arm", ["gda_v1", "gda_v2"])
def test_decoding_with_a_cache_equals_the_full_forward(arm):
  cfg = ModelConfig(
    attention=arm,
    num_heads=8,
    num_kv_heads=2,
    d_model=64,
    head_dim=8,
    mlp_dim=96,
    num_layers=2,
    gda_ratio=4 if arm == "gda_v2" else 2,
  )
  model = DecoderLM(cfg, rngs=nnx.Rngs(1))
  # Under jit: one program for the prompt and one for every decode step.
  full = nnx.jit(lambda m, tokens: m(tokens))(model, _TOKENS)
  prefill = nnx.jit(lambda m, tokens, c, n: m(tokens, cache=c, cache_lengths_B=n))
  decode = nnx.jit(
    lambda m, tokens, p, c, n: m(tokens, positions_BxT=p, cache=c, cache_lengths_B=n)
  )
  cache = model.init_cache(2, 16)
  lengths = jnp.zeros((2,), jnp.int32)
  logits, cache = prefill(model, _TOKENS[:, :9], cache, lengths)
  steps = [logits]
  lengths = lengths + 9
  for i in range(9, 13):
    step, cache = decode(model, _TOKENS[:, i : i + 1], jnp.full((2, 1), i), cache, lengths)
    steps.append(step)
    lengths = lengths + 1
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("ratio", [1, 3, 4])
def test_grouped_arms_match_the_transformer_by_parameters(ratio):
  base = ModelConfig(
    attention="transformer",
    num_heads=60,
    num_kv_heads=4,
    d_model=240,
    head_dim=8,
    mlp_dim=640,
    num_layers=2,
    gda_ratio=ratio,
  )
  names = ("transformer", "diff_v1", "diff_v2", "gda_v1", "gda_v2")
  cfgs = matched_configs(base, names=names)
  n_t = count_params(cfgs["transformer"])
  for name in ("gda_v1", "gda_v2"):
    assert abs(count_params(cfgs[name]) - n_t) / n_t < 0.005, name
  g1, g2 = cfgs["gda_v1"], cfgs["gda_v2"]
  assert g1.num_heads + g1.num_heads // ratio == 60  # V1's head budget re-split r : 1
  assert g2.num_heads == 60
  if ratio == 1:  # r = 1 is matched as DIFF V1 and V2 are
    assert g1.replace(attention="diff_v1", gda_ratio=1) == cfgs["diff_v1"].replace(gda_ratio=1)
    assert g2.replace(attention="diff_v2") == cfgs["diff_v2"]
    for a, b in (("gda_v1", "diff_v1"), ("gda_v2", "diff_v2")):
      assert flops_per_token(cfgs[a], 256).model == flops_per_token(cfgs[b], 256).model
  heads = matched_configs(base, v2_match="heads", names=("gda_v1",))["gda_v1"]
  assert heads.mlp_dim == base.mlp_dim


def test_the_noise_map_is_counted_once_per_group():
  cfg = ModelConfig(attention="gda_v1", num_heads=8, num_kv_heads=2, head_dim=16, gda_ratio=4)
  v1 = cfg.replace(attention="diff_v1")
  # Two noise maps instead of eight: 6 maps' scores fewer, 2d FLOPs each per key.
  spec = arms.get("gda_v1")
  assert arms.get("diff_v1").attention_flops(v1) - spec.attention_flops(cfg) == 6 * 2 * 16


@pytest.mark.parametrize(
  "arm,heads,ratio,kv,match",
  [
    ("gda_v1", 6, 4, 1, "multiple of gda_ratio"),
    ("gda_v1", 8, 2, 3, "multiple of num_kv_heads"),
    ("gda_v2", 8, 4, 4, "multiple of num_kv_heads"),
    ("gda_v1", 8, 0, 1, "gda_ratio=0"),
  ],
)
def test_head_counts_that_do_not_form_groups_are_refused(arm, heads, ratio, kv, match):
  with pytest.raises(ValueError, match=match):
    cfg = ModelConfig(attention=arm, num_heads=heads, num_kv_heads=kv, gda_ratio=ratio)
    DecoderLM(cfg, rngs=nnx.Rngs(0))


def test_unmatchable_baselines_are_refused_naming_the_fix():
  base = ModelConfig(attention="transformer", num_heads=6, num_kv_heads=2, gda_ratio=4)
  with pytest.raises(ValueError, match="multiple of 5"):
    matched_configs(base, names=("gda_v1",))
  with pytest.raises(ValueError, match="multiple of 4"):
    matched_configs(base, names=("gda_v2",))
