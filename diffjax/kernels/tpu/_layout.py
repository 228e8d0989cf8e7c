"""Static description of one kernel call (:class:`Plan`), its masks and the operands' layout.

Operands are head-major, [B, N, Tp, width]; row statistics are lane-dense (:func:`rows_to_tiles`).
Design: docs/kernels_tpu.md, "What the fused TPU kernels do".
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Finite stand-in for -inf: a masked score becomes this, so that exp(mask - max)
# stays 0 for rows with a real key and a fully masked row keeps max == MASK.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything static about a call: lengths, tiles, masks and the V1/V2 flavour.

  Attributes:
    q_len, kv_len: real lengths T and S (causal offset S - T uses them).
    block_q, block_kv: the tile of this pass after shrinking to the sequence.
    causal: causal mask with queries as the last T positions.
    segmented: segment ids are given.
    scale: score scale.
    shared_k: one key for both maps (V2) instead of K1, K2 (V1).
    lam_rows: lambda varies per token (lane-dense row slabs, V2) instead of per head
      (float32 [H] in SMEM, V1).
    group: query heads per kv group, G = H // K.
    heads, kv_heads: H (DIFF heads / V2 pairs; grouped: the N noise heads) and K.
    dq_chunk: query rows per backward call (a multiple of block_q), or None to take
      the fewest calls whose dQ fits VMEM (:func:`diffjax.kernels.tpu._backward.chunk_rows`).
    signal: grouped attention's r signal heads per noise head (1 for DIFF).
  """

  q_len: int
  kv_len: int
  block_q: int
  block_kv: int
  causal: bool
  segmented: bool
  scale: float
  shared_k: bool
  lam_rows: bool
  heads: int
  kv_heads: int
  dq_chunk: int | None = None
  signal: int = 1

  @property
  def group(self) -> int:
    return self.heads // self.kv_heads

  @property
  def q_len_padded(self) -> int:
    return round_up(self.q_len, self.block_q)

  @property
  def kv_len_padded(self) -> int:
    return round_up(self.kv_len, self.block_kv)

  @property
  def num_q_blocks(self) -> int:
    return self.q_len_padded // self.block_q

  @property
  def num_kv_blocks(self) -> int:
    return self.kv_len_padded // self.block_kv

  @property
  def causal_offset(self) -> int:
    return self.kv_len - self.q_len

  @property
  def masks_kv_padding(self) -> bool:
    # Causal rows of real queries never reach a padded key; other masks need help.
    return not self.causal and self.kv_len_padded != self.kv_len

  @property
  def needs_mask(self) -> bool:
    return self.causal or self.segmented or self.masks_kv_padding

  # Layout of the operands.
  @property
  def q_in_one_array(self) -> bool:
    """V2: both query components of pair h are heads 2h, 2h + 1 of one array."""
    return self.shared_k

  def q_head(self, c: int, h):
    """(array, head in it) of query component c of head h."""
    return (0, 2 * h + c) if self.q_in_one_array else (c, h)

  def spec(self, rows: int, width: int, index_map):
    """BlockSpec of a (rows, width) tile of one head of a [B, N, T, width] array;
    ``index_map(*grid)`` gives (batch, head, row block)."""
    return pl.BlockSpec(
      (None, None, rows, width), lambda *grid: (lambda b, h, r: (b, h, r, 0))(*index_map(*grid))
    )

  def group_spec(self, rows: int, width: int, heads: int, index_map):
    """BlockSpec of ``heads`` consecutive heads over ``rows`` rows from row 0;
    ``index_map(*grid)`` gives (batch, block of heads)."""
    return pl.BlockSpec(
      (None, heads, rows, width), lambda *grid: (lambda b, g: (b, g, 0, 0))(*index_map(*grid))
    )

  @staticmethod
  def shape(batch: int, heads: int, length: int, width: int) -> tuple[int, ...]:
    return (batch, heads, length, width)

  seq_axis = 2  # of every [B, N, T, width] operand

  # Causal block skipping. Tile (i, j) holds a visible score iff its last query
  # position reaches its first key; the first key tile is always visited so that
  # every query row (even a fully masked one) gets its outputs written. The causal
  # grids visit exactly these tiles (``visited_tiles``).
  def block_visible(self, i, j):
    if not self.causal:
      return True
    last_q = i * self.block_q + (self.block_q - 1) + self.causal_offset
    return jnp.logical_or(j == 0, j * self.block_kv <= last_q)

  def last_visible_kv_block(self, i):
    """Largest j with a visible tile in query row block i (its last visited step)."""
    last_q = i * self.block_q + (self.block_q - 1) + self.causal_offset
    return jnp.clip(jnp.floor_divide(last_q, self.block_kv), 0, self.num_kv_blocks - 1)

  def visited_tiles(self) -> np.ndarray:
    """bool [num_q_blocks, num_kv_blocks]: the tiles a grid visits, :meth:`block_visible`
    in numpy (every tile without a causal mask)."""
    i = np.arange(self.num_q_blocks)[:, None]
    j = np.arange(self.num_kv_blocks)[None, :]
    if not self.causal:
      return np.ones((self.num_q_blocks, self.num_kv_blocks), bool)
    last_q = i * self.block_q + (self.block_q - 1) + self.causal_offset
    return (j == 0) | (j * self.block_kv <= last_q)

  def forward_steps(self) -> tuple[np.ndarray, np.ndarray]:
    """The causal forward's grid: its visited tiles row by row, as int32 scalar-prefetch
    tables (query tile i per step, :func:`pack_kv_step` of key tile j per step).

    A query tile's first step (key tile 0) starts its online softmax and its last step
    (its last visible key tile) writes the outputs.
    """
    i, j = np.nonzero(self.visited_tiles())  # row-major: query tile outer
    return i.astype(np.int32), pack_kv_step(j, run_edges(i, first=True), run_edges(i, first=False))

  def tile_cases(self, i, j):
    """(condition, apply_mask) pairs that together cover the visible tiles.

    With a purely causal mask, tiles entirely below the diagonal skip building and
    applying the mask (most tiles of a long sequence).
    """
    visible = self.block_visible(i, j)
    if not self.needs_mask:
      return [(visible, False)]
    if self.causal and not self.segmented:
      below = j * self.block_kv + (self.block_kv - 1) <= i * self.block_q + self.causal_offset
      return [
        (jnp.logical_and(visible, below), False),
        (jnp.logical_and(visible, jnp.logical_not(below)), True),
      ]
    return [(visible, True)]

  def mask(self, i, j, q_seg_ref, kv_seg_ref):
    """Boolean [block_q, block_kv] (True = attend) for tile (i, j), or None."""
    if not self.needs_mask:
      return None
    shape = (self.block_q, self.block_kv)
    k_pos = j * self.block_kv + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    keep = None
    if self.causal:
      q_pos = i * self.block_q + self.causal_offset + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
      keep = k_pos <= q_pos
    if self.masks_kv_padding:
      in_range = k_pos < self.kv_len
      keep = in_range if keep is None else jnp.logical_and(keep, in_range)
    if self.segmented:
      same = q_seg_ref[...] == kv_seg_ref[...]  # [bq, 1] == [1, bk]
      keep = same if keep is None else jnp.logical_and(keep, same)
    return keep


