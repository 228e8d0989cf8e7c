"""Context parallelism in the model: the LM's loss and every parameter gradient on meshes
that shard the sequence over ``context`` equal the single-device ones.

The sharded checks run on the test process's 8 CPU devices (tests/conftest.py), in the
integration tier (one compile per mesh). Mesh shapes are (data, fsdp, tensor, context).
Batches hold packed documents whose boundaries fall inside and across the context shards;
the load-balanced (zig-zag) order is applied by the train step's own wrapper
(``diffjax.train.setup.with_mesh_rules``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffjax import sharding as shd
from diffjax.model import ModelConfig, matched_configs
from diffjax.presets import base_config
from diffjax.train.config_utils import check_config
from diffjax.train.setup import build_train_setup, with_mesh_rules
from diffjax.train.steps import create_model, loss_sums, split_params

TOL = 1e-5
B, T = 4, 32
sharded = pytest.mark.integration  # one compile per mesh

BASE = ModelConfig(
  attention="transformer",
  vocab_size=48,
  d_model=32,
  num_layers=2,
  num_heads=4,
  num_kv_heads=4,
  head_dim=8,
  mlp_dim=48,
)
ARMS = matched_configs(BASE, v2_match="heads")
MESHES = ((1, 1, 1, 8), (2, 1, 2, 2), (1, 2, 1, 4))
STRATEGIES = ("ring", "all_gather")
# The default run: every arm, mesh and strategy appears once; the rest of the grid (and the
# sequential order, which tests/ops/test_context_parallel.py checks at the op level) is slow.
FAST = [
  ("transformer", MESHES[0], "ring"),
  ("diff_v1", MESHES[1], "ring"),
  ("diff_v2", MESHES[2], "all_gather"),
]
SLOW = [(a, m, s) for a in ARMS for m in MESHES for s in STRATEGIES if (a, m, s) not in FAST]


def packed_batch(seed: int = 0) -> dict[str, np.ndarray]:
  """Rows of packed documents of random lengths (boundaries anywhere), the last one
  padded with loss_mask 0; positions restart at every document."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((B, T), np.int32)
  pos = np.zeros((B, T), np.int32)
  for b in range(B):
    t, doc = 0, 1
    while t < T:
      n = int(rng.integers(3, 14))
      seg[b, t : t + n], pos[b, t : t + n] = doc, np.arange(min(n, T - t))
      t, doc = t + n, doc + 1
  toks = rng.integers(0, BASE.vocab_size, size=(B, T + 1)).astype(np.int32)
  mask = np.ones((B, T), np.float32)
  mask[-1, -5:] = 0.0
  return {
    "inputs": toks[:, :-1],
    "targets": toks[:, 1:],
    "segment_ids": seg,
    "positions": pos,
    "loss_mask": mask,
  }


def mean_loss_and_grads(cfg: ModelConfig, mesh_shape, strategy: str, load_balance: bool = True):
  graphdef, params = split_params(create_model(cfg, 0))

  def f(p, batch):
    def loss(p):
      total, count = loss_sums(graphdef, p, batch)
      return total / count

    return jax.value_and_grad(loss)(p)

  if mesh_shape is None:
    return jax.jit(f)(params, packed_batch())
  n = int(np.prod(mesh_shape))
  mesh = shd.make_mesh(mesh_shape, devices=jax.devices()[:n])
  rules = shd.DEFAULT_RULES
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  fn = jax.jit(
    with_mesh_rules(f, mesh, rules, context_strategy=strategy, context_load_balance=load_balance),
    in_shardings=(replicated, shd.batch_sharding(mesh, rules)),
  )
  return fn(params, packed_batch())


# Errors are max|sharded - single| over a leaf, relative to the leaf's max|single|, but at
# least FLOOR x the largest gradient of the model: DIFF V1's lambda vectors get gradients
# ~1e-4 of the largest, sums over every token with heavy cancellation, where float32 alone
# puts each path ~3e-6 / ~7e-6 (of the leaf's size) from the float64 value.
FLOOR = 1e-2


def max_rel(a, b, floor: float = 0.0) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), floor, 1e-30))


def check(arm: str, mesh_shape, strategy: str, load_balance: bool = True, **model_kw) -> None:
  """The sharded model (``model_kw`` replaced in its config) against the same model on one
  device with the XLA attention."""
  cfg = ARMS[arm]
  want_loss, want_grads = mean_loss_and_grads(cfg.replace(implementation="xla"), None, strategy)
  got_loss, got_grads = mean_loss_and_grads(
    cfg.replace(**model_kw), mesh_shape, strategy, load_balance
  )
  assert abs(float(got_loss) - float(want_loss)) <= TOL * abs(float(want_loss))
  flat = jax.tree_util.tree_flatten_with_path(want_grads)[0]
  floor = FLOOR * max(float(np.max(np.abs(np.asarray(g)))) for _, g in flat)
  assert jax.tree.structure(got_grads) == jax.tree.structure(want_grads)
  for (path, want), got in zip(flat, jax.tree.leaves(got_grads)):
    err = max_rel(got, want, floor)
    assert err <= TOL, (jax.tree_util.keystr(path), err)


