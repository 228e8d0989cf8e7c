"""Rotary position embeddings with both pairing conventions.

``interleaved`` (the default, as in the DIFF reference code and GPT-J) rotates the
pairs (x[2i], x[2i+1]); ``half`` (NeoX / HF Llama / DiffLlama) rotates
(x[i], x[i + D/2]). Both use frequency theta^(-2i/D) for pair i.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from diffjax.core.config import ROPE_STYLES
from diffjax.core.dtypes import accumulation_dtype
from diffjax.core.platform import current_platform


def rope_frequencies(head_dim: int, theta: float, dtype=jnp.float32) -> jax.Array:
  """theta^(-2i/D) for the D/2 pairs i, [D/2] in ``dtype``."""
  if head_dim % 2:
    raise ValueError(f"RoPE needs an even head dim; got head_dim={head_dim}.")
  return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=dtype) / head_dim))


def _cos_sin(angles_BxTxF: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos and sin of the angles, [B, T, D/2] each.

  On a CPU they are computed in a loop over the batch rows: XLA's CPU compiler would
  otherwise fuse the transcendental functions into every consumer and evaluate them once per
  head and per element of the forward and backward rotations. Loop outputs are kept in
  memory, and the loops of every layer are merged into one (the same values, computed once).
  Elsewhere the plain expressions.
  """
  if current_platform() == "cpu":
    return jax.lax.map(lambda a: (jnp.cos(a), jnp.sin(a)), angles_BxTxF)
  return jnp.cos(angles_BxTxF), jnp.sin(angles_BxTxF)


def apply_rope(
  x_BxTxHxD: jax.Array,
  positions_BxT: jax.Array,
  *,
  theta: float = 10000.0,
  style: str = "interleaved",
) -> jax.Array:
  """Rotates every D-wide head vector by its position.

  The angles and the rotation run in float32 (float64 for float64 x); the result has
  the dtype of x.
  """
  if style not in ROPE_STYLES:
    raise ValueError(f"rope style {style!r} is not one of {ROPE_STYLES}.")
  d = x_BxTxHxD.shape[-1]
  acc = accumulation_dtype(x_BxTxHxD.dtype)
  freqs_F = rope_frequencies(d, theta, acc)
  angles_BxTxF = positions_BxT.astype(acc)[..., None] * freqs_F[None, None, :]
  cos, sin = _cos_sin(angles_BxTxF)
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  x = x_BxTxHxD.astype(acc)
  if style == "interleaved":
    x1, x2 = x[..., 0::2], x[..., 1::2]
    r1 = x1 * cos - x2 * sin
    r2 = x1 * sin + x2 * cos
    out = jnp.stack([r1, r2], axis=-1).reshape(x.shape)
  else:
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return out.astype(x_BxTxHxD.dtype)