def run_edges(keys: np.ndarray, *, first: bool) -> np.ndarray:
  """bool per step: the first (or last) step of each run of equal consecutive keys."""
  edge = np.ones(len(keys), bool)
  if len(keys) > 1:
    if first:
      edge[1:] = keys[1:] != keys[:-1]
    else:
      edge[:-1] = keys[1:] != keys[:-1]
  return edge


def pack_kv_step(j: np.ndarray, first: np.ndarray, last: np.ndarray) -> np.ndarray:
  """int32 words 4 j + 2 last + first: a key tile and the flags of one grid step."""
  return (4 * np.asarray(j, np.int64) + 2 * last + first).astype(np.int32)


def unpack_kv_step(word):
  """(j, first, last) of a :func:`pack_kv_step` word read in a kernel or index map."""
  return (
    jax.lax.shift_right_logical(word, 2),
    jnp.bitwise_and(word, 1) == 1,
    jnp.bitwise_and(word, 2) == 2,
  )


def pop_step_tables(refs: list):
  """Pops a causal kernel's two scalar-prefetch step tables (they come first in ``refs``)
  and reads the current step: (row entry, key tile j, first, last). The row entry is the
  query tile (forward) or the head-and-query-tile index (backward)."""
  row_steps, kv_steps = refs.pop(0), refs.pop(0)
  step = pl.program_id(1)
  return (row_steps[step], *unpack_kv_step(kv_steps[step]))


