"""Weight decay by what a parameter is: scanned and unrolled models decay the same leaves.

Each check is also run with the rank rule that decided decay before (``ndim >= 2``), and must
fail with it: a scanned model stacks every per-layer vector into an ``(L, d)`` array.
"""

from __future__ import annotations

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import REPO, small_model_config  # noqa: E402
from kernel_checks import rel_err

from diffjax import presets
from diffjax.model import ARMS, DecoderLM, ModelConfig, layout, resolve_model
from diffjax.model.sizes import SWEEP_SIZES
from diffjax.train import steps as steps_lib
from diffjax.train.optim import decay_mask, make_optimizer, model_decay_mask

# Leaves that are per-channel vectors in every arm that has them.
VECTORS = {"scale", "norm_scale", "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"}


def rank_mask(params):
  """The rule this project used before: decay every array of rank 2 or more."""
  return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def abstract_params(cfg: ModelConfig) -> dict:
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(params=0)))
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def flat(tree) -> dict[tuple, object]:
  return {
    tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path): leaf
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def unrolled_to_scanned_paths(tree_unrolled: dict) -> dict[tuple, set]:
  """For each scanned leaf path ("layers", ...), the set of values its unrolled leaves have."""
  out: dict[tuple, set] = {}
  for path, v in flat(tree_unrolled).items():
    key = ("layers", *path[2:]) if path[0] == "blocks" else path
    out.setdefault(key, set()).add(bool(v))
  return out


def layout_mismatches(mask_fn, cfg: ModelConfig) -> list[str]:
  """Leaves whose decay differs between the unrolled and the scanned model of ``cfg``."""
  plain = unrolled_to_scanned_paths(mask_fn(cfg.replace(scan_layers=False)))
  scanned = {p: bool(v) for p, v in flat(mask_fn(cfg.replace(scan_layers=True))).items()}
  assert set(plain) == set(scanned)
  return sorted("/".join(map(str, p)) for p in scanned if plain[p] != {scanned[p]})


MASKS = {"roles": model_decay_mask, "rank": lambda cfg: rank_mask(abstract_params(cfg))}


@pytest.mark.parametrize("arm", ARMS)
def test_scanned_and_unrolled_models_decay_the_same_leaves(arm):
  cfg = small_model_config(arm)
  assert layout_mismatches(MASKS["roles"], cfg) == []
  # The rank rule decays the stacked norm gains (and V1's lambda and norm gain) when scanned.
  bad = layout_mismatches(MASKS["rank"], cfg)
  expected = {"layers/attn_norm/scale", "layers/mlp_norm/scale"}
  if arm == "diff_v1":
    expected |= {f"layers/attn/{n}" for n in VECTORS - {"scale"}}
  assert set(bad) == expected


@pytest.mark.parametrize("arm", ARMS)
def test_the_decay_set_is_the_weight_matrices(arm):
  for scan in (False, True):
    mask = flat(model_decay_mask(small_model_config(arm, scan_layers=scan)))
    for path, decayed in mask.items():
      assert decayed == (path[-1] not in VECTORS), (path, decayed)
  # DIFF V2's W_lambda is a projection E -> h: decayed like the others.
  if arm == "diff_v2":
    assert flat(model_decay_mask(small_model_config(arm)))[("blocks", 0, "attn", "w_lambda")]


