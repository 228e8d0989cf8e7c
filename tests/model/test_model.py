"""The decoder LM and its config: parameter counts, causality, jit, dtypes, capture, remat."""

from __future__ import annotations

import functools
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax.model import ARMS, DecoderLM, Hooks, ModelConfig, count_params, matched_configs

# One layer keeps compiles short; the capture and parameter-count tests use two.
VOCAB, E, D, LAYERS, MLP = 23, 32, 8, 1, 48
T = 12


def base_config(**kw) -> ModelConfig:
  """A tiny transformer spec; matched_configs derives the DIFF arms from it."""
  fields = dict(
    attention="transformer",
    vocab_size=VOCAB,
    d_model=E,
    num_layers=LAYERS,
    num_heads=4,
    num_kv_heads=2,
    head_dim=D,
    mlp_dim=MLP,
  )
  fields.update(kw)
  return ModelConfig(**fields)


def arm_config(arm, **kw) -> ModelConfig:
  return matched_configs(base_config(**kw))[arm]


@functools.cache
def model_for(cfg: ModelConfig, seed: int = 0) -> DecoderLM:
  """One model per (config, seed); tests only read it."""
  return DecoderLM(cfg, rngs=nnx.Rngs(seed))


def num_params(model) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def tokens_and_targets(seed=0, batch=2):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, (batch, T)).astype(np.int32)
  targets = rng.integers(0, VOCAB, (batch, T)).astype(np.int32)
  return jnp.asarray(tokens), jnp.asarray(targets)


@nnx.jit
def forward(model, tokens):
  return model(tokens)


@nnx.jit(static_argnames="hooks")
def forward_with_hooks(model, tokens, hooks):
  return model(tokens, hooks=hooks)


@nnx.jit
def forward_capture(model, tokens):
  return model(tokens, capture=True)


# --------------------------------------------------------------------------------------
# Parameter counts and matched arms.
# --------------------------------------------------------------------------------------

COUNT_BASES = {
  "mha": dict(num_heads=4, num_kv_heads=4, num_layers=2),
  "gqa": dict(num_heads=4, num_kv_heads=2, num_layers=3),
  "gqa_tied": dict(num_heads=8, num_kv_heads=2, head_dim=4, num_layers=2, tie_embeddings=True),
}


@pytest.mark.parametrize("base", list(COUNT_BASES))
def test_count_params_matches_the_built_model(base):
  # Matched by heads: V2 keeps the baseline's FFN, so its extra parameters are its own.
  arms = matched_configs(base_config(**COUNT_BASES[base]), v2_match="heads")
  actual = {}
  for arm, cfg in arms.items():
    abstract = nnx.eval_shape(lambda cfg=cfg: DecoderLM(cfg, rngs=nnx.Rngs(0)))
    actual[arm] = num_params(abstract)
    assert count_params(cfg) == actual[arm], (arm, count_params(cfg), actual[arm])
  b = arms["transformer"]
  e, h, d, layers = b.d_model, b.num_heads, b.head_dim, b.num_layers
  # DIFF V1 adds the four lambda vectors (4d) and the 2d-wide norm gain per layer.
  assert actual["diff_v1"] - actual["transformer"] == 6 * d * layers
  # DIFF V2 adds the second query of each pair (E h d) and W_lambda (E h) per layer.
  assert actual["diff_v2"] - actual["transformer"] == (e * h * d + e * h) * layers
  if b.tie_embeddings:
    untied = nnx.eval_shape(lambda: DecoderLM(b.replace(tie_embeddings=False), rngs=nnx.Rngs(0)))
    assert num_params(untied) - actual["transformer"] == e * b.vocab_size


def test_matched_configs_shapes():
  arms = matched_configs(base_config())
  assert set(arms) == set(ARMS)
  v1, v2 = arms["diff_v1"], arms["diff_v2"]
  assert (v1.attention, v1.num_heads, v1.num_kv_heads, v1.head_dim) == ("diff_v1", 2, 1, D)
  assert (v2.attention, v2.num_heads, v2.num_kv_heads, v2.head_dim) == ("diff_v2", 4, 2, D)
  assert diffjax.arms.get("diff_v1").value_head_dim(v1) == 2 * D
  assert diffjax.arms.get("diff_v2").value_head_dim(v2) == D


