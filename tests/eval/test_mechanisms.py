"""The mechanism measures: attention-sink mass, context RMS and DIFF V1's norm magnification,
against hand-computed values on constructed maps, and the model passes that feed them."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diffjax.core.reference import rms_norm
from diffjax.eval import measures
from diffjax.eval.runner import ModelRunner
from diffjax.eval.sections.mechanisms import mechanisms
from diffjax.model import DecoderLM, ModelConfig


def _uniform_causal(b, h, t, seg=None):
  valid = np.tril(np.ones((t, t), bool))[None].repeat(b, 0)
  if seg is not None:
    valid &= seg[:, :, None] == seg[:, None, :]
  a = valid / valid.sum(-1, keepdims=True)
  return np.repeat(a[:, None], h, axis=1), valid


def test_document_starts_from_segments_positions_or_neither():
  seg = np.array([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
  np.testing.assert_array_equal(measures.document_starts(seg), [[0, 0, 0, 3, 3, 5], [0] * 6])
  pos = np.array([[0, 1, 2, 0, 1, 0]])
  np.testing.assert_array_equal(measures.document_starts(positions_BxT=pos), [[0, 0, 0, 3, 3, 5]])
  np.testing.assert_array_equal(measures.document_starts(shape=(2, 3)), np.zeros((2, 3)))
  np.testing.assert_array_equal(
    measures.sink_rows(measures.document_starts(seg))[0], [False, True, True, False, True, False]
  )


def test_sink_mass_of_uniform_attention_is_the_mean_of_one_over_row_length():
  t = 7
  attn, _ = _uniform_causal(2, 3, t)
  starts = measures.document_starts(shape=(2, t))
  got = measures.sink_mass(measures.first_token_weight(attn, starts), measures.sink_rows(starts))
  # Rows 1..6 see 2..7 keys: mean of 1/2, ..., 1/7.
  want = np.mean([1.0 / (r + 1) for r in range(1, t)])
  assert got["mean"] == pytest.approx(want, rel=1e-12)
  assert got["per_head"] == pytest.approx([want] * 3, rel=1e-12)


def test_sink_mass_follows_packed_documents_and_one_hot_sinks():
  seg = np.array([[0, 0, 0, 1, 1, 1, 1]])
  attn, _ = _uniform_causal(1, 2, 7, seg)
  starts = measures.document_starts(seg)
  got = measures.sink_mass(measures.first_token_weight(attn, starts), measures.sink_rows(starts))
  # Document 1: rows 1, 2 (1/2, 1/3); document 2: rows 4, 5, 6 (1/2, 1/3, 1/4).
  assert got["mean"] == pytest.approx(np.mean([1 / 2, 1 / 3, 1 / 2, 1 / 3, 1 / 4]), rel=1e-12)
  one_hot = np.zeros_like(attn)
  one_hot[..., np.arange(7), starts[0]] = 1.0
  assert (
    measures.sink_mass(measures.first_token_weight(one_hot, starts), measures.sink_rows(starts))[
      "mean"
    ]
    == 1.0
  )
  # A DIFF map can put negative weight on the sink: A1 one-hot on it, lambda A2 more so.
  diff = one_hot - 1.5 * one_hot
  assert measures.sink_mass(measures.first_token_weight(diff, starts), measures.sink_rows(starts))[
    "mean"
  ] == pytest.approx(-0.5)
  # jax arrays take the same path (the runner computes the weights on device).
  np.testing.assert_allclose(
    np.asarray(measures.first_token_weight(jnp.asarray(attn), starts)),
    measures.first_token_weight(attn, starts),
    rtol=1e-6,
  )


def test_context_rms_of_uniform_attention_over_orthogonal_unit_values():
  """n orthogonal values of RMS 1 mixed uniformly have RMS 1/sqrt(n): the norm then magnifies
  by sqrt(n) (the V2 write-up's ~100x for near-uniform attention over 10^4 tokens)."""
  t, d = 8, 8
  v = np.sqrt(d) * np.eye(t, d)[None, :, None, :]  # [1, S, 1, D], RMS 1 each
  attn, valid = _uniform_causal(1, 1, t)
  ctx = np.einsum("bhts,bskd->bthd", attn, v)  # [1, T, 1, D]
  rows = np.arange(1, t + 1)
  np.testing.assert_allclose(measures.rms(ctx)[0, :, 0], 1.0 / np.sqrt(rows), rtol=1e-12)
  np.testing.assert_allclose(measures.visible_value_rms(v, valid)[0], np.ones(t), rtol=1e-12)
  np.testing.assert_allclose(
    measures.norm_magnification(ctx, 0.0)[0, :, 0], np.sqrt(rows), rtol=1e-12
  )
  far = np.full((1, 1, 1, d), 1.0 / math.sqrt(10_000))
  assert measures.norm_magnification(far, 1e-5)[0, 0, 0] == pytest.approx(
    100.0 / math.sqrt(1.1), rel=1e-9
  )


@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0])
def test_v2_difference_of_one_hot_maps_stays_within_sqrt2(lam):
  """A1 one-hot on key a, A2 one-hot on key b != a, orthogonal unit values: the context RMS is
  sqrt(1 + lambda^2) <= sqrt(2); with a == b it is 1 - lambda (down to 0)."""
  d = 4
  v = np.sqrt(d) * np.eye(2, d)[None, :, None, :]
  a1 = np.array([1.0, 0.0])
  for a2, want in ((np.array([0.0, 1.0]), math.sqrt(1 + lam**2)), (a1, 1 - lam)):
    ctx = np.einsum("s,sd->d", a1 - lam * a2, v[0, :, 0])
    assert measures.rms(ctx) == pytest.approx(want, abs=1e-12)
    assert measures.rms(ctx) <= math.sqrt(2) + 1e-12


