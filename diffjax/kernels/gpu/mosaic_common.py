"""What the Mosaic GPU kernels (forward, backward, decode) share: launch, ring, tiles, products.

:func:`run_warpgroups`, :func:`producer_ring`, :func:`smem_tile`, the online softmax, ``wgmma``.
Design: docs/kernels_gpu.md, "The kernels" and "In the interpreter (numbers)".
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from diffjax.kernels.gpu.pair_common import EMPTY_LSE, NEG, PairGeometry

BLOCK_Q = 64  # query rows per warpgroup: the M of one wgmma
COMPUTE_WGS = 2
_ROW = plgpu.Layout.WGMMA.reduce(1)
_COL = plgpu.Layout.WGMMA.reduce(0)


@dataclasses.dataclass(frozen=True)
class MosaicConfig(PairGeometry):
  """Static description of one call (hashable: a custom_vjp non-diff argument).

  Attributes:
    variant: "v1" (two query and key arrays, one lambda per head) or "v2" (heads 2i
      and 2i+1 of one query array on one key array, one lambda per token).
    causal: causal mask; queries are the last ``q_len`` of ``kv_len`` positions.
    scale: score scale.
    q_len, kv_len: true (unpadded) lengths.
    group: DIFF heads (V1) or pairs (V2) per kv group.
    segments: whether segment ids are passed.
    block_kv: keys per step of the forward kernel.
    stages: shared-memory slots of the forward kernel's K/V ring.
    interpret: run in the Mosaic GPU interpreter.
    bwd_stages, dq_parts: the backward's tiles (:class:`MosaicBlockSizes`).
    noise_group: r, the signal heads that share one noise head (grouped differential
      attention, :mod:`~diffjax.kernels.gpu.mosaic_gda`); 1 for DIFF V1 / V2.
  """

  variant: str
  causal: bool
  scale: float
  q_len: int
  kv_len: int
  group: int
  segments: bool
  block_kv: int
  stages: int
  interpret: bool
  bwd_stages: int = 1
  dq_parts: int = 1
  noise_group: int = 1

  def kernel_kwargs(self) -> dict:
    return launch_kwargs(self.interpret)


def launch_kwargs(interpret: bool) -> dict:
  """Keyword arguments of ``plgpu.kernel`` / ``pl.kernel`` for a three-warpgroup kernel.

  ``interpret``: jax's Mosaic GPU interpreter (``InterpretGPUParams``) on the CPU, as jax
  ships it; jax 0.10 and 0.11 interpret only part of what these kernels use
  (docs/kernels_gpu.md says what, and what the interpreted tests leave unchecked).
  """
  if interpret:
    check_threads(COMPUTE_WGS + 1)
    return dict(interpret=_interpret_params())
  return dict(compiler_params=plgpu.CompilerParams(approx_math=False))


def _interpret_params():
  """jax's parameters of its Mosaic GPU interpreter, with their defaults."""
  params = getattr(plgpu, "InterpretGPUParams", None)
  if params is None:  # jax 0.10 names them only in a private module
    from jax._src.pallas.mosaic_gpu.interpret import params as gpu_params  # pylint: disable=import-outside-toplevel

    params = gpu_params.InterpretGPUParams
  return params()


def check_threads(num_threads: int) -> None:
  """Raises if the CPU client cannot run ``num_threads`` warpgroups at once.

  The Mosaic GPU interpreter runs each warpgroup of a CTA as its own CPU computation, and
  a warpgroup blocked in a barrier wait holds its thread of the CPU client's pool. That
  pool has ``max(CPU cores, host devices)`` threads, so a kernel with a producer and two
  consumer warpgroups needs at least three, or it stalls for good; this turns the stall
  into an error that names the fix.
  """
  cpu = jax.devices("cpu")
  pool = max(
    len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
    len(cpu),
  )
  if pool < num_threads:
    raise RuntimeError(
      f"The Mosaic GPU interpreter runs each of this kernel's {num_threads} "
      f"warpgroups as its own computation, but this CPU client runs {pool} at once "
      f"({len(cpu)} host device(s) on a machine with fewer cores), so the kernel "
      "would stall in a barrier wait. Start the process with "
      f"XLA_FLAGS=--xla_force_host_platform_device_count={max(num_threads, 8)} (or "
      f"jax.config.update('jax_num_cpu_devices', {max(num_threads, 8)}) before the "
      "first jax call)."
    )


