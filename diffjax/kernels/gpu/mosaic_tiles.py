"""Tiles of the Mosaic GPU kernels and the budgets that choose them.

Shared-memory models, register estimates and :class:`MosaicBlockSizes`, validated against both.
Design: docs/kernels_gpu.md, "Tiles and the models behind them".
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from diffjax import hardware
from diffjax.kernels.gpu import pair_common as pc
from diffjax.kernels.gpu.mosaic_common import BLOCK_Q, COMPUTE_WGS, swizzle_bytes

# What the kernels are tiled for: an H100 (an H200 has the same SMs).
_HOPPER_GPU = hardware.get("h100")
SMEM_BYTES = _HOPPER_GPU.smem_per_block  # shared memory one CTA may opt in to: 227 KiB
# Registers of an SM, shared by the CTA's three warpgroups as ``set_max_registers`` splits
# them (two consumers and a producer of 128 threads each).
REGISTERS_PER_SM = _HOPPER_GPU.registers_per_sm
SMEM_ALIGN = 1024  # Mosaic GPU places every scratch buffer at a multiple of 1 KiB
BARRIER_BYTES = 8
# What plgpu.kernel adds to its scratch buffers (pl.kernel with run_scoped adds nothing).
KERNEL_SMEM_EXTRA = 2048


def _buffers(*nbytes: int) -> int:
  return sum(pc.round_up(n, SMEM_ALIGN) for n in nbytes if n)


# ----------------------------------------------------------------------------------
# Forward.


def exchange_parts(dv: int) -> int:
  """Column chunks in which O2 crosses to warpgroup 0: two of 128 from Dv = 256 on.

  Halving the float32 exchange buffer is what lets V1 at d 128 (Dv 256) keep two ring
  slots within shared memory.
  """
  return 2 if dv >= 256 and dv % 256 == 0 else 1


def forward_smem_bytes(
  d: int,
  dv: int,
  block_kv: int,
  stages: int,
  variant: str,
  segments: bool = True,
  itemsize: int = 2,
) -> int:
  """Shared memory the forward kernel is launched with, in bytes."""
  v1 = variant == "v1"
  keys = _buffers(stages * block_kv * d * itemsize) * (2 if v1 else 1)
  buffers = keys + _buffers(
    COMPUTE_WGS * BLOCK_Q * d * itemsize,  # Q of both maps
    stages * block_kv * dv * itemsize,  # V ring
    BLOCK_Q * dv // exchange_parts(dv) * 4,  # O2 crossing to warpgroup 0
    BLOCK_Q * 4,
    COMPUTE_WGS * BLOCK_Q * 4,  # lambda, log-sum-exps
    COMPUTE_WGS * BLOCK_Q * 4 if segments else 0,  # query segment ids
    stages * block_kv * 4 if segments else 0,
  )  # key segment ids
  bars = 2 * COMPUTE_WGS + stages * (3 + v1 + segments) + 2 + (exchange_parts(dv) > 1)
  return buffers + bars * BARRIER_BYTES + KERNEL_SMEM_EXTRA


# (keys per step, ring slots), preferred first. Steps are 64 keys: the P V wgmma reads
# V as an MN-major operand, whose K extent (the keys) must be a multiple of the
# swizzle width in elements (64 at a 128-byte swizzle). Three slots hide a TMA round
# trip behind two steps of compute; V1 at d 128 (Dv 256) gets two (a third does not fit
# beside the K1, K2 and V tiles of the other two); one slot is the fallback for widths
# beyond these, loading the next block only after both warpgroups are done with the last.
_CANDIDATES = ((64, 3), (64, 2), (64, 1))


def forward_blocks(
  d: int, dv: int, variant: str, segments: bool = True, itemsize: int = 2
) -> tuple[int, int]:
  """(block_kv, stages) of the forward kernel: the first candidate within ``SMEM_BYTES``.

  Examples (bf16): V1 d 64 / Dv 128 -> (64, 3); V2 d 128 -> (64, 3); V1 d 128 / Dv 256
  -> (64, 2), with O2 exchanged in two halves.
  """
  for block_kv, stages in _CANDIDATES:
    if forward_smem_bytes(d, dv, block_kv, stages, variant, segments, itemsize) <= SMEM_BYTES:
      return block_kv, stages
  raise ValueError(
    f"No block size fits shared memory for d={d}, dv={dv} ({variant}); "
    "the smallest needs "
    f"{forward_smem_bytes(d, dv, 64, 1, variant, segments, itemsize)} bytes."
  )


# Registers a forward/decode consumer thread may hold (set_max_registers), its producer's,
# and what is not tiles: the row statistics, indices, addresses (an estimate from the tile
# shapes). 2 x 128 consumer threads at 232 and 128 producer threads at 40 use 64,512 of
# REGISTERS_PER_SM.
CONSUMER_REGISTERS = 232
PRODUCER_REGISTERS = 40
_REGISTER_OVERHEAD = 32


def consumer_registers(dv: int, block_kv: int) -> int:
  """Estimated registers per consumer thread of the forward kernel.

  The float32 [64, Dv] accumulator (Dv / 2 a thread over 128 threads), the float32
  [64, block_kv] score tile (block_kv / 2), its bf16 probabilities (block_kv / 4), and
  ``_REGISTER_OVERHEAD``. Dv 256 with 64-key steps: 128 + 32 + 16 + 32 = 208.
  """
  return dv // 2 + block_kv // 2 + block_kv // 4 + _REGISTER_OVERHEAD


# ----------------------------------------------------------------------------------
# Backward.

BLOCK_KV_BWD = 64  # keys per CTA of the backward: the M of its key-major wgmmas
ROWS = 5  # per-row terms the backward reads: lse_a, lse_b, d_a, d_b, lam
# Queries per sub-tile of a backward step: the K extent of the MN-major Q and dO
# operands of the dK and dV products, so every backward tile takes at most a 64-byte
# swizzle (one swizzle serves both operands of a wgmma).
BWD_Q_SUB = 32
BWD_REGISTERS = 240  # per consumer thread: with the producer's 24, 64,512 of REGISTERS_PER_SM
BWD_PRODUCER_REGISTERS = 24
_BWD_OVERHEAD = 40  # indices, barrier and TMA addresses, the row vectors of a sub-tile


def bwd_swizzle_cap(itemsize: int = 2) -> int:
  return BWD_Q_SUB * itemsize


def value_split(dv: int) -> tuple[int, int]:
  """Column widths of dV (and of V, dO) held by warpgroups 0 and 1.

  Both are multiples of 16 (wgmma's K step for the dP half-products): Dv 256 -> (128,
  128); V2 at d 80 (Dv 80) -> (48, 32).
  """
  if dv % 16:
    raise ValueError(f"value dim {dv} must be a multiple of 16.")
  first = pc.round_up(dv // 2, 16)
  if first >= dv:
    raise ValueError(
      f"value dim {dv} is too small to split between two warpgroups (it needs at least 32)."
    )
  return first, dv - first


def dq_parts(d: int, itemsize: int = 2) -> int:
  """Column chunks of dQ = dS K, each formed and reduce-added on its own.

  Chunks of 32 columns (16 accumulator registers a thread) where d is a multiple of
  32; a chunk is a column slice of the K tile, so it spans whole swizzle rows. Else
  one chunk. d 128 -> 4; d 96 -> 3; d 80 -> 1.
  """
  swizzle_elems = swizzle_bytes(d, itemsize, bwd_swizzle_cap(itemsize)) // itemsize
  width = 32
  if d % width == 0 and width % swizzle_elems == 0:
    return d // width
  return 1


def backward_smem_bytes(
  d: int, dv: int, stages: int, parts: int, variant: str, segments: bool = True, itemsize: int = 2
) -> int:
  """Shared memory the backward kernel is launched with, in bytes."""
  bq, bk = BLOCK_Q, BLOCK_KV_BWD
  keys = 2 if variant == "v1" else 1
  widths = value_split(dv)
  buffers = _buffers(
    keys * bk * d * itemsize,  # K_a (K_b), loaded once
    *(bk * w * itemsize for w in widths),  # V halves, loaded once
    *(stages * bq * d * itemsize for _ in range(COMPUTE_WGS)),  # Q ring per map
    *(stages * bq * w * itemsize for w in widths),  # dO halves ring
    stages * ROWS * bq * 4,  # row terms
    stages * bq * 4 if segments else 0,  # query segment ids
    bk * 4 if segments else 0,  # key segment ids
    COMPUTE_WGS * bk * BWD_Q_SUB * 4,  # dP halves crossing
    COMPUTE_WGS * bk * bq * itemsize,  # P crossing, then dS^T
    COMPUTE_WGS * bq * (d // parts) * 4,  # dQ chunk on its way to HBM
    COMPUTE_WGS * 4,
  )  # an opaque zero per warpgroup
  bars = 5 + stages * (2 * COMPUTE_WGS + 2 + segments) + 2
  return buffers + bars * BARRIER_BYTES


def backward_registers(d: int, dv: int) -> int:
  """Estimated registers per consumer thread of the backward kernel.

  All loop: a [64, d] float32 dK (d / 2 a thread) and a [64, Dv / 2] dV half (Dv / 4).
  A 32-query sub-tile adds its score/probability, dP and kept-probability tiles
  (16 each); the dQ chunk (at most 16) comes when those are dead. V1 d 128:
  64 + 64 + 48 + 40 overhead = 216 of 240.
  """
  half = value_split(dv)[0]
  return d // 2 + half // 2 + 3 * (BLOCK_KV_BWD * BWD_Q_SUB // 128) + _BWD_OVERHEAD


def backward_step_bytes(d: int, dv: int, variant: str, itemsize: int = 2) -> dict:
  """A model of the HBM bytes and FLOPs per visited step (64 queries x 64 keys) of
  three backward designs.

  * ``"key_major"`` (this kernel; one pass): per step it reads Q_a, Q_b, dO and the
    row terms, and reduce-adds both maps' float32 dQ rows (``2 * 64 * d * 4`` bytes;
    an add that misses L2 also reads them back: ``"key_major_l2_miss"``). K and V are
    read once per CTA. Backward FLOPs per query-key pair: 20d (V1), 16d (V2). The dQ
    chunks change how many reduce-adds carry the bytes, not the bytes.
  * ``"query_major"`` (one pass, the other way round): per step it reads K_a, K_b (V1)
    and V, and reduce-adds float32 dK_a, dK_b and dV; Q and dO are read once per CTA.
    The same FLOPs.
  * ``"two_pass"`` (a dK/dV kernel and a separate dQ kernel): the key-major reads, plus
    the dQ pass's re-reads of K_a, K_b and V; it recomputes the scores and dP: 28d (V1),
    22d (V2).

  Returns bytes per step (keys ending in ``_flops``: FLOPs per step).
  """
  bq = bk = BLOCK_Q
  keys = 2 if variant == "v1" else 1
  q_reads = bq * (2 * d + dv) * itemsize + ROWS * bq * 4
  kv_reads = bk * (keys * d + dv) * itemsize
  dq = 2 * bq * d * 4
  pairs = bq * bk
  v1 = variant == "v1"
  return {
    "key_major": q_reads + dq,
    "key_major_l2_miss": q_reads + 2 * dq,
    "query_major": kv_reads + bk * (keys * d + dv) * 4,
    "two_pass": q_reads + kv_reads,
    "one_pass_flops": (20 if v1 else 16) * pairs * d,
    "two_pass_flops": (28 if v1 else 22) * pairs * d,
  }


# Ring slots of the backward, preferred first: two let the producer load the next
# step's Q and dO while this one computes. V1 d 128 / Dv 256 gets one.
_BWD_STAGES = (2, 1)


def backward_blocks(
  d: int, dv: int, variant: str, segments: bool = True, itemsize: int = 2
) -> tuple[int, int]:
  """(stages, dq_parts) of the backward kernel: the deepest ring within shared memory."""
  parts = dq_parts(d, itemsize)
  for stages in _BWD_STAGES:
    if backward_smem_bytes(d, dv, stages, parts, variant, segments, itemsize) <= SMEM_BYTES:
      return stages, parts
  raise ValueError(
    f"No backward tiling fits shared memory for d={d}, dv={dv} ({variant}): the "
    f"smallest needs {backward_smem_bytes(d, dv, 1, parts, variant, segments, itemsize)} "
    f"bytes of {SMEM_BYTES}."
  )


@dataclasses.dataclass(frozen=True)
class MosaicBlockSizes:
  """Tiles of the Mosaic GPU kernels, validated against the H100/H200 budgets.

  Attributes:
    block_kv: keys per step of the forward: a multiple of 64 (the P V wgmma reads V
      MN-major, whose key extent must be a multiple of the 128-byte swizzle's 64
      elements) and at most 256 (the N of the S = Q K^T wgmma).
    stages: shared-memory slots of the forward's K/V ring, 1 to 4.
    bwd_stages: slots of the backward's Q/dO ring, 1 to 4; None: the budget's choice.
    dq_parts: column chunks in which the backward forms and reduce-adds dQ; None: 32
      columns a chunk where the swizzle allows (:func:`dq_parts`).

  :meth:`default` takes the deepest forward ring of 64-key steps that fits shared
  memory (:func:`forward_blocks`) and the backward tiles of :func:`backward_blocks`;
  :meth:`check` rejects a choice that exceeds shared memory or the consumer's
  registers, naming both numbers; :meth:`resolved` fills the backward fields left None.
  """

  block_kv: int = 64
  stages: int = 3
  bwd_stages: int | None = None
  dq_parts: int | None = None

  def __post_init__(self):
    for name in ("block_kv", "stages", "bwd_stages", "dq_parts"):
      value = getattr(self, name)
      if name in ("bwd_stages", "dq_parts") and value is None:
        continue
      if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an int.")
    if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
      raise ValueError(
        f"block_kv={self.block_kv} must be 64, 128, 192 or 256 (a multiple "
        "of 64 for the P V wgmma, at most 256 for the S = Q K^T wgmma)."
      )
    if not 1 <= self.stages <= 4:
      raise ValueError(f"stages={self.stages} must be in [1, 4].")
    if self.bwd_stages is not None and not 1 <= self.bwd_stages <= 4:
      raise ValueError(f"bwd_stages={self.bwd_stages} must be in [1, 4] (or None).")
    if self.dq_parts is not None and self.dq_parts not in (1, 2, 3, 4):
      raise ValueError(f"dq_parts={self.dq_parts} must be 1, 2, 3 or 4 (or None).")

  @classmethod
  def default(
    cls, d: int, dv: int, variant: str, segments: bool = True, itemsize: int = 2
  ) -> MosaicBlockSizes:
    try:
      backward = backward_blocks(d, dv, variant, segments, itemsize)
    except ValueError:  # a forward-only caller may still run; resolved() names the bytes
      backward = (None, None)
    return cls(*forward_blocks(d, dv, variant, segments, itemsize), *backward)

  def resolved(
    self, d: int, dv: int, variant: str, segments: bool = True, itemsize: int = 2
  ) -> MosaicBlockSizes:
    """These tiles with the backward fields filled in, after :meth:`check`."""
    parts = self.dq_parts or dq_parts(d, itemsize)
    stages = self.bwd_stages
    if stages is None:
      stages = next(
        (
          s
          for s in _BWD_STAGES
          if backward_smem_bytes(d, dv, s, parts, variant, segments, itemsize) <= SMEM_BYTES
        ),
        1,
      )
    out = dataclasses.replace(self, bwd_stages=stages, dq_parts=parts)
    out.check(d, dv, variant, segments, itemsize)
    return out

  def check(self, d: int, dv: int, variant: str, segments: bool = True, itemsize: int = 2) -> None:
    """Raises ValueError if these tiles do not fit one CTA of an H100/H200."""

    def fits(what: str, smem: int, fix: str) -> None:
      if smem > SMEM_BYTES:
        default = MosaicBlockSizes.default(d, dv, variant, segments, itemsize)
        raise ValueError(
          f"{self}{what} needs {smem} bytes of shared memory for d={d}, dv={dv} "
          f"({variant}); a CTA has {SMEM_BYTES}. Use {fix} (the default here is "
          f"{default})."
        )

    fits(
      "",
      forward_smem_bytes(d, dv, self.block_kv, self.stages, variant, segments, itemsize),
      "fewer stages or a smaller block_kv",
    )
    regs = consumer_registers(dv, self.block_kv)
    if regs > CONSUMER_REGISTERS:
      raise ValueError(
        f"{self} needs about {regs} registers a consumer thread at dv={dv}; the kernel "
        f"gives each {CONSUMER_REGISTERS}. Use a smaller block_kv."
      )
    if self.dq_parts is not None:
      swizzle_elems = swizzle_bytes(d, itemsize, bwd_swizzle_cap(itemsize)) // itemsize
      if d % self.dq_parts or (d // self.dq_parts) % swizzle_elems:
        raise ValueError(
          f"dq_parts={self.dq_parts} must split d={d} into chunks of whole "
          f"{swizzle_elems}-element swizzle rows."
        )
    if self.bwd_stages is not None and self.dq_parts is not None:
      fits(
        ": the backward",
        backward_smem_bytes(d, dv, self.bwd_stages, self.dq_parts, variant, segments, itemsize),
        "fewer bwd_stages or more dq_parts",
      )


def check_inputs(variant: str, qs, ks, v) -> None:
  """Clear errors for what the kernels do not take (before Mosaic GPU's own checks)."""
  if variant not in ("v1", "v2"):
    raise ValueError(f"variant={variant!r} must be 'v1' or 'v2'.")
  if len(qs) != (2 if variant == "v1" else 1) or len(ks) != len(qs):
    wanted = "(q1, q2) and (k1, k2)" if variant == "v1" else "(q,) and (k,)"
    raise ValueError(f"{variant} takes {wanted}; got {len(qs)} query and {len(ks)} key arrays.")
  dtypes = {jnp.dtype(x.dtype) for x in (*qs, *ks, v)}
  if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(
      f"The Mosaic GPU kernels take bfloat16 or float16 q, k and v of one dtype; got "
      f"{sorted({jnp.dtype(x.dtype).name for x in (*qs, *ks, v)})}. Cast them, or use "
      "implementation='stock' (jax.nn.dot_product_attention), which takes float32."
    )
  for name, width in (("head dim", qs[0].shape[-1]), ("value dim", v.shape[-1])):
    if width % 16:
      raise ValueError(f"{name} {width} must be a multiple of 16 (wgmma's K step).")


def fits(variant: str, dtype, d: int, dv: int, segments: bool) -> bool:
  """Whether the Mosaic GPU kernels take these inputs (dtype, widths, shared memory)."""
  if dtype is None or jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return False
  if d % 16 or dv % 16 or dv < 32:
    return False
  itemsize = jnp.dtype(dtype).itemsize
  try:
    forward_blocks(d, dv, variant, segments, itemsize)
    backward_blocks(d, dv, variant, segments, itemsize)
  except ValueError:
    return False
  return True