def test_matched_configs_errors():
  with pytest.raises(ValueError) as info:
    matched_configs(base_config(num_heads=3, num_kv_heads=1))
  assert re.search(r"num_heads\W+3\b", str(info.value)), str(info.value)
  with pytest.raises(ValueError) as info:
    matched_configs(base_config(num_heads=6, num_kv_heads=3))
  assert re.search(r"num_kv_heads\W+3\b", str(info.value)), str(info.value)
  with pytest.raises(ValueError, match="diff_v1"):
    matched_configs(base_config(attention="diff_v1", num_heads=2, num_kv_heads=1))


@pytest.mark.parametrize(
  "bad,fragments",
  [
    (dict(d_model=0), ["d_model", r"\b0\b"]),
    (dict(d_model=-32), ["d_model", "-32"]),
    (dict(num_heads=6, num_kv_heads=4), [r"\b6\b", r"\b4\b"]),
    (dict(dtype="float8"), ["float8"]),
    (dict(param_dtype="int8"), ["int8"]),
    (dict(remat="sometimes"), ["sometimes"]),
    (dict(rope_style="neox"), ["neox"]),
    (dict(head_dim=7), [r"\b7\b"]),
    (dict(implementation="cuda"), ["cuda"]),
  ],
)
def test_model_config_rejects_bad_values(bad, fragments):
  with pytest.raises(ValueError) as info:
    base_config(**bad)
  for frag in fragments:
    assert re.search(frag, str(info.value)), (frag, str(info.value))


def test_an_unknown_arm_is_named_where_the_model_is_built():
  cfg = base_config(attention="diff_v3")  # a name some module may still register
  for build in (lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)), lambda: count_params(cfg)):
    with pytest.raises(ValueError, match="Unknown arm 'diff_v3'; the arms are .*'diff_v2'"):
      build()


def test_model_config_from_dict():
  cfg = base_config(attention="diff_v2", remat="dots")
  assert ModelConfig.from_dict(cfg.to_dict()) == cfg
  with pytest.raises(ValueError, match="n_layers"):
    ModelConfig.from_dict(dict(cfg.to_dict(), n_layers=3))


def test_param_dtype_sets_the_dtype_of_the_weight_matrices():
  """``param_dtype`` is validated, so it must act: the weight matrices take it.

  (Vectors such as norm gains and the DIFF V1 lambda vectors may stay float32.)
  """
  cfg = arm_config("diff_v1", param_dtype="bfloat16")
  abstract = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))
  dtypes = {
    str(x.dtype) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)) if len(x.shape) >= 2
  }
  assert dtypes == {"bfloat16"}, f"param_dtype='bfloat16' gave weight matrices of {dtypes}"


# --------------------------------------------------------------------------------------
# Causality, measured through gradients.
# --------------------------------------------------------------------------------------


def influence_matrix(model, tokens_T, positions_T=None, segment_ids_T=None):
  """influence[t, s] = |d (logits[t] . w) / d embedding(token s)|, float64 [T, T].

  The tokens are distinct and the LM head is untied, so embedding-table row tokens[s]
  enters the model only as the input at position s: its gradient is the gradient with
  respect to that input embedding.
  """
  assert not model.config.tie_embeddings
  assert len(set(np.asarray(tokens_T).tolist())) == len(tokens_T)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  w_V = jnp.asarray(np.random.default_rng(1).standard_normal(model.config.vocab_size), jnp.float32)
  tokens = jnp.asarray(tokens_T)[None]
  pos = None if positions_T is None else jnp.asarray(positions_T)[None]
  seg = None if segment_ids_T is None else jnp.asarray(segment_ids_T)[None]

  @jax.jit
  def influence(params_):
    def outputs(p):
      return nnx.merge(graphdef, p, rest)(tokens, pos, seg)[0] @ w_V  # [T]

    jac = jax.jacrev(outputs)(params_)
    j_TxVxE = jac["embed"]["embedding"][...]
    return jnp.linalg.norm(j_TxVxE[:, tokens[0]], axis=-1)  # [T, T]

  return np.asarray(influence(params), np.float64)