def make_plan(
  *,
  q_len: int,
  kv_len: int,
  block_q: int,
  block_kv: int,
  causal: bool,
  segmented: bool,
  scale: float,
  shared_k: bool,
  lam_rows: bool,
  heads: int,
  kv_heads: int,
  dq_chunk: int | None = None,
  signal: int = 1,
) -> Plan:
  """Shrinks the tiles to the sequence (16-row and 128-lane granularity)."""
  block_q = min(block_q, round_up(q_len, 16))
  block_kv = min(block_kv, round_up(kv_len, 128))
  return Plan(
    q_len=q_len,
    kv_len=kv_len,
    block_q=block_q,
    block_kv=block_kv,
    causal=causal,
    segmented=segmented,
    scale=float(scale),
    shared_k=shared_k,
    lam_rows=lam_rows,
    heads=heads,
    kv_heads=kv_heads,
    dq_chunk=dq_chunk,
    signal=signal,
  )


def rows_to_tiles(x_BxHxRxT, block: int, padded: int):
  """[B, H, R, T] -> [B, H, padded / block, R, block], T zero-padded to ``padded``."""
  b, h, r, t = x_BxHxRxT.shape
  if padded != t:
    x_BxHxRxT = jnp.pad(x_BxHxRxT, ((0, 0), (0, 0), (0, 0), (0, padded - t)))
  return x_BxHxRxT.reshape(b, h, r, padded // block, block).transpose(0, 1, 3, 2, 4)


def tiles_to_rows(x_BxHxNxRxBlock, length: int):
  """The inverse of :func:`rows_to_tiles`: [B, H, R, length]."""
  b, h, n, r, block = x_BxHxNxRxBlock.shape
  return x_BxHxNxRxBlock.transpose(0, 1, 3, 2, 4).reshape(b, h, r, n * block)[..., :length]


def dot_nt(a, b):
  """a [m, k] @ b[n, k]^T with float32 accumulation."""
  return jax.lax.dot_general(
    a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=_precision(a)
  )


def dot_tn(a, b):
  """a[k, m]^T @ b [k, n] with float32 accumulation."""
  return jax.lax.dot_general(
    a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32, precision=_precision(a)
  )


def dot_nn(a, b):
  return jax.lax.dot_general(
    a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32, precision=_precision(a)
  )


def _precision(a):
  # float32 inputs get full float32 matmuls (the MXU otherwise rounds to bf16).
  return jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None


def vmem_limit(nbytes: int) -> int:
  """Scoped VMEM request: the estimate with headroom, between 32 and 64 MiB (every
  v5e, v5p and v6e core has more VMEM than that)."""
  return int(min(max(math.ceil(nbytes * 1.5), 32 * 2**20), 64 * 2**20))


def grid_specs(plan, coords):
  """``(spec, tile)``: BlockSpec makers whose index maps take a kernel's own block
  coordinates, ``coords(*grid_indices)`` (the grid may be a flattened schedule of them).
  ``spec(block_shape, index_map)`` is a plain BlockSpec; ``tile(rows, width, index_map)`` the
  layout ``plan``'s tile of ``rows`` x ``width``."""

  def spec(block_shape, index_map):
    return pl.BlockSpec(block_shape, lambda *grid: index_map(*coords(*grid)))

  def tile(rows, width, index_map):
    return plan.spec(rows, width, lambda *grid: index_map(*coords(*grid)))

  return spec, tile


# Pieces of the kernels shared by DIFF and grouped attention.


def init_softmax(m_ref, l_ref, acc_ref):
  """Starts the online softmax states (running max, sum and output) of a query tile."""
  m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
  l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
  acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def scores(plan, q, k, keep):
  """The scaled scores q k^T of a tile [block_q, block_kv], masked ones at MASK_VALUE."""
  s = dot_nt(q, k) * plan.scale
  if keep is not None:
    s = jnp.where(keep, s, MASK_VALUE)
  return s


def probs(plan, q, k, keep, lse):
  """The softmax probabilities of a tile from its rows' log-sum-exps ``lse`` [block_q, 1];
  masked entries and fully masked rows give 0."""
  return jnp.exp(scores(plan, q, k, keep) - lse)


def online_softmax_step(m_ref, l_ref, acc_ref, c: int, s, v):
  """Adds a key tile's scores ``s`` and values ``v`` to map c's online softmax."""
  m_prev = m_ref[c]
  m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
  alpha = jnp.exp(m_prev - m_next)
  p = jnp.exp(s - m_next)
  l_ref[c] = alpha * l_ref[c] + jnp.sum(p, axis=1, keepdims=True)
  acc_ref[c] = alpha * acc_ref[c] + dot_nn(p.astype(v.dtype), v)
  m_ref[c] = m_next


def finish_softmax(m_ref, l_ref, acc_ref, c: int):
  """Map c's normalised output [block_q, Dv] and log-sum-exp [block_q, 1]; a row that met
  no visible key gets 0 and inf."""
  m, l = m_ref[c], l_ref[c]
  seen = m > 0.5 * MASK_VALUE  # the row met at least one visible key
  inv_l = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
  out = acc_ref[c] * inv_l
  return out, jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)


