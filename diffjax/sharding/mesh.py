"""Device meshes, the checks a model puts on them, and the shardings of the train state.

:func:`validate_mesh_for_model` refuses, by the rules table in use, a mesh that would split a
DIFF V1 head or a V2 pair from its kv group, or any parameter dimension unevenly
(docs/scaling.md#mesh-axes-and-the-rules-table).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from diffjax.sharding.rules import (
  DEFAULT_RULES,
  MESH_AXES,
  Rules,
  logical_to_spec,
  mesh_axes_of,
  shards_of,
  spec_for_mesh,
)


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
  """Replaces one -1 entry by the remaining device count and checks the product."""
  return _fill(
    _padded(shape, "mesh shape"),
    num_devices,
    "mesh shape",
    "devices",
    "Set mesh.shape so the product equals the device count, or use -1 for one axis.",
  )


def _fill(shape: tuple[int, ...], count: int, name: str, unit: str, fix: str) -> tuple[int, ...]:
  """``shape`` with its -1 entry (if any) taking what the others leave of ``count``; refuses
  (one line, ending with ``fix``) a shape whose product cannot be ``count``."""
  if shape.count(-1) > 1:
    raise ValueError(f"{name} {shape} may contain at most one -1 ('the rest').")
  if any(s == 0 or s < -1 for s in shape):
    raise ValueError(f"{name} {shape} entries must be positive or -1.")
  known = int(np.prod([s for s in shape if s != -1]))
  if -1 in shape:
    if count % known:
      raise ValueError(
        f"{name} {shape}: the {count} {unit} do not divide by the fixed entries' product "
        f"{known}. {fix}"
      )
    shape = tuple(count // known if s == -1 else s for s in shape)
  if int(np.prod(shape)) != count:
    raise ValueError(
      f"{name} {dict(zip(MESH_AXES, shape))} spans {int(np.prod(shape))} {unit}, but there "
      f"are {count}. {fix}"
    )
  return shape


# Mesh axes that may span several slices (their collectives then travel over the data-centre
# network, DCN): data parallelism, and FSDP when asked. Sequence (context) and tensor
# parallelism exchange activations inside every layer and stay within a slice.
DCN_AXES = ("data", "fsdp")
# The logical axes whose arrays may be split across slices: the batch (data and FSDP) and
# the parameters' embedding axis (FSDP).
DCN_LOGICAL = ("batch", "embed")


def _slice_of(device: Any) -> int:
  """The TPU slice ``device`` sits in (0 for other platforms: a GPU's ``slice_index`` names
  its host, and the hosts of a GPU job form one mesh)."""
  if getattr(device, "platform", "tpu") != "tpu":
    return 0
  return int(getattr(device, "slice_index", 0) or 0)


def slice_groups(devices: Sequence[Any]) -> list[list[Any]]:
  """``devices`` grouped by TPU slice (``device.slice_index``; one group on other platforms
  and single-slice topologies), in slice order."""
  groups: dict[int, list[Any]] = {}
  for d in devices:
    groups.setdefault(_slice_of(d), []).append(d)
  return [groups[k] for k in sorted(groups)]


def _padded(shape: Sequence[int], what: str) -> tuple[int, ...]:
  """``shape`` as one entry per mesh axis (a 3-entry shape: no context parallelism)."""
  shape = tuple(int(s) for s in shape)
  if len(shape) == len(MESH_AXES) - 1:
    shape = shape + (1,)
  if len(shape) != len(MESH_AXES):
    raise ValueError(
      f"{what} {shape} must have {len(MESH_AXES)} entries for axes {MESH_AXES} "
      f"(or {len(MESH_AXES) - 1}, leaving context at 1)."
    )
  return shape


def resolve_dcn_shape(dcn_shape: Sequence[int] | None, num_slices: int) -> tuple[int, ...]:
  """How many slices each mesh axis spans: ``dcn_shape`` (None or empty: every slice on
  ``data``) checked against ``num_slices``; one -1 entry takes the rest.

  Refuses, in one line, a shape that would put a tensor or context axis across slices.
  """
  if not dcn_shape:
    return (num_slices,) + (1,) * (len(MESH_AXES) - 1)
  shape = _padded(dcn_shape, "mesh.dcn_shape")
  check_dcn_axes(shape)
  return _fill(
    shape,
    num_slices,
    "mesh.dcn_shape",
    "slices",
    f"Make its product the {num_slices} slices the devices form (or leave it empty: every "
    "slice on data).",
  )


def check_dcn_axes(dcn_shape: Sequence[int]) -> None:
  """Refuses (one line) a DCN shape that splits a mesh axis outside :data:`DCN_AXES` across
  slices."""
  shape = _padded(dcn_shape, "mesh.dcn_shape")
  for axis, n in zip(MESH_AXES, shape):
    if axis not in DCN_AXES and n != 1:
      slices = "the remaining" if n == -1 else str(n)
      raise ValueError(
        f"mesh.dcn_shape={shape} puts the {axis} axis across {slices} slices; {axis} "
        "parallelism exchanges activations in every layer and must stay inside a slice. Put "
        "the slices on data (or fsdp), e.g. mesh.dcn_shape=(-1, 1, 1, 1)."
      )


def check_rules_within_slices(rules: Rules, dcn_shape: Sequence[int]) -> None:
  """Refuses (one line) rules that would split a logical axis other than
  :data:`DCN_LOGICAL` over a mesh axis that spans several slices."""
  crossing = {a for a, n in zip(MESH_AXES, _padded(dcn_shape, "mesh.dcn_shape")) if n != 1}
  for name, axes in rules:
    wide = [a for a in mesh_axes_of(axes) if a in crossing]
    if wide and name not in DCN_LOGICAL:
      raise ValueError(
        f"mesh rule {name!r} -> {axes!r} would split {name!r} across slices (mesh axis "
        f"{wide[0]!r} spans {dict(zip(MESH_AXES, _padded(dcn_shape, 'mesh.dcn_shape')))[wide[0]]}"
        f" slices); only {list(DCN_LOGICAL)} may cross slices. Map {name!r} to a mesh axis "
        "inside a slice (tensor, context) or to None."
      )


def mesh_dcn_shape(mesh: Mesh) -> tuple[int, ...]:
  """How many slices each of the mesh's axes spans (all 1 on one slice)."""
  slices = np.vectorize(_slice_of, otypes=[int])(mesh.devices)
  out = []
  for i in range(slices.ndim):
    lines = np.moveaxis(slices, i, -1).reshape(-1, slices.shape[i])
    out.append(max(len(set(row.tolist())) for row in lines))
  return tuple(out)


