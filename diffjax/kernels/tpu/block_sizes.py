"""Tile sizes of the fused differential-attention TPU kernels and of the decode kernel."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from diffjax import hardware
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
      block_q_bwd). None (default): the fewest chunks whose dQ fits 24 MiB of VMEM
      (``_backward.DQ_VMEM_BUDGET``). A larger value than the default may exceed the
      VMEM limit; a smaller one is for tests.

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
        raise ValueError(
          f"{name}={value!r} must be a positive multiple of {_SUBLANES} (the TPU sublane count)."
        )
    for name in ("block_kv", "block_kv_bwd"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0 or value % _LANES:
        raise ValueError(
          f"{name}={value!r} must be a positive multiple of {_LANES} (the TPU lane count)."
        )
    n = self.dq_chunk
    if n is not None and (
      isinstance(n, bool) or not isinstance(n, int) or n <= 0 or n % self.block_q_bwd
    ):
      raise ValueError(
        f"dq_chunk={n!r} must be None (decided from the sequence length) "
        f"or a positive multiple of block_q_bwd={self.block_q_bwd}."
      )

  @classmethod
  def get_default(cls, head_dim: int, generation: str | None = None) -> BlockSizes:
    """Default tiles for a component head width, per TPU generation.

    ``generation`` is "v5e", "v5p" or "v6e"; None takes the generation of
    ``jax.devices()[0]`` on a TPU (:func:`tpu_generation`). Off a TPU, or for another
    generation, the generation-free tiles (:func:`_base_tiles`). For a known generation,
    each pass takes the first candidate (:func:`_candidates`) whose VMEM estimate fits its
    budget, MXU-aligned ones first (docs/kernels_tpu.md, "Default tiles").
    """
    base = _base_tiles(head_dim)
    if generation is None:
      generation = tpu_generation()
    if generation not in GENERATIONS:
      return cls(*base)
    mxu = hardware.get(generation).mxu_width
    fwd = _first_fitting(base[:2], mxu, lambda q, k: _fwd_vmem(q, k, head_dim), _FWD_BUDGET)
    bwd = _first_fitting(base[2:], mxu, lambda q, k: _bwd_vmem(q, k, head_dim), _BWD_BUDGET)
    return cls(*fwd, *bwd)


# The generations whose tiles follow their MXU width (:mod:`diffjax.hardware`): those with
# the 64 MiB of VMEM per core the kernels request (``_layout.vmem_limit``).
GENERATIONS = ("v5e", "v5p", "v6e")
# VMEM the kernels request at most (``_layout.vmem_limit``) over its 1.5 headroom; the
# backward leaves 24 MiB of that to a query chunk's dQ (``_backward.DQ_VMEM_BUDGET``).
_FWD_BUDGET = 64 * 2**20 * 2 // 3
_BWD_BUDGET = _FWD_BUDGET - 24 * 2**20


def _base_tiles(head_dim: int) -> tuple[int, int, int, int]:
  """(block_q, block_kv, block_q_bwd, block_kv_bwd) off a TPU: wider heads (value 2 d)
  get smaller backward key tiles, as the backward keeps eight float32 [block_q,
  block_kv] temporaries and the key-side accumulators alive per step."""
  if head_dim <= 64:
    return 512, 1024, 512, 512
  if head_dim <= 128:
    return 512, 512, 512, 256
  return 256, 512, 256, 256


def _fwd_vmem(bq: int, bk: int, head_dim: int) -> int:
  from diffjax.kernels.tpu import _forward  # pylint: disable=g-import-not-at-top

  return _forward.vmem_bytes(bq, bk, head_dim, 2 * head_dim, 4, 2)


def _bwd_vmem(bq: int, bk: int, head_dim: int) -> int:
  from diffjax.kernels.tpu import _backward  # pylint: disable=g-import-not-at-top

  return _backward.step_vmem_bytes(
    bq, bk, head_dim, 2 * head_dim, 4, 2, out_item=4, partials_in=True
  )


def _candidates(tile: tuple[int, int]) -> list[tuple[int, int]]:
  """The tile, then halvings (the larger side, the key side on a tie) down to 128."""
  out = [tile]
  bq, bk = tile
  while bq > _LANES or bk > _LANES:
    if bk >= bq:
      bk //= 2
    else:
      bq //= 2
    out.append((bq, bk))
  return out


def _first_fitting(tile: tuple[int, int], mxu: int, vmem, budget: int) -> tuple[int, int]:
  """The first candidate within ``budget``, MXU-aligned ones first; else the smallest."""
  cands = _candidates(tile)
  fits = [c for c in cands if vmem(*c) <= budget]
  aligned = [c for c in fits if c[0] % mxu == 0 and c[1] % mxu == 0]
  return (aligned or fits or cands[-1:])[0]


def tpu_generation(device_kind: str | None = None) -> str | None:
  """ "v5e", "v5p" or "v6e" from a device kind ("TPU v5 lite", "TPU v5p", "TPU v6 lite",
  ...; :func:`diffjax.hardware.for_device_kind`); None takes ``jax.devices()[0]`` and gives
  None off a TPU or for other chips."""
  if device_kind is None:
    import jax  # pylint: disable=g-import-not-at-top

    device = jax.devices()[0]
    if device.platform != "tpu":
      return None
    device_kind = device.device_kind
  chip = hardware.for_device_kind(device_kind)
  return chip.name if chip is not None and chip.name in GENERATIONS else None


def resolve_block_sizes(
  block_sizes: BlockSizes | Mapping[str, Any] | None, head_dim: int
) -> BlockSizes:
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
    if (
      isinstance(value, bool)
      or not isinstance(value, int)
      or value <= 0
      or value % _LANES
      or value > _MAX_DECODE_BLOCK
    ):
      raise ValueError(
        f"block_kv={value!r} must be a positive multiple of {_LANES} (the TPU "
        f"lane count) of at most {_MAX_DECODE_BLOCK}."
      )
    n = self.num_splits
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
      raise ValueError(f"num_splits={n!r} must be None or a positive int.")

  @classmethod
  def get_default(
    cls, head_dim: int, value_dim: int, kv_heads: int, itemsize: int
  ) -> DecodeBlockSizes:
    """The largest block (power of two times 128) whose cache tiles stay within 4 MiB."""
    per_position = (
      itemsize * kv_heads * (2 * _round_up(head_dim, _LANES) + _round_up(value_dim, _LANES))
    )
    block = _MAX_DECODE_BLOCK
    while block > _LANES and block * per_position > _DECODE_TILE_BYTES:
      block //= 2
    return cls(block_kv=block)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def resolve_decode_block_sizes(
  block_sizes: DecodeBlockSizes | Mapping[str, Any] | None,
  *,
  head_dim: int,
  value_dim: int,
  kv_heads: int,
  itemsize: int,
) -> DecodeBlockSizes:
  """None (defaults for the cache shape), a DecodeBlockSizes, or a dict of its fields."""
  default = DecodeBlockSizes.get_default(head_dim, value_dim, kv_heads, itemsize)
  return _v.resolve_fields(block_sizes, default, DecodeBlockSizes)
