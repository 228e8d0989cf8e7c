"""Optimizer: AdamW with warm-up, cosine or linear decay to a floor, and clipping.

Weight decay reaches the weight matrices and never the per-channel vectors, told by each
parameter's logical axis names, not its rank, so scanned and unrolled models decay alike.
"""

from __future__ import annotations

import optax
from flax import nnx

from diffjax.model import DecoderLM, ModelConfig
from diffjax.nn.layers import is_weight_matrix, logical_names
from diffjax.train.sections import OptimConfig


def learning_rate_schedule(cfg: OptimConfig) -> optax.Schedule:
  """Linear warm-up from 0 to ``lr`` over ``warmup_steps``, then decay to ``min_lr``
  at ``decay_steps`` and stay there. (A mapping of the section's keys is resolved, and
  checked, first.)"""
  cfg = OptimConfig.from_config(cfg)
  lr, min_lr, warmup, total = cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.decay_steps
  warm = optax.linear_schedule(0.0, lr, max(warmup, 1))
  span = max(total - warmup, 1)
  if cfg.schedule == "cosine":
    decay = optax.cosine_decay_schedule(lr, span, alpha=min_lr / lr)
  elif cfg.schedule == "linear":
    decay = optax.linear_schedule(lr, min_lr, span)
  else:
    decay = optax.constant_schedule(lr)
  if warmup == 0:
    return decay
  return optax.join_schedules([warm, decay], [warmup])


def decay_mask(state: nnx.State | nnx.Module) -> dict:
  """The weight-decay mask of a model's parameters, as a tree like ``nnx.to_pure_dict``'s.

  Args:
    state: a model or its parameter state (abstract shapes are enough, e.g. from
      ``nnx.eval_shape``). Every parameter must carry logical axis names.
  Returns:
    A nested dict with the parameter tree's keys and a bool per parameter: True where
    AdamW decays it, i.e. for the weight matrices
    (:func:`diffjax.nn.layers.is_weight_matrix`).
  Raises:
    ValueError: a parameter without logical axis names (its role cannot be told).
  """
  if isinstance(state, nnx.Module):
    state = nnx.state(state, nnx.Param)
  mask: dict = {}
  for path, var in nnx.to_flat_state(state):
    names = logical_names(var)
    if names is None:
      raise ValueError(
        f"Parameter {'/'.join(map(str, path))} has no logical axis names, so "
        "weight decay cannot tell a matrix from a norm gain; create it with "
        "diffjax.nn.layers.make_param."
      )
    node = mask
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = is_weight_matrix(names)
  return mask


def model_decay_mask(model_cfg: ModelConfig) -> dict:
  """:func:`decay_mask` of the :class:`~diffjax.model.DecoderLM` that ``model_cfg`` builds
  (from abstract shapes: nothing is allocated)."""
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: DecoderLM(model_cfg, rngs=nnx.Rngs(params=0)))
  return decay_mask(nnx.state(model, nnx.Param))


def make_optimizer(
  cfg: OptimConfig, model: ModelConfig | dict
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW (paper betas by config) with global-norm clipping; returns (tx, schedule).

  Args:
    cfg: the run's ``optim`` section (a mapping of its keys is resolved, and checked, first).
    model: the model config whose parameters the optimizer updates (the decay mask is
      derived from it), or a decay mask from :func:`decay_mask`.
  """
  cfg = OptimConfig.from_config(cfg)
  mask = model_decay_mask(model) if isinstance(model, ModelConfig) else model
  schedule = learning_rate_schedule(cfg)
  parts = []
  if cfg.clip_norm and cfg.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(cfg.clip_norm))
  parts.append(
    optax.adamw(
      schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask
    )
  )
  return optax.chain(*parts), schedule