def check_mesh_slices(mesh: Mesh, rules: Rules) -> None:
  """Refuses (one line) a mesh whose tensor or context axis spans slices, or rules that
  would split another logical axis than :data:`DCN_LOGICAL` across slices."""
  dcn = mesh_dcn_shape(mesh)
  if any(n != 1 for n in dcn):
    check_dcn_axes(dcn)
    check_rules_within_slices(rules, dcn)


def make_mesh(
  shape: Sequence[int] = (-1, 1, 1, 1),
  devices: Sequence[Any] | None = None,
  dcn_shape: Sequence[int] | None = None,
) -> Mesh:
  """A mesh with axes :data:`MESH_AXES` (data, fsdp, tensor, context) over ``devices``
  (default: all of them). A 3-entry ``shape`` leaves the context axis at 1.

  On devices of several TPU slices (``device.slice_index``), ``shape`` is the mesh within one
  slice and ``dcn_shape`` how many slices each axis spans (default: all on ``data``); an
  axis' size is their product, its slices outermost, so only the collectives of axes with a
  DCN share leave a slice.
  """
  devices = list(jax.devices()) if devices is None else list(devices)
  groups = slice_groups(devices)
  dcn = resolve_dcn_shape(dcn_shape, len(groups))
  if len(groups) == 1:
    shape = resolve_mesh_shape(shape, len(devices))
    try:
      arr = mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # non-physical device sets (CPU, topologies) keep their order
      arr = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(arr, MESH_AXES)
  sizes = {len(g) for g in groups}
  if len(sizes) != 1:
    raise ValueError(
      f"The devices form {len(groups)} slices of unequal sizes {sorted(sizes)}; a multi-slice "
      "mesh needs slices of one topology."
    )
  ici = resolve_mesh_shape(shape, sizes.pop())
  per_slice = []
  for g in groups:
    try:
      per_slice.append(mesh_utils.create_device_mesh(ici, devices=g))
    except Exception:  # non-physical device sets keep their order
      per_slice.append(np.asarray(g, dtype=object).reshape(ici))
  # [slices..., within...] -> interleave each axis' DCN part (outer) with its ICI part.
  blocks = np.stack(per_slice).reshape(dcn + ici)
  n = len(MESH_AXES)
  order = [i for pair in zip(range(n), range(n, 2 * n)) for i in pair]
  arr = blocks.transpose(order).reshape([d * i for d, i in zip(dcn, ici)])
  return Mesh(arr, MESH_AXES)


