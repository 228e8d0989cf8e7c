"""grad_accum_reduce="step" on the layouts XLA cannot partition per data shard: it runs as
"micro_batch", says so once, and gives the same step (on the test process's 8 CPU devices,
tests/conftest.py)."""

import jax
import numpy as np
import optax
import pytest

from diffjax import sharding as shd
from diffjax.model import ModelConfig
from diffjax.train import steps as steps_lib
from diffjax.train.setup import with_mesh_rules


@pytest.mark.parametrize(
  "shape, falls_back",
  [
    ((2, 2, 2, 1), True),
    ((2, 2, 1, 2), True),
    ((2, 1, 2, 2), False),
    ((2, 2, 1, 1), False),
    ((2, 4, 1, 1), False),
    ((4, 1, 1, 2), False),
  ],
)
def test_the_layouts_that_fall_back_are_those_with_a_shared_table_and_token_axis(shape, falls_back):
  mesh = shd.make_mesh(shape, jax.devices()[: int(np.prod(shape))])
  with shd.activation_sharding(mesh, shd.DEFAULT_RULES):
    inner = shd.data_shard_rules()
  assert inner is not None
  assert (steps_lib.step_reduce_fallback(mesh, inner) is not None) == falls_back
  # Without fsdp on the table (or on the rows) the same mesh sums per data shard.
  for name, axes in (("embed", None), ("batch", "data")):
    rules = shd.rules_from_config([[name, axes]])
    with shd.activation_sharding(mesh, rules):
      inner = shd.data_shard_rules()
    assert inner is None or steps_lib.step_reduce_fallback(mesh, inner) is None


def test_a_step_reduction_that_falls_back_says_so_once_and_gives_the_micro_batch_step(
  monkeypatch, capsys
):
  cfg = ModelConfig(
    attention="diff_v1",
    d_model=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=64,
    vocab_size=50,
  )
  graphdef, state = steps_lib.init_state(cfg, optax.sgd(1.0), seed=0)
  rng = np.random.default_rng(0)
  batch = {
    "inputs": rng.integers(0, 50, (8, 8)).astype(np.int32),
    "targets": rng.integers(0, 50, (8, 8)).astype(np.int32),
    "segment_ids": np.ones((8, 8), np.int32),
    "positions": np.tile(np.arange(8, dtype=np.int32), (8, 1)),
    "loss_mask": np.ones((8, 8), np.float32),
  }
  mesh = shd.make_mesh((2, 2, 2, 1))
  monkeypatch.setattr(steps_lib, "_NOTED", set())
  per_shard = []
  real = steps_lib._accumulate_per_data_shard  # pylint: disable=protected-access
  monkeypatch.setattr(
    steps_lib, "_accumulate_per_data_shard", lambda *a: per_shard.append(1) or real(*a)
  )

  def after(reduce):
    step = steps_lib.make_train_step(graphdef, optax.sgd(1.0), lambda s: 1.0, 2, reduce)
    new, metrics = jax.jit(with_mesh_rules(step, mesh, shd.DEFAULT_RULES))(state, batch)
    return jax.tree.leaves(new["params"]), float(metrics["loss"])

  got, loss = after("step")
  after_again = after("step")  # traced again: no second note
  want, want_loss = after("micro_batch")
  assert not per_shard
  notes = [l for l in capsys.readouterr().err.splitlines() if l.startswith("note:")]
  assert len(notes) == 1, notes
  assert "grad_accum_reduce='step' runs as 'micro_batch'" in notes[0]
  assert "fsdp splits both the embedding table and the tokens while tensor is larger" in notes[0]
  assert loss == want_loss == after_again[1]
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
