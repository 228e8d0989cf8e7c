"""The library versions diffjax runs on, and what differs between them.

The tested sets, one constraints file each: docs/getting_started.md#install. Code whose
behaviour depends on a version asks here.
"""

from __future__ import annotations

import re

import flax
import jax


def version_tuple(text: str) -> tuple[int, ...]:
  """``"0.12.0.1"`` -> ``(0, 12, 0)``: the first three numbers of a version string."""
  return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


JAX_VERSION = version_tuple(jax.__version__)
FLAX_VERSION = version_tuple(flax.__version__)

# Flax 0.12 renamed the variable metadata key that holds logical axis names.
FLAX_SHARDING_KEY = "out_sharding" if FLAX_VERSION >= (0, 12) else "sharding_names"
