"""Optimizer: AdamW with warm-up, cosine or linear decay to a floor, and clipping.

Weight decay applies to matrices only (ndim >= 2: projections, MLP, embedding and
LM head); norm gains and the DIFF V1 lambda vectors (ndim 1) are not decayed, so
decay never pulls the per-head norm gain or lambda towards zero.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

SCHEDULES = ("cosine", "linear", "constant")


def learning_rate_schedule(cfg) -> optax.Schedule:
  """Linear warm-up from 0 to ``lr`` over ``warmup_steps``, then decay to ``min_lr``
  at ``decay_steps`` (default: the run's ``num_steps``) and stay there."""
  lr, min_lr = float(cfg.lr), float(cfg.min_lr)
  warmup = int(cfg.warmup_steps)
  total = int(cfg.decay_steps)
  if cfg.schedule not in SCHEDULES:
    raise ValueError(f"optim.schedule={cfg.schedule!r} is not one of {SCHEDULES}.")
  if lr <= 0 or min_lr < 0 or min_lr > lr:
    raise ValueError(f"Need 0 <= optim.min_lr <= optim.lr and lr > 0; got lr={lr}, "
                     f"min_lr={min_lr}.")
  if warmup < 0 or total < warmup:
    raise ValueError(f"Need 0 <= optim.warmup_steps <= decay steps; got warmup_steps={warmup},"
                     f" decay_steps={total}.")
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


def decay_mask(params: Any) -> Any:
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW (paper betas by config) with global-norm clipping; returns (tx, schedule)."""
  schedule = learning_rate_schedule(cfg)
  parts = []
  if cfg.clip_norm and cfg.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(float(cfg.clip_norm)))
  parts.append(optax.adamw(schedule, b1=float(cfg.b1), b2=float(cfg.b2), eps=float(cfg.eps),
                           weight_decay=float(cfg.weight_decay), mask=decay_mask))
  return optax.chain(*parts), schedule
