"""Sharding on the ground floor: logical-axis rules, device meshes, kernel PartitionSpecs.

* :mod:`diffjax.sharding.rules`: the rules table from logical axis names to the mesh
  axes ``data``, ``fsdp``, ``tensor``, ``context``, and the active-mesh context that modules
  (:func:`constrain`) and ops (:func:`current`) read;
* :mod:`diffjax.sharding.mesh`: building a mesh, checking it against a model, and
  the shardings of parameters, optimizer state and batches;
* :mod:`diffjax.sharding.kernel_specs`: the PartitionSpecs that run the attention
  kernels per device under ``jax.shard_map``.

This package imports nothing from the rest of diffjax, so every layer can use it.
"""

from diffjax.sharding.kernel_specs import (
  check_head_sharding,
  decode_partition_specs,
  diff_v1_partition_specs,
  diff_v2_partition_specs,
  kernel_partition_specs,
  mha_partition_specs,
)
from diffjax.sharding.mesh import (
  DCN_AXES,
  DCN_LOGICAL,
  batch_rows_multiple,
  batch_sharding,
  check_dcn_axes,
  check_mesh_slices,
  check_rules_within_slices,
  logical_param_specs,
  make_mesh,
  mesh_dcn_shape,
  param_shardings,
  process_rows,
  resolve_dcn_shape,
  resolve_mesh_shape,
  slice_groups,
  state_shardings,
  validate_mesh_for_model,
)
from diffjax.sharding.rules import (
  CONTEXT_STRATEGIES,
  DEFAULT_RULES,
  MESH_AXES,
  ContextParallel,
  activation_sharding,
  constrain,
  context_parallel,
  current,
  data_shard_rules,
  logical_to_spec,
  rules_from_config,
  rules_replaced,
  spec_for_mesh,
)

__all__ = [
  "DCN_AXES",
  "DCN_LOGICAL",
  "check_dcn_axes",
  "check_mesh_slices",
  "check_rules_within_slices",
  "mesh_dcn_shape",
  "resolve_dcn_shape",
  "slice_groups",
  "CONTEXT_STRATEGIES",
  "ContextParallel",
  "context_parallel",
  "DEFAULT_RULES",
  "MESH_AXES",
  "activation_sharding",
  "batch_rows_multiple",
  "batch_sharding",
  "check_head_sharding",
  "constrain",
  "current",
  "data_shard_rules",
  "decode_partition_specs",
  "diff_v1_partition_specs",
  "diff_v2_partition_specs",
  "logical_param_specs",
  "logical_to_spec",
  "make_mesh",
  "mha_partition_specs",
  "kernel_partition_specs",
  "param_shardings",
  "process_rows",
  "resolve_mesh_shape",
  "rules_from_config",
  "rules_replaced",
  "spec_for_mesh",
  "state_shardings",
  "validate_mesh_for_model",
]