def forward_grid(plan, batch: int, heads: int):
  """The forward's grid, block coordinates and scalar-prefetch tables.

  Batch and heads share the leading parallel axis, so that a megacore chip can split it
  between its two cores even when B == 1. A causal grid walks the visited tiles
  (:meth:`Plan.forward_steps`); ``coords(*grid)`` gives (batch, head, query tile, key tile).
  """
  if plan.causal:
    q_steps, kv_steps = plan.forward_steps()

    def coords(bh, step, q_ref, kv_ref):
      return bh // heads, bh % heads, q_ref[step], unpack_kv_step(kv_ref[step])[0]

    return (batch * heads, len(q_steps)), coords, [jnp.asarray(q_steps), jnp.asarray(kv_steps)]

  def coords(bh, i, j):
    return bh // heads, bh % heads, i, j

  return (batch * heads, plan.num_q_blocks, plan.num_kv_blocks), coords, []


def segment_specs(plan, spec, q_block, kv_block):
  """BlockSpecs of q_seg [B, Tp, 1] and kv_seg [B, 1, Sp]: the tiles of query block
  ``q_block(*coords)`` and key block ``kv_block(*coords)``."""
  return [
    spec((None, plan.block_q, 1), lambda b_, *c: (b_, q_block(*c), 0)),
    spec((None, 1, plan.block_kv), lambda b_, *c: (b_, 0, kv_block(*c))),
  ]


def call(kernel, args, *, grid, prefetch, in_specs, out_specs, out_shape, scratch, semantics,
         vmem, cost, interpret, name):  # fmt: skip
  """``pallas_call`` of ``kernel`` on ``prefetch`` (scalar-prefetch tables) and ``args``."""
  return pl.pallas_call(
    kernel,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(prefetch),
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      scratch_shapes=scratch,
    ),
    out_shape=out_shape,
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=semantics, vmem_limit_bytes=vmem_limit(vmem)
    ),
    cost_estimate=cost,
    interpret=interpret,
    name=name,
  )(*prefetch, *args)