def _distinct_tokens(seed):
  return np.random.default_rng(seed).permutation(VOCAB)[:T].astype(np.int32)


@pytest.mark.parametrize("arm", ARMS)
def test_loss_at_t_does_not_depend_on_later_inputs(arm):
  infl = influence_matrix(model_for(arm_config(arm)), _distinct_tokens(2))
  t_idx, s_idx = np.indices(infl.shape)
  future = s_idx > t_idx
  np.testing.assert_array_equal(infl[future], 0.0)
  # Every earlier (and the same) position does matter.
  assert infl[~future].min() > 1e-6 * infl.max(), infl


@pytest.mark.parametrize("arm", ARMS)
def test_packed_documents_do_not_see_each_other(arm):
  seg = np.array([0] * 5 + [1] * 4 + [2] * 3, np.int32)
  pos = np.concatenate([np.arange(5), np.arange(4), np.arange(3)]).astype(np.int32)
  infl = influence_matrix(model_for(arm_config(arm)), _distinct_tokens(3), pos, seg)
  t_idx, s_idx = np.indices(infl.shape)
  visible = (s_idx <= t_idx) & (seg[s_idx] == seg[t_idx])
  # Zero for other documents, including earlier ones, and for the future.
  np.testing.assert_array_equal(infl[~visible], 0.0)
  assert infl[visible].min() > 1e-6 * infl.max(), infl


