"""Logical axis names to mesh axes: the rules table and the active mesh.

The model names every parameter axis (``embed``, ``heads``, ``kv_heads``,
``head_dim``, ``mlp``, ``vocab``, ``norm``) and activation axis (``batch``,
``length``, ...). One rules table maps those names to the mesh axes ``data``,
``fsdp`` and ``tensor``:

  * batch over ``data`` and ``fsdp``;
  * parameters and optimizer state FSDP-sharded over ``fsdp`` along ``embed``;
  * attention heads, kv heads, MLP hidden and vocabulary over ``tensor``.

Modules call :func:`constrain` on their activations with logical names; it is a
no-op unless a mesh and a rules table are active (see :func:`activation_sharding`),
so the modules run unchanged on one device and in users' own models. The ops read
the same context (:func:`current`) to run kernels per device under ``shard_map``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("norm", None),
    # The leading axis of scanned (stacked) layer parameters stays whole.
    ("layers", None),
)

Rules = Sequence[tuple[str, Any]]


def rules_from_config(rules: Sequence[Sequence[Any]] | Mapping[str, Any] | None) -> Rules:
  """Normalises a rules table from a config (list of pairs or a dict); None: the default."""
  if rules is None:
    return DEFAULT_RULES
  items = rules.items() if isinstance(rules, Mapping) else rules
  out = []
  for item in items:
    name, axes = tuple(item)
    if isinstance(axes, (list, tuple)):
      axes = tuple(axes)
      bad = [a for a in axes if a not in MESH_AXES]
    else:
      bad = [axes] if axes is not None and axes not in MESH_AXES else []
    if bad:
      raise ValueError(f"Sharding rule {name!r} -> {axes!r} names unknown mesh axes {bad}; "
                       f"the mesh axes are {MESH_AXES}.")
    out.append((name, axes))
  return tuple(out)


def logical_to_spec(names: Sequence[str | None], rules: Rules) -> PartitionSpec:
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


_STATE = threading.local()


@contextlib.contextmanager
def activation_sharding(mesh: jax.sharding.Mesh, rules: Rules) -> Iterator[None]:
  """Within this context (at trace time), :func:`constrain` applies the rules."""
  prev = getattr(_STATE, "value", None)
  _STATE.value = (mesh, tuple(rules))
  try:
    yield
  finally:
    _STATE.value = prev


def current() -> tuple[jax.sharding.Mesh, Rules] | None:
  """The active (mesh, rules), or None outside :func:`activation_sharding`."""
  return getattr(_STATE, "value", None)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """``x`` constrained to the sharding its logical axis ``names`` get; as is without a mesh."""
  state = current()
  if state is None:
    return x
  mesh, rules = state
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, rules)))
