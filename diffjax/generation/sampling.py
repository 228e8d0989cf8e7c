"""Turning next-token logits into tokens: greedy, temperature, top-k, top-p.

A logits processor is a plain function ``(logits_BxV, step) -> logits_BxV``, run in order inside
the jitted decode step before the filters (docs/generation.md#the-api).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

LogitsProcessor = Callable[[jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
  """How the next token is chosen.

  Attributes:
    temperature: 0 for greedy (argmax); else logits are divided by it and sampled.
    top_k: keep the k most likely tokens (None: all).
    top_p: keep the smallest set of most likely tokens whose probability reaches p
      (nucleus sampling; 1.0 or None: all).
    seed: the random seed; the same seed, prompts and options give the same tokens.
  """

  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None
  seed: int = 0

  def __post_init__(self):
    t = self.temperature
    if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
      raise ValueError(f"temperature={t!r} must be a finite number >= 0 (0 is greedy).")
    if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
      raise ValueError(f"top_k={self.top_k!r} must be a positive integer or None.")
    p = self.top_p
    if p is not None and (not isinstance(p, (int, float)) or not 0 < p <= 1):
      raise ValueError(f"top_p={p!r} must be in (0, 1] or None.")
    if not isinstance(self.seed, int):
      raise ValueError(f"seed={self.seed!r} must be an integer.")


def top_k_filter(logits_BxV: jax.Array, k: int) -> jax.Array:
  """Keeps the k largest logits of each row (ties at the k-th value are kept too)."""
  k = min(k, logits_BxV.shape[-1])
  kth_Bx1 = jax.lax.top_k(logits_BxV, k)[0][:, -1:]
  return jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)


def top_p_filter(logits_BxV: jax.Array, p: float) -> jax.Array:
  """Keeps, per row, the most likely tokens until their probability mass reaches p.

  A token is kept when the mass of the tokens more likely than it is below p, so the
  most likely token is always kept.
  """
  sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
  probs_BxV = jax.nn.softmax(sorted_BxV.astype(jnp.float32), axis=-1)
  mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
  keep_count_Bx1 = jnp.sum(mass_before_BxV < p, axis=-1, keepdims=True)
  threshold_Bx1 = jnp.take_along_axis(sorted_BxV, keep_count_Bx1 - 1, axis=-1)
  return jnp.where(logits_BxV < threshold_Bx1, -jnp.inf, logits_BxV)


def choose_tokens(
  logits_BxV: jax.Array,
  key: jax.Array,
  step: jax.Array,
  options: SamplingOptions,
  processors: Sequence[LogitsProcessor] = (),
) -> jax.Array:
  """The next token of each row, int32 [B].

  Args:
    logits_BxV: next-token logits.
    key: the step's random key (unused when greedy).
    step: the index of the token being generated (0 for the first).
    options: temperature, top-k, top-p.
    processors: applied in order first.
  """
  logits_BxV = logits_BxV.astype(jnp.float32)
  for proc in processors:
    logits_BxV = proc(logits_BxV, step)
  if options.temperature == 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits_BxV = logits_BxV / options.temperature
  if options.top_k is not None:
    logits_BxV = top_k_filter(logits_BxV, options.top_k)
  if options.top_p is not None and options.top_p < 1:
    logits_BxV = top_p_filter(logits_BxV, options.top_p)
  return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)
