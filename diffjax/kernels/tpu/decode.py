"""DIFF V1 decoding on TPUs: one query token per row against a KV cache (Pallas, Mosaic).

:func:`diff_v1_decode_pallas_tpu` and, on the same kernel, :func:`gda_v1_decode_pallas_tpu`.
Design: docs/kernels_tpu.md, "Decoding" and "Grouped differential attention".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from diffjax.core import reference
from diffjax.core import validation as _v
from diffjax.kernels.tpu import _layout as layout
from diffjax.kernels.tpu._core import Interpret, interpret_mode
from diffjax.kernels.tpu.block_sizes import DecodeBlockSizes, resolve_decode_block_sizes

_LANES = 128

# How a kernel reads a cache array [B, S, K, X] (docs/kernels_tpu.md): the view
# names the order of (kv group K, positions S, width X) after the batch axis.
SKD, KSD, KDS = "skd", "ksd", "kds"


def cache_view(kv_heads: int, width: int, itemsize: int) -> str:
  """The view of a [B, S, kv_heads, width] cache array that matches its TPU layout.

  ``"kds"`` ([B, K, X, S]) when ``width`` is not a multiple of 128; otherwise
  ``"skd"`` (the array as it is) for 2, 4 or a multiple of 8 kv groups (and one
  group of a 32-bit type) and ``"ksd"`` ([B, K, S, X]) for other group counts. These
  are the default layouts XLA gives such arrays on v5e and v5p (the ahead-of-time
  tests check that the kernel's operands are bitcasts of the cache).
  """
  if width % _LANES:
    return KDS
  if kv_heads in (2, 4) or kv_heads % 8 == 0 or (kv_heads == 1 and itemsize == 4):
    return SKD
  return KSD


def cache_length_multiple(
  head_dim: int | None = None,
  value_dim: int | None = None,
  block_sizes: DecodeBlockSizes | dict | None = None,
) -> int:
  """The multiple a KV cache's length should have so that decoding reads it in place.

  128 whatever the head dims and block sizes (arguments accepted for symmetry with
  the GPU kernel's function). A cache of another length longer than ``block_kv`` is
  padded to it (a copy of the whole cache) on every call.
  """
  del head_dim, value_dim, block_sizes
  return _LANES


def _to_view(x_BxSxKxX, view: str):
  if view == KSD:
    return x_BxSxKxX.transpose(0, 2, 1, 3)
  if view == KDS:
    return x_BxSxKxX.transpose(0, 2, 3, 1)
  return x_BxSxKxX


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What is static about a call.

  ``flat``: both views are ``"skd"``, and the kernel works on the tiles as
  [block_kv * K, X] matrices (see :func:`_accumulate_flat`); otherwise it loops over
  the kv groups (:func:`_accumulate_groups`).
  """

  block_kv: int
  blocks_per_split: int
  splits: int
  kv_heads: int
  rows: int  # query rows per kv group, padded
  scale: float
  k_view: str
  v_view: str

  @property
  def flat(self) -> bool:
    return self.k_view == SKD and self.v_view == SKD

  @property
  def columns(self) -> int:  # query rows of all kv groups
    return self.kv_heads * self.rows


def _group_tile(ref, view: str, g: int):
  """The [block_kv, X] (``"kds"``: [X, block_kv]) tile of kv group ``g``."""
  if view != SKD:
    return ref[g]
  if ref.dtype.itemsize == 4:
    return ref[:, g, :]
  # Group g is one row of each position's [K, X] tile; 16-bit rows are packed in
  # pairs, and Mosaic picks them out far faster (to compile) from 32-bit values.
  bk, _, x = ref.shape
  return ref[:, pl.ds(g, 1), :].astype(jnp.float32).reshape(bk, x).astype(ref.dtype)


def _online_softmax(s, m_prev, l_prev, axis: int):
  """One step of the running max and sum along ``axis``: (m, l, alpha, p)."""
  m_next = jnp.maximum(m_prev, jnp.max(s, axis=axis, keepdims=True))
  alpha = jnp.exp(m_prev - m_next)
  p = jnp.exp(s - m_next)
  return m_next, alpha * l_prev + jnp.sum(p, axis=axis, keepdims=True), alpha, p


def _accumulate_groups(
  plan: _Plan, q_ref, k_refs, v_ref, m_ref, l_ref, acc_ref, start, kv_len, masked: bool
):
  """Scores [rows, block_kv] per kv group and map; one tile of each group at a time."""
  bk, gp = plan.block_kv, plan.rows
  if masked:  # the block holding the row's last valid position
    keep = start + lax.broadcasted_iota(jnp.int32, (gp, bk), 1) < kv_len
    # Positions run along the rows of a V tile, or its columns in the "kds" view.
    v_shape, v_axis = ((1, bk), 1) if plan.v_view == KDS else ((bk, 1), 0)
    v_keep = start + lax.broadcasted_iota(jnp.int32, v_shape, v_axis) < kv_len
  for g in range(plan.kv_heads):
    v = _group_tile(v_ref, plan.v_view, g)
    if masked:
      # Slots past kv_len hold anything (stale or padded values, even NaN); their
      # weights are 0, but 0 * NaN is not.
      v = jnp.where(v_keep, v, jnp.zeros_like(v))
    rows = pl.ds(g * gp, gp)
    for c, k_ref in enumerate(k_refs):
      k = _group_tile(k_ref, plan.k_view, g)
      q = q_ref[c, rows, :]
      s = (layout.dot_nn(q, k) if plan.k_view == KDS else layout.dot_nt(q, k)) * plan.scale
      if masked:
        s = jnp.where(keep, s, layout.MASK_VALUE)
      m, l, alpha, p = _online_softmax(s, m_ref[c, rows, :], l_ref[c, rows, :], axis=1)
      p = p.astype(v.dtype)
      pv = layout.dot_nt(p, v) if plan.v_view == KDS else layout.dot_nn(p, v)
      acc_ref[c, rows, :] = alpha * acc_ref[c, rows, :] + pv
      m_ref[c, rows, :] = m
      l_ref[c, rows, :] = l


def _accumulate_flat(
  plan: _Plan, q_ref, k_refs, v_ref, m_ref, l_ref, acc_ref, start, kv_len, masked: bool
):
  """Row-major tiles [block_kv, K, X] as [block_kv * K, X]: row r is position r // K
  of group r % K. One product per map scores every row against the query rows of
  all groups ([block_kv * K, K * rows], transposed), and the rows of other groups
  are masked, so no group's rows are gathered out of the tiles; the value product
  then sums each group's own rows. The statistics are row vectors [1, K * rows] and
  the accumulators are transposed ([Dv, K * rows])."""
  bk, kh, gp = plan.block_kv, plan.kv_heads, plan.rows
  n, cols = bk * kh, plan.columns
  row = lax.broadcasted_iota(jnp.int32, (n, cols), 0)
  col = lax.broadcasted_iota(jnp.int32, (n, cols), 1)
  keep = lax.rem(row, kh) == lax.div(col, gp)
  v = v_ref[...].reshape(n, v_ref.shape[-1])
  if masked:
    keep = jnp.logical_and(keep, start + lax.div(row, kh) < kv_len)
    v_row = lax.broadcasted_iota(jnp.int32, (n, 1), 0)
    v = jnp.where(start + lax.div(v_row, kh) < kv_len, v, jnp.zeros_like(v))
  for c, k_ref in enumerate(k_refs):
    k = k_ref[...].reshape(n, k_ref.shape[-1])
    s = jnp.where(keep, layout.dot_nt(k, q_ref[c]) * plan.scale, layout.MASK_VALUE)
    m, l, alpha, p = _online_softmax(s, m_ref[c], l_ref[c], axis=0)
    acc_ref[c] = alpha * acc_ref[c] + layout.dot_tn(v, p.astype(v.dtype))
    m_ref[c] = m
    l_ref[c] = l


def _decode_kernel(
  len_ref,
  q_ref,
  k1_ref,
  k2_ref,
  v_ref,
  acc_out_ref,
  ml_out_ref,
  m_ref,
  l_ref,
  acc_ref,
  *,
  plan: _Plan,
):
  b, split, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bk = plan.block_kv
  start = (split * plan.blocks_per_split + j) * bk
  kv_len = len_ref[b]

  pl.when(j == 0)(functools.partial(layout.init_softmax, m_ref, l_ref, acc_ref))

  accumulate = functools.partial(
    _accumulate_flat if plan.flat else _accumulate_groups,
    plan,
    q_ref,
    (k1_ref, k2_ref),
    v_ref,
    m_ref,
    l_ref,
    acc_ref,
    start,
    kv_len,
  )
  whole = start + bk <= kv_len
  pl.when(whole)(functools.partial(accumulate, masked=False))
  pl.when(jnp.logical_and(start < kv_len, jnp.logical_not(whole)))(
    functools.partial(accumulate, masked=True)
  )

  @pl.when(j == plan.blocks_per_split - 1)
  def _finish():
    acc_out_ref[...] = acc_ref[...]
    # m and l side by side: in lanes 0 and 1 (groups), or rows 0 and 1 (flat).
    ml_out_ref[...] = jnp.concatenate([m_ref[...], l_ref[...]], axis=1 if plan.flat else 2)


def _kv_block(b, split, j, len_ref, *, block_kv: int, blocks_per_split: int):
  """The cache block grid step (b, split, j) reads: its own, or past the row's last
  valid position the block holding that position (already in VMEM: no new DMA)."""
  last = jnp.maximum(lax.div(len_ref[b] + block_kv - 1, block_kv) - 1, 0)
  return jnp.minimum(split * blocks_per_split + j, last)


def _block_kv(s: int, blocks: DecodeBlockSizes) -> tuple[int, int]:
  """(block, padded length): the block divides the padded length."""
  if s <= blocks.block_kv:
    return s, s
  sp = layout.round_up(s, _LANES)
  bk = blocks.block_kv
  while sp % bk:
    bk -= _LANES
  return bk, sp


def _merge(acc, m, l):
  """Merges the per-split partial softmax results (axis 1): acc [B, splits, 2, C, Dv],
  m and l [B, splits, 2, C] -> [B, 2, C, Dv]. A split that saw no position has l == 0
  and acc == 0."""
  seen = l > 0.0
  safe = jnp.where(seen, l, 1.0)
  return reference.merge_partials(
    acc / safe[..., None], jnp.where(seen, m + jnp.log(safe), -jnp.inf), 1
  )


def _block_shapes(plan: _Plan, dv: int):
  """(row statistics, accumulator, m and l output) blocks of one (row, split): in the flat
  form the statistics are rows and the accumulators transposed, else columns."""
  cols = plan.columns
  if plan.flat:
    return (2, 1, cols), (2, dv, cols), (2, 2, cols)
  return (2, cols, 1), (2, cols, dv), (2, cols, 2)


def _grid_spec(plan: _Plan, b: int, d: int, dv: int) -> pltpu.PrefetchScalarGridSpec:
  """Grid (B, splits, blocks per split) over the prefetched cache lengths, and its blocks."""
  bk, kh, cols = plan.block_kv, plan.kv_heads, plan.columns
  kv_block = functools.partial(_kv_block, block_kv=bk, blocks_per_split=plan.blocks_per_split)

  def cache_spec(view: str, width: int):
    if view == SKD:
      return pl.BlockSpec(
        (None, bk, kh, width), lambda bi, si, j, lens: (bi, kv_block(bi, si, j, lens), 0, 0)
      )
    if view == KSD:
      return pl.BlockSpec(
        (None, kh, bk, width), lambda bi, si, j, lens: (bi, 0, kv_block(bi, si, j, lens), 0)
      )
    return pl.BlockSpec(
      (None, kh, width, bk), lambda bi, si, j, lens: (bi, 0, 0, kv_block(bi, si, j, lens))
    )

  out_spec = lambda shape: pl.BlockSpec(
    (None, None, *shape), lambda bi, si, j, lens: (bi, si) + (0,) * len(shape)
  )
  stat_shape, acc_shape, ml_shape = _block_shapes(plan, dv)
  return pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=1,
    grid=(b, plan.splits, plan.blocks_per_split),
    in_specs=[
      pl.BlockSpec((None, 2, cols, d), lambda bi, si, j, lens: (bi, 0, 0, 0)),
      cache_spec(plan.k_view, d),
      cache_spec(plan.k_view, d),
      cache_spec(plan.v_view, dv),
    ],
    out_specs=[out_spec(acc_shape), out_spec(ml_shape)],
    scratch_shapes=[
      pltpu.VMEM(stat_shape, jnp.float32),
      pltpu.VMEM(stat_shape, jnp.float32),
      pltpu.VMEM(acc_shape, jnp.float32),
    ],
  )


def _vmem_bytes(plan: _Plan, d: int, dv: int, itemsize: int) -> int:
  """VMEM estimate of one step: both buffers of the cache tiles, the float32 softmax state
  and accumulators, and six float32 score-sized temporaries."""
  bk, kh, cols, gp = plan.block_kv, plan.kv_heads, plan.columns, plan.rows
  tiles = 2 * itemsize * bk * kh * (2 * layout.round_up(d, _LANES) + layout.round_up(dv, _LANES))
  work = (
    bk * kh * layout.round_up(cols, _LANES)
    if plan.flat
    else layout.round_up(gp, 8) * layout.round_up(bk, _LANES)
  )  # one map's scores
  return tiles + 4 * (
    3 * 2 * layout.round_up(cols, 8) * (layout.round_up(dv, _LANES) + 2 * _LANES) + 6 * work
  )


def _decode_maps(q1, q2, k1, k2, v, kv_len, *, scale, blocks, interpret):
  """Both maps of every query head over the cache: [B, 2, K, G, Dv] float32 (map 0: q1
  on K1, map 1: q2 on K2; q1, q2 [B, 1, H, D], head h in row h % G of group h // G)."""
  b, _, h, d = q1.shape
  s, kh, dv = k1.shape[1], k1.shape[2], v.shape[3]
  g = h // kh
  itemsize = k1.dtype.itemsize
  gp = layout.round_up(g, 8 * max(1, 4 // q1.dtype.itemsize))
  bk, sp = _block_kv(s, blocks)
  if sp != s:  # a copy of the cache: see cache_length_multiple
    pad = lambda x: jnp.pad(x, ((0, 0), (0, sp - s), (0, 0), (0, 0)))
    k1, k2, v = pad(k1), pad(k2), pad(v)
  n_blocks = sp // bk
  splits = blocks.num_splits if blocks.num_splits is not None else (2 if b == 1 else 1)
  splits = max(1, min(splits, n_blocks))
  per_split = pl.cdiv(n_blocks, splits)
  plan = _Plan(
    block_kv=bk,
    blocks_per_split=per_split,
    splits=splits,
    kv_heads=kh,
    rows=gp,
    scale=float(scale),
    k_view=cache_view(kh, d, itemsize),
    v_view=cache_view(kh, dv, itemsize),
  )
  cols = plan.columns

  # [B, 1, H, D] x2 -> [B, 2, K * Gp, D]; head h is row h % G of group h // G.
  q = jnp.stack([q1, q2], axis=1).reshape(b, 2, kh, g, d)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, gp - g), (0, 0))).reshape(b, 2, cols, d)
  kv_len = jnp.clip(kv_len.astype(jnp.int32), 0, s)

  grid_spec = _grid_spec(plan, b, d, dv)
  _, acc_shape, ml_shape = _block_shapes(plan, dv)
  vmem = _vmem_bytes(plan, d, dv, itemsize)
  cache_bytes = itemsize * b * sp * kh * (2 * d + dv)
  acc, ml = pl.pallas_call(
    functools.partial(_decode_kernel, plan=plan),
    grid_spec=grid_spec,
    out_shape=[
      jax.ShapeDtypeStruct((b, splits, *acc_shape), jnp.float32),
      jax.ShapeDtypeStruct((b, splits, *ml_shape), jnp.float32),
    ],
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "arbitrary"),
      vmem_limit_bytes=layout.vmem_limit(vmem),
    ),
    cost_estimate=pl.CostEstimate(
      flops=4 * b * h * s * (d + dv), transcendentals=2 * b * h * s, bytes_accessed=int(cache_bytes)
    ),
    interpret=interpret,
    name="diff_v1_decode",
  )(kv_len, q, _to_view(k1, plan.k_view), _to_view(k2, plan.k_view), _to_view(v, plan.v_view))
  if plan.flat:
    acc, m, l = acc.swapaxes(-1, -2), ml[..., 0, :], ml[..., 1, :]
  else:
    m, l = ml[..., 0], ml[..., 1]
  return _merge(acc, m, l).reshape(b, 2, kh, gp, dv)[:, :, :, :g]


