"""Generation, serving and scoring check the mesh against the model before placing anything:
one line naming the numbers and what the caller changes (on the test process's 8 CPU
devices, tests/conftest.py)."""

import re

import jax
import pytest
from flax import nnx

from diffjax import sharding as shd
from diffjax.eval.harness.scorer import TokenScorer
from diffjax.generation import generate
from diffjax.model import DecoderLM, ModelConfig
from diffjax.serve import Engine

# One kv head: a tensor axis of 2 would split a kv group from the heads that read it.
ONE_KV = ModelConfig(
  attention="diff_v1",
  vocab_size=64,
  d_model=32,
  num_layers=1,
  num_heads=4,
  num_kv_heads=1,
  head_dim=8,
  mlp_dim=64,
)
NEEDLE = re.escape("The tensor axis (2) must divide num_kv_heads=1")


@pytest.fixture(scope="module")
def model():
  return DecoderLM(ONE_KV, rngs=nnx.Rngs(params=0))


@pytest.fixture(scope="module")
def mesh():
  return shd.make_mesh((1, 1, 2), jax.devices()[:2])


def test_generate_refuses_a_mesh_that_splits_a_kv_group(model, mesh):
  with pytest.raises(ValueError, match=NEEDLE + ".*Pass a mesh="):
    generate(model, [[1, 2, 3]], max_new_tokens=2, mesh=mesh, preflight=False)


def test_the_engine_names_the_serve_commands_mesh_flag(model, mesh):
  with pytest.raises(ValueError, match=NEEDLE + ".*Serve with another --mesh"):
    Engine(model, slots=2, context=32, mesh=mesh)


def test_the_scorer_refuses_a_mesh_that_splits_a_kv_group(model, mesh):
  with pytest.raises(ValueError, match=NEEDLE + ".*Score on a mesh="):
    TokenScorer(model, max_length=16, mesh=mesh)