def test_packed_document_matches_the_document_alone():
  """A document packed after another gives the logits it gives on its own."""
  model = model_for(arm_config("diff_v1"))
  tokens = _distinct_tokens(4)
  seg = jnp.asarray(np.array([[0] * 5 + [1] * 7], np.int32))
  pos = jnp.asarray(np.concatenate([np.arange(5), np.arange(7)])[None].astype(np.int32))
  packed = nnx.jit(lambda m, x, p, s: m(x, p, s))(model, jnp.asarray(tokens)[None], pos, seg)
  alone = forward(model, jnp.asarray(tokens[5:])[None])
  chex.assert_trees_all_close(packed[:, 5:], alone, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------
# jit, dtypes, capture, remat, hooks.
# --------------------------------------------------------------------------------------


# jit and eager share every line; one arm runs by default, the others with -m slow.
@pytest.mark.parametrize(
  "arm",
  [
    pytest.param("transformer", marks=pytest.mark.slow),
    "diff_v1",
    pytest.param("diff_v2", marks=pytest.mark.slow),
  ],
)
def test_jit_and_eager_agree(arm):
  model = model_for(arm_config(arm))
  tokens, _ = tokens_and_targets(5)
  eager = model(tokens)
  jitted = forward(model, tokens)
  chex.assert_shape(eager, (2, T, VOCAB))
  chex.assert_type(eager, jnp.float32)
  chex.assert_trees_all_close(eager, jitted, atol=1e-5, rtol=1e-5)


# bf16 compute (parameters stay float32): max |logits_bf16 - logits_f32| must stay below
# 2.5% of max |logits_f32|. bf16 keeps 8 mantissa bits (relative rounding 2^-9); measured
# errors of these tiny models are 0.4-0.9%, so the bound leaves a margin of about 3x.
BF16_REL_TOL = 0.025


@pytest.mark.parametrize("arm", ARMS)
def test_bfloat16_compute_is_close_to_float32(arm):
  cfg = arm_config(arm, init_std=0.1)
  f32 = model_for(cfg)
  bf16 = model_for(cfg.replace(dtype="bfloat16"))
  nnx.update(bf16, nnx.state(f32, nnx.Param))  # same weights
  tokens, _ = tokens_and_targets(6)
  l32 = np.asarray(forward(f32, tokens))
  l16 = forward(bf16, tokens)
  chex.assert_type(l16, jnp.float32)  # logits are float32 whatever the compute dtype
  err = np.abs(np.asarray(l16) - l32).max()
  scale = np.abs(l32).max()
  assert err <= BF16_REL_TOL * scale, (err, scale)
  assert err > 0  # bf16 did run


CAPTURE_KEYS = {
  "transformer": {"logits", "probs", "hidden", "context", "values"},
  "diff_v1": {
    "logits1",
    "logits2",
    "probs1",
    "probs2",
    "lambda",
    "lambda_init",
    "hidden",
    "context",
    "values",
  },
  "diff_v2": {"logits1", "logits2", "probs1", "probs2", "lambda", "hidden", "context", "values"},
}


@pytest.mark.parametrize("arm", ARMS)
def test_capture_returns_the_same_logits_and_per_layer_maps(arm):
  cfg = arm_config(arm, num_layers=2)
  model = model_for(cfg)
  tokens, _ = tokens_and_targets(7)
  logits, caps = forward_capture(model, tokens)
  chex.assert_trees_all_close(logits, forward(model, tokens), atol=1e-5, rtol=1e-5)
  assert isinstance(caps, list) and len(caps) == cfg.num_layers
  b, h = tokens.shape[0], cfg.num_heads
  for layer, (cap, block) in enumerate(zip(caps, model.blocks)):
    assert set(cap) == CAPTURE_KEYS[arm], (layer, sorted(cap))
    maps = [k for k in cap if k.startswith(("logits", "probs"))]
    for k in maps:
      chex.assert_shape(cap[k], (b, h, T, T))
      chex.assert_type(cap[k], jnp.float32)
    for k in (k for k in maps if k.startswith("probs")):
      p = np.asarray(cap[k])
      np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)
      np.testing.assert_array_equal(np.triu(np.ones((T, T)), 1)[None, None] * p, 0.0)
    chex.assert_shape(cap["hidden"], (b, T, cfg.d_model))
    if arm == "diff_v1":
      chex.assert_shape(cap["lambda"], ())
      assert float(cap["lambda"]) == pytest.approx(float(block.attn.lambda_value()), abs=1e-7)
      assert float(cap["lambda_init"]) == pytest.approx(
        0.8 - 0.6 * math.exp(-0.3 * layer), abs=1e-6
      )
    if arm == "diff_v2":
      chex.assert_shape(cap["lambda"], (b, T, h))
      lam = np.asarray(cap["lambda"])
      assert ((lam > 0) & (lam < 1)).all()
  # The last hidden state, through the final norm and the head, gives the logits.
  x = np.asarray(caps[-1]["hidden"], np.float64)
  x = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + cfg.norm_eps)
  x = x * np.asarray(model.final_norm.scale[...], np.float64)
  np.testing.assert_allclose(
    x @ np.asarray(model.lm_head[...], np.float64), logits, atol=1e-4, rtol=1e-4
  )


def _loss(model, tokens, targets):
  logits = model(tokens)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


_loss_and_grad = nnx.jit(nnx.value_and_grad(_loss))


@functools.cache
def _reference_loss_and_grads(arm):
  tokens, targets = tokens_and_targets(8)
  loss, grads = _loss_and_grad(model_for(arm_config(arm)), tokens, targets)
  return float(loss), jax.tree.map(np.asarray, nnx.to_pure_dict(grads))


# The remat wrapper is the same for every arm; each policy runs on a DIFF arm.
@pytest.mark.parametrize(
  "arm,policy",
  [
    pytest.param("diff_v1", "full", marks=pytest.mark.slow),
    ("diff_v1", "dots"),
    ("diff_v2", "full"),
  ],
)
def test_remat_gives_the_same_loss_and_gradients(arm, policy):
  ref_loss, ref_grads = _reference_loss_and_grads(arm)
  model = model_for(arm_config(arm, remat=policy))
  model_plain = model_for(arm_config(arm))
  chex.assert_trees_all_equal(
    nnx.to_pure_dict(nnx.state(model, nnx.Param)),
    nnx.to_pure_dict(nnx.state(model_plain, nnx.Param)),
  )
  tokens, targets = tokens_and_targets(8)
  loss, grads = _loss_and_grad(model, tokens, targets)
  assert float(loss) == pytest.approx(ref_loss, rel=1e-6)
  grads = jax.tree.map(np.asarray, nnx.to_pure_dict(grads))
  chex.assert_trees_all_close(grads, ref_grads, atol=1e-7, rtol=1e-5)
  assert max(np.abs(g).max() for g in jax.tree.leaves(grads)) > 0