@functools.partial(jax.jit, static_argnames=("scale", "blocks", "interpret"))
def _decode(q1, q2, k1, k2, v, lam_H, kv_len, *, scale, blocks, interpret):
  b, _, h, d = q1.shape
  n, kh, dv = q2.shape[2], k1.shape[2], v.shape[3]
  g, nk = h // kh, n // kh  # signal and noise heads per kv group
  if n != h:
    # Noise head m of group k goes to row m of the group's G rows; the rest are zeros.
    q2_rows = jnp.pad(q2.reshape(b, 1, kh, nk, d), ((0, 0),) * 3 + ((0, g - nk), (0, 0)))
    q2 = q2_rows.reshape(b, 1, h, d)
  o = _decode_maps(q1, q2, k1, k2, v, kv_len, scale=scale, blocks=blocks, interpret=interpret)
  # Grouped: signal head c of group k (c < G) takes noise row c // r of that group.
  noise_KxGxDv = o[:, 1] if n == h else jnp.repeat(o[:, 1, :, :nk], h // n, axis=2)
  lam_KxG = lam_H.astype(jnp.float32).reshape(kh, g)
  out = o[:, 0] - lam_KxG[None, :, :, None] * noise_KxGxDv
  return out.reshape(b, 1, h, dv).astype(q1.dtype)


def _checked_decode(op: str, q1, q2, k1, k2, v, lam_H, kv_len_B, *, scale, block_sizes, interpret):
  """Checks the arguments of ``op`` (diff_v1 or gda_v1) decoding and calls the kernel: the
  block sizes resolved, lambda per head (grouped: q2 of fewer heads than q1)."""
  lam_H = jnp.asarray(lam_H)
  check = {"diff_v1": _v.check_diff_v1, "gda_v1": _v.check_gda_v1}[op]
  check(q1, q2, k1, k2, v, lam_H)
  _v.check_decode(q1, kv_len_B, f"{op}_decode_pallas_tpu", wider=f"{op}_pallas_tpu")
  b, _, h, d = q1.shape
  blocks = resolve_decode_block_sizes(
    block_sizes, head_dim=d, value_dim=v.shape[3], kv_heads=k1.shape[2], itemsize=k1.dtype.itemsize
  )
  return _decode(
    q1,
    q2,
    k1,
    k2,
    v,
    jnp.broadcast_to(lam_H, (h,)),
    jnp.asarray(kv_len_B),
    scale=_v.default_scale(scale, d),
    blocks=blocks,
    interpret=interpret_mode(interpret),
  )


def diff_v1_decode_pallas_tpu(
  q1_Bx1xHxD: jax.Array,
  q2_Bx1xHxD: jax.Array,
  k1_BxSxKxD: jax.Array,
  k2_BxSxKxD: jax.Array,
  v_BxSxKxDv: jax.Array,
  lam_H: jax.Array | float,
  kv_len_B: jax.Array,
  *,
  scale: float | None = None,
  block_sizes: DecodeBlockSizes | dict | None = None,
  interpret: Interpret = False,
) -> jax.Array:
  """DIFF V1 attention of one new token per sequence against a KV cache, on a TPU.

  Args:
    q1_Bx1xHxD, q2_Bx1xHxD: the new token's two query components (T = 1).
    k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv: the cache (S slots; Dv = 2 D in the paper).
    lam_H: lambda, a scalar or [H].
    kv_len_B: int [B], valid cache length per sequence (the new token included);
      positions >= kv_len are ignored, values are clipped to [0, S].
    scale: score scale, default 1 / sqrt(D).
    block_sizes: None, a :class:`DecodeBlockSizes` or a dict of its fields.
    interpret: run in the TPU interpreter (True, or ``pltpu.InterpretParams``).
  Returns:
    [B, 1, H, Dv] in the dtype of q1; a row with ``kv_len == 0`` is zero. No
    gradient: decoding is inference only.
  """
  return _checked_decode(
    "diff_v1", q1_Bx1xHxD, q2_Bx1xHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H, kv_len_B,
    scale=scale, block_sizes=block_sizes, interpret=interpret,
  )  # fmt: skip


def gda_v1_decode_pallas_tpu(
  q1_Bx1xHxD: jax.Array,
  q2_Bx1xNxD: jax.Array,
  k1_BxSxKxD: jax.Array,
  k2_BxSxKxD: jax.Array,
  v_BxSxKxDv: jax.Array,
  lam_H: jax.Array | float,
  kv_len_B: jax.Array,
  *,
  scale: float | None = None,
  block_sizes: DecodeBlockSizes | dict | None = None,
  interpret: Interpret = False,
) -> jax.Array:
  """Grouped differential attention (V1 style) of one new token per sequence against a KV
  cache, on a TPU.

  Args:
    q1_Bx1xHxD: the new token's H signal query heads; q2_Bx1xNxD: its N = H / r noise
      heads (noise head n serves signal heads n r .. n r + r - 1); N a multiple of K.
    k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H, kv_len_B, scale, block_sizes, interpret:
      as :func:`diff_v1_decode_pallas_tpu`.
  Returns:
    [B, 1, H, Dv] in the dtype of q1; a row with ``kv_len == 0`` is zero. No gradient.
  """
  return _checked_decode(
    "gda_v1", q1_Bx1xHxD, q2_Bx1xNxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H, kv_len_B,
    scale=scale, block_sizes=block_sizes, interpret=interpret,
  )  # fmt: skip
