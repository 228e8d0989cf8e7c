"""Tile sizes and launch parameters of the GPU kernels, with validation and defaults.

Two frozen dataclasses:

* :class:`BlockSizes` for the training kernels (DIFF V1 and V2, forward and backward);
* :class:`DecodeBlockSizes` for the single-token DIFF V1 decode kernel.

Every public kernel accepts ``block_sizes=None`` (per-head-dim defaults), an instance,
or a ``dict`` of fields that override the defaults. Block sizes are powers of two
because the Triton backend of Pallas needs power-of-two tile shapes, and at least 16
because a tensor-core dot needs 16 rows. A block longer than the (padded) sequence
is shrunk to it, so small inputs never need tuning.

The defaults are starting points chosen from register and shared-memory budgets on
an H100 (two float32 accumulators of the value width per query row in the forward
pass; dK1, dK2 and dV accumulators per key row in the backward pass); they have not
been swept on hardware. Sweep them per chip with ``benchmarks/attention.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from diffjax.core import validation as _v

_MIN_BLOCK = 16
_MAX_BLOCK = 1024
_WARPS = (1, 2, 4, 8, 16)


def next_power_of_2(n: int) -> int:
  """Smallest power of two >= n (1 for n <= 1)."""
  return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _check_block(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, int):
    raise ValueError(f"{name}={value!r} must be an int.")
  if value < _MIN_BLOCK or value > _MAX_BLOCK or value & (value - 1):
    raise ValueError(f"{name}={value} must be a power of two in [{_MIN_BLOCK}, {_MAX_BLOCK}] "
                     "(Triton tiles are powers of two; a tensor-core dot needs 16 rows).")


def _check_launch(name: str, value: Any, allowed: tuple[int, ...] | None, lo: int = 1,
                  hi: int = 8) -> None:
  if isinstance(value, bool) or not isinstance(value, int):
    raise ValueError(f"{name}={value!r} must be an int.")
  if allowed is not None and value not in allowed:
    raise ValueError(f"{name}={value} must be one of {allowed}.")
  if allowed is None and not lo <= value <= hi:
    raise ValueError(f"{name}={value} must be in [{lo}, {hi}].")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the fused DIFF attention kernels (V1 and V2).

  Attributes:
    block_q, block_kv: query rows per program and keys per inner step, forward.
    block_q_dkv, block_kv_dkv: the dK/dV backward kernel (one program per key block
      and kv group; it loops over the group's heads and the query blocks).
    block_q_dq, block_kv_dq: the dQ backward kernel (one program per query block).
    num_warps, num_stages: Triton launch parameters of the forward kernel.
    num_warps_bwd, num_stages_bwd: the same for both backward kernels.
  """
  block_q: int = 64
  block_kv: int = 64
  block_q_dkv: int = 32
  block_kv_dkv: int = 64
  block_q_dq: int = 64
  block_kv_dq: int = 32
  num_warps: int = 8
  num_stages: int = 2
  num_warps_bwd: int = 8
  num_stages_bwd: int = 2

  def __post_init__(self):
    for name in ("block_q", "block_kv", "block_q_dkv", "block_kv_dkv", "block_q_dq",
                 "block_kv_dq"):
      _check_block(name, getattr(self, name))
    _check_launch("num_warps", self.num_warps, _WARPS)
    _check_launch("num_warps_bwd", self.num_warps_bwd, _WARPS)
    _check_launch("num_stages", self.num_stages, None)
    _check_launch("num_stages_bwd", self.num_stages_bwd, None)

  @classmethod
  def default(cls, head_dim: int, value_dim: int | None = None) -> "BlockSizes":
    """Defaults keyed on the padded value width (the forward keeps two accumulators of it).

    Args:
      head_dim: query/key width D.
      value_dim: value width Dv (DIFF V1: 2 D; DIFF V2: D). Defaults to 2 D.
    """
    dv = next_power_of_2(max(value_dim if value_dim is not None else 2 * head_dim,
                             head_dim, _MIN_BLOCK))
    if dv <= 64:
      return cls(128, 64, 64, 64, 64, 64, num_warps=4, num_stages=3, num_warps_bwd=4)
    if dv <= 128:
      return cls(128, 64, 64, 64, 64, 64, num_warps=8, num_stages=3, num_warps_bwd=8)
    if dv <= 256:
      return cls(64, 64, 32, 64, 64, 32, num_warps=8, num_stages=2, num_warps_bwd=8)
    return cls(32, 32, 16, 32, 32, 16, num_warps=8, num_stages=1, num_warps_bwd=8,
               num_stages_bwd=1)

  def clamped(self, q_len: int, kv_len: int) -> "BlockSizes":
    """Shrinks every block to the padded length it tiles (never below 16)."""
    tq = max(_MIN_BLOCK, next_power_of_2(q_len))
    tk = max(_MIN_BLOCK, next_power_of_2(kv_len))
    return dataclasses.replace(
        self, block_q=min(self.block_q, tq), block_kv=min(self.block_kv, tk),
        block_q_dkv=min(self.block_q_dkv, tq), block_kv_dkv=min(self.block_kv_dkv, tk),
        block_q_dq=min(self.block_q_dq, tq), block_kv_dq=min(self.block_kv_dq, tk))

  @property
  def q_multiple(self) -> int:
    """The query length is padded to a multiple of this (every q block divides it)."""
    return max(self.block_q, self.block_q_dkv, self.block_q_dq)

  @property
  def kv_multiple(self) -> int:
    return max(self.block_kv, self.block_kv_dkv, self.block_kv_dq)


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
  """Tiles of the DIFF V1 decode kernel (one query token against a KV cache).

  Attributes:
    block_kv: cache positions per inner step.
    num_splits: how many parts the cache is split into (flash-decoding); each part is
      reduced by its own program and the parts are merged afterwards. None picks enough
      parts to give the GPU about ``target_programs`` programs.
    target_programs: used when ``num_splits`` is None (an H100 has 132 SMs).
    num_warps, num_stages: Triton launch parameters.
  """
  block_kv: int = 64
  num_splits: int | None = None
  target_programs: int = 264
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    _check_block("block_kv", self.block_kv)
    if self.num_splits is not None:
      _check_launch("num_splits", self.num_splits, None, lo=1, hi=1 << 16)
    _check_launch("target_programs", self.target_programs, None, lo=1, hi=1 << 20)
    _check_launch("num_warps", self.num_warps, _WARPS)
    _check_launch("num_stages", self.num_stages, None)

  @classmethod
  def default(cls, head_dim: int, value_dim: int | None = None) -> "DecodeBlockSizes":
    dv = next_power_of_2(max(value_dim if value_dim is not None else 2 * head_dim,
                             head_dim, _MIN_BLOCK))
    return cls(block_kv=128 if dv <= 128 else 64)


def resolve(block_sizes, default, cls=BlockSizes):
  """None -> ``default``; a dict overrides fields of ``default``; an instance is kept."""
  return _v.resolve_fields(block_sizes, default, cls)