@sharded
@pytest.mark.parametrize("arm,mesh_shape,strategy", FAST)
def test_loss_and_gradients_match_one_device(arm, mesh_shape, strategy):
  check(arm, mesh_shape, strategy)


@sharded
@pytest.mark.slow
@pytest.mark.parametrize("arm,mesh_shape,strategy", SLOW)
def test_loss_and_gradients_match_one_device_everywhere(arm, mesh_shape, strategy):
  check(arm, mesh_shape, strategy)


@sharded
@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["pallas_tpu"])
@pytest.mark.parametrize("arm", ["diff_v1", "diff_v2"])
def test_ring_with_kernel_blocks_in_the_model(arm, implementation):
  # The fused TPU kernels per ring block (in the interpreter), two context shards.
  check(arm, (1, 1, 1, 2), "ring", implementation=implementation, interpret=True)


@sharded
@pytest.mark.slow
def test_without_load_balancing_too():
  check("diff_v2", (1, 1, 2, 4), "ring", load_balance=False)


@sharded
def test_the_train_step_shards_the_sequence_and_refuses_bad_lengths():
  cfg = ARMS["diff_v1"]
  optim = base_config().optim
  setup = build_train_setup(
    cfg, optim, seed=0, mesh=shd.make_mesh((1, 1, 1, 8)), rules=shd.DEFAULT_RULES
  )
  assert tuple(setup.batch_sharding.spec) == (("data", "fsdp"), "context")
  state = setup.init_fn()
  batch = jax.device_put(packed_batch(), setup.batch_sharding)
  _, metrics = setup.train_step(state, batch)
  one = build_train_setup(
    cfg, optim, seed=0, mesh=shd.make_mesh((1, 1, 1, 1), jax.devices()[:1]), rules=shd.DEFAULT_RULES
  )
  _, want = one.train_step(one.init_fn(), packed_batch())
  assert float(metrics["loss"]) == pytest.approx(float(want["loss"]), rel=TOL)
  short = {k: v[:, :24] for k, v in packed_batch().items()}  # 24 is not a multiple of 16
  with pytest.raises(ValueError, match="seq_len=24 with a context axis of 8"):
    setup.eval_step(setup.init_fn()["params"], short, 0)


@sharded
def test_analysis_refuses_a_sharded_sequence():
  cfg = ARMS["diff_v1"]
  model = create_model(cfg, 0)
  mesh = shd.make_mesh((1, 1, 1, 8))
  with shd.activation_sharding(mesh, shd.DEFAULT_RULES):
    with pytest.raises(ValueError, match="capture=True and logits/probs hooks"):
      model(jnp.zeros((2, 16), jnp.int32), capture=True)


def test_config_checks_name_the_context_settings():
  c = base_config()
  c.mesh.shape = (1, 1, 1, 4)
  c.seq_len = 100
  with pytest.raises(ValueError, match="seq_len=100 must be a multiple of 8"):
    check_config(c)
  c.seq_len, c.mesh.context_strategy = 128, "tree"
  with pytest.raises(ValueError, match="mesh.context_strategy='tree'"):
    check_config(c)
  c.mesh.context_strategy = "all_gather"
  check_config(c)
  assert shd.resolve_mesh_shape((-1, 1, 1), 4) == (4, 1, 1, 1)
  assert shd.resolve_mesh_shape((1, 1, 1, -1), 4) == (1, 1, 1, 4)
  with pytest.raises(ValueError, match="context_strategy"):
    with shd.activation_sharding(
      shd.make_mesh((1, 1, 1), jax.devices()[:1]), shd.DEFAULT_RULES, context_strategy="tree"
    ):
      pass


class _FakeSharding:
  """Stands in for a process's view of a batch sharding on a multi-host mesh."""

  def __init__(self, blocks):
    self.blocks = blocks

  def addressable_devices_indices_map(self, shape):
    del shape
    return {i: (slice(r0, r1), slice(t0, t1)) for i, (r0, r1, t0, t1) in enumerate(self.blocks)}


def test_process_rows_share_rows_within_a_context_group():
  # One process of a (1, 2, 1, 4) mesh over 2 processes x 4 devices, context spanning
  # processes: its 4 devices hold rows 2..3, each a quarter of the sequence.
  quarter = [(2, 4, t * 16, (t + 1) * 16) for t in range(4)]
  assert shd.process_rows(_FakeSharding(quarter), (4, 64)) == (1, 2)
  # Two processes of one context group (each half the sequence of rows 0..3) share slot 0.
  assert shd.process_rows(_FakeSharding([(0, 4, 0, 32)]), (8, 64)) == (0, 2)
  assert shd.process_rows(_FakeSharding([(0, 4, 32, 64)]), (8, 64)) == (0, 2)
  # Single process: every row.
  one = shd.batch_sharding(shd.make_mesh((1, 1, 1), jax.devices()[:1]))
  assert shd.process_rows(one, (4, 64)) == (0, 1)
  with pytest.raises(ValueError, match="not one aligned block"):
    shd.process_rows(_FakeSharding([(0, 1, 0, 64), (2, 3, 0, 64)]), (4, 64))
  with pytest.raises(ValueError, match="not one aligned block"):
    shd.process_rows(_FakeSharding([(1, 3, 0, 64)]), (4, 64))
