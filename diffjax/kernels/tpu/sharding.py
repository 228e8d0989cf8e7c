"""PartitionSpecs that run the per-device kernels under ``jax.shard_map``.

The kernels see whole heads: a DIFF V1 head with its two components, a V2 pair
(query heads 2i and 2i+1), and the kv group they read. Sharding the head axes in
contiguous blocks keeps all of that on one shard whenever the mesh's head axis
divides the number of kv heads K: shard r then holds kv groups [r K/n, (r+1) K/n)
and exactly the query heads (or pairs) that read them. Batch shards freely.

Example::

  in_specs, out_spec = diff_v1_partition_specs("data", "model", segment_ids=False)
  fn = jax.shard_map(functools.partial(diff_v1_attention_tpu, causal=True), mesh=mesh,
                     in_specs=in_specs, out_specs=out_spec, check_vma=False)
  out = fn(q1, q2, k1, k2, v, lam_H)
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

AxisName = str | tuple[str, ...] | None


def _specs(batch_axis: AxisName, head_axis: AxisName, segment_ids: bool):
  heads_4d = P(batch_axis, None, head_axis, None)
  seg = (P(batch_axis, None), P(batch_axis, None)) if segment_ids else ()
  return heads_4d, seg


def diff_v1_partition_specs(batch_axis: AxisName = "data", head_axis: AxisName = "model",
                            *, segment_ids: bool = False) -> tuple[tuple[P, ...], P]:
  """In/out specs for :func:`diff_v1_attention_tpu` under ``shard_map``.

  Args:
    batch_axis, head_axis: mesh axis names (or tuples of names, or None) that shard
      the batch and the heads. The head axis size must divide K (kv groups).
    segment_ids: append specs for ``q_segment_ids, kv_segment_ids`` (pass them
      positionally after ``lam_H``).
  Returns:
    ``(in_specs, out_spec)`` for ``(q1, q2, k1, k2, v, lam_H[, q_seg, kv_seg])``.
  """
  heads_4d, seg = _specs(batch_axis, head_axis, segment_ids)
  in_specs = (heads_4d, heads_4d, heads_4d, heads_4d, heads_4d, P(head_axis), *seg)
  return in_specs, heads_4d


def diff_v2_partition_specs(batch_axis: AxisName = "data", head_axis: AxisName = "model",
                            *, segment_ids: bool = False) -> tuple[tuple[P, ...], P]:
  """In/out specs for :func:`diff_v2_attention_tpu` under ``shard_map``.

  The 2H query heads split into contiguous blocks of whole pairs; lambda [B, T, H]
  splits its pair axis the same way. The head axis size must divide K.
  Returns ``(in_specs, out_spec)`` for ``(q, k, v, lam[, q_seg, kv_seg])``.
  """
  heads_4d, seg = _specs(batch_axis, head_axis, segment_ids)
  in_specs = (heads_4d, heads_4d, heads_4d, P(batch_axis, None, head_axis), *seg)
  return in_specs, heads_4d


def check_head_sharding(num_kv_heads: int, head_shards: int) -> None:
  """Raises if ``head_shards`` would split a kv group away from its query heads."""
  if head_shards <= 0 or num_kv_heads % head_shards:
    raise ValueError(f"{num_kv_heads=} must be a multiple of {head_shards=} so that every "
                     "shard holds whole kv groups with the query heads that read them.")
