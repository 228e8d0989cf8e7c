"""DIFF V1 decoding on Mosaic GPU (Hopper): one query token against a KV cache.

:func:`diff_v1_decode_pallas_gpu` and, on the same kernel, :func:`gda_v1_decode_pallas_gpu`.
Design: docs/kernels_gpu.md, "The kernels" (Decode) and "Grouped differential attention".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from diffjax.core import reference
from diffjax.core import validation as _v
from diffjax.core.platform import HOPPER, gpu_capability
from diffjax.kernels.gpu import mosaic_common as mc
from diffjax.kernels.gpu import mosaic_tiles as tiles
from diffjax.kernels.gpu import pair_common as pc
from diffjax.kernels.gpu.pair_common import EMPTY_LSE, LOG2E, NEG

BLOCK_KV = 64  # cache rows per step (the key extent of the P V wgmma: 64 at a 128B swizzle)
ROWS = mc.BLOCK_Q  # query rows of a tile: the heads of one kv group, zero-padded
LENS = 32  # kv_len is copied as 32 int32 (one 128-byte TMA box) per batch row
# CTAs to aim for when choosing cache splits: a wave on an H100/H200 (132 SMs, one CTA
# each at this shared memory).
TARGET_CTAS = 132


def decode_smem_bytes(d: int, dv: int, stages: int, itemsize: int = 2) -> int:
  """Shared memory the decode kernel is launched with, in bytes (buffers aligned to
  1 KiB, 8 bytes a barrier, as :mod:`~diffjax.kernels.gpu.mosaic_tiles` counts)."""
  align = lambda n: pc.round_up(n, tiles.SMEM_ALIGN)
  q = mc.COMPUTE_WGS * align(ROWS * d * itemsize)
  keys = mc.COMPUTE_WGS * align(stages * BLOCK_KV * d * itemsize)
  values = align(stages * BLOCK_KV * dv * itemsize)
  rows = align(mc.COMPUTE_WGS * ROWS * 4) + align(LENS * 4)
  bars = mc.COMPUTE_WGS + mc.COMPUTE_WGS * stages + stages + 1 + stages
  return q + keys + values + rows + bars * tiles.BARRIER_BYTES + tiles.KERNEL_SMEM_EXTRA


def decode_stages(d: int, dv: int, itemsize: int = 2) -> int:
  """Ring slots: the most (up to 4) within shared memory. d 128 / Dv 256 -> 2."""
  for stages in (4, 3, 2, 1):
    if decode_smem_bytes(d, dv, stages, itemsize) <= tiles.SMEM_BYTES:
      return stages
  raise ValueError(f"No decode tiling fits shared memory for d={d}, dv={dv}.")


def cache_length_multiple() -> int:
  """The multiple a cache's length should have to be read in place (else it is padded)."""
  return BLOCK_KV