def swizzle_bytes(width: int, itemsize: int, max_swizzle: int = 128) -> int:
  """The widest of 128/64/32-byte swizzles (at most ``max_swizzle``) dividing a row."""
  row = width * itemsize
  for swizzle in (128, 64, 32):
    if swizzle <= max_swizzle and row % swizzle == 0:
      return swizzle
  raise ValueError(
    f"A row of {width} elements of {itemsize} bytes ({row} bytes) is not a "
    "multiple of 32 bytes; use a head dim that is a multiple of 16."
  )


def smem_transforms(width: int, dtype, max_swizzle: int = 128) -> tuple:
  """Tiling + swizzle of a [rows, width] shared-memory tile that ``wgmma`` reads.

  The swizzle is the widest of 128, 64 and 32 bytes that divides a row (and is at most
  ``max_swizzle``), so head dims like 80 (160-byte rows: 32-byte swizzle) and 96
  (64-byte swizzle) need no padding.
  """
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = swizzle_bytes(width, itemsize, max_swizzle)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def smem_tile(shape, width: int, dtype, max_swizzle: int = 128):
  """A shared-memory buffer that ``wgmma`` reads, swizzled for rows of ``width``."""
  return plgpu.SMEM(shape, dtype, transforms=smem_transforms(width, dtype, max_swizzle))


def store_out(value, tile, dst) -> None:
  """Stores the [rows, w] ``value`` to the global-memory view ``dst`` through the shared-memory
  ``tile`` ([rows, W], W >= w, free to overwrite): into its first w columns, then by TMA.

  Mosaic GPU stores a wgmma-layout value to global memory from registers only where each warp
  writes whole 32-byte sectors and the warpgroup whole 128-byte lines, which jax 0.12 checks:
  16-bit tiles never pass, float32 ones whose rows are not whole lines do not either. A TMA copy
  reads contiguous shared memory, so a tile's first w < W columns go 8 rows (one row of
  swizzle tiles) a copy. The caller waits for the copies (``plgpu.wait_smem_to_gmem``) before
  it writes the tile again or ends.
  """
  rows, width = value.shape
  if width == tile.shape[-1]:
    tile[...] = value
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile, dst)
    return
  tile.at[:, pl.ds(0, width)][...] = value
  plgpu.commit_smem()
  for r in range(0, rows, 8):
    plgpu.copy_smem_to_gmem(tile.at[pl.ds(r, 8), pl.ds(0, width)], dst.at[pl.ds(r, 8)])


def barriers(n: int = 1, arrivals: int = 1):
  return plgpu.Barrier(num_arrivals=arrivals, num_barriers=n)


def scratch_refs(refs, scratch):
  """Puts None back where a scratch buffer was left out (it is unused there)."""
  it = iter(refs)
  return [None if x is None else next(it) for x in scratch]


def run_warpgroups(consumer, producer) -> None:
  """Warpgroups 0 and 1 run ``consumer(0)`` and ``consumer(1)``, warpgroup 2 ``producer``."""
  wg = lax.axis_index("wg")
  pl.when(wg == 0)(functools.partial(consumer, 0))
  pl.when(wg == 1)(functools.partial(consumer, 1))
  pl.when(wg == 2)(producer)


def producer_ring(load, n, stages: int, consumed) -> None:
  """The producer's side of a ring of ``stages`` shared-memory slots.

  ``load(step, slot)`` issues the TMA copies of steps 0 .. n - 1, each into slot
  ``step % stages`` once both consumers have released it (``consumed``, two arrivals).
  At the end the producer also observes each slot's last release, so every barrier ends
  on a phase all its waiters saw (the interpreter checks this).
  """
  for i in range(stages):
    pl.when(i < n)(functools.partial(load, jnp.int32(i), i))

  def refill(j, carry):
    slot = lax.rem(j, jnp.int32(stages))
    plgpu.barrier_wait(consumed.at[slot])
    load(j, slot)
    return carry

  lax.fori_loop(jnp.int32(stages), jnp.maximum(n, stages), refill, None)
  for i in range(stages):
    pl.when(i < n)(functools.partial(plgpu.barrier_wait, consumed.at[i]))