def _zero_probs(p):
  return jnp.zeros_like(p)


_IDENTITY = Hooks(probs=lambda p: p)
_ZERO = Hooks(probs=_zero_probs)


@pytest.mark.parametrize("arm", ARMS)
def test_probability_hooks(arm):
  model = model_for(arm_config(arm))
  tokens, _ = tokens_and_targets(9)
  plain = np.asarray(forward(model, tokens))
  same = np.asarray(forward_with_hooks(model, tokens, _IDENTITY))
  np.testing.assert_allclose(same, plain, atol=1e-5, rtol=1e-5)
  zeroed = np.asarray(forward_with_hooks(model, tokens, _ZERO))
  assert np.abs(zeroed - plain).max() > 1e-3 * np.abs(plain).max()
  # With every attention map zeroed, position t sees only its own token: changing the
  # first token leaves the logits at later positions unchanged.
  other = tokens.at[:, 0].set((tokens[:, 0] + 1) % VOCAB)
  zeroed_other = np.asarray(forward_with_hooks(model, other, _ZERO))
  np.testing.assert_array_equal(zeroed_other[:, 1:], zeroed[:, 1:])
  plain_other = np.asarray(forward(model, other))
  assert np.abs(plain_other[:, 1:] - plain[:, 1:]).max() > 0


# --------------------------------------------------------------------------------------
# Lambda reported by the model.
# --------------------------------------------------------------------------------------


@nnx.jit
def _lambda_summary(model, tokens, positions, segment_ids):
  return model.lambda_summary(tokens, positions, segment_ids)


@pytest.mark.parametrize("arm", ARMS)
def test_lambda_summary_reports_each_diff_layer(arm):
  cfg = arm_config(arm, num_layers=3)
  model = model_for(cfg)
  tokens, _ = tokens_and_targets(9)
  # Two packed documents in row 0, so positions and segment ids matter.
  positions = jnp.asarray([list(range(5)) + list(range(T - 5)), list(range(T))], jnp.int32)
  segments = jnp.asarray([[1] * 5 + [2] * (T - 5), [1] * T], jnp.int32)
  got = _lambda_summary(model, tokens, positions, segments)
  without_tokens = model.lambda_summary()
  _, caps = model(tokens, positions, segments, capture=True)
  layers = range(cfg.num_layers)
  if arm == "transformer":
    assert got == {} and without_tokens == {}
  elif arm == "diff_v1":
    # lambda depends on the parameters only: the same with or without a batch.
    assert set(got) == set(without_tokens) == {f"lambda/layer_{i}" for i in layers}
    for i in layers:
      assert float(got[f"lambda/layer_{i}"]) == pytest.approx(float(caps[i]["lambda"]), abs=1e-7)
      assert float(without_tokens[f"lambda/layer_{i}"]) == pytest.approx(
        float(caps[i]["lambda"]), abs=1e-7
      )
  else:
    # lambda is per token: its mean over the batch, and nothing without one.
    assert without_tokens == {}
    assert set(got) == {f"lambda_mean/layer_{i}" for i in layers}
    for i in layers:
      want = float(jnp.mean(caps[i]["lambda"]))
      assert float(got[f"lambda_mean/layer_{i}"]) == pytest.approx(want, abs=1e-6)
      assert 0.0 < want < 1.0
    # Layers past the first see the earlier blocks' output, so the means differ.
    assert len({round(float(v), 6) for v in got.values()}) == cfg.num_layers