def num_splits(batch: int, kv_heads: int, kv_len: int, target: int = TARGET_CTAS) -> int:
  """Cache splits: enough CTAs for a wave, at most one 64-row block each."""
  blocks = max(1, -(-kv_len // BLOCK_KV))
  return max(1, min(blocks, -(-target // (batch * kv_heads))))


@dataclasses.dataclass(frozen=True)
class MosaicDecodeBlockSizes:
  """Launch choice of the Mosaic GPU decode kernel.

  Attributes:
    num_splits: cache splits per (batch row, kv group); None: enough CTAs for one
      wave of an H100/H200 (:func:`num_splits`). The steps are 64 cache rows (the key
      extent of the P V wgmma at a 128-byte swizzle) and the ring depth is the most that
      fits shared memory (:func:`decode_stages`), so only the split count is free.
  """

  num_splits: int | None = None

  def __post_init__(self):
    n = self.num_splits
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
      raise ValueError(f"num_splits={n!r} must be a positive int (or None).")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  scale: float
  split_len: int  # cache rows per split (a multiple of 64; the last split may be cut)
  splits: int
  stages: int
  interpret: bool


def _scratch(dtype, d: int, dv: int, stages: int) -> list:
  """The decode kernel's shared-memory buffers and barriers, in its argument order."""
  bk = BLOCK_KV
  smem = lambda shape, width: mc.smem_tile(shape, width, dtype)
  bars = mc.barriers
  return [
    [smem((ROWS, d), d) for _ in range(mc.COMPUTE_WGS)],  # q_smem
    [smem((stages, bk, d), d) for _ in range(mc.COMPUTE_WGS)],  # k_smem (K1, K2)
    smem((stages, bk, dv), dv),  # v_smem
    plgpu.SMEM((mc.COMPUTE_WGS, ROWS), jnp.float32),  # lse_smem
    plgpu.SMEM((LENS,), jnp.int32),  # len_smem
    bars(mc.COMPUTE_WGS),  # q_bar
    bars(mc.COMPUTE_WGS * stages),  # k_bar [w * stages + slot]
    bars(stages),  # v_bar
    bars(),  # len_bar
    bars(stages, mc.COMPUTE_WGS),  # consumed
  ]


def decode_partials(cfg: DecodeConfig, q1, q2, k1, k2, v, lens):
  """Per-split partial results.

  Args:
    q1, q2: [B, K, 64, d], the G heads of each kv group in the first rows.
    k1, k2: [B, S, K, d] and v: [B, S, K, Dv], S a multiple of 64; splits past S
      (or past a row's kv_len) read nothing.
    lens: int32 [B, 32], the valid cache length of row b in lens[b, 0].
  Returns:
    (o1, o2) float32 [B, K, splits, 64, Dv], normalised per split, and (lse1, lse2)
    float32 [B, K, splits, 64] in base 2 (``EMPTY_LSE`` for a split with no valid row).
  """
  # One function: the kernel's warpgroups are closures over the sizes set here.
  b, kh, _, d = q1.shape
  dv = v.shape[3]
  dtype = q1.dtype
  bk, stages = BLOCK_KV, cfg.stages
  splits = cfg.splits
  c = cfg.scale * LOG2E

  def kernel(
    q1_ref,
    q2_ref,
    k1_ref,
    k2_ref,
    v_ref,
    len_ref,
    o1_ref,
    o2_ref,
    lse1_ref,
    lse2_ref,
    q_smem,
    k_smem,
    v_smem,
    lse_smem,
    len_smem,
    q_bar,
    k_bar,
    v_bar,
    len_bar,
    consumed,
  ):
    kvh = lax.axis_index("kv_heads")
    split = lax.axis_index("splits")
    bi = lax.axis_index("batch")
    start = split * cfg.split_len

    def blocks():
      plgpu.barrier_wait(len_bar.at[0])
      kv_len = len_smem[0]
      return kv_len, jnp.clip(lax.div(kv_len - start + bk - 1, bk), 0, cfg.split_len // bk)

    def consumer(w: int):
      plgpu.set_max_registers(tiles.CONSUMER_REGISTERS, action="increase")
      q_ref = (q1_ref, q2_ref)[w]
      plgpu.copy_gmem_to_smem(q_ref.at[bi, kvh], q_smem[w], q_bar.at[w])
      kv_len, n = blocks()
      plgpu.barrier_wait(q_bar.at[w])

      def step(j, carry):
        slot = lax.rem(j, jnp.int32(stages))
        plgpu.barrier_wait(k_bar.at[w * stages + slot])
        sc = mc.product((ROWS, bk), q_smem[w], k_smem[w].at[slot].transpose((1, 0))) * c
        kpos = start + j * bk + mc.iota((ROWS, bk), 1)
        sc = jnp.where(kpos < kv_len, sc, NEG)
        return mc.softmax_step(
          carry, sc, v_smem.at[slot], v_bar.at[slot], consumed.at[slot], cfg, dtype, masked=False
        )

      out, lse = mc.softmax_finish(*lax.fori_loop(0, n, step, mc.softmax_start(ROWS, dv)))
      (o1_ref, o2_ref)[w][bi, kvh, split] = out
      lse_smem[w] = lse
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(lse_smem.at[w], (lse1_ref, lse2_ref)[w].at[bi, kvh, split])
      plgpu.wait_smem_to_gmem(0)

    def producer():
      plgpu.set_max_registers(tiles.PRODUCER_REGISTERS, action="decrease")
      plgpu.copy_gmem_to_smem(len_ref.at[bi], len_smem, len_bar.at[0])
      _, n = blocks()

      def load(j, slot):
        rows = (bi, pl.ds(start + j * bk, bk), kvh)
        for w, k_ref in enumerate((k1_ref, k2_ref)):
          plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem[w].at[slot], k_bar.at[w * stages + slot])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_bar.at[slot])

      mc.producer_ring(load, n, stages, consumed)

    mc.run_warpgroups(consumer, producer)

  acc = jax.ShapeDtypeStruct((b, kh, splits, ROWS, dv), jnp.float32)
  lse = jax.ShapeDtypeStruct((b, kh, splits, ROWS), jnp.float32)
  return plgpu.kernel(
    kernel,
    out_type=[acc, acc, lse, lse],
    scratch_types=_scratch(dtype, d, dv, stages),
    grid=(kh, splits, b),
    grid_names=("kv_heads", "splits", "batch"),
    num_threads=mc.COMPUTE_WGS + 1,
    thread_name="wg",
    kernel_name="diff_v1_decode_mgpu",
    **mc.launch_kwargs(cfg.interpret),
  )(q1, q2, k1, k2, v, lens)


def _merge(o, lse):
  """Merges normalised per-split results (axis 2) by their base-2 log-sum-exps."""
  return reference.merge_partials(o, jnp.where(lse >= EMPTY_LSE, -jnp.inf, lse / LOG2E), 2)


@functools.partial(jax.jit, static_argnames=("scale", "splits", "interpret"))
def _decode(q1, q2, k1, k2, v, lam_H, kv_len, *, scale, splits, interpret):
  b, _, h, d = q1.shape
  s, kh, dv = k1.shape[1], k1.shape[2], v.shape[3]
  g = h // kh
  g2 = q2.shape[2] // kh  # noise heads per kv group (g for DIFF V1)
  # A cache whose length is a multiple of 64 is read in place; another is padded (a
  # copy) to one. Query rows: [B, 1, H, d] -> [B, K, 64, d] (a copy of B x H x d).
  sp = pc.round_up(s, BLOCK_KV)
  split_len = pc.round_up(-(-sp // splits), BLOCK_KV)
  pad = lambda x: pc.pad_axis(x, 1, sp)
  rows = lambda q: pc.pad_axis(q.reshape(b, kh, q.shape[2] // kh, d), 2, ROWS)
  lens = pc.pad_axis(jnp.clip(kv_len.astype(jnp.int32), 0, s)[:, None], 1, LENS)
  itemsize = jnp.dtype(q1.dtype).itemsize
  cfg = DecodeConfig(
    scale=scale,
    split_len=split_len,
    splits=-(-sp // split_len),
    stages=decode_stages(d, dv, itemsize),
    interpret=interpret,
  )
  o1, o2, lse1, lse2 = decode_partials(cfg, rows(q1), rows(q2), pad(k1), pad(k2), pad(v), lens)
  out1, out2 = _merge(o1, lse1)[:, :, :g], _merge(o2, lse2)[:, :, :g2]  # [B, K, G, Dv]
  if g2 != g:  # each noise head's output over its r signal heads
    out2 = jnp.repeat(out2, g // g2, axis=2)
  lam = lam_H.astype(jnp.float32).reshape(kh, g)[None, :, :, None]
  return (out1 - lam * out2).reshape(b, 1, h, dv).astype(q1.dtype)


def check_decode_inputs(q1, k1, v, *others) -> None:
  """Raises NotImplementedError naming what the Mosaic GPU decode kernel does not take:
  bf16 or fp16 arrays of one dtype, widths that are multiples of 16, at most
  :data:`ROWS` query heads per kv group, a Hopper (sm_90)."""
  dtypes = {jnp.dtype(x.dtype) for x in (q1, k1, v, *others)}
  reason = None
  if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    reason = "it takes bfloat16 or float16 q, k and v of one dtype; float32 decodes with 'xla'"
  elif q1.shape[2] // k1.shape[2] > ROWS:
    reason = f"{q1.shape[2] // k1.shape[2]} query heads per kv group; it takes at most {ROWS}"
  elif q1.shape[-1] % 16 or v.shape[-1] % 16:
    reason = f"head dims ({q1.shape[-1]}, {v.shape[-1]}) must be multiples of 16 (wgmma's K step)"
  elif gpu_capability() != HOPPER:
    major, minor = gpu_capability()
    reason = f"the GPU is sm_{major}{minor}, not a Hopper (sm_90)"
  if reason is not None:
    raise NotImplementedError(f"the Mosaic GPU decode kernel refuses these inputs: {reason}")


def _checked_decode(q1, q2, k1, k2, v, lam_H, kv_len_B, *, scale, block_sizes, interpret):
  """The decode kernel's call after the op's own checks: checks what the kernel takes and
  picks the splits."""
  check_decode_inputs(q1, k1, v, q2, k2)
  b, _, h, d = q1.shape
  s, kh = k1.shape[1], k1.shape[2]
  blocks = _v.resolve_fields(block_sizes, MosaicDecodeBlockSizes(), MosaicDecodeBlockSizes)
  splits = blocks.num_splits or num_splits(b, kh, s)
  splits = min(splits, -(-s // BLOCK_KV))
  return _decode(
    q1,
    q2,
    k1,
    k2,
    v,
    jnp.broadcast_to(lam_H, (h,)),
    jnp.asarray(kv_len_B),
    scale=_v.default_scale(scale, d),
    splits=splits,
    interpret=bool(interpret),
  )


def diff_v1_decode_pallas_gpu(
  q1_Bx1xHxD: jax.Array,
  q2_Bx1xHxD: jax.Array,
  k1_BxSxKxD: jax.Array,
  k2_BxSxKxD: jax.Array,
  v_BxSxKxDv: jax.Array,
  lam_H: jax.Array,
  kv_len_B: jax.Array,
  *,
  scale: float | None = None,
  block_sizes=None,
  interpret: bool = False,
) -> jax.Array:
  """DIFF V1 attention of one new token per sequence against a KV cache, on Mosaic GPU.

  The arguments and the result are those of the TPU kernel,
  :func:`diffjax.kernels.tpu.diff_v1_decode_pallas_tpu` (both match
  :func:`diffjax.kernels.gpu.decode.diff_v1_decode_reference`), except: the inputs are
  bfloat16 or float16; ``block_sizes`` is None, a :class:`MosaicDecodeBlockSizes` or a
  dict of its fields; ``interpret`` runs jax's Mosaic GPU interpreter. No gradient.
  """
  lam_H = jnp.asarray(lam_H)
  _v.check_diff_v1(q1_Bx1xHxD, q2_Bx1xHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H)
  _v.check_decode(q1_Bx1xHxD, kv_len_B, "diff_v1_decode_pallas_gpu", wider="diff_v1_pallas_gpu")
  return _checked_decode(
    q1_Bx1xHxD, q2_Bx1xHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H, kv_len_B,
    scale=scale, block_sizes=block_sizes, interpret=interpret,
  )  # fmt: skip


def gda_v1_decode_pallas_gpu(
  q1_Bx1xHxD: jax.Array,
  q2_Bx1xNxD: jax.Array,
  k1_BxSxKxD: jax.Array,
  k2_BxSxKxD: jax.Array,
  v_BxSxKxDv: jax.Array,
  lam_H: jax.Array,
  kv_len_B: jax.Array,
  *,
  scale: float | None = None,
  block_sizes=None,
  interpret: bool = False,
) -> jax.Array:
  """Grouped differential attention (V1 style) of one new token against a KV cache.

  As :func:`diff_v1_decode_pallas_gpu` with N = H / r noise heads in ``q2_Bx1xNxD``: a
  CTA per (kv group, cache split, batch row) reads K1, K2 and V once for the group's
  signal and noise heads. Returns [B, 1, H, Dv] in the dtype of q1. No gradient.
  """
  lam_H = jnp.asarray(lam_H)
  _v.check_gda_v1(q1_Bx1xHxD, q2_Bx1xNxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H)
  _v.check_decode(q1_Bx1xHxD, kv_len_B, "gda_v1_decode_pallas_gpu", wider="gda_v1_pallas_gpu")
  return _checked_decode(
    q1_Bx1xHxD, q2_Bx1xNxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H, kv_len_B,
    scale=scale, block_sizes=block_sizes, interpret=interpret,
  )  # fmt: skip
