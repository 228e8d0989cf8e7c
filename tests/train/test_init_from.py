"""Starting a run from another run's weights (``checkpoint.init_from``), as the 64K
extension starts from a 4K run: same shapes, other settings free, layouts converted."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import REPO  # noqa: E402

from diffjax.model import layout
from diffjax.presets import base_config, load_config
from diffjax.train import CheckpointError, load_model
from diffjax.train.config_utils import check_config
from diffjax.train.loading import initial_params
from diffjax.train.trainer import train_and_evaluate


def config(steps: int):
  c = base_config()
  c.model.update(dict(arm="diff_v1", size="tiny", d_model=32, num_layers=2, mlp_dim=64, head_dim=8))
  c.seq_len, c.global_batch_size, c.num_steps = 32, 2, steps
  c.log_every, c.eval_every, c.eval_batches, c.tensorboard = 1, 0, 1, False
  c.data.max_documents = 30
  c.checkpoint.update(dict(every=steps, keep=2, async_save=False))
  c.mesh.num_devices = 1
  return c


@pytest.mark.integration
def test_a_run_starts_from_another_runs_weights(tmp_path, capsys):
  first = str(tmp_path / "first")
  train_and_evaluate(config(2), first)
  saved, _, _ = load_model(first)
  want = nnx.to_pure_dict(nnx.state(saved))

  # A longer-context run of the same shapes: other rope_theta (allowed by init_changes) and
  # seq_len, scanned layers.
  c = config(1)
  c.model.rope_theta, c.model.scan_layers, c.seq_len = 640_000.0, True, 64
  c.checkpoint.init_from = first
  c.checkpoint.init_changes = ("rope_theta",)
  second = str(tmp_path / "second")
  result = train_and_evaluate(c, second)
  out = capsys.readouterr().out
  assert f"Initialised the parameters from step 2 of {first}" in out
  assert result["step"] == 1

  # The parameters it started from are the first run's, stacked for the scanned model.
  from diffjax.model import ModelConfig  # pylint: disable=import-outside-toplevel

  cfg = ModelConfig.from_dict(
    {**saved.config.to_dict(), "scan_layers": True, "rope_theta": 640_000.0}
  )
  target = layout.stack_layers(want)
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params, step = initial_params(
    first, cfg, target, jax.tree.map(lambda _: one, target), allowed_changes=("rope_theta",)
  )
  assert step == 2
  for a, b in zip(jax.tree.leaves(target), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # Another rope_theta not allowed, other shapes, or no checkpoints, are refused by name.
  with pytest.raises(CheckpointError, match=r"--config\.model\.rope_theta=10000\.0"):
    initial_params(first, cfg, target, None)
  with pytest.raises(CheckpointError, match="d_model: saved 32 vs now 48"):
    initial_params(first, cfg.replace(d_model=48), target, None)
  # Another vocabulary: the line says what to set.
  with pytest.raises(
    CheckpointError, match=r"set --config\.model\.vocab_size=\d+ and train with the tokenizer"
  ):
    initial_params(first, cfg.replace(vocab_size=cfg.vocab_size + 1), target, None)
  # Another arm: the line names the arm the run holds and where a retrofit's command is.
  with pytest.raises(
    CheckpointError, match=r"--config\.model\.arm=diff_v1, at the sizes it was made with"
  ):
    initial_params(first, cfg.replace(attention="transformer"), target, None)
  with pytest.raises(FileNotFoundError, match="init_from"):
    initial_params(str(tmp_path / "nowhere"), cfg, target, None)


def test_the_64k_config_needs_init_from_to_start(tmp_path):
  c = load_config(os.path.join(REPO, "configs", "paper_3b_64k.py"))
  assert c.seq_len == 65_536 and c.model.rope_theta == 640_000.0 and c.optim.lr == 8e-5
  assert tuple(c.mesh.shape) == (1, 4, 1, 16) and c.model.scan_layers
  assert c.global_batch_size * c.seq_len * c.num_steps == pytest.approx(1.5e9, rel=0.001)
  check_config(c)  # a resumed run needs no init_from, and aot compiles without one
  # A fresh run without it stops with the key named (here: a tiny model on one device).
  t = config(1)
  t.checkpoint.init_from = None
  with pytest.raises(ValueError, match="checkpoint.init_from is required"):
    train_and_evaluate(t, str(tmp_path / "fresh"))
  assert not (tmp_path / "fresh" / "checkpoints").exists() or not any(
    (tmp_path / "fresh" / "checkpoints").iterdir()
  )
