"""PartitionSpecs that run the per-device attention kernels under ``jax.shard_map``.

The kernels (TPU and GPU alike) see whole heads: a DIFF V1 head with its two
components, a V2 pair (query heads 2i and 2i+1), and the kv group they read.
Sharding the head axes in contiguous blocks keeps all of that on one shard whenever
the mesh's head axis divides the number of kv heads K: shard r then holds kv groups
[r K/n, (r+1) K/n) and exactly the query heads (or pairs) that read them. Batch
shards freely; sequence and head dim stay whole.

Every function returns ``(in_specs, out_spec)`` in the kernel's positional argument
order, with the two segment-id arrays appended when ``segment_ids=True``. Pass
``check_vma=False`` to ``jax.shard_map`` (Pallas calls carry no varying-axis rules)::

  in_specs, out_spec = diff_v1_partition_specs("data", "model", segment_ids=True)
  fn = jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=out_spec,
                     check_vma=False)
  out = fn(q1, q2, k1, k2, v, lam_H, q_seg, kv_seg)
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

AxisName = str | tuple[str, ...] | None
Specs = tuple[tuple[P, ...], P]


def _heads(batch_axis: AxisName, head_axis: AxisName) -> P:
  """[B, T, heads, D]: batch and heads split."""
  return P(batch_axis, None, head_axis, None)


def _segments(batch_axis: AxisName, segment_ids: bool) -> tuple[P, ...]:
  return (P(batch_axis, None), P(batch_axis, None)) if segment_ids else ()


def mha_partition_specs(
  batch_axis: AxisName = "data", head_axis: AxisName = "model", *, segment_ids: bool = False
) -> Specs:
  """Specs for a baseline kernel ``(q, k, v[, q_seg, kv_seg])``."""
  x = _heads(batch_axis, head_axis)
  return (x, x, x, *_segments(batch_axis, segment_ids)), x


def diff_v1_partition_specs(
  batch_axis: AxisName = "data", head_axis: AxisName = "model", *, segment_ids: bool = False
) -> Specs:
  """Specs for a DIFF V1 kernel ``(q1, q2, k1, k2, v, lam_H[, q_seg, kv_seg])``.

  Args:
    batch_axis, head_axis: mesh axis names (or tuples of names, or None) that shard
      the batch and the heads. The head axis size must divide K (kv groups).
    segment_ids: append specs for ``q_segment_ids, kv_segment_ids``.
  Returns:
    ``(in_specs, out_spec)``; ``lam_H`` is split with the heads.
  """
  x = _heads(batch_axis, head_axis)
  return (x, x, x, x, x, P(head_axis), *_segments(batch_axis, segment_ids)), x


def diff_v2_partition_specs(
  batch_axis: AxisName = "data", head_axis: AxisName = "model", *, segment_ids: bool = False
) -> Specs:
  """Specs for a DIFF V2 kernel ``(q, k, v, lam[, q_seg, kv_seg])``.

  The 2H query heads split into contiguous blocks of whole pairs; lambda [B, T, H]
  splits its pair axis the same way. The head axis size must divide K.
  """
  x = _heads(batch_axis, head_axis)
  lam_BxTxH = P(batch_axis, None, head_axis)
  return (x, x, x, lam_BxTxH, *_segments(batch_axis, segment_ids)), x


def decode_partition_specs(batch_axis: AxisName = "data", head_axis: AxisName = "model") -> Specs:
  """Specs for DIFF V1 decoding ``(q1, q2, k1, k2, v, lam_H, kv_len_B)``.

  The head axis size must divide K.
  """
  x = _heads(batch_axis, head_axis)
  return (x, x, x, x, x, P(head_axis), P(batch_axis)), x


_BY_OP = {
  "mha": mha_partition_specs,
  "diff_v1": diff_v1_partition_specs,
  "diff_v2": diff_v2_partition_specs,
}


def partition_specs(
  op: str, batch_axis: AxisName, head_axis: AxisName, *, segment_ids: bool = False
) -> Specs:
  """The specs of ``op`` ("mha", "diff_v1" or "diff_v2")."""
  if op not in _BY_OP:
    raise ValueError(f"Unknown op {op!r}; expected one of {tuple(_BY_OP)}.")
  return _BY_OP[op](batch_axis, head_axis, segment_ids=segment_ids)


def check_head_sharding(num_kv_heads: int, head_shards: int) -> None:
  """Raises if ``head_shards`` would split a kv group away from its query heads."""
  if head_shards <= 0 or num_kv_heads % head_shards:
    raise ValueError(
      f"{num_kv_heads=} must be a multiple of {head_shards=} so that every "
      "shard holds whole kv groups with the query heads that read them."
    )
