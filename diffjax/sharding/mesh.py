"""Device meshes, the checks a model puts on them, and the shardings of the train state.

:func:`validate_mesh_for_model` refuses a tensor axis that would split a DIFF V1 head or a V2
pair from its kv group (docs/scaling.md#mesh-axes-and-the-rules-table).
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


def validate_mesh_for_model(
  mesh: Mesh, model_cfg: Any, global_batch_size: int | None = None, heads: str = "heads"
) -> None:
  """Clear errors for meshes that would split heads, kv groups or the batch.

  ``model_cfg`` is a :class:`diffjax.model.ModelConfig` (read by field name only);
  ``heads`` says what one of its ``num_heads`` is (the arm's
  :attr:`~diffjax.arms.ArmSpec.heads`, e.g. "DIFF V2 pairs").
  """
  t = mesh.shape["tensor"]
  what = heads
  if model_cfg.num_heads % t:
    raise ValueError(
      f"The tensor axis ({t}) must divide the {model_cfg.num_heads} "
      f"{what}; a shard must hold whole heads. Change mesh.shape."
    )
  if model_cfg.num_kv_heads % t:
    raise ValueError(
      f"The tensor axis ({t}) must divide num_kv_heads="
      f"{model_cfg.num_kv_heads} so each shard holds whole kv groups with the "
      "heads that read them. Change mesh.shape."
    )
  for name, size in (("mlp_dim", model_cfg.mlp_dim), ("vocab_size", model_cfg.vocab_size)):
    if size % t:
      raise ValueError(
        f"The tensor axis ({t}) must divide {name}={size}. Change mesh.shape or {name}."
      )
  f = mesh.shape["fsdp"]
  if model_cfg.d_model % f:
    raise ValueError(f"The fsdp axis ({f}) must divide d_model={model_cfg.d_model}.")
  if global_batch_size is not None:
    rows = mesh.shape["data"] * f
    if global_batch_size % rows:
      raise ValueError(
        f"global_batch_size={global_batch_size} must be divisible by "
        f"data*fsdp={rows} (the batch is split over both axes)."
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