def iota(shape, dim):
  return plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, shape, dim), plgpu.Layout.WGMMA)


def row(x):
  """``x`` [M] in the layout of a per-row vector of a wgmma tile."""
  return plgpu.layout_cast(x, _ROW)


def col(x):
  """``x`` [N] in the layout of a per-column vector of a wgmma tile."""
  return plgpu.layout_cast(x, _COL)


def bcast_rows(x, shape):
  """A per-row vector [M] broadcast along the columns of an [M, N] tile."""
  return lax.broadcast_in_dim(x, shape, [0])


def bcast_cols(x, shape):
  """A per-column vector [N] broadcast along the rows of an [M, N] tile."""
  return lax.broadcast_in_dim(x, shape, [1])


def product(shape, a, b_ref):
  """``a @ b_ref`` into a fresh float32 accumulator (a: smem ref or registers)."""

  def body(acc_ref):
    plgpu.wgmma(acc_ref, a, b_ref)
    return acc_ref[...]

  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def accumulate(acc, a, b_ref, cfg):
  """``acc + a @ b_ref`` with ``acc`` kept in the wgmma accumulator registers.

  Compiled kernels accumulate in place (``pl.run_state`` with ``plgpu.ACC.init``).
  The Mosaic GPU interpreter (jax 0.10 and 0.11 alike) cannot run ``run_state``
  accumulators; there the product goes to a fresh zero accumulator and is added, which
  is the value the in-place ``wgmma`` (``acc + a @ b``) computes. So the interpreted
  tests check this value, never the in-place program (docs/kernels_gpu.md).
  """
  if cfg.interpret:
    return acc + product(acc.shape, a, b_ref)

  def body(acc_ref):
    plgpu.wgmma(acc_ref, a, b_ref)

  return pl.run_state(body)(plgpu.ACC.init(acc))


def pair_refs(refs, v1: bool):
  """The first query and key refs of a pair kernel's arguments: (qa, qb, ka, kb).

  V1 passes Q1, Q2, K1, K2; V2 passes one Q and one K (its two halves), used twice.
  """
  qa = next(refs)
  qb = next(refs) if v1 else qa
  ka = next(refs)
  kb = next(refs) if v1 else ka
  return qa, qb, ka, kb


def softmax_start(rows: int, dv: int):
  """The online softmax's carry before the first key block: the [rows, dv] accumulator,
  the running base-2 row maximum and the running row sum."""
  return (
    plgpu.layout_cast(jnp.zeros((rows, dv), jnp.float32), plgpu.Layout.WGMMA),
    row(jnp.full((rows,), NEG, jnp.float32)),
    row(jnp.zeros((rows,), jnp.float32)),
  )


def softmax_step(carry, scores, v_tile, v_ready, consumed, cfg, dtype, *, masked: bool):
  """Folds one block of base-2 scores into the carry: rescales, waits for the block's V
  tile (``v_ready``), adds P @ V and frees the ring slot (``consumed``).

  ``masked``: the block may hold rows with every key masked so far (max still NEG); their
  probabilities are taken against 0 so that they stay 0.
  """
  acc, m, l = carry
  m_new = jnp.maximum(m, scores.max(axis=1))
  m_ref = jnp.where(m_new == NEG, 0.0, m_new) if masked else m_new
  alpha = jnp.exp2(m - m_new)
  p = jnp.exp2(scores - bcast_rows(m_ref, scores.shape))
  l = alpha * l + p.sum(axis=1)
  acc = acc * bcast_rows(alpha, acc.shape)
  plgpu.barrier_wait(v_ready)
  acc = accumulate(acc, p.astype(dtype), v_tile, cfg)
  plgpu.barrier_arrive(consumed)
  return acc, m_new, l


def softmax_finish(acc, m, l):
  """(normalised output, base-2 log-sum-exp per row); a row that saw no key gets 0 and
  EMPTY_LSE."""
  empty = l == 0.0
  safe = jnp.where(empty, 1.0, l)
  return (acc * bcast_rows(1.0 / safe, acc.shape), jnp.where(empty, EMPTY_LSE, m + jnp.log2(safe)))