def _split_by(name: str, mesh: Mesh, rules: Rules) -> tuple[tuple[str, ...], int]:
  """(the mesh axes the logical axis ``name`` maps to on ``mesh``, how many devices they span)."""
  entry = spec_for_mesh(logical_to_spec((name,), rules), mesh)[0]
  return mesh_axes_of(entry), shards_of(entry, mesh)


def _axes_text(axes: tuple[str, ...], n: int, name: str) -> str:
  """The start of a message: e.g. ``The tensor axis (8)``, or ``The fsdp*context axes (8)
  that 'embed' maps to`` for several axes."""
  if len(axes) == 1:
    return f"The {axes[0]} axis ({n})"
  return f"The {'*'.join(axes)} axes ({n}) that {name!r} maps to"


def validate_mesh_for_model(
  mesh: Mesh,
  model_cfg: Any,
  global_batch_size: int | None = None,
  heads: str = "heads",
  *,
  rules: Rules = DEFAULT_RULES,
  params: Any = None,
  fix: str | None = None,
) -> None:
  """Clear errors for meshes that would split heads, kv groups, a parameter or the batch.

  Every check reads the mesh axes ``rules`` map each logical axis to (the tensor axis for
  the heads under :data:`DEFAULT_RULES`), so a table of one's own is checked as it will lay
  the arrays out.

  Args:
    mesh: the device mesh.
    model_cfg: a :class:`diffjax.model.ModelConfig` (read by field name only).
    global_batch_size: when given, checked against the mesh axes the batch is split over.
    heads: what one of its ``num_heads`` is (the arm's :attr:`~diffjax.arms.ArmSpec.heads`,
      e.g. "DIFF V2 pairs").
    rules: the rules table the arrays will be laid out by.
    params: the model's parameters (an ``nnx.State``, abstract or not): every dimension is
      then checked against the mesh axes its logical axis maps to
      (:func:`check_param_layout`).
    fix: the sentence that ends each message, saying what the caller can change (default:
      the training config's keys, "Change mesh.shape ...").
  """
  rules = tuple(rules)

  def advice(name: str, field: str | None = None) -> str:
    if fix is not None:
      return fix
    changed = dict(rules).get(name) != dict(DEFAULT_RULES).get(name)
    keys = ["mesh.shape"] + ([f"mesh.rules' {name!r} rule"] if changed else [])
    return f"Change {' or '.join(keys + ([field] if field else []))}."

  axes, t = _split_by("heads", mesh, rules)
  if model_cfg.num_heads % t:
    raise ValueError(
      f"{_axes_text(axes, t, 'heads')} must divide the {model_cfg.num_heads} {heads}; a shard "
      f"must hold whole heads. {advice('heads')}"
    )
  if model_cfg.num_kv_heads % t:
    raise ValueError(
      f"{_axes_text(axes, t, 'heads')} must divide num_kv_heads={model_cfg.num_kv_heads} so "
      f"each shard holds whole kv groups with the heads that read them. {advice('heads')}"
    )
  for field, name in (
    ("num_kv_heads", "kv_heads"),
    ("mlp_dim", "mlp"),
    ("vocab_size", "vocab"),
    ("d_model", "embed"),
  ):
    size = getattr(model_cfg, field)
    axes, n = _split_by(name, mesh, rules)
    if size % n:
      raise ValueError(
        f"{_axes_text(axes, n, name)} must divide {field}={size}. {advice(name, field)}"
      )
  if global_batch_size is not None:
    axes, rows = _split_by("batch", mesh, rules)
    if global_batch_size % rows:
      raise ValueError(
        f"global_batch_size={global_batch_size} must be divisible by {'*'.join(axes)}={rows} "
        f"(the batch's rows are split over {'both axes' if len(axes) == 2 else 'those axes'}). "
        f"Use a multiple of {rows}. {advice('batch')}"
      )
  if params is not None:
    check_param_layout(params, mesh, rules, fix=fix or "Change mesh.shape or mesh.rules.")


