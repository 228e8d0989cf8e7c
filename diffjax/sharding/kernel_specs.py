"""PartitionSpecs that run the per-device attention kernels under ``jax.shard_map``.

Whole heads with their kv group per shard, batch split freely; each function returns ``(in_specs,
out_spec)`` in the kernel's argument order. Pass ``check_vma=False`` to ``jax.shard_map``.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from diffjax.core import op_specs

AxisName = str | tuple[str, ...] | None
Specs = tuple[tuple[P, ...], P]


def kernel_partition_specs(
  axes,
  batch_axis: AxisName = "data",
  head_axis: AxisName = "tensor",
  *,
  segment_ids: bool = False,
  length_axis: AxisName = None,
) -> Specs:
  """Specs for a kernel whose positional arrays have the logical ``axes`` of an op
  (:attr:`diffjax.core.op_specs.OpSpec.axes`): ``batch`` over ``batch_axis``, ``heads`` in
  contiguous blocks over ``head_axis`` (by default the ``data`` and ``tensor`` axes of a
  :func:`diffjax.sharding.make_mesh` mesh), ``length`` over ``length_axis`` (context
  parallelism; None: whole), every other axis whole. With ``segment_ids`` the two segment-id
  arrays [B, T] and [B, S] follow. The output is [B, T, heads, Dv].
  """
  mesh_axis = {"batch": batch_axis, "heads": head_axis, "length": length_axis}
  ins = tuple(P(*(mesh_axis.get(a) for a in names)) for names in axes)
  seg = (P(batch_axis, length_axis),) * 2 if segment_ids else ()
  return (*ins, *seg), P(batch_axis, length_axis, head_axis, None)


def mha_partition_specs(
  batch_axis: AxisName = "data", head_axis: AxisName = "tensor", *, segment_ids: bool = False
) -> Specs:
  """Specs for a baseline kernel ``(q, k, v[, q_seg, kv_seg])``."""
  return kernel_partition_specs(op_specs.MHA.axes, batch_axis, head_axis, segment_ids=segment_ids)


def diff_v1_partition_specs(
  batch_axis: AxisName = "data", head_axis: AxisName = "tensor", *, segment_ids: bool = False
) -> Specs:
  """Specs for a DIFF V1 kernel ``(q1, q2, k1, k2, v, lam_H[, q_seg, kv_seg])``; ``lam_H``
  splits with the heads. The head axis size must divide K (kv groups)."""
  return kernel_partition_specs(
    op_specs.DIFF_V1.axes, batch_axis, head_axis, segment_ids=segment_ids
  )


def diff_v2_partition_specs(
  batch_axis: AxisName = "data", head_axis: AxisName = "tensor", *, segment_ids: bool = False
) -> Specs:
  """Specs for a DIFF V2 kernel ``(q, k, v, lam[, q_seg, kv_seg])``: the 2H query heads in
  contiguous blocks of whole pairs, lambda [B, T, H] likewise. The head axis size must
  divide K."""
  return kernel_partition_specs(
    op_specs.DIFF_V2.axes, batch_axis, head_axis, segment_ids=segment_ids
  )


def decode_partition_specs(batch_axis: AxisName = "data", head_axis: AxisName = "tensor") -> Specs:
  """Specs for DIFF V1 decoding ``(q1, q2, k1, k2, v, lam_H, kv_len_B)``. The head axis size
  must divide K."""
  return kernel_partition_specs(op_specs.DIFF_V1_DECODE.axes, batch_axis, head_axis)


def check_head_sharding(num_kv_heads: int, head_shards: int) -> None:
  """Raises if ``head_shards`` would split a kv group away from its query heads."""
  if head_shards <= 0 or num_kv_heads % head_shards:
    raise ValueError(
      f"{num_kv_heads=} must be a multiple of {head_shards=} so that every "
      "shard holds whole kv groups with the query heads that read them."
    )
