"""diffjax.eval.runner: weight quantization of a model and the quantization knobs of its runner."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from diffjax.eval import evaluate

# flax warns about its own deprecated metadata names when models are built; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_weight_quantization_is_per_output_channel_and_leaves_the_original(runners):
  model = runners["diff_v1"].model
  q = evaluate.quantize_model_weights(model, 4)
  w = np.asarray(model.blocks[0].attn.o[...])  # (H, 2d, E): output axis last
  qw = np.asarray(q.blocks[0].attn.o[...])
  np.testing.assert_allclose(np.abs(qw).max(axis=(0, 1)), np.abs(w).max(axis=(0, 1)), rtol=1e-6)
  levels = qw / (np.abs(w).max(axis=(0, 1)) / 7)
  np.testing.assert_allclose(levels, np.round(levels), atol=1e-3)
  wq = np.asarray(model.blocks[1].attn.q[...])  # (E, H, 2, d): input axis first
  np.testing.assert_allclose(
    np.abs(np.asarray(q.blocks[1].attn.q[...])).max(0), np.abs(wq).max(0), rtol=1e-6
  )
  np.testing.assert_array_equal(q.embed.embedding[...], model.embed.embedding[...])
  np.testing.assert_array_equal(q.lm_head[...], model.lm_head[...])
  np.testing.assert_array_equal(
    np.asarray(q.blocks[0].attn.lambda_q1[...]), np.asarray(model.blocks[0].attn.lambda_q1[...])
  )
  assert not np.array_equal(np.asarray(model.blocks[0].attn.o[...]), qw)


def test_weight_quantization_is_the_same_for_scanned_and_unrolled_models():
  """The scanned model's stacked kernels are quantized per layer, its stacked norm gains and
  lambda vectors not at all: the result is the unrolled model's, stacked."""
  from flax import nnx

  from diffjax.model import DecoderLM, ModelConfig, layout

  cfg = ModelConfig(
    attention="diff_v1",
    vocab_size=40,
    d_model=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=40,
  )
  plain = nnx.to_pure_dict(
    nnx.state(
      evaluate.quantize_model_weights(DecoderLM(cfg, rngs=nnx.Rngs(params=0)), 4), nnx.Param
    )
  )
  scanned = nnx.to_pure_dict(
    nnx.state(
      evaluate.quantize_model_weights(
        DecoderLM(cfg.replace(scan_layers=True), rngs=nnx.Rngs(params=0)), 4
      ),
      nnx.Param,
    )
  )
  for a, b in zip(jax.tree.leaves(layout.stack_layers(plain)), jax.tree.leaves(scanned)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_knobs_off_match_the_plain_model_and_quantization_changes_it(runners, text_batches):
  tokens = text_batches[0][:, :-1]
  for arm in ("transformer", "diff_v2"):
    runner = runners[arm]
    plain = runner.logits_fn()(tokens)
    np.testing.assert_allclose(runner.knob_fn()(tokens), plain, atol=2e-5)
    np.testing.assert_allclose(runner.knob_fn(knobs={"logits_bits": 16})(tokens), plain, atol=1e-3)
    assert np.abs(runner.knob_fn(knobs={"logits_bits": 2})(tokens) - plain).max() > 1e-4
    assert np.abs(runner.knob_fn(knobs={"kv_bits": 2})(tokens) - plain).max() > 1e-4
  with pytest.raises(ValueError, match="Unknown knob"):
    runner.knob_fn(knobs={"bits": 4})
