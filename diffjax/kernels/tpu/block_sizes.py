"""Tile sizes of the fused differential-attention TPU kernels and of the decode kernel."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from diffjax.core import validation as _v

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
    dq_chunk: query rows per backward kernel call (a positive multiple of
      block_q_bwd). The backward keeps a chunk's dQ in VMEM for a kv group's whole
      sweep and passes float32 dK/dV partial sums from one chunk to the next. None
      (default): the fewest chunks whose dQ (float32 accumulator and two output
      buffers) fits 24 MiB (``_backward.DQ_VMEM_BUDGET``; at D = 128 in bfloat16 with
      one head per kv group, one chunk up to T = 12288). A larger value than the
      default may exceed the VMEM limit; a smaller one is for tests.

  A tile longer than the (8- or 128-rounded) sequence is shrunk to it, so the
  defaults also serve short sequences. Sequences that are not a multiple of the
  tile are padded inside the kernel wrapper and the padding is masked.
  """

  block_q: int = 512
  block_kv: int = 512
  block_q_bwd: int = 512
  block_kv_bwd: int = 512
  dq_chunk: int | None = None

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
    n = self.dq_chunk
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n <= 0
                          or n % self.block_q_bwd):
      raise ValueError(f"dq_chunk={n!r} must be None (decided from the sequence length) "
                       f"or a positive multiple of block_q_bwd={self.block_q_bwd}.")

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
  return _v.resolve_fields(block_sizes, BlockSizes.get_default(head_dim), BlockSizes)


# The cache tiles of one decode step (K1, K2 and V of every kv group, one buffer) are
# kept under this many bytes by the default block; the pipeline holds two buffers.
_DECODE_TILE_BYTES = 4 * 2**20
_MAX_DECODE_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
  """Tiles of the DIFF V1 decode kernel (one query token against a KV cache).

  Attributes:
    block_kv: cache positions per step (a multiple of 128, at most 1024). A cache
      whose length is a multiple of 128 but not of ``block_kv`` is read with the
      largest smaller multiple of 128 that divides it.
    num_splits: parts the cache of a row is split into, each reduced by its own
      program and merged afterwards. None: 2 for a batch of one row (both cores of a
      megacore chip get work), else 1.
  """

  block_kv: int = 512
  num_splits: int | None = None

  def __post_init__(self):
    value = self.block_kv
    if (isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % _LANES
        or value > _MAX_DECODE_BLOCK):
      raise ValueError(f"block_kv={value!r} must be a positive multiple of {_LANES} (the TPU "
                       f"lane count) of at most {_MAX_DECODE_BLOCK}.")
    n = self.num_splits
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
      raise ValueError(f"num_splits={n!r} must be None or a positive int.")

  @classmethod
  def get_default(cls, head_dim: int, value_dim: int, kv_heads: int,
                  itemsize: int) -> "DecodeBlockSizes":
    """The largest block (power of two times 128) whose cache tiles stay within 4 MiB."""
    per_position = itemsize * kv_heads * (2 * _round_up(head_dim, _LANES)
                                          + _round_up(value_dim, _LANES))
    block = _MAX_DECODE_BLOCK
    while block > _LANES and block * per_position > _DECODE_TILE_BYTES:
      block //= 2
    return cls(block_kv=block)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def resolve_decode_block_sizes(block_sizes: "DecodeBlockSizes | Mapping[str, Any] | None", *,
                               head_dim: int, value_dim: int, kv_heads: int,
                               itemsize: int) -> DecodeBlockSizes:
  """None (defaults for the cache shape), a DecodeBlockSizes, or a dict of its fields."""
  default = DecodeBlockSizes.get_default(head_dim, value_dim, kv_heads, itemsize)
  return _v.resolve_fields(block_sizes, default, DecodeBlockSizes)
