"""The precision the sensitive steps run in, and the check that float64 can be honoured.

float32 accumulation for float32, bfloat16 and float16 inputs, float64 for float64 inputs, never
silently narrowed (docs/model.md#functional-ops).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def accumulation_dtype(dtype: Any) -> np.dtype:
  """float32, or float64 for float64 ``dtype``: where softmax, norms, RoPE and lambda run."""
  return jnp.promote_types(dtype, jnp.float32)


def check_float64_enabled(name: str, dtype: Any) -> None:
  """Raises if ``dtype`` is float64 while 64-bit JAX is off (JAX would make it float32).

  ``name`` is the setting's name, e.g. ``"dtype"``, used in the message.
  """
  if np.dtype(dtype) != np.float64:
    return
  if jax.dtypes.canonicalize_dtype(np.float64) != np.float64:
    raise ValueError(
      f"{name}=float64 needs 64-bit JAX, which is off (JAX would compute in float32): call "
      "jax.config.update('jax_enable_x64', True) (or set JAX_ENABLE_X64=1) before building "
      f"the model, or use {name}=float32."
    )
