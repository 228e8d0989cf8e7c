"""Grouped differential attention (GDA) on Mosaic GPU (Hopper): the noise map once per group.

:func:`gda_v1_pallas_gpu` and :func:`gda_v2_pallas_gpu` (r = 1 runs :mod:`.mosaic`).
Design: docs/kernels_gpu.md, "Grouped differential attention".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from diffjax.core import validation as _v
from diffjax.core.platform import HOPPER, gpu_capability
from diffjax.kernels.gpu import mosaic
from diffjax.kernels.gpu import mosaic_common as mc
from diffjax.kernels.gpu import mosaic_gda_bwd as gb
from diffjax.kernels.gpu import mosaic_gda_fwd as gf
from diffjax.kernels.gpu import mosaic_tiles as tiles
from diffjax.kernels.gpu.mosaic_gda_fwd import MAX_GROUP, forward_smem_bytes, forward_stages

# ----------------------------------------------------------------------------------
# Differentiation: the forward above and the grouped backward (mosaic_gda_bwd).


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _grouped(qs, ks, v, lam_BxHxT, q_seg, kv_seg, cfg):
  return gf.forward(cfg, *qs, ks, v, lam_BxHxT, q_seg, kv_seg)[0]


def _grouped_fwd(qs, ks, v, lam_BxHxT, q_seg, kv_seg, cfg):
  o, o2, lse1, lse2 = gf.forward(cfg, *qs, ks, v, lam_BxHxT, q_seg, kv_seg)
  return o, (qs, ks, v, lam_BxHxT, q_seg, kv_seg, o, o2, lse1, lse2)


def _grouped_bwd(cfg, res, do):
  (q1, q2), ks, v, lam_BxHxT, q_seg, kv_seg, o, o2, lse1, lse2 = res
  b, t, h, dv = o.shape
  n, r = o2.shape[2], cfg.noise_group
  dtype = v.dtype
  do32 = do.astype(jnp.float32)
  o2_32 = o2.astype(jnp.float32)
  do_BxTxNxRxDv = do32.reshape(b, t, n, r, dv)
  # Signal head h: d_b = rowsum(dO_h O2_{h // r}) (minus its d lambda), and its row term
  # d_a = rowsum(dO_h O1_h) = rowsum(dO_h O) + lam d_b.
  d_b = jnp.einsum("btnrd,btnd->bnrt", do_BxTxNxRxDv, o2_32).reshape(b, h, t)
  d_a = jnp.einsum("bthd,bthd->bht", do32, o.astype(jnp.float32)) + lam_BxHxT * d_b
  # Noise head n: its dO is G_n = -sum_j lam_j dO_j over the group, its row term
  # rowsum(G_n O2) (of the rounded G_n the kernel reads).
  lam_BxTxNxR = jnp.transpose(lam_BxHxT, (0, 2, 1)).reshape(b, t, n, r)
  g = (-jnp.einsum("btnrd,btnr->btnd", do_BxTxNxRxDv, lam_BxTxNxR)).astype(dtype)
  d_g = jnp.einsum("btnd,btnd->bnt", g.astype(jnp.float32), o2_32)
  (dq1, dq2), (dk1, dk2), dvv = gb.backward(
    cfg,
    q1,
    q2,
    ks[0],
    ks[-1],
    v,
    do.astype(dtype),
    g,
    jnp.stack([lse1, d_a], axis=2),
    jnp.stack([lse2, d_g], axis=2),
    q_seg,
    kv_seg,
    stages=cfg.bwd_stages,
    dq_parts=cfg.dq_parts,
  )
  dks = (dk1.astype(dtype), dk2.astype(dtype)) if len(ks) == 2 else ((dk1 + dk2).astype(dtype),)
  dq = (dq1.astype(q1.dtype), dq2.astype(q2.dtype))
  return dq, dks, dvv.astype(dtype), -d_b, None, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


@dataclasses.dataclass(frozen=True)
class _Tiles:
  stages: int
  bwd_stages: int
  dq_parts: int
  block_kv: int = 64  # the grouped kernels step 64 keys at a time


def refusal(dtypes, d: int, dv: int, r: int, shared_k: bool, segments: bool) -> str | None:
  """Why the grouped kernels do not take these inputs (None: they do)."""
  names = sorted({jnp.dtype(x).name for x in dtypes})
  if len(names) != 1 or names[0] not in ("bfloat16", "float16"):
    return (
      f"they take bfloat16 or float16 inputs of one dtype (got {names}); cast them, or use "
      "implementation='stock', which takes float32"
    )
  if r > MAX_GROUP:
    return f"r={r} signal heads a noise head is more than the {MAX_GROUP} the forward unrolls"
  itemsize = jnp.dtype(names[0]).itemsize
  ok = d % 16 == 0 and dv % 16 == 0 and dv >= 32
  try:
    if ok:
      forward_stages(d, dv, shared_k, segments, itemsize)
      gb.blocks(d, dv, segments, itemsize)
  except ValueError:
    ok = False
  if not ok:
    return (
      f"head dims ({d}, {dv}) must be multiples of 16 (value dim at least 32) whose "
      "tiles fit one CTA's shared memory"
    )
  if gf.o2_parts(d, dv, itemsize) is None:
    return (
      f"the value dim ({dv}) must be a multiple of the head dim ({d}): the output leaves "
      "through the query tile"
    )
  capability = gpu_capability()
  if capability != HOPPER:
    return f"the GPU is sm_{capability[0]}{capability[1]}, not a Hopper (sm_90)"
  return None


def _tiles(variant, qs, ks, v, q_seg, block_sizes) -> _Tiles:
  """The grouped kernels' tiles, called as :func:`~diffjax.kernels.gpu.mosaic._blocks`
  (V1 and V2 differ only in how many key arrays ``ks`` holds)."""
  del variant
  (q1, q2), segments = qs, q_seg is not None
  d, dv = q1.shape[3], v.shape[3]
  r = q1.shape[2] // q2.shape[2]
  reason = refusal([x.dtype for x in (q1, q2, *ks, v)], d, dv, r, len(ks) == 1, segments)
  if reason is not None:
    raise NotImplementedError(f"the grouped Mosaic GPU kernels refuse these inputs: {reason}")
  itemsize = jnp.dtype(q1.dtype).itemsize
  stages = forward_stages(d, dv, len(ks) == 1, segments, itemsize)
  bwd_stages, parts = gb.blocks(d, dv, segments, itemsize)
  if block_sizes is None:
    return _Tiles(stages, bwd_stages, parts)
  default = tiles.MosaicBlockSizes(64, stages, bwd_stages, parts)
  blocks = _v.resolve_fields(block_sizes, default, tiles.MosaicBlockSizes)
  if blocks.block_kv != 64:
    raise ValueError(
      f"block_kv={blocks.block_kv}: the grouped kernels step 64 keys at a time (block_kv is "
      "64); their tiles are stages, bwd_stages and dq_parts."
    )
  stages = blocks.stages
  bwd_stages, parts = blocks.bwd_stages or bwd_stages, blocks.dq_parts or parts
  smem = forward_smem_bytes(d, dv, 64, stages, len(ks) == 1, segments, itemsize)
  if smem > tiles.SMEM_BYTES:
    raise ValueError(
      f"stages={stages} needs {smem} bytes of shared memory for d={d}, dv={dv}; a CTA has "
      f"{tiles.SMEM_BYTES}. Use fewer stages (the default here is {default.stages})."
    )
  swizzle = mc.swizzle_bytes(d, itemsize, tiles.bwd_swizzle_cap(itemsize)) // itemsize
  if d % parts or (d // parts) % swizzle:
    raise ValueError(
      f"dq_parts={parts} must split d={d} into chunks of whole {swizzle}-element swizzle rows."
    )
  bwd = gb.smem_bytes(d, dv, bwd_stages, parts, segments, itemsize)
  if bwd > tiles.SMEM_BYTES:
    raise ValueError(
      f"bwd_stages={bwd_stages}, dq_parts={parts} need {bwd} bytes of shared memory for "
      f"d={d}, dv={dv}; a CTA has {tiles.SMEM_BYTES}. Use fewer bwd_stages (the default "
      f"here is {default.bwd_stages})."
    )
  return _Tiles(stages, bwd_stages, parts)


def gda_v1_pallas_gpu(
  q1_BxTxHxD: jax.Array,
  q2_BxTxNxD: jax.Array,
  k1_BxSxKxD: jax.Array,
  k2_BxSxKxD: jax.Array,
  v_BxSxKxDv: jax.Array,
  lam_H: jax.Array,
  *,
  causal: bool = True,
  q_segment_ids: jax.Array | None = None,
  kv_segment_ids: jax.Array | None = None,
  scale: float | None = None,
  block_sizes: tiles.MosaicBlockSizes | dict | None = None,
  interpret: bool = False,
) -> jax.Array:
  """Grouped differential attention, V1 style, on Mosaic GPU, differentiable.

  Args:
    q1_BxTxHxD: H signal query heads; q2_BxTxNxD: N = H / r noise heads, noise head n
      serving signal heads n r .. n r + r - 1; N a multiple of K.
    k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv: the K kv groups' keys and value.
    lam_H: a scalar or float [H]; used in float32.
    causal, q_segment_ids, kv_segment_ids, scale, interpret: as
      :func:`~diffjax.kernels.gpu.mosaic.diff_v1_pallas_gpu`.
    block_sizes: None, or ``stages`` (the forward's ring), ``bwd_stages``, ``dq_parts``
      as a dict or :class:`~diffjax.kernels.gpu.mosaic_tiles.MosaicBlockSizes`.
  Returns:
    [B, T, H, Dv] in the dtype of q1 (bfloat16 or float16 inputs of one dtype). r = 1
    runs :func:`~diffjax.kernels.gpu.mosaic.diff_v1_pallas_gpu`.
  """
  lam_H = jnp.asarray(lam_H)
  _v.check_gda_v1(q1_BxTxHxD, q2_BxTxNxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H)
  qs, ks = (q1_BxTxHxD, q2_BxTxNxD), (k1_BxSxKxD, k2_BxSxKxD)
  segs = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  opts = dict(causal=causal, scale=scale, block_sizes=block_sizes, interpret=interpret)
  if q2_BxTxNxD.shape[2] == q1_BxTxHxD.shape[2]:
    return mosaic.diff_v1_pallas_gpu(*qs, *ks, v_BxSxKxDv, lam_H, **segs, **opts)
  grouped = dict(plan=_tiles, core=_grouped)
  return mosaic._checked_run("v1", qs, ks, v_BxSxKxDv, lam_H, **segs, **opts, **grouped)


def gda_v2_pallas_gpu(
  q1_BxTxHxD: jax.Array,
  q2_BxTxNxD: jax.Array,
  k_BxSxKxD: jax.Array,
  v_BxSxKxD: jax.Array,
  lam_BxTxH: jax.Array,
  *,
  causal: bool = True,
  q_segment_ids: jax.Array | None = None,
  kv_segment_ids: jax.Array | None = None,
  scale: float | None = None,
  block_sizes: tiles.MosaicBlockSizes | dict | None = None,
  interpret: bool = False,
) -> jax.Array:
  """Grouped differential attention, V2 style (one K, lambda per token), on Mosaic GPU.

  Args as :func:`gda_v1_pallas_gpu`, with the baseline's k, v and ``lam_BxTxH`` (already
  squashed) per token and signal head. Returns [B, T, H, D] in the dtype of q1. r = 1
  runs :func:`~diffjax.kernels.gpu.mosaic.diff_v2_pallas_gpu` on the interleaved pairs.
  """
  _v.check_gda_v2(q1_BxTxHxD, q2_BxTxNxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
  b, t, h, d = q1_BxTxHxD.shape
  segs = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  opts = dict(causal=causal, scale=scale, block_sizes=block_sizes, interpret=interpret)
  if q2_BxTxNxD.shape[2] == h:
    q_BxTxQxD = jnp.stack([q1_BxTxHxD, q2_BxTxNxD], axis=3).reshape(b, t, 2 * h, d)
    return mosaic.diff_v2_pallas_gpu(q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH, **segs, **opts)
  qs, grouped = (q1_BxTxHxD, q2_BxTxNxD), dict(plan=_tiles, core=_grouped)
  return mosaic._checked_run(
    "v2", qs, (k_BxSxKxD,), v_BxSxKxD, lam_BxTxH, **segs, **opts, **grouped
  )
