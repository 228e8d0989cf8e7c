"""Logical axis names to mesh axes: the rules table (:data:`DEFAULT_RULES`) and the active mesh.

:func:`constrain` (in modules) and :func:`current` (in ops) read what :func:`activation_sharding`
makes active: docs/scaling.md#mesh-axes-and-the-rules-table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "context")
# Strategies for attention over a sequence sharded along ``context``
# (diffjax.ops.context_parallel): pass K/V blocks around a ring, or gather them.
CONTEXT_STRATEGIES = ("ring", "all_gather")

DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
  ("batch", ("data", "fsdp")),
  # Activations' sequence axis; a context axis of size 1 (the default) leaves it whole.
  ("length", "context"),
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

# The logical axis names diffjax's modules give their parameters and activations (the
# parameters' in diffjax.nn.layers, diffjax.nn.attention and diffjax.model.lm, the attention
# ops' in diffjax.core.op_specs): a rules table from a config may map only these.
LOGICAL_AXES: tuple[str, ...] = tuple(name for name, _ in DEFAULT_RULES)

Rules = Sequence[tuple[str, Any]]


def rules_from_config(
  rules: Sequence[Sequence[Any]] | Mapping[str, Any] | None,
  logical_axes: Sequence[str] = LOGICAL_AXES,
) -> Rules:
  """The rules table of a config: ``rules`` (a list of ``[logical name, mesh axes]`` pairs or
  a dict; None: none) merged over :data:`DEFAULT_RULES`, so a table names only the rules it
  changes (``[["embed", ["fsdp", "context"]]]`` keeps every other default; map a name to None
  to replicate it). A full table merged so is itself.

  Refuses, in one line, a logical name outside ``logical_axes`` (the names diffjax's modules
  use, :data:`LOGICAL_AXES`; pass more for a module of your own that uses others), a name
  given twice, and mesh axes outside :data:`MESH_AXES`.
  """
  if rules is None:
    return DEFAULT_RULES
  items = rules.items() if isinstance(rules, Mapping) else rules
  given: dict[str, Any] = {}
  for item in items:
    try:
      name, axes = tuple(item)
    except (TypeError, ValueError):
      raise ValueError(
        f"Sharding rule {item!r} must be a [logical name, mesh axes] pair, e.g. "
        '["embed", "fsdp"] or ["embed", ["fsdp", "context"]].'
      ) from None
    if name not in logical_axes:
      near = difflib.get_close_matches(str(name), logical_axes, n=1)
      hint = f" Did you mean {near[0]!r}?" if near else ""
      raise ValueError(
        f"Sharding rule {name!r} -> {axes!r} names an unknown logical axis {name!r}; the "
        f"logical axes are {tuple(logical_axes)}.{hint}"
      )
    if name in given:
      raise ValueError(
        f"Sharding rule {name!r} is given twice ({given[name]!r} and {axes!r}); give each "
        "logical axis once."
      )
    if isinstance(axes, (list, tuple)):
      axes = tuple(axes)
      bad = [a for a in axes if a not in MESH_AXES]
    else:
      bad = [axes] if axes is not None and axes not in MESH_AXES else []
    if bad:
      raise ValueError(
        f"Sharding rule {name!r} -> {axes!r} names unknown mesh axes {bad}; "
        f"the mesh axes are {MESH_AXES}."
      )
    given[name] = axes
  merged = [(name, given.pop(name, axes)) for name, axes in DEFAULT_RULES]
  return tuple(merged + list(given.items()))


def mesh_axes_of(entry) -> tuple[str, ...]:
  """The mesh axes of a rules or PartitionSpec entry (None, one name or several) as a tuple."""
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


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
    axes_t = tuple(a for a in mesh_axes_of(axes) if a not in used)
    used.update(axes_t)
    out.append(None if not axes_t else axes_t[0] if len(axes_t) == 1 else axes_t)
  return PartitionSpec(*out)


def spec_for_mesh(spec: PartitionSpec, mesh: jax.sharding.Mesh) -> PartitionSpec:
  """``spec`` without the mesh axes ``mesh`` lacks (e.g. ``context`` on a mesh built with
  only data, fsdp and tensor): those dimensions are not split along them."""
  names = set(mesh.axis_names)

  def fit(entry):
    if entry is None:
      return None
    kept = tuple(a for a in mesh_axes_of(entry) if a in names)
    return None if not kept else kept[0] if len(kept) == 1 else kept

  return PartitionSpec(*(fit(e) for e in spec))


def shards_of(entry, mesh: jax.sharding.Mesh) -> int:
  """How many devices a rules or PartitionSpec ``entry`` (None, one mesh axis or several)
  splits a dimension over on ``mesh`` (axes it lacks count 1)."""
  shape = dict(mesh.shape)
  return math.prod(int(shape.get(a, 1)) for a in mesh_axes_of(entry))


_STATE = threading.local()


@dataclasses.dataclass(frozen=True)
class ContextParallel:
  """How attention runs when the active mesh shards the sequence (``length``) axis.

  Attributes:
    mesh: the active mesh.
    axis: the mesh axis ``length`` maps to (``"context"``).
    size: that axis' size (> 1).
    strategy: ``"ring"`` (K/V blocks travel around the devices; no device ever holds
      the whole sequence's keys) or ``"all_gather"`` (each device gathers all K/V).
    load_balance: the sequence is in the zig-zag order
      (:func:`diffjax.ops.context_parallel.zigzag_permutation`), which gives every
      device an equal share of the causal work; the train and eval steps permute their
      batches into it (the loss is a sum over tokens, so it is unchanged).
  """

  mesh: jax.sharding.Mesh
  axis: str
  size: int
  strategy: str = "ring"
  load_balance: bool = True


@contextlib.contextmanager
def activation_sharding(
  mesh: jax.sharding.Mesh,
  rules: Rules,
  *,
  context_strategy: str = "ring",
  context_load_balance: bool = True,
) -> Iterator[None]:
  """Within this context (at trace time), :func:`constrain` applies the rules.

  ``context_strategy`` and ``context_load_balance`` configure attention when the rules
  shard ``length`` over a mesh axis of size > 1 (see :class:`ContextParallel`). With
  ``context_load_balance`` (the default) the sequences must be in zig-zag order, as the
  trainer's steps put them; pass False for sequences in their natural order.
  """
  if context_strategy not in CONTEXT_STRATEGIES:
    raise ValueError(f"context_strategy={context_strategy!r} is not one of {CONTEXT_STRATEGIES}.")
  prev = getattr(_STATE, "value", None), getattr(_STATE, "context", None)
  _STATE.value = (mesh, tuple(rules))
  _STATE.context = (context_strategy, bool(context_load_balance))
  try:
    yield
  finally:
    _STATE.value, _STATE.context = prev


def data_shard_rules() -> Rules | None:
  """Under :func:`activation_sharding` whose rules split ``batch`` first over ``data`` (of
  size > 1, and no other logical axis over it): the rules with ``data`` taken off ``batch``,
  for a computation run on each data shard under ``shard_map`` over ``data``; else None."""
  state = current()
  if state is None:
    return None
  mesh, rules = state
  axes = mesh_axes_of(logical_to_spec(("batch",), rules)[0])
  elsewhere = any("data" in mesh_axes_of(a) for name, a in rules if name != "batch")
  if dict(mesh.shape).get("data", 1) == 1 or axes[:1] != ("data",) or elsewhere:
    return None
  inner = axes[1:]
  inner = inner[0] if len(inner) == 1 else (inner or None)
  return tuple((name, inner if name == "batch" else a) for name, a in rules)


@contextlib.contextmanager
def rules_replaced(rules: Rules, mesh=None) -> Iterator[None]:
  """The active context settings with other rules (and another mesh, e.g. the abstract mesh
  inside a ``shard_map`` over some of its axes), at trace time."""
  prev = _STATE.value
  _STATE.value = (prev[0] if mesh is None else mesh, tuple(rules))
  try:
    yield
  finally:
    _STATE.value = prev


def current() -> tuple[jax.sharding.Mesh, Rules] | None:
  """The active (mesh, rules), or None outside :func:`activation_sharding`."""
  return getattr(_STATE, "value", None)


def context_parallel() -> ContextParallel | None:
  """The active context parallelism: None unless the active rules map ``length`` to one
  mesh axis of size > 1."""
  state = current()
  if state is None:
    return None
  mesh, rules = state
  axes = spec_for_mesh(logical_to_spec(("length",), rules), mesh)[0]
  if axes is None:
    return None
  if not isinstance(axes, str):
    raise ValueError(
      f"The sequence axis 'length' maps to several mesh axes {axes}; context "
      "parallelism takes one axis."
    )
  size = int(mesh.shape.get(axes, 1))
  if size == 1:
    return None
  strategy, load_balance = getattr(_STATE, "context", None) or ("ring", True)
  return ContextParallel(mesh, axes, size, strategy, load_balance)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """``x`` constrained to the sharding its logical axis ``names`` get; as is without a mesh."""
  state = current()
  if state is None:
    return x
  mesh, rules = state
  spec = spec_for_mesh(logical_to_spec(names, rules), mesh)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
