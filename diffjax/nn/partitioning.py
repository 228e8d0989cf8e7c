"""Activation sharding constraints by logical axis names.

Modules call :func:`constrain` on their activations with logical names; it is a
no-op unless a mesh and a rules table are active (see :func:`activation_sharding`),
so the modules run unchanged on one device and in users' own models.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

_STATE = threading.local()


def logical_to_spec(names: Sequence[str | None], rules) -> PartitionSpec:
  """Maps logical axis names to a PartitionSpec with a rules table.

  ``rules`` is a sequence of ``(logical_name, mesh_axes)`` pairs, mesh_axes being
  None, a mesh axis name or a tuple of names. Names without a rule are replicated,
  and a mesh axis already used by an earlier dimension is not reused.
  """
  table = dict(rules)
  used: set[str] = set()
  out = []
  for name in names:
    axes = table.get(name) if name is not None else None
    if axes is None:
      out.append(None)
      continue
    axes_t = (axes,) if isinstance(axes, str) else tuple(axes)
    axes_t = tuple(a for a in axes_t if a not in used)
    used.update(axes_t)
    out.append(None if not axes_t else axes_t[0] if len(axes_t) == 1 else axes_t)
  return PartitionSpec(*out)


@contextlib.contextmanager
def activation_sharding(mesh: jax.sharding.Mesh, rules) -> Iterator[None]:
  """Within this context (at trace time), :func:`constrain` applies the rules."""
  prev = getattr(_STATE, "value", None)
  _STATE.value = (mesh, tuple(rules))
  try:
    yield
  finally:
    _STATE.value = prev


def current():
  """The active (mesh, rules), or None outside :func:`activation_sharding`."""
  return getattr(_STATE, "value", None)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  state = getattr(_STATE, "value", None)
  if state is None:
    return x
  mesh, rules = state
  spec = logical_to_spec(names, rules)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
