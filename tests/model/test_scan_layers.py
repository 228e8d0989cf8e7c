"""Scanned layers: the same parameters and function as the unrolled model, per-layer
lambda_init carried as data, and checkpoints that load across the two layouts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import small_model_config
from kernel_checks import rel_err

from diffjax import sharding as shd
from diffjax.model import DecoderLM, ModelConfig, layout
from diffjax.nn.layers import Hooks
from diffjax.train import checkpoint as ckpt
from diffjax.train.loading import load_model
from diffjax.train.setup import build_train_setup

ARMS = ("transformer", "diff_v1", "diff_v2")
OPTIM = dict(
  lr=1e-3,
  min_lr=0.0,
  warmup_steps=0,
  schedule="constant",
  decay_steps=10,
  b1=0.9,
  b2=0.95,
  weight_decay=0.1,
  eps=1e-8,
  clip_norm=1.0,
)


def pair(arm: str, **kw) -> tuple[DecoderLM, DecoderLM]:
  cfg = small_model_config(arm, **kw)
  return (
    DecoderLM(cfg, rngs=nnx.Rngs(params=3)),
    DecoderLM(cfg.replace(scan_layers=True), rngs=nnx.Rngs(params=3)),
  )


def tokens(b=2, t=11, seed=0):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, 40)


def max_rel(a, b) -> float:
  """max |a - b| / max |a|."""
  return rel_err(b, a)


@pytest.mark.parametrize("arm", ARMS)
def test_scanned_model_has_the_same_parameters_and_outputs(arm):
  plain, scanned = pair(arm)
  p_plain = nnx.to_pure_dict(nnx.state(plain))
  p_scan = nnx.to_pure_dict(nnx.state(scanned))
  assert "blocks" not in p_scan and p_scan["layers"]["attn"]["o"].shape[0] == 3
  # Same initial draws: stacking the unrolled model's blocks gives the scanned tree.
  stacked = layout.stack_layers(p_plain)
  for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(p_scan)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  x = tokens()
  seg = jnp.asarray([[1] * 5 + [2] * 6, [1] * 11])
  pos = jnp.asarray([list(range(5)) + list(range(6)), list(range(11))])
  assert max_rel(plain(x, pos, seg), scanned(x, pos, seg)) < 1e-6


@pytest.mark.parametrize(
  "arm,remat",
  [
    pytest.param("transformer", "none", marks=pytest.mark.slow),
    ("diff_v1", "dots"),
    pytest.param("diff_v2", "full", marks=pytest.mark.slow),
  ],
)
def test_scanned_gradients_match_per_layer(arm, remat):
  plain, scanned = pair(arm, remat=remat)
  x, y = tokens(seed=1), tokens(seed=2)

  def loss(m):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(m(x), y))

  grad = nnx.jit(nnx.grad(loss))  # one program each, not op by op
  g_plain = layout.stack_layers(nnx.to_pure_dict(grad(plain)))
  g_scan = nnx.to_pure_dict(grad(scanned))
  names = jax.tree_util.tree_flatten_with_path(g_scan)[0]
  assert len(names) == len(jax.tree.leaves(g_plain))
  for (path, b), a in zip(names, jax.tree.leaves(g_plain)):
    assert max_rel(a, b) < 1e-5, path


def test_diff_v1_lambda_init_follows_the_layer():
  plain, scanned = pair("diff_v1")
  want = [0.8 - 0.6 * np.exp(-0.3 * i) for i in range(3)]
  _, caps = scanned(tokens(), capture=True)
  np.testing.assert_allclose([float(c["lambda_init"]) for c in caps], want, rtol=1e-6)
  assert [scanned.layer(i).attn.lambda_init for i in range(3)] == pytest.approx(want)
  s_plain, s_scan = plain.lambda_summary(), scanned.lambda_summary()
  assert s_plain.keys() == s_scan.keys() and len(s_scan) == 3
  for k in s_plain:
    assert float(s_plain[k]) == pytest.approx(float(s_scan[k]), rel=1e-6)
  # Layer 2's lambda differs from layer 0's by lambda_init alone at the same vectors:
  # a model that ran every scanned layer with layer 0's lambda_init would fail above.
  assert want[2] - want[0] > 0.2


@pytest.mark.parametrize("arm", ["diff_v1", "diff_v2"])
def test_capture_and_hooks_work_inside_the_scan(arm):
  plain, scanned = pair(arm)
  x = tokens(seed=4)
  hooks = Hooks(logits=lambda s: jnp.round(s * 8) / 8, kv=lambda a: a * 0.5)
  (l_plain, c_plain), (l_scan, c_scan) = (m(x, capture=True, hooks=hooks) for m in (plain, scanned))
  assert max_rel(l_plain, l_scan) < 1e-5
  assert len(c_scan) == 3
  for a, b in zip(c_plain, c_scan):
    assert a.keys() == b.keys()
    for k in a:
      assert max_rel(a[k], b[k]) < 1e-5, k
  # The hooks ran: the unhooked model gives other logits.
  assert max_rel(scanned(x), l_scan) > 1e-3


@pytest.mark.slow  # tests/generation/test_generate.py covers the cache on unrolled models by default
def test_generation_cache_runs_on_a_scanned_model():
  plain, scanned = pair("diff_v1")
  x = tokens(b=2, t=6, seed=5)
  outs = []
  for m in (plain, scanned):
    cache = m.init_cache(2, 8)
    logits, cache = m(x, cache=cache, cache_lengths_B=jnp.zeros((2,), jnp.int32))
    nxt = jnp.argmax(logits[:, -1:], -1)
    step, _ = m(nxt, jnp.full((2, 1), 6), cache=cache, cache_lengths_B=jnp.full((2,), 6))
    outs.append(step)
  assert max_rel(outs[0], outs[1]) < 1e-5


def test_stacked_parameters_lead_with_an_unsharded_layers_axis():
  _, scanned = pair("diff_v1")
  specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(scanned)))
  assert tuple(specs["layers"]["attn"]["q"]) == ("layers", "embed", "heads", None, "head_dim")
  assert tuple(specs["embed"]["embedding"]) == ("vocab", "embed")
  spec = shd.logical_to_spec(tuple(specs["layers"]["attn"]["q"]), shd.DEFAULT_RULES)
  assert spec[0] is None and spec[1] == "fsdp" and spec[2] == "tensor"


def test_layout_conversion_round_trips_and_refuses_bad_trees():
  plain, _ = pair("transformer")
  tree = {"params": nnx.to_pure_dict(nnx.state(plain)), "step": jnp.zeros(())}
  tree["opt"] = (optax.EmptyState(), {"mu": tree["params"]})
  stacked = layout.stack_layers(tree)
  assert layout.tree_layout(stacked) == "layers" and layout.tree_layout(tree) == "blocks"
  assert layout.num_layers_of(stacked) == 3 == layout.num_layers_of(tree)
  back = layout.unstack_layers(stacked, 3)
  assert jax.tree.structure(back) == jax.tree.structure(tree)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert layout.convert_layout(tree, "blocks", 3) is tree
  with pytest.raises(ValueError, match="num_layers=4"):
    layout.unstack_layers(stacked, 4)
  with pytest.raises(ValueError, match="both"):
    layout.tree_layout({"a": {"blocks": {}}, "b": {"layers": {}}})
  assert layout.names_layout(["params/blocks/0/attn/q"]) == "blocks"
  assert layout.names_layout(["opt_state/0/mu/layers/attn/q", "step"]) == "layers"


def _setup(cfg: ModelConfig):
  mesh = shd.make_mesh((1, 1, 1), jax.devices()[:1])
  import ml_collections  # pylint: disable=import-outside-toplevel

  return build_train_setup(
    cfg, ml_collections.ConfigDict(OPTIM), seed=0, mesh=mesh, rules=shd.DEFAULT_RULES
  )


def _batch(seed: int) -> dict:
  x = np.asarray(tokens(b=2, t=12, seed=seed), np.int32)
  return {
    "inputs": x,
    "targets": np.roll(x, -1, axis=1),
    "segment_ids": np.ones_like(x),
    "positions": np.tile(np.arange(12, dtype=np.int32), (2, 1)),
    "loss_mask": np.ones(x.shape, np.float32),
  }


# Saving unrolled and restoring scanned, then loading that checkpoint unrolled, converts
# both ways; -m slow adds the scanned writer.
@pytest.mark.integration
@pytest.mark.parametrize("save_scanned", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_checkpoints_load_across_layouts(tmp_path, save_scanned):
  cfg = small_model_config("diff_v1")
  saver = _setup(cfg.replace(scan_layers=save_scanned))
  loader = _setup(cfg.replace(scan_layers=not save_scanned))
  state = saver.init_fn()
  state, _ = saver.train_step(state, _batch(0))
  directory = str(tmp_path / "checkpoints")
  manager = ckpt.make_manager(directory, keep=2, async_save=False)
  meta = {"model_config": cfg.replace(scan_layers=save_scanned).to_dict()}
  ckpt.save(manager, 1, state, None, meta)
  manager.wait_until_finished()
  messages = []
  step, restored = ckpt.restore_newest_good(
    manager,
    loader.abstract_state,
    None,
    check_meta=lambda m: ckpt.check_model_config(
      m["model_config"], cfg.replace(scan_layers=not save_scanned).to_dict(), directory
    ),
    message=messages.append,
  )
  manager.close()
  assert step == 1 and not messages
  want = "blocks" if save_scanned else "layers"
  assert layout.tree_layout(restored) == want
  converted = layout.convert_layout(jax.tree.map(np.asarray, state), want, 3)
  assert jax.tree.structure(converted) == jax.tree.structure(restored)
  for a, b in zip(jax.tree.leaves(converted), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Analysis loads either layout as an unscanned model with the same parameters.
  model, _, _ = load_model(str(tmp_path))
  assert not model.config.scan_layers
  unrolled = layout.convert_layout(jax.tree.map(np.asarray, state["params"]), "blocks", 3)
  got = nnx.to_pure_dict(nnx.state(model))
  for a, b in zip(jax.tree.leaves(unrolled), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Training continues from the converted state as it does from the saved one.
  _, m_saved = saver.train_step(state, _batch(1))
  _, m_loaded = loader.train_step(restored, _batch(1))
  assert float(m_saved["loss"]) == pytest.approx(float(m_loaded["loss"]), rel=1e-5)