def _zero_grad_update(mask, params, weight_decay=0.1):
  tx = optax.adamw(1e-2, weight_decay=weight_decay, mask=mask)

  @jax.jit
  def update(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    return optax.apply_updates(params, updates)

  return update(params)


@pytest.mark.parametrize("arm", ("diff_v1", "diff_v2"))
def test_a_zero_gradient_step_leaves_norm_gains_and_lambda_unchanged(arm):
  for scan in (False, True):
    cfg = small_model_config(arm, scan_layers=scan)
    params = nnx.to_pure_dict(nnx.state(DecoderLM(cfg, rngs=nnx.Rngs(params=1)), nnx.Param))
    new = flat(_zero_grad_update(model_decay_mask(cfg), params))
    old = flat(params)
    for path in old:
      if path[-1] in VECTORS:
        np.testing.assert_array_equal(
          np.asarray(new[path]), np.asarray(old[path]), err_msg=str(path)
        )
      else:  # decay moves every matrix towards zero
        assert float(jnp.max(jnp.abs(new[path] - old[path]))) > 0, path
    # The rank rule moves the stacked vectors of the scanned model.
    moved = [
      p
      for p, v in flat(_zero_grad_update(rank_mask(params), params)).items()
      if p[-1] in VECTORS and not np.array_equal(np.asarray(v), np.asarray(old[p]))
    ]
    assert bool(moved) == scan, moved


def _train(cfg: ModelConfig, steps: int, mask_fn=None) -> dict:
  """``steps`` AdamW steps (weight decay 0.1) of ``cfg`` on fixed random batches."""
  ocfg = presets.base_config().optim
  ocfg.update(
    dict(lr=3e-3, min_lr=0.0, warmup_steps=0, schedule="constant", decay_steps=10, weight_decay=0.1)
  )
  graphdef, params = steps_lib.split_params(DecoderLM(cfg, rngs=nnx.Rngs(params=0)))
  tx, schedule = make_optimizer(ocfg, cfg if mask_fn is None else mask_fn(params))
  step = jax.jit(steps_lib.make_train_step(graphdef, tx, schedule))
  state = {
    "params": params,
    "opt_state": tx.init(params),
    "step": jnp.zeros((), jnp.int32),
    "rng": jax.random.key_data(jax.random.key(0)),
  }
  rng = np.random.default_rng(0)
  for _ in range(steps):
    batch = {
      "inputs": rng.integers(0, 40, (4, 16)).astype(np.int32),
      "targets": rng.integers(0, 40, (4, 16)).astype(np.int32),
      "segment_ids": np.ones((4, 16), np.int32),
      "positions": np.tile(np.arange(16, dtype=np.int32), (4, 1)),
      "loss_mask": np.ones((4, 16), np.float32),
    }
    state, metrics = step(state, batch)
    chex.assert_tree_all_finite(metrics)
  return jax.tree.map(np.asarray, state["params"])


def _max_rel_diff(mask=None, arm="diff_v1", steps=4) -> float:
  plain = _train(small_model_config(arm), steps, mask)
  scanned = layout.unstack_layers(_train(small_model_config(arm, scan_layers=True), steps, mask), 3)
  return max(rel_err(b, a) for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(scanned)))


@pytest.mark.integration  # whole training runs
# DIFF V1 (norm gains, its norm scale and λ vectors) and V2 (its λ projection) carry the
# leaves the rank rule got wrong; the baseline's norm gains are the same kind as theirs.
@pytest.mark.parametrize(
  "arm", [pytest.param("transformer", marks=pytest.mark.slow), "diff_v1", "diff_v2"]
)
def test_scanned_and_unrolled_runs_reach_the_same_parameters(arm):
  # Float32 round-off only: the two layouts run the same arithmetic in another order.
  assert _max_rel_diff(arm=arm) < 1e-5


@pytest.mark.integration  # whole training runs
def test_scanned_and_unrolled_runs_differ_under_the_rank_rule():
  # The same comparison fails with the rank rule: decay pulls the scanned norm gains down.
  assert _max_rel_diff(mask=rank_mask) > 1e-4


def _preset_models() -> list[tuple[str, ModelConfig]]:
  configs = os.path.join(REPO, "configs")
  runs = [
    ("paper_3b", presets.load_config(os.path.join(configs, "paper_3b.py"))),
    ("paper_3b_64k", presets.load_config(os.path.join(configs, "paper_3b_64k.py"))),
  ]
  runs += [
    (f"paper_sweep {s}", presets.load_config(os.path.join(configs, "paper_sweep.py"), s))
    for s in SWEEP_SIZES
  ]
  out = []
  for name, run in runs:
    for arm in ARMS:
      out.append((f"{name} {arm}", resolve_model({**run.model.to_dict(), "arm": arm}).config))
  return out


def test_paper_presets_decay_the_same_leaves_as_their_unrolled_versions():
  """Every scanned paper preset decays exactly the leaves its unrolled version decays.

  The mask depends on the arm and the structure options, not on the widths, so each preset
  is checked at its own options with two layers of width 64 (abstract shapes of a 13B model
  take minutes to build on two cores).
  """
  models = _preset_models()
  assert all(cfg.scan_layers for _, cfg in models)
  for name, cfg in models:
    shrunk = cfg.replace(
      d_model=64,
      num_layers=2,
      mlp_dim=96,
      vocab_size=64,
      num_heads=min(cfg.num_heads, 4),
      num_kv_heads=min(cfg.num_kv_heads, 4),
      head_dim=16,
      dtype="float32",
    )
    assert layout_mismatches(MASKS["roles"], shrunk) == [], name
    assert layout_mismatches(MASKS["rank"], shrunk), name


def test_a_parameter_without_logical_names_is_refused():
  state = nnx.State({"w": nnx.Param(jnp.ones((2, 2)))})
  with pytest.raises(ValueError, match="w has no logical axis names"):
    decay_mask(state)
