"""Loading trained models from a ``train.py`` workdir for evaluation and analysis."""

from __future__ import annotations

import os

import jax
from flax import nnx

from diffjax.model import DecoderLM, ModelConfig
from diffjax.train import checkpoint as ckpt
from diffjax.train.steps import create_model


def load_model(workdir: str, step: int | None = None, **model_overrides
               ) -> tuple[DecoderLM, ModelConfig, int]:
  """Returns ``(model, model_config, step)`` from the checkpoints of ``workdir``.

  ``step`` defaults to the latest complete checkpoint. ``model_overrides`` change
  settings that do not alter parameters (e.g. ``implementation="xla"``).
  """
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"No checkpoints in {directory!r}: pass the --workdir of a "
                            "train.py run.")
  manager = ckpt.make_manager(directory, keep=1_000_000, async_save=False)
  steps = manager.all_steps()
  if not steps:
    raise FileNotFoundError(f"{directory!r} holds no complete checkpoint.")
  if step is None:
    step = max(steps)
  elif step not in steps:
    raise ValueError(f"step={step} is not among the checkpoints of {directory!r}: {sorted(steps)}.")
  meta = ckpt.read_meta(manager, step)
  cfg = ModelConfig.from_dict({**meta["model_config"], **model_overrides})
  with nnx.use_eager_sharding(False):
    abstract = nnx.eval_shape(lambda: create_model(cfg, 0))
  graphdef, abstract_state = nnx.split(abstract)
  target = nnx.to_pure_dict(abstract_state)
  params = ckpt.restore_params(manager, step, target)
  state = nnx.State(abstract_state)
  nnx.replace_by_pure_dict(state, params)
  model = nnx.merge(graphdef, state)
  manager.close()
  return model, cfg, step
