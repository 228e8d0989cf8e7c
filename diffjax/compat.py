"""The library versions diffjax runs on, and what differs between them.

Tested sets (one constraints file each at the repository root): Python 3.11 with jax 0.10.2 and
flax 0.12.8 (``constraints.txt``), Python 3.12 with jax 0.11.2 and flax 0.12.12
(``constraints-py312.txt``), Python 3.13 with jax 0.12.0.1 and flax 0.12.12
(``constraints-py313.txt``). Code whose behaviour depends on a version asks here.
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