def test_largest_visible_value_rms_bounds_a_convex_mix():
  v = np.zeros((1, 3, 2, 2))
  v[0, 0, 0] = [3.0, 4.0]  # RMS sqrt(12.5)
  v[0, 1, 1] = [1.0, 1.0]  # RMS 1
  valid = np.tril(np.ones((3, 3), bool))[None]
  np.testing.assert_allclose(
    measures.largest_visible_value_rms(v, valid)[0], [math.sqrt(12.5)] * 3, rtol=1e-12
  )
  late = valid & (np.arange(3)[None, None, :] > 0)  # rows that cannot see key 0
  np.testing.assert_allclose(measures.largest_visible_value_rms(v, late)[0], [0.0, 1.0, 1.0])


def test_distribution_and_gradient_ratio():
  d = measures.distribution(np.array([1.0, 2.0, 3.0, np.nan, 100.0]))
  assert d["median"] == 2.5 and d["max"] == 100.0 and d["mean"] == pytest.approx(26.5)
  assert math.isnan(measures.distribution(np.array([np.nan]))["median"])
  g_in = np.array([[[[3.0, 4.0]], [[1.0, 0.0]]]])
  g_out = np.array([[[[1.0, 0.0]], [[0.0, 0.0]]]])
  r = measures.gradient_ratio(g_in, g_out)
  assert r[0, 0, 0] == 5.0 and math.isnan(r[0, 1, 0])


def _model(arm, **kw):
  cfg = ModelConfig(
    attention=arm,
    vocab_size=23,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=48,
    **kw,
  )
  return DecoderLM(cfg, rngs=nnx.Rngs(0))


def _batch():
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, 23, (2, 13))
  seg = np.array([[0] * 5 + [1] * 8, [0] * 13])
  pos = np.array([list(range(5)) + list(range(8)), list(range(13))])
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "segment_ids": seg[:, :-1],
    "positions": pos[:, :-1],
    "loss_mask": np.ones((2, 12), np.float32),
  }


