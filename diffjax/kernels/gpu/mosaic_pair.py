"""Flash attention over a pair of softmax maps on Mosaic GPU (Hopper, sm_90).

The arithmetic is that of :mod:`diffjax.kernels.gpu.flash_pair` (same residuals, same
masking and log-sum-exp conventions, constants in :mod:`diffjax.kernels.gpu.pair_common`):

    out_t = softmax(qa_t Ka^T s) V - lam_t * softmax(qb_t Kb^T s) V

V1: Ka = K1, Kb = K2, one lambda per head. V2: heads 2i and 2i+1 of one query array,
Ka = Kb = K, one lambda per token.

Forward kernel (:func:`forward`). One CTA per (head or pair, 64 query rows, batch
row), three warpgroups:

* warpgroup 2 is the producer: it TMA-copies the Ka, Kb (V1 only) and V tiles of
  each key block into a ring of ``stages`` shared-memory slots, each slot guarded by
  a "ready" barrier per buffer and one "consumed" barrier;
* warpgroup 0 runs map a and warpgroup 1 map b over the same 64 query rows. Each
  keeps one float32 accumulator of width Dv in registers (two of them do not fit one
  warpgroup's registers at Dv = 256) and its own online softmax, and both multiply the
  same V tile from shared memory: V is read from HBM once per key block. S = Q K^T is
  a ``wgmma`` from shared memory with K transposed in place; P V takes P from registers.
* at the end warpgroup 1 hands its normalised output to warpgroup 0 in float32
  through shared memory (in two column halves at Dv >= 256, see
  :func:`exchange_parts`) and writes the second output O2; warpgroup 0 combines
  ``O1 - lam O2`` in float32.

Key blocks above the causal diagonal are never loaded or visited. Blocks that need no
mask (fully visible, no segment ids, no padded keys) skip the mask arithmetic.

The residuals (O2 and both log-sum-exps) are what the fused backward
(:mod:`diffjax.kernels.gpu.mosaic_pair_bwd`) reads; :mod:`diffjax.kernels.gpu.mosaic`
wraps both in a ``jax.custom_vjp``, and ``implementation="pallas_gpu"`` runs them on a
Hopper for bf16/fp16 inputs (:mod:`diffjax.kernels.gpu.fused`).

Shapes. Head dims are used as they are (64, 80, 96, 128, ...: any multiple of 16);
the shared-memory swizzle is the widest of 128/64/32 bytes that divides a row. The
query length is padded to a multiple of 64 and the key length to a multiple of the
key block by the caller (:func:`forward_padded` does it); padded keys are masked by the
true length. Inputs are bf16 or
fp16: a tf32 ``wgmma`` takes only K-major shared-memory operands, and the V tile enters
P V with its value dim contiguous (MN-major). float32 runs on the Triton kernels.

On a CPU the kernels run in jax's Mosaic GPU interpreter (``interpret=True``, see
:mod:`diffjax.kernels.gpu.mosaic_interpret`), and their lowering to Mosaic GPU IR runs
without a GPU (``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``; jax 0.11
wants an abstract GPU device for it, ``jax.sharding.use_abstract_mesh``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from diffjax.core import validation as _v
from diffjax.kernels.gpu import mosaic_interpret
from diffjax.kernels.gpu import pair_common as pc
from diffjax.kernels.gpu.pair_common import EMPTY_LSE, LOG2E, NEG, PairGeometry, kv_blocks

BLOCK_Q = 64  # query rows per warpgroup: the M of one wgmma
COMPUTE_WGS = 2
SMEM_BYTES = 227 * 1024  # usable shared memory per CTA on an H100/H200
_ROW = plgpu.Layout.WGMMA.reduce(1)
_COL = plgpu.Layout.WGMMA.reduce(0)


@dataclasses.dataclass(frozen=True)
class MosaicConfig(PairGeometry):
  """Static description of one call (hashable: a custom_vjp non-diff argument).

  Attributes:
    variant: "v1" or "v2" (see the module docstring).
    causal: causal mask; queries are the last ``q_len`` of ``kv_len`` positions.
    scale: score scale.
    q_len, kv_len: true (unpadded) lengths.
    group: DIFF heads (V1) or pairs (V2) per kv group.
    segments: whether segment ids are passed.
    block_kv: keys per step of the forward kernel.
    stages: shared-memory slots of the forward kernel's K/V ring.
    interpret: run in the Mosaic GPU interpreter.
    bwd_stages, dq_parts: the backward's tiles (:class:`MosaicBlockSizes`).
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
  dq_parts: int = 2

  def kernel_kwargs(self) -> dict:
    return launch_kwargs(self.interpret)


