"""The accelerators diffjax knows, one frozen record each: what every other module reads.

A :class:`Tpu` or :class:`Gpu` per device kind, found by ``device_kind`` prefix (longest match
wins; :func:`for_device_kind`). Imports nothing from diffjax (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

import numpy as np

KIB = 1024
MIB = 1024**2
GIB = 1024**3

# Compute capability of the GPUs the Mosaic GPU kernels are written for (sm_90a).
HOPPER = (9, 0)

# The same on every GPU in the table (compute capability 8.0 and 9.0).
WARP_THREADS = 32
MAX_THREADS_PER_BLOCK = 1024
MAX_THREADS_PER_SM = 2048
MAX_REGISTERS_PER_THREAD = 255
# Shared memory a block gets without opting in to more.
DEFAULT_SMEM_PER_BLOCK = 48 * KIB


@dataclasses.dataclass(frozen=True, kw_only=True)
class Accelerator:
  """What every accelerator in the table has.

  Attributes:
    name: the short name used on command lines and in tables ("v5e", "h100").
    platform: "tpu" or "gpu", as ``jax.Device.platform`` says.
    device_kinds: prefixes of ``jax.Device.device_kind`` that name this accelerator.
    dense_flops_per_s: dense peak FLOP/s of one chip or GPU, by dtype name
      ("bfloat16", ...); a dtype not listed has no published peak here.
    hbm_bytes: device memory of one chip or GPU, bytes.
    hbm_bytes_per_s: its bandwidth, bytes/s.
  """

  name: str
  platform: str
  device_kinds: tuple[str, ...]
  dense_flops_per_s: Mapping[str, float] = dataclasses.field(hash=False)
  hbm_bytes: int
  hbm_bytes_per_s: float

  @property
  def hbm_gib(self) -> float:
    return self.hbm_bytes / GIB

  def flops(self, dtype="bfloat16") -> float | None:
    """The dense peak for ``dtype`` (a name or a dtype), or None when the table has none."""
    return self.dense_flops_per_s.get(_dtype_name(dtype))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tpu(Accelerator):
  """One TPU chip.

  Attributes:
    mxu_width: side of one MXU's square systolic array.
    vmem_bytes: VMEM of one TensorCore, bytes.
    tensorcores: TensorCores per chip (two on a megacore chip).
  """

  mxu_width: int
  vmem_bytes: int
  tensorcores: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gpu(Accelerator):
  """One NVIDIA GPU.

  Attributes:
    device_description: the full ``device_kind`` one such GPU reports.
    compute_capability: (major, minor); :data:`HOPPER` is (9, 0), Ampere (8, 0).
    sms: streaming multiprocessors.
    fp32_cores_per_sm: float32 units per SM.
    smem_per_block: shared memory one block (CTA) may opt in to, bytes.
    smem_per_sm: shared memory per SM, bytes.
    registers_per_sm: 32-bit registers per SM.
    registers_per_block: 32-bit registers one block may use.
    l2_bytes: L2 cache, bytes.
    clock_ghz: boost clock.
  """

  device_description: str
  compute_capability: tuple[int, int]
  sms: int
  fp32_cores_per_sm: int
  smem_per_block: int
  smem_per_sm: int
  registers_per_sm: int
  registers_per_block: int
  l2_bytes: int
  clock_ghz: float

  @property
  def hopper(self) -> bool:
    return self.compute_capability == HOPPER


def _flops(**by_dtype: float) -> Mapping[str, float]:
  return types.MappingProxyType(by_dtype)


_H100 = Gpu(
  name="h100",
  platform="gpu",
  device_kinds=("NVIDIA H100",),
  device_description="NVIDIA H100 80GB HBM3",
  dense_flops_per_s=_flops(bfloat16=989e12, float16=989e12),
  hbm_bytes=84_942_979_072,
  hbm_bytes_per_s=3_352_320_000_000,
  compute_capability=HOPPER,
  sms=132,
  fp32_cores_per_sm=128,
  smem_per_block=227 * KIB,
  smem_per_sm=228 * KIB,
  registers_per_sm=65536,
  registers_per_block=65536,
  l2_bytes=50 * MIB,
  clock_ghz=1.98,
)
# The H200 is the H100's chip with more and faster HBM.
_H200 = dataclasses.replace(
  _H100,
  name="h200",
  device_kinds=("NVIDIA H200",),
  device_description="NVIDIA H200",
  hbm_bytes=150_754_820_096,
  hbm_bytes_per_s=4_800_000_000_000,
)


def _tpu(
  name: str,
  device_kinds: tuple[str, ...],
  bfloat16_flops: float,
  hbm_bytes: int,
  hbm_bytes_per_s: float,
  mxu_width: int,
  vmem_bytes: int,
  tensorcores: int,
) -> Tpu:
  """One TPU row of the table; a TPU's published dense peak is bfloat16's."""
  return Tpu(
    name=name,
    platform="tpu",
    device_kinds=device_kinds,
    dense_flops_per_s=_flops(bfloat16=bfloat16_flops),
    hbm_bytes=hbm_bytes,
    hbm_bytes_per_s=hbm_bytes_per_s,
    mxu_width=mxu_width,
    vmem_bytes=vmem_bytes,
    tensorcores=tensorcores,
  )


_TABLE: tuple[Accelerator, ...] = (
  # name, device_kinds, bfloat16 FLOP/s, HBM, HBM bytes/s, MXU width, VMEM, TensorCores
  _tpu("v4", ("TPU v4",), 275e12, 32 * GIB, 1200e9, 128, 16 * MIB, 2),
  _tpu("v5e", ("TPU v5 lite", "TPU v5e"), 197e12, 16 * GIB, 819e9, 128, 128 * MIB, 1),
  _tpu("v5p", ("TPU v5p", "TPU v5"), 459e12, 95 * GIB, 2765e9, 128, 64 * MIB, 2),
  _tpu("v6e", ("TPU v6 lite", "TPU v6e"), 918e12, 32 * GIB, 1640e9, 256, 128 * MIB, 1),
  _H100,
  _H200,
  Gpu(
    name="a100",
    platform="gpu",
    device_kinds=("NVIDIA A100",),
    device_description="NVIDIA A100-SXM4-80GB",
    dense_flops_per_s=_flops(bfloat16=312e12, float16=312e12),
    hbm_bytes=80 * GIB,
    hbm_bytes_per_s=2_039_000_000_000,
    compute_capability=(8, 0),
    sms=108,
    fp32_cores_per_sm=64,
    smem_per_block=163 * KIB,
    smem_per_sm=164 * KIB,
    registers_per_sm=65536,
    registers_per_block=65536,
    l2_bytes=40 * MIB,
    clock_ghz=1.41,
  ),
)

# Every accelerator by name, in table order (TPUs oldest first, then GPUs).
ACCELERATORS: Mapping[str, Accelerator] = types.MappingProxyType({a.name: a for a in _TABLE})


def names(platform: str | None = None) -> tuple[str, ...]:
  """The names in the table, all or those of one platform ("tpu" or "gpu")."""
  return tuple(a.name for a in _TABLE if platform is None or a.platform == platform)


def get(name: str) -> Accelerator:
  """The accelerator called ``name`` (case-insensitive), or a ValueError listing the names."""
  key = name.lower()
  if key not in ACCELERATORS:
    raise ValueError(f"Unknown accelerator {name!r}; use one of {list(ACCELERATORS)}.")
  return ACCELERATORS[key]


# (lowercased prefix, accelerator), longest prefix first: the first that matches is the
# longest, so "TPU v5 lite" is not taken for the v5p's "TPU v5".
_BY_PREFIX = sorted(
  ((kind.lower(), a) for a in _TABLE for kind in a.device_kinds), key=lambda p: -len(p[0])
)


def for_device_kind(device_kind: str) -> Accelerator | None:
  """The accelerator of a ``jax.Device.device_kind``, or None (a CPU, a chip not listed)."""
  kind = device_kind.lower()
  return next((a for prefix, a in _BY_PREFIX if kind.startswith(prefix)), None)


def peak_flops(device_kind: str, dtype="bfloat16") -> float | None:
  """The dense peak FLOP/s of one device of ``device_kind`` in ``dtype``, or None when
  the table has no such device or no peak for that dtype."""
  accelerator = for_device_kind(device_kind)
  return None if accelerator is None else accelerator.flops(dtype)


def _dtype_name(dtype) -> str:
  return dtype if isinstance(dtype, str) else np.dtype(dtype).name
