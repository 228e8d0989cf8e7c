"""A run's sequence length against the mesh it resolves to, refused in one line that names the
config keys before anything is written (on the test process's 8 CPU devices,
tests/conftest.py)."""

import re

import jax
import pytest
from helpers import tiny_config

from diffjax import sharding as shd
from diffjax.model import ModelConfig
from diffjax.presets import base_config
from diffjax.train.setup import build_train_setup
from diffjax.train.trainer import train_and_evaluate

CFG = ModelConfig(
  attention="diff_v1",
  vocab_size=64,
  d_model=32,
  num_layers=1,
  num_heads=2,
  num_kv_heads=2,
  head_dim=8,
  mlp_dim=64,
)


def _setup(mesh, seq_len, **kw):
  return build_train_setup(
    CFG, base_config().optim, seed=0, mesh=mesh, rules=shd.DEFAULT_RULES, seq_len=seq_len, **kw
  )


def test_the_sequence_is_checked_against_the_context_axis_the_mesh_resolved_to():
  # mesh.shape=(1, 1, 1, -1) on 4 devices: a context axis of 4.
  mesh = shd.make_mesh((1, 1, 1, -1), jax.devices()[:4])
  with pytest.raises(
    ValueError,
    match=re.escape("seq_len=36 with a context axis of 4: the load-balanced order")
    + ".*multiple of 8.*set mesh.context_load_balance=False \\(then a multiple of 4",
  ):
    _setup(mesh, 36)
  _setup(mesh, 36, context_load_balance=False)
  _setup(mesh, 40)
  with pytest.raises(ValueError, match=re.escape("seq_len=30 with a context axis of 4: ")):
    _setup(mesh, 30, context_load_balance=False)
  # The steps say the same, with the config keys (not a function's load_balance=).
  setup = _setup(mesh, None)
  batch = setup.abstract_batch(4, 36)
  with pytest.raises(ValueError, match="mesh.context_load_balance=False") as e:
    setup.eval_step.lower(setup.abstract_state["params"], batch, 0)
  assert "load_balance=False" not in str(e.value).replace("mesh.context_load_balance=False", "")


def test_a_context_axis_of_the_rest_that_does_not_split_seq_len_is_refused_before_writing(tmp_path):
  c = tiny_config(steps=2)
  c.mesh.num_devices, c.mesh.shape = 3, (1, 1, 1, -1)
  with pytest.raises(ValueError, match=re.escape("seq_len=32 does not split over the 3 devices")):
    train_and_evaluate(c, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
