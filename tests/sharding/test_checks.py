"""The rules table a config gives, and the checks that refuse a mesh before anything is placed
or traced: the model against the mesh by the rules in use, and the attention kernels' split
(on the test process's 8 CPU devices, tests/conftest.py)."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import REPO
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from diffjax import sharding as shd
from diffjax.model import DecoderLM, ModelConfig
from diffjax.presets import base_config, load_config
from diffjax.train.setup import build_train_setup


def _cfg(**kw) -> ModelConfig:
  return ModelConfig(
    **{
      **dict(attention="diff_v1", vocab_size=64, d_model=32, num_layers=1, num_heads=2),
      **dict(num_kv_heads=2, head_dim=8, mlp_dim=64),
      **kw,
    }
  )


def test_a_rules_table_of_a_config_names_known_logical_axes_and_merges_over_the_defaults():
  with pytest.raises(ValueError, match=r"unknown logical axis 'head'.*Did you mean 'heads'\?"):
    shd.rules_from_config({"batch": ["data", "fsdp"], "head": "tensor"})
  with pytest.raises(ValueError, match=r"unknown logical axis 'lenght'.*Did you mean 'length'\?"):
    shd.rules_from_config([["lenght", "context"]])
  with pytest.raises(ValueError, match="'embed' is given twice"):
    shd.rules_from_config([["embed", "fsdp"], ["embed", None]])
  with pytest.raises(ValueError, match="names unknown mesh axes"):
    shd.rules_from_config([["embed", "nowhere"]])
  # A table names the rules it changes; the others keep their defaults.
  rules = dict(shd.rules_from_config([["embed", ["fsdp", "context"]], ["vocab", None]]))
  assert rules["embed"] == ("fsdp", "context") and rules["vocab"] is None
  assert rules["batch"] == ("data", "fsdp") and rules["heads"] == "tensor"
  assert rules["length"] == "context"
  assert shd.rules_from_config(shd.DEFAULT_RULES) == shd.DEFAULT_RULES
  assert shd.rules_from_config({}) == shd.DEFAULT_RULES == shd.rules_from_config(None)
  # The shipped config that sets a full table means what it meant.
  c = load_config(os.path.join(REPO, "configs", "paper_3b_64k.py"))
  want = tuple((n, ("fsdp", "context") if n == "embed" else a) for n, a in shd.DEFAULT_RULES)
  assert shd.rules_from_config(c.mesh.rules) == want


@pytest.mark.parametrize("scan", [False, True])
def test_every_logical_axis_the_models_use_can_be_given_a_rule(scan):
  from diffjax import arms  # pylint: disable=import-outside-toplevel

  names = set()
  for arm in arms.names():
    cfg = _cfg(attention=arm, num_layers=2, num_heads=4, gda_ratio=2, scan_layers=scan)
    with nnx.use_eager_sharding(False):
      model = nnx.eval_shape(lambda c=cfg: DecoderLM(c, rngs=nnx.Rngs(params=0)))
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model)))
    for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)):
      names.update(n for n in spec if n is not None)
  assert names and names <= set(shd.LOGICAL_AXES), names - set(shd.LOGICAL_AXES)


def _build(cfg, mesh, rules, **kw):
  return build_train_setup(cfg, base_config().optim, seed=0, mesh=mesh, rules=rules, **kw)


def test_the_model_is_checked_against_the_mesh_by_the_rules_in_use():
  # configs/paper_3b_64k.py's embed -> (fsdp, context) splits d_model over 8 devices.
  rules = shd.rules_from_config([["embed", ["fsdp", "context"]]])
  mesh = shd.make_mesh((1, 2, 1, 4), jax.devices()[:8])
  with pytest.raises(
    ValueError,
    match=re.escape("fsdp*context axes (8) that 'embed' maps to must divide d_model=36. Change ")
    + ".*mesh.rules' 'embed' rule",
  ):
    _build(_cfg(d_model=36), mesh, rules, global_batch_size=4)
  _build(_cfg(d_model=40), mesh, rules, global_batch_size=4)
  # Any parameter dimension, named with its logical axis, size and mesh axes: here DIFF V1's
  # lambda vectors [head_dim] under a rule that splits the per-channel vectors.
  rules = shd.rules_from_config([["norm", "tensor"]])
  mesh = shd.make_mesh((1, 1, 4, 1), jax.devices()[:4])
  with pytest.raises(
    ValueError,
    match=r"Parameter blocks/0/attn/lambda_\w+ \(6,\): its logical axis 'norm' of size 6 is "
    r"split over mesh axes \('tensor',\) \(4 devices\), which do not divide it",
  ):
    _build(_cfg(num_heads=4, num_kv_heads=4, head_dim=6), mesh, rules)
  # The common cases keep their own messages.
  with pytest.raises(ValueError, match=re.escape("The tensor axis (4) must divide num_kv_heads=2")):
    _build(_cfg(num_heads=4), mesh, shd.DEFAULT_RULES)


def test_the_batch_checks_follow_the_rules_for_the_batch():
  mesh = shd.make_mesh((2, 2, 1, 1), jax.devices()[:4])
  data_only = shd.rules_from_config([["batch", "data"]])
  # The batch split over data alone: 2-row micro-batches split, 6 rows too.
  _build(_cfg(), mesh, data_only, global_batch_size=4, grad_accum_steps=2)
  _build(_cfg(), mesh, data_only, global_batch_size=6)
  with pytest.raises(ValueError, match=re.escape("2 rows does not split over data*fsdp=4")):
    _build(_cfg(), mesh, shd.DEFAULT_RULES, global_batch_size=4, grad_accum_steps=2)
  with pytest.raises(
    ValueError, match=re.escape("global_batch_size=5 must be divisible by data=2")
  ):
    _build(_cfg(), mesh, data_only, global_batch_size=5)


def test_kernel_specs_default_to_the_meshes_axes():
  in_specs, out = shd.mha_partition_specs()
  assert out == P("data", None, "tensor", None)
  assert in_specs[0] == P("data", None, "tensor", None)
  assert shd.decode_partition_specs()[1] == P("data", None, "tensor", None)


def _forward(model, x, mesh, load_balance=True):
  @nnx.jit
  def f(model, x):
    with shd.activation_sharding(mesh, shd.DEFAULT_RULES, context_load_balance=load_balance):
      return model(x)

  return f(model, x)


@pytest.mark.parametrize("axes", [("data",), ("data", "tensor")])
def test_attention_runs_on_a_mesh_without_some_of_the_rules_axes(axes):
  model = DecoderLM(_cfg(), rngs=nnx.Rngs(params=0))
  mesh = Mesh(np.array(jax.devices()[: 2 ** len(axes)]).reshape((2,) * len(axes)), axes)
  x = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 8)), jnp.int32)
  np.testing.assert_allclose(_forward(model, x, mesh), model(x), atol=2e-5, rtol=2e-5)


def test_attention_refuses_a_batch_or_heads_the_mesh_does_not_split():
  model = DecoderLM(_cfg(), rngs=nnx.Rngs(params=0))
  x = jnp.zeros((3, 8), jnp.int32)
  with pytest.raises(ValueError, match=r"a batch of 3 rows does not split over the 2 devices"):
    _forward(model, x, shd.make_mesh((2, 1, 1, 1), jax.devices()[:2]))
  one_kv = DecoderLM(_cfg(num_kv_heads=1), rngs=nnx.Rngs(params=0))
  with pytest.raises(ValueError, match=r"has 1 heads, which do not split over the 2 devices"):
    _forward(one_kv, jnp.zeros((2, 8), jnp.int32), shd.make_mesh((1, 1, 2, 1), jax.devices()[:2]))