def launch_kwargs(interpret: bool) -> dict:
  """Keyword arguments of ``plgpu.kernel`` / ``pl.kernel`` for a three-warpgroup kernel."""
  if interpret:
    mosaic_interpret.check_threads(COMPUTE_WGS + 1)
    return dict(interpret=mosaic_interpret.params())
  return dict(compiler_params=plgpu.CompilerParams(approx_math=False))


def smem_tile(shape, width: int, dtype):
  """A shared-memory buffer that ``wgmma`` reads, swizzled for rows of ``width``."""
  return plgpu.SMEM(shape, dtype, transforms=smem_transforms(width, dtype))


def barriers(n: int = 1, arrivals: int = 1):
  return plgpu.Barrier(num_arrivals=arrivals, num_barriers=n)


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


def smem_transforms(width: int, dtype) -> tuple:
  """Tiling + swizzle of a [rows, width] shared-memory tile that ``wgmma`` reads.

  The swizzle is the widest of 128, 64 and 32 bytes that divides a row, so head dims
  like 80 (160-byte rows: 32-byte swizzle) and 96 (64-byte swizzle) need no padding.
  """
  itemsize = jnp.dtype(dtype).itemsize
  row = width * itemsize
  for swizzle in (128, 64, 32):
    if row % swizzle == 0:
      return (plgpu.TilingTransform((8, swizzle // itemsize)),
              plgpu.SwizzleTransform(swizzle))
  raise ValueError(f"A row of {width} x {jnp.dtype(dtype).name} ({row} bytes) is not a "
                   "multiple of 32 bytes; use a head dim that is a multiple of 16.")


def _iota(shape, dim):
  return plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, shape, dim), plgpu.Layout.WGMMA)


def _row(x):
  return plgpu.layout_cast(x, _ROW)


def _col(x):
  return plgpu.layout_cast(x, _COL)


def _bcast_rows(x, shape):
  """A per-row vector [M] broadcast along the columns of an [M, N] tile."""
  return lax.broadcast_in_dim(x, shape, [0])


def _bcast_cols(x, shape):
  """A per-column vector [N] broadcast along the rows of an [M, N] tile."""
  return lax.broadcast_in_dim(x, shape, [1])


def _product(shape, a, b_ref):
  """``a @ b_ref`` into a fresh float32 accumulator (a: smem ref or registers)."""
  def body(acc_ref):
    plgpu.wgmma(acc_ref, a, b_ref)
    return acc_ref[...]
  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def accumulate(acc, a, b_ref, cfg: MosaicConfig):
  """``acc + a @ b_ref`` with ``acc`` kept in the wgmma accumulator registers.

  Compiled kernels accumulate in place (``pl.run_state`` with ``plgpu.ACC.init``).
  The Mosaic GPU interpreter (jax 0.10.2 and 0.11.2 alike) cannot run ``run_state``
  accumulators; there the product goes to a fresh zero accumulator and is added,
  which is the value the interpreter's in-place ``wgmma`` (``acc + a @ b``) computes.
  """
  if cfg.interpret:
    return acc + _product(acc.shape, a, b_ref)

  def body(acc_ref):
    plgpu.wgmma(acc_ref, a, b_ref)
  return pl.run_state(body)(plgpu.ACC.init(acc))


def tile_mask(cfg: MosaicConfig, q_start, kv_start, shape, qseg=None, kvseg=None):
  """Visible (query, key) pairs of a [queries, keys] tile, in the wgmma layout."""
  kpos = kv_start + _iota(shape, 1)
  mask = kpos < cfg.kv_len
  if cfg.causal:
    qpos = q_start + cfg.offset + _iota(shape, 0)
    mask = jnp.logical_and(mask, kpos <= qpos)
  if cfg.segments:
    mask = jnp.logical_and(mask, _bcast_rows(qseg, shape) == _bcast_cols(kvseg, shape))
  return mask


# ----------------------------------------------------------------------------------
# Forward.