def check_param_layout(
  param_state: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES, fix: str = "Change mesh.shape."
) -> None:
  """Refuses (one line, ending with ``fix``) a parameter dimension that the mesh axes its
  logical axis maps to (by ``rules``, as :func:`param_shardings` lays it out) do not divide,
  naming the parameter, the logical axis, its size and the axes.

  ``param_state`` is an ``nnx.State`` of parameters carrying their logical axis names
  (abstract, e.g. from ``nnx.eval_shape``, or not).
  """
  is_spec = lambda x: isinstance(x, PartitionSpec) or x is None  # noqa: E731
  specs = jax.tree_util.tree_flatten_with_path(
    nnx.to_pure_dict(nnx.get_partition_spec(param_state)), is_leaf=is_spec
  )[0]
  values = dict(jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(param_state))[0])
  for path, spec in specs:
    value = values.get(path)
    if not isinstance(spec, PartitionSpec) or value is None:
      continue
    names, shape = tuple(spec), tuple(getattr(value, "shape", ()))
    if len(names) != len(shape):
      continue
    placed = spec_for_mesh(logical_to_spec(names, rules), mesh)
    for name, size, entry in zip(names, shape, placed):
      n = shards_of(entry, mesh)
      if size % n:
        where = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        raise ValueError(
          f"Parameter {where} {shape}: its logical axis {name!r} of size {size} is split over "
          f"mesh axes {mesh_axes_of(entry)} ({n} devices), which do not divide it. {fix}"
        )


def logical_param_specs(graphdef_state: nnx.State) -> Any:
  """Logical PartitionSpecs (axis names) of an ``nnx.State`` of parameters."""
  return nnx.get_partition_spec(graphdef_state)


def param_shardings(param_state: nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> dict:
  """NamedShardings for the params (as a pure dict, like the train state holds)."""
  specs = nnx.to_pure_dict(nnx.get_partition_spec(param_state))

  def to_sharding(spec):
    names = tuple(spec) if isinstance(spec, PartitionSpec) else ()
    return NamedSharding(mesh, spec_for_mesh(logical_to_spec(names, rules), mesh))

  return jax.tree.map(
    to_sharding, specs, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None
  )


def state_shardings(
  tx: optax.GradientTransformation, abstract_state: dict, param_shards: dict, mesh: Mesh
) -> dict:
  """Shardings of the whole train state: optimizer moments follow their params."""
  replicated = NamedSharding(mesh, PartitionSpec())
  opt = optax.tree_map_params(
    tx,
    lambda _, s: s,
    abstract_state["opt_state"],
    param_shards,
    transform_non_params=lambda _: replicated,
  )
  return {"params": param_shards, "opt_state": opt, "step": replicated, "rng": replicated}


def batch_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> NamedSharding:
  """Sharding of a [batch, length] input array."""
  return NamedSharding(mesh, spec_for_mesh(logical_to_spec(("batch", "length"), rules), mesh))


def batch_rows_multiple(mesh: Mesh | None, rules: Rules = DEFAULT_RULES) -> int:
  """How many devices the batch axis is split over on ``mesh``: a batch's rows must come in
  multiples of it (1 without a mesh)."""
  if mesh is None:
    return 1
  spec = spec_for_mesh(logical_to_spec(("batch",), rules), mesh)[0]
  axes = mesh_axes_of(spec)
  return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def process_rows(sharding: NamedSharding, global_shape: tuple[int, int]) -> tuple[int, int]:
  """Which rows of a [batch, length] global batch this process must load: ``(slot,
  num_slots)``, the process's rows being ``[slot * rows, (slot + 1) * rows)`` with
  ``rows = batch // num_slots``.

  Each process loads whole rows for its devices. When the sequence is sharded over a
  ``context`` axis that spans processes, the processes of one context group share their
  rows (same slot) and each device takes its part of the sequence from them.
  """
  mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
  if mesh is not None and spec is not None:
    entries = tuple(spec) + (None,) * (len(global_shape) - len(spec))
    for i, (size, entry) in enumerate(zip(global_shape, entries)):
      n = shards_of(entry, mesh)
      if int(size) % n:
        axes = mesh_axes_of(entry)
        if i == 0:
          raise ValueError(
            f"global_batch_size={size} does not split over the {n} devices of mesh axes "
            f"{axes} that hold the batch's rows: use a multiple of {n}, or change mesh.shape."
          )
        raise ValueError(
          f"seq_len={size} does not split over the {n} devices of mesh axes {axes} that "
          f"shard the sequence: use a multiple of {n} (of {2 * n} with "
          "mesh.context_load_balance=True, the default), or change mesh.shape."
        )
  b = int(global_shape[0])
  rows = {
    (s[0].start or 0, b if s[0].stop is None else s[0].stop)
    for s in sharding.addressable_devices_indices_map(tuple(global_shape)).values()
  }
  start, stop = min(r[0] for r in rows), max(r[1] for r in rows)
  size = stop - start
  covered = set()
  for r0, r1 in rows:
    covered.update(range(r0, r1))
  if covered != set(range(start, stop)) or b % size or start % size:
    raise ValueError(
      f"This process's devices hold rows {sorted(rows)} of the {b}-row batch, "
      "which are not one aligned block; choose a mesh whose batch axes split the "
      "processes evenly."
    )
  return start // size, b // size
