"""Training through the fused kernels (interpreted) matches the XLA path.

The gradient of the model's loss with respect to every parameter is compared leaf by leaf:
AdamW normalises each update by the gradient's running scale, so a loss curve is blind to a
gradient that is wrong by a constant factor (a dK twice too large trains the same), while the
gradients themselves are not. A kernel with a deliberately doubled dK must fail the check.
"""

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from kernel_checks import rel_err

from diffjax.model import DecoderLM, ModelConfig
from diffjax.ops import dispatch
from diffjax.presets import base_config
from diffjax.train.optim import make_optimizer
from diffjax.train.steps import init_state, loss_sums, make_train_step, split_params

STEPS = 3
# Per-step loss agreement, float32: the kernels reorder the softmax sums (online
# softmax over key blocks), so equality is to rounding, compounded over steps.
LOSS_RTOL = 2e-4
# Per-leaf gradient agreement, float32, relative to the leaf's largest entry.
GRAD_RTOL = 1e-4


def _cfg(arm, implementation):
  return ModelConfig(
    attention=arm,
    vocab_size=64,
    d_model=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    mlp_dim=64,
    implementation=implementation,
    interpret=implementation != "xla",
  )


def _batch():
  rng = np.random.default_rng(1)
  seg = np.array([[1] * 20 + [2] * 12, [1] * 32], np.int32)
  pos = np.array([list(range(20)) + list(range(12)), list(range(32))], np.int32)
  return {
    "inputs": rng.integers(0, 64, (2, 32)).astype(np.int32),
    "targets": rng.integers(0, 64, (2, 32)).astype(np.int32),
    "segment_ids": seg,
    "positions": pos,
    "loss_mask": np.ones((2, 32), np.float32),
  }


@functools.cache
def _xla_grads(arm) -> dict:
  return _grads(arm, "xla")


def _grads(arm, implementation) -> dict:
  """The gradient of the mean token loss with respect to every parameter."""
  graphdef, params = split_params(DecoderLM(_cfg(arm, implementation), rngs=nnx.Rngs(params=0)))

  def loss(p):
    total, count = loss_sums(graphdef, p, _batch())
    return total / count

  return jax.tree.map(np.asarray, jax.jit(jax.grad(loss))(params))


def _grad_errors(got: dict, want: dict) -> dict[str, float]:
  flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
  flat_want = jax.tree.leaves(want)
  return {jax.tree_util.keystr(path): rel_err(a, b) for (path, a), b in zip(flat_got, flat_want)}


def _doubled_dk(fn, k_index):
  """``fn`` with the same output and twice the true cotangent of argument ``k_index`` (dK):
  a second call through which only that argument is differentiated adds its gradient again."""

  def mutated(*arrays, **kw):
    sg = jax.lax.stop_gradient
    only_k = [a if i == k_index else sg(a) for i, a in enumerate(arrays)]
    extra = fn(*only_k, **kw)
    return fn(*arrays, **kw) + (extra - sg(extra))

  return mutated


@pytest.mark.integration  # the interpreted TPU kernels through a whole model
@pytest.mark.parametrize("arm", ["diff_v1", "diff_v2"])
def test_kernel_gradients_match_xla_for_every_parameter(arm):
  want = _xla_grads(arm)
  errs = _grad_errors(_grads(arm, "pallas_tpu"), want)
  bad = {k: e for k, e in errs.items() if not e <= GRAD_RTOL}
  assert not bad, bad
  for leaf in jax.tree.leaves(want):
    assert np.all(np.isfinite(leaf)) and np.max(np.abs(leaf)) > 0


@pytest.mark.integration
@pytest.mark.parametrize("arm", ["diff_v1", "diff_v2"])
def test_a_kernel_with_a_doubled_dk_fails_the_gradient_check(arm, monkeypatch):
  (row,) = [r for r in dispatch.rows(arm) if r.name == "pallas_tpu"]
  k_index = dispatch.OPS[arm].keys[0]  # V1: q1, q2, k1, k2, v, lam; V2: q, k, v, lam
  monkeypatch.setattr(dispatch, "_TABLE", {k: list(v) for k, v in dispatch._TABLE.items()})
  dispatch.register_implementation(arm, "pallas_tpu", _doubled_dk(row.fn, k_index), row.platforms)
  errs = _grad_errors(_grads(arm, "pallas_tpu"), _xla_grads(arm))
  bad = {k for k, e in errs.items() if not e <= GRAD_RTOL}
  # dK feeds the key projection of every layer, and through the residual stream all that
  # precedes it: the check must see the key kernels at least.
  assert {k for k in bad if "['attn']['k']" in k} == {
    f"['blocks'][{i}]['attn']['k']" for i in range(2)
  }, bad


def _losses(arm, implementation):
  cfg = _cfg(arm, implementation)
  ocfg = base_config().optim
  ocfg.update(dict(lr=3e-3, warmup_steps=0, decay_steps=10))
  tx, schedule = make_optimizer(ocfg, cfg)
  graphdef, state = init_state(cfg, tx, seed=0)
  step = jax.jit(make_train_step(graphdef, tx, schedule))
  batch = _batch()  # one fixed batch, so the loss must fall step after step
  losses = []
  for _ in range(STEPS):
    state, m = step(state, batch)
    losses.append(float(m["loss"]))
  return losses


# Whole training steps through the TPU kernels in the interpreter: the gradient checks above
# already cover what they compute, so these run with -m slow.
@pytest.mark.slow
@pytest.mark.parametrize("arm", ["diff_v1", "diff_v2"])
def test_kernel_training_matches_xla(arm):
  ref = _losses(arm, "xla")
  got = _losses(arm, "pallas_tpu")
  np.testing.assert_allclose(got, ref, rtol=LOSS_RTOL, err_msg=f"{arm} via pallas_tpu")
  assert ref[-1] < ref[0]  # the steps really train