@pytest.mark.parametrize(
  "arm,kw",
  [
    ("transformer", {}),
    ("diff_v1", {}),
    ("diff_v2", {}),
    ("diff_v2", dict(v2_pairing="across_groups")),
  ],
)
def test_mechanisms_of_a_model_match_its_captured_maps(arm, kw):
  model = _model(arm, **kw)
  batch = _batch()
  out = mechanisms(ModelRunner(model), [batch])
  _, caps = model(
    jnp.asarray(batch["inputs"]),
    jnp.asarray(batch["positions"]),
    jnp.asarray(batch["segment_ids"]),
    capture=True,
  )
  starts = measures.document_starts(batch["segment_ids"])
  rows = measures.sink_rows(starts)
  for layer, cap in zip(out["layers"], caps):
    if arm == "transformer":
      combined = np.asarray(cap["probs"])
    else:
      lam = np.asarray(cap["lambda"], np.float64)
      lam = lam if lam.ndim == 0 else np.transpose(lam, (0, 2, 1))[..., None]
      combined = np.asarray(cap["probs1"], np.float64) - lam * np.asarray(cap["probs2"])
      assert layer["sink"]["a1"]["mean"] == pytest.approx(
        measures.sink_mass(measures.first_token_weight(np.asarray(cap["probs1"]), starts), rows)[
          "mean"
        ],
        rel=1e-5,
      )
    assert layer["sink"]["combined"]["mean"] == pytest.approx(
      measures.sink_mass(measures.first_token_weight(combined, starts), rows)["mean"],
      rel=1e-4,
      abs=1e-6,
    )
    ctx = np.asarray(cap["context"], np.float64)
    assert layer["context_rms"]["max"] == pytest.approx(measures.rms(ctx).max(), rel=1e-5)
    assert ("gradient_magnification" in layer) == (arm == "diff_v1")
    # A convex mix of values has at most the largest value's RMS; DIFF V2's difference with
    # sigma(lambda) < 1 at most twice it (DIFF V1's lambda is not bounded by 1).
    if arm == "transformer":
      assert layer["bounded_context_rms"]["max"] <= 1.0 + 1e-5
    if arm == "diff_v2":
      assert layer["bounded_context_rms"]["max"] < 2.0
  if arm == "transformer":
    assert out["summary"]["above_sqrt2"] == 0.0


def test_v1_norm_gradients_are_the_chain_rule_through_its_norm():
  """The gradient the taps read before the norm is the norm's vector-Jacobian product of the
  gradient they read after it, at the captured head outputs: the taps sit on either side of
  the norm, layer by layer."""
  model = _model("diff_v1")
  batch = _batch()
  runner = ModelRunner(model)
  grads = runner.norm_gradients(
    batch["inputs"], batch["targets"], batch["positions"], batch["segment_ids"], batch["loss_mask"]
  )
  _, caps = model(
    jnp.asarray(batch["inputs"]),
    jnp.asarray(batch["positions"]),
    jnp.asarray(batch["segment_ids"]),
    capture=True,
  )
  for i, ((g_pre, g_post), cap) in enumerate(zip(grads, caps)):
    attn = model.layer(i).attn
    _, vjp = jax.vjp(lambda x: rms_norm(x, attn.norm_scale[...], attn.norm_eps), cap["context"])
    (want,) = vjp(jnp.asarray(g_post))
    np.testing.assert_allclose(g_pre, np.asarray(want), rtol=2e-4, atol=1e-7)
    assert np.abs(g_post).max() > 0
  with pytest.raises(ValueError, match="DIFF V1"):
    ModelRunner(_model("transformer")).norm_gradients(
      batch["inputs"], batch["targets"], None, None, batch["loss_mask"]
    )


def test_mechanisms_is_skipped_without_validation_batches():
  from diffjax.eval.config import EvalConfig  # pylint: disable=import-outside-toplevel
  from diffjax.eval.evaluate import evaluate_model  # pylint: disable=import-outside-toplevel

  lines = []
  cfg = EvalConfig(context_len=256, sections=("mechanisms",))
  out = evaluate_model(_model("diff_v1"), [], cfg, log=lines.append)
  assert out["sections"] == {} and out["scalars"] == {}
  assert lines == ["skipping mechanisms: no validation batches"]
  # val_batches=0 keeps none of the batches given: the same.
  cfg0 = EvalConfig(context_len=256, sections=("mechanisms",), val_batches=0)
  assert evaluate_model(_model("diff_v1"), [_batch()], cfg0)["sections"] == {}
