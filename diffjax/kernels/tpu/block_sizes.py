"""Tile sizes of the fused differential-attention TPU kernels."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

# The score tile [block_q, block_kv] puts keys on the 128-wide lane axis and
# queries on the 8-row sublane axis of a TPU vector register.
_SUBLANES = 8
_LANES = 128


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the forward and backward kernels.

  Attributes:
    block_q: query rows per forward tile (a multiple of 8).
    block_kv: key rows per forward tile (a multiple of 128).
    block_q_bwd: query rows per backward tile (a multiple of 8).
    block_kv_bwd: key rows per backward tile (a multiple of 128).

  A tile longer than the (8- or 128-rounded) sequence is shrunk to it, so the
  defaults also serve short sequences. Sequences that are not a multiple of the
  tile are padded inside the kernel wrapper and the padding is masked.
  """

  block_q: int = 512
  block_kv: int = 512
  block_q_bwd: int = 512
  block_kv_bwd: int = 512

  def __post_init__(self):
    for name in ("block_q", "block_q_bwd"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0 or value % _SUBLANES:
        raise ValueError(f"{name}={value!r} must be a positive multiple of {_SUBLANES} "
                         "(the TPU sublane count).")
    for name in ("block_kv", "block_kv_bwd"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0 or value % _LANES:
        raise ValueError(f"{name}={value!r} must be a positive multiple of {_LANES} "
                         "(the TPU lane count).")

  @classmethod
  def get_default(cls, head_dim: int) -> "BlockSizes":
    """Defaults sized so that every tile of a step fits the 16 MiB default VMEM budget.

    Larger component heads (96, 128; value width 2x that) get smaller backward key
    tiles, because the backward keeps seven float32 [block_q, block_kv] temporaries
    and three float32 key-side accumulators alive per step.
    """
    if head_dim <= 64:
      return cls(block_q=512, block_kv=1024, block_q_bwd=512, block_kv_bwd=512)
    if head_dim <= 128:
      return cls(block_q=512, block_kv=512, block_q_bwd=512, block_kv_bwd=256)
    return cls(block_q=256, block_kv=512, block_q_bwd=256, block_kv_bwd=256)


def resolve_block_sizes(block_sizes: "BlockSizes | Mapping[str, Any] | None",
                        head_dim: int) -> BlockSizes:
  """Accepts None (per-head-dim defaults), a BlockSizes, or a dict of its fields.

  A dict may give only some fields; the others come from the defaults for ``head_dim``.
  """
  if block_sizes is None:
    return BlockSizes.get_default(head_dim)
  if isinstance(block_sizes, BlockSizes):
    return block_sizes
  if isinstance(block_sizes, Mapping):
    fields = {f.name for f in dataclasses.fields(BlockSizes)}
    unknown = sorted(set(block_sizes) - fields)
    if unknown:
      raise ValueError(f"Unknown block size fields {unknown}; expected some of {sorted(fields)}.")
    return dataclasses.replace(BlockSizes.get_default(head_dim), **dict(block_sizes))
  raise TypeError("block_sizes must be None, a BlockSizes or a dict of its fields; got "
                  f"{type(block_sizes).__name__}.")