def forward(cfg: MosaicConfig, qs, ks, v, lam_BxHxT, q_seg, kv_seg):
  """Runs the forward kernel; the same contract as :func:`flash_pair.forward`.

  ``qs`` = (q1, q2) for V1, (q,) for V2 (heads 2i, 2i+1 form pair i); ``ks`` likewise.
  Lengths are padded (queries to 64, keys to ``block_kv``). Returns (out, o2) in the
  query dtype [B, T, H, Dv] and (lse_a, lse_b) float32 [B, H, T], base 2.
  """
  b, t, _, d = qs[0].shape
  s, dv = ks[0].shape[1], v.shape[3]
  h = lam_BxHxT.shape[1]
  dtype = qs[0].dtype
  bq, bk = BLOCK_Q, cfg.block_kv
  stages = max(1, min(cfg.stages, s // bk))  # never more slots than key blocks
  c = cfg.scale * LOG2E
  v1 = cfg.variant == "v1"
  parts = exchange_parts(dv)
  width = dv // parts

  def kernel(*refs):
    it = iter(refs)
    qa_ref = next(it)
    qb_ref = next(it) if v1 else qa_ref
    ka_ref = next(it)
    kb_ref = next(it) if v1 else ka_ref
    v_ref, lam_ref = next(it), next(it)
    qseg_ref, kvseg_ref = (next(it), next(it)) if cfg.segments else (None, None)
    o_ref, o2_ref, lse_a_ref, lse_b_ref = next(it), next(it), next(it), next(it)
    (q_smem, ka_smem, kb_smem, v_smem, x_smem, lam_smem, lse_smem, qseg_smem,
     kvseg_smem, q_bar, row_bar, ka_bar, kb_bar, v_bar, kvseg_bar, consumed,
     x_bar, x_free) = it

    bi = lax.axis_index("batch")
    hi = lax.axis_index("heads")
    q_start = lax.axis_index("q_seq") * bq
    kvh = lax.div(hi, jnp.int32(cfg.group))
    n_full, n_end = kv_blocks(cfg, q_start, bq, bk)
    kb_smem = kb_smem if v1 else ka_smem
    kb_bar = kb_bar if v1 else ka_bar

    def consumer(w: int):
      # Registers: 2 x 128 consumer threads at 232 and 128 producer threads at 40 use
      # 64,512 of the SM's 65,536; a consumer holds a [64, Dv] float32 accumulator
      # (128 registers a thread at Dv = 256) next to the [64, 64] score tile.
      plgpu.set_max_registers(232, action="increase")
      q_ref, k_smem, k_bar = ((qa_ref, ka_smem, ka_bar) if w == 0
                              else (qb_ref, kb_smem, kb_bar))
      head = hi if v1 else 2 * hi + w
      plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(q_start, bq), head], q_smem.at[w],
                              q_bar.at[w])
      if cfg.segments:
        plgpu.copy_gmem_to_smem(qseg_ref.at[bi, pl.ds(q_start, bq)], qseg_smem.at[w],
                                row_bar.at[w])
      elif w == 0:
        plgpu.copy_gmem_to_smem(lam_ref.at[bi, hi, pl.ds(q_start, bq)], lam_smem,
                                row_bar.at[0])
      plgpu.barrier_wait(q_bar.at[w])
      qseg = None
      if cfg.segments:
        plgpu.barrier_wait(row_bar.at[w])
        qseg = _row(qseg_smem.at[w][...])

      def step(j, carry, masked: bool):
        acc, m, l = carry
        slot = lax.rem(j, jnp.int32(stages))
        plgpu.barrier_wait(k_bar.at[slot])
        sc = _product((bq, bk), q_smem.at[w],
                      k_smem.at[slot].transpose((1, 0))) * c
        if masked:
          kvseg = None
          if cfg.segments:
            plgpu.barrier_wait(kvseg_bar.at[slot])
            kvseg = _col(kvseg_smem.at[slot][...])
          sc = jnp.where(tile_mask(cfg, q_start, j * bk, (bq, bk), qseg, kvseg), sc, NEG)
        m_new = jnp.maximum(m, sc.max(axis=1))
        m_ref = jnp.where(m_new == NEG, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(sc - _bcast_rows(m_ref, sc.shape))
        l = alpha * l + p.sum(axis=1)
        acc = acc * _bcast_rows(alpha, acc.shape)
        plgpu.barrier_wait(v_bar.at[slot])
        acc = accumulate(acc, p.astype(dtype), v_smem.at[slot], cfg)
        plgpu.barrier_arrive(consumed.at[slot])
        return acc, m_new, l

      carry = (plgpu.layout_cast(jnp.zeros((bq, dv), jnp.float32), plgpu.Layout.WGMMA),
               _row(jnp.full((bq,), NEG, jnp.float32)),
               _row(jnp.zeros((bq,), jnp.float32)))
      carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
      acc, m, l = lax.fori_loop(n_full, n_end, functools.partial(step, masked=True),
                                carry)
      empty = l == 0.0
      safe = jnp.where(empty, 1.0, l)
      out = acc * _bcast_rows(1.0 / safe, acc.shape)
      lse_smem.at[w][...] = jnp.where(empty, EMPTY_LSE, m + jnp.log2(safe))
      plgpu.commit_smem()
      lse_ref = lse_a_ref if w == 0 else lse_b_ref
      plgpu.copy_smem_to_gmem(lse_smem.at[w], lse_ref.at[bi, hi, pl.ds(q_start, bq)])
      rows = (bi, pl.ds(q_start, bq), hi)
      # O2 goes to warpgroup 0 in float32, ``parts`` column chunks at a time through
      # one chunk of shared memory (x_bar: a chunk is written; x_free: it was read).
      if w == 1:
        for part in range(parts):
          if part:
            plgpu.barrier_wait(x_free)
          x_smem[...] = out[:, part * width:(part + 1) * width]
          plgpu.barrier_arrive(x_bar)
        o2_ref[rows] = out.astype(dtype)
      else:
        if cfg.segments:  # the lambda copy was issued after the segment ids
          plgpu.copy_gmem_to_smem(lam_ref.at[bi, hi, pl.ds(q_start, bq)], lam_smem,
                                  row_bar.at[0])
        plgpu.barrier_wait(row_bar.at[0])
        lam = _row(lam_smem[...])
        for part in range(parts):
          plgpu.barrier_wait(x_bar)
          o2 = plgpu.layout_cast(x_smem[...], plgpu.Layout.WGMMA)
          if part + 1 < parts:
            plgpu.barrier_arrive(x_free)
          o1 = out[:, part * width:(part + 1) * width]
          o_ref[(*rows, pl.ds(part * width, width))] = (
              o1 - _bcast_rows(lam, o1.shape) * o2).astype(dtype)
      plgpu.wait_smem_to_gmem(0)

    def producer():
      plgpu.set_max_registers(40, action="decrease")

      def load(j, slot):
        keys = (bi, pl.ds(j * bk, bk), kvh)
        plgpu.copy_gmem_to_smem(ka_ref.at[keys], ka_smem.at[slot], ka_bar.at[slot])
        if v1:
          plgpu.copy_gmem_to_smem(kb_ref.at[keys], kb_smem.at[slot], kb_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_bar.at[slot])
        if cfg.segments:
          plgpu.copy_gmem_to_smem(kvseg_ref.at[bi, pl.ds(j * bk, bk)], kvseg_smem.at[slot],
                                  kvseg_bar.at[slot])

      producer_ring(load, n_end, stages, consumed)

    run_warpgroups(consumer, producer)

  smem = lambda shape, width, dt=dtype: smem_tile(shape, width, dt)
  bars = barriers
  seg = cfg.segments
  scratch = [
      smem((COMPUTE_WGS, bq, d), d),                       # q_smem
      smem((stages, bk, d), d),                            # ka_smem
      smem((stages, bk, d), d) if v1 else None,            # kb_smem
      smem((stages, bk, dv), dv),                          # v_smem
      smem((bq, width), width, jnp.float32),               # x_smem: O2 for warpgroup 0
      plgpu.SMEM((bq,), jnp.float32),                      # lam_smem
      plgpu.SMEM((COMPUTE_WGS, bq), jnp.float32),          # lse_smem
      plgpu.SMEM((COMPUTE_WGS, bq), jnp.int32) if seg else None,
      plgpu.SMEM((stages, bk), jnp.int32) if seg else None,
      bars(COMPUTE_WGS), bars(COMPUTE_WGS), bars(stages),
      bars(stages) if v1 else None, bars(stages), bars(stages) if seg else None,
      bars(stages, COMPUTE_WGS), bars(), bars() if parts > 1 else None,
  ]
  q_args = list(qs)
  args = q_args + list(ks) + [v, lam_BxHxT] + ([q_seg, kv_seg] if seg else [])
  out_type = [jax.ShapeDtypeStruct((b, t, h, dv), dtype)] * 2 + [
      jax.ShapeDtypeStruct((b, h, t), jnp.float32)] * 2
  return plgpu.kernel(
      lambda *refs: kernel(*refs[:len(args) + 4], *_scratch_refs(refs[len(args) + 4:],
                                                                 scratch)),
      out_type=out_type,
      scratch_types=[x for x in scratch if x is not None],
      grid=(h, t // bq, b),
      grid_names=("heads", "q_seq", "batch"),
      num_threads=COMPUTE_WGS + 1,
      thread_name="wg",
      kernel_name=f"diff_{cfg.variant}_fwd_mgpu",
      **cfg.kernel_kwargs(),
  )(*args)


def _scratch_refs(refs, scratch):
  """Puts None back where a scratch buffer was left out (it is unused there)."""
  it = iter(refs)
  return [None if x is None else next(it) for x in scratch]


def exchange_parts(dv: int) -> int:
  """Column chunks in which O2 crosses to warpgroup 0: two of 128 from Dv = 256 on.

  Halving the float32 exchange buffer is what lets V1 at d 128 (Dv 256) keep two ring
  slots within shared memory.
  """
  return 2 if dv >= 256 and dv % 256 == 0 else 1


def forward_smem_bytes(d: int, dv: int, block_kv: int, stages: int, variant: str,
                       segments: bool = True, itemsize: int = 2) -> int:
  """Shared memory the forward kernel allocates, in bytes (before alignment)."""
  keys = 2 if variant == "v1" else 1
  ring = stages * block_kv * (keys * d + dv) * itemsize
  q = COMPUTE_WGS * BLOCK_Q * d * itemsize
  exchange = BLOCK_Q * dv // exchange_parts(dv) * 4
  rows = (1 + COMPUTE_WGS) * BLOCK_Q * 4
  seg = (COMPUTE_WGS * BLOCK_Q + stages * block_kv) * 4 if segments else 0
  return ring + q + exchange + rows + seg


# Shared memory the lowering adds on top of the buffers counted above (barriers,
# alignment of each buffer to 1 KiB for the swizzle); measured from the lowering's
# own total at the 3B shapes (about 4.5 KiB), rounded up.
SMEM_MARGIN = 6 * 1024
# (keys per step, ring slots), preferred first. Steps are 64 keys: the P V wgmma reads
# V as an MN-major operand, whose K extent (the keys) must be a multiple of the
# swizzle width in elements (64 at a 128-byte swizzle). Three slots hide a TMA round
# trip behind two steps of compute; V1 at d 128 (Dv 256) gets two (a third does not fit
# beside the K1, K2 and V tiles of the other two); one slot is the fallback for widths
# beyond these, loading the next block only after both warpgroups are done with the last.
_CANDIDATES = ((64, 3), (64, 2), (64, 1))


def forward_blocks(d: int, dv: int, variant: str, segments: bool = True,
                   itemsize: int = 2) -> tuple[int, int]:
  """(block_kv, stages) of the forward kernel: the first candidate that fits.

  Budget: ``SMEM_BYTES`` (227 KiB per CTA on an H100/H200) minus ``SMEM_MARGIN``.
  Examples (bf16): V1 d 64 / Dv 128 -> (64, 3); V2 d 128 -> (64, 3); V1 d 128 /
  Dv 256 -> (64, 2) with O2 exchanged in two halves (whole, the float32 buffer made
  (64, 2) need 235,640 bytes by the lowering's count).
  """
  for block_kv, stages in _CANDIDATES:
    used = forward_smem_bytes(d, dv, block_kv, stages, variant, segments, itemsize)
    if used + SMEM_MARGIN <= SMEM_BYTES:
      return block_kv, stages
  raise ValueError(f"No block size fits shared memory for d={d}, dv={dv} ({variant}); "
                   "the smallest needs "
                   f"{forward_smem_bytes(d, dv, 64, 1, variant, segments, itemsize)} bytes.")


# Registers a consumer thread may hold (set_max_registers) and what is not tiles:
# the row statistics, indices, addresses. An estimate from the tile shapes.
CONSUMER_REGISTERS = 232
_REGISTER_OVERHEAD = 32


def consumer_registers(dv: int, block_kv: int) -> int:
  """Estimated registers per consumer thread of the forward kernel.

  The float32 [64, Dv] accumulator (Dv / 2 a thread over 128 threads), the float32
  [64, block_kv] score tile (block_kv / 2), its bf16 probabilities (block_kv / 4), and
  ``_REGISTER_OVERHEAD``. Dv 256 with 64-key steps: 128 + 32 + 16 + 32 = 208.
  """
  return dv // 2 + block_kv // 2 + block_kv // 4 + _REGISTER_OVERHEAD


# ----------------------------------------------------------------------------------
# Backward tiles (the kernel is in mosaic_pair_bwd).

BLOCK_KV_BWD = 64  # keys per CTA of the backward: the M of its key-major wgmmas
ROWS = 5  # per-row terms the backward reads: lse_a, lse_b, d_a, d_b, lam


def value_split(dv: int) -> tuple[int, int]:
  """Column widths of dV (and of V, dO) held by warpgroups 0 and 1.

  Both are multiples of 16 (wgmma's K step for the dP half-products): Dv 256 -> (128,
  128); V2 at d 80 (Dv 80) -> (48, 32).
  """
  if dv % 16:
    raise ValueError(f"value dim {dv} must be a multiple of 16.")
  first = pc.round_up(dv // 2, 16)
  if first >= dv:
    raise ValueError(f"value dim {dv} is too small to split between two warpgroups "
                     "(it needs at least 32).")
  return first, dv - first


def backward_smem_bytes(d: int, dv: int, stages: int, dq_parts: int, variant: str,
                        segments: bool = True, itemsize: int = 2) -> int:
  """Shared memory the backward kernel allocates, in bytes (before alignment)."""
  bq, bk = BLOCK_Q, BLOCK_KV_BWD
  keys = 2 if variant == "v1" else 1
  resident = bk * (keys * d + dv) * itemsize  # K_a (K_b) and V, loaded once
  ring = stages * bq * (2 * d + dv) * itemsize  # Q_a, Q_b, dO per step
  rows = stages * ROWS * bq * 4
  exchange = COMPUTE_WGS * bk * bq * (4 + itemsize)  # dP halves (f32) and P / dS
  staging = COMPUTE_WGS * bq * (d // dq_parts) * 4  # dQ on its way to the reduce-add
  seg = (stages * bq + bk) * 4 if segments else 0
  return resident + ring + rows + exchange + staging + seg


# (ring slots, dQ column chunks), preferred first. Two slots let the producer load the
# next step's Q and dO while this one computes; dQ in two chunks halves its staging
# buffer. V2 d 128 -> (2, 2); V1 d 128 / Dv 256 -> (1, 2); V1 d 64 -> (2, 1).
_BWD_CANDIDATES = ((2, 1), (2, 2), (1, 1), (1, 2))


def backward_step_bytes(d: int, dv: int, variant: str, itemsize: int = 2) -> dict:
  """A model of the HBM bytes and FLOPs per visited step (64 queries x 64 keys) of
  three backward designs.

  * ``"key_major"`` (this kernel; one pass): per step it reads Q_a, Q_b, dO and the
    row terms, and reduce-adds both maps' float32 dQ rows (``2 * 64 * d * 4`` bytes;
    an add that misses L2 also reads them back: ``"key_major_l2_miss"``). K and V are
    read once per CTA. Backward FLOPs per query-key pair: 20d (V1), 16d (V2).
  * ``"query_major"`` (one pass, the other way round): per step it reads K_a, K_b (V1)
    and V, and reduce-adds float32 dK_a, dK_b and dV; Q and dO are read once per CTA.
    The same FLOPs.
  * ``"two_pass"`` (a dK/dV kernel and a separate dQ kernel, as the Triton path): the
    key-major reads, plus the dQ pass's re-reads of K_a, K_b and V; it recomputes the
    scores and dP: 28d (V1), 22d (V2).

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


def _backward_fits(d, dv, stages, parts, variant, segments, itemsize) -> bool:
  if d % parts or (d // parts) % 16:
    return False
  used = backward_smem_bytes(d, dv, stages, parts, variant, segments, itemsize)
  return used + SMEM_MARGIN <= SMEM_BYTES


def backward_blocks(d: int, dv: int, variant: str, segments: bool = True,
                    itemsize: int = 2) -> tuple[int, int]:
  """(stages, dq_parts) of the backward kernel: the first candidate within shared memory."""
  for stages, parts in _BWD_CANDIDATES:
    if _backward_fits(d, dv, stages, parts, variant, segments, itemsize):
      return stages, parts
  raise ValueError(
      f"No backward tiling fits shared memory for d={d}, dv={dv} ({variant}): the "
      f"smallest needs {backward_smem_bytes(d, dv, 1, 2, variant, segments, itemsize)} "
      f"bytes of {SMEM_BYTES - SMEM_MARGIN}.")


def backward_registers(d: int, dv: int) -> int:
  """Estimated registers per consumer thread of the backward kernel.

  A [64, d] float32 dK (d / 2 a thread) and a [64, Dv / 2] dV half (Dv / 4) live all
  loop; at the dQ product a [64, d] float32 result (d / 2) joins them, and the [64, 64]
  tiles (S, dP: 32 each) are dead by then. V1 d 128: 64 + 64 + 64 + 32 overhead = 224
  of 232.
  """
  half = value_split(dv)[0]
  live = d // 2 + half // 2
  return live + max(d // 2, 2 * 32) + 32


@dataclasses.dataclass(frozen=True)
class MosaicBlockSizes:
  """Tiles of the Mosaic GPU kernels, validated against the H100/H200 budgets.

  Attributes:
    block_kv: keys per step of the forward: a multiple of 64 (the P V wgmma reads V
      MN-major, whose key extent must be a multiple of the 128-byte swizzle's 64
      elements) and at most 256 (the N of the S = Q K^T wgmma).
    stages: shared-memory slots of the forward's K/V ring, 1 to 4.
    bwd_stages: slots of the backward's Q/dO ring, 1 to 4; None: the budget's choice.
    dq_parts: column chunks in which the backward stages dQ for its reduce-adds, 1, 2
      or 4; None: the budget's choice.

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
      raise ValueError(f"block_kv={self.block_kv} must be 64, 128, 192 or 256 (a multiple "
                       "of 64 for the P V wgmma, at most 256 for the S = Q K^T wgmma).")
    if not 1 <= self.stages <= 4:
      raise ValueError(f"stages={self.stages} must be in [1, 4].")
    if self.bwd_stages is not None and not 1 <= self.bwd_stages <= 4:
      raise ValueError(f"bwd_stages={self.bwd_stages} must be in [1, 4] (or None).")
    if self.dq_parts is not None and self.dq_parts not in (1, 2, 4):
      raise ValueError(f"dq_parts={self.dq_parts} must be 1, 2 or 4 (or None).")

  @classmethod
  def default(cls, d: int, dv: int, variant: str, segments: bool = True,
              itemsize: int = 2) -> "MosaicBlockSizes":
    try:
      backward = backward_blocks(d, dv, variant, segments, itemsize)
    except ValueError:  # a forward-only caller may still run; resolved() names the bytes
      backward = (None, None)
    return cls(*forward_blocks(d, dv, variant, segments, itemsize), *backward)

  def resolved(self, d: int, dv: int, variant: str, segments: bool = True,
               itemsize: int = 2) -> "MosaicBlockSizes":
    """These tiles with the backward fields filled in, after :meth:`check`."""
    stages, parts = self.bwd_stages, self.dq_parts
    if stages is None or parts is None:
      for cand_stages, cand_parts in _BWD_CANDIDATES:
        if stages not in (None, cand_stages) or parts not in (None, cand_parts):
          continue
        if _backward_fits(d, dv, cand_stages, cand_parts, variant, segments, itemsize):
          stages, parts = cand_stages, cand_parts
          break
      else:
        stages, parts = stages or 1, parts or 2  # the smallest; check() names the bytes
    out = dataclasses.replace(self, bwd_stages=stages, dq_parts=parts)
    out.check(d, dv, variant, segments, itemsize)
    return out

  def check(self, d: int, dv: int, variant: str, segments: bool = True,
            itemsize: int = 2) -> None:
    """Raises ValueError if these tiles do not fit one CTA of an H100/H200."""
    default = lambda: MosaicBlockSizes.default(d, dv, variant, segments, itemsize)
    smem = forward_smem_bytes(d, dv, self.block_kv, self.stages, variant, segments,
                              itemsize) + SMEM_MARGIN
    if smem > SMEM_BYTES:
      raise ValueError(
          f"{self} needs about {smem} bytes of shared memory for d={d}, dv={dv} "
          f"({variant}); a CTA has {SMEM_BYTES}. Use fewer stages or a smaller block_kv "
          f"(the default here is {default()}).")
    regs = consumer_registers(dv, self.block_kv)
    if regs > CONSUMER_REGISTERS:
      raise ValueError(
          f"{self} needs about {regs} registers a consumer thread at dv={dv}; the kernel "
          f"gives each {CONSUMER_REGISTERS}. Use a smaller block_kv.")
    if self.dq_parts is not None and (d % self.dq_parts or (d // self.dq_parts) % 16):
      raise ValueError(f"dq_parts={self.dq_parts} must split d={d} into chunks that are "
                       "multiples of 16.")
    if self.bwd_stages is not None and self.dq_parts is not None:
      smem = backward_smem_bytes(d, dv, self.bwd_stages, self.dq_parts, variant, segments,
                                 itemsize) + SMEM_MARGIN
      if smem > SMEM_BYTES:
        raise ValueError(
            f"{self}: the backward needs about {smem} bytes of shared memory for d={d}, "
            f"dv={dv} ({variant}); a CTA has {SMEM_BYTES}. Use fewer bwd_stages or more "
            f"dq_parts (the default here is {default()}).")


def check_inputs(variant: str, qs, ks, v) -> None:
  """Clear errors for what the kernels do not take (before Mosaic GPU's own checks)."""
  if variant not in ("v1", "v2"):
    raise ValueError(f"variant={variant!r} must be 'v1' or 'v2'.")
  if len(qs) != (2 if variant == "v1" else 1) or len(ks) != len(qs):
    wanted = "(q1, q2) and (k1, k2)" if variant == "v1" else "(q,) and (k,)"
    raise ValueError(f"{variant} takes {wanted}; got {len(qs)} query and {len(ks)} key "
                     "arrays.")
  dtypes = {jnp.dtype(x.dtype) for x in (*qs, *ks, v)}
  if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(
        f"The Mosaic GPU kernels take bfloat16 or float16 q, k and v of one dtype; got "
        f"{sorted({jnp.dtype(x.dtype).name for x in (*qs, *ks, v)})}. Cast them, or use "
        "diffjax.kernels.gpu.diff_v1_fused / diff_v2_fused (Triton), which take float32.")
  for name, width in (("head dim", qs[0].shape[-1]), ("value dim", v.shape[-1])):
    if width % 16:
      raise ValueError(f"{name} {width} must be a multiple of 16 (wgmma's K step).")


def forward_padded(variant: str, qs, ks, v, lam_BxHxT, q_seg=None, kv_seg=None, *,
                   causal: bool = True, scale: float | None = None, block_sizes=None,
                   interpret: bool = False):
  """:func:`forward` on unpadded inputs: pads the lengths, runs, slices the padding off.

  Args are as in :func:`forward`, with any lengths T and S; ``lam_BxHxT`` is float32
  [B, H, T] (H: DIFF heads for V1, pairs for V2). ``block_sizes``: None (the default
  for these widths), a :class:`MosaicBlockSizes` or a dict of its fields. Returns
  (out, o2, lse_a, lse_b) for the true lengths.
  """
  check_inputs(variant, qs, ks, v)
  b, t, _, d = qs[0].shape
  s, dv = ks[0].shape[1], v.shape[3]
  h = lam_BxHxT.shape[1]
  itemsize = jnp.dtype(qs[0].dtype).itemsize
  blocks = _v.resolve_fields(
      block_sizes, MosaicBlockSizes.default(d, dv, variant, q_seg is not None, itemsize),
      MosaicBlockSizes)
  blocks.check(d, dv, variant, q_seg is not None, itemsize)
  block_kv, stages = blocks.block_kv, blocks.stages
  tp, sp = pc.round_up(t, BLOCK_Q), pc.round_up(s, block_kv)
  cfg = MosaicConfig(variant=variant, causal=bool(causal),
                     scale=float(scale) if scale is not None else d ** -0.5, q_len=t,
                     kv_len=s, group=h // ks[0].shape[2], segments=q_seg is not None,
                     block_kv=block_kv, stages=stages, interpret=bool(interpret))
  qs = tuple(pc.pad_axis(q, 1, tp) for q in qs)
  ks = tuple(pc.pad_axis(k, 1, sp) for k in ks)
  q_seg, kv_seg = pc.pad_segment_ids(q_seg, kv_seg, tp, sp)
  o, o2, lse_a, lse_b = forward(cfg, qs, ks, pc.pad_axis(v, 1, sp),
                                pc.pad_axis(lam_BxHxT.astype(jnp.float32), 2, tp),
                                q_seg, kv_seg)
  return o[:, :t], o2[:, :t], lse_a[:, :, :t], lse_b[:, :, :t]
