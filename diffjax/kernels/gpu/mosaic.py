"""Differentiable DIFF V1 / V2 attention on Mosaic GPU (Hopper): forward and backward fused.

:func:`diff_v1_pallas_gpu` and :func:`diff_v2_pallas_gpu`: :mod:`.mosaic_fwd` and
:mod:`.mosaic_bwd` under one ``jax.custom_vjp``. Design: docs/kernels_gpu.md, "The kernels".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from diffjax.core import validation as _v
from diffjax.core.platform import HOPPER, gpu_capability
from diffjax.kernels.gpu import mosaic_bwd as mb
from diffjax.kernels.gpu import mosaic_common as mc
from diffjax.kernels.gpu import mosaic_fwd as mf
from diffjax.kernels.gpu import mosaic_tiles as tiles
from diffjax.kernels.gpu import pair_common as pc


def refusal(variant: str, dtypes, d: int, dv: int, segments: bool) -> str | None:
  """Why the Mosaic GPU kernels do not take inputs of these dtypes and widths (None: they
  do). They take bf16 or fp16 arrays of one dtype, head and value dims that are multiples
  of 16 whose tiles fit one CTA's shared memory, on a Hopper (sm_90)."""
  names = sorted({jnp.dtype(x).name for x in dtypes})
  if len(names) != 1 or names[0] not in ("bfloat16", "float16"):
    return (
      f"they take bfloat16 or float16 inputs of one dtype (got {names}); cast them, or use "
      "implementation='stock' (jax.nn.dot_product_attention), which takes float32"
    )
  if not tiles.fits(variant, names[0], d, dv, segments):
    return (
      f"head dims ({d}, {dv}) must be multiples of 16 (value dim at least 32) whose "
      "tiles fit one CTA's shared memory"
    )
  capability = gpu_capability()
  if capability != HOPPER:
    return f"the GPU is sm_{capability[0]}{capability[1]}, not a Hopper (sm_90)"
  return None


def _refuse(variant: str, qs, ks, v, segments: bool) -> None:
  reason = refusal(
    variant, [x.dtype for x in (*qs, *ks, v)], qs[0].shape[-1], v.shape[-1], segments
  )
  if reason is not None:
    raise NotImplementedError(f"the Mosaic GPU kernels refuse these inputs: {reason}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _pair(qs, ks, v, lam_BxHxT, q_seg, kv_seg, cfg):
  return mf.forward(cfg, qs, ks, v, lam_BxHxT, q_seg, kv_seg)[0]


def _pair_fwd(qs, ks, v, lam_BxHxT, q_seg, kv_seg, cfg):
  o, o2, lse_a, lse_b = mf.forward(cfg, qs, ks, v, lam_BxHxT, q_seg, kv_seg)
  return o, (qs, ks, v, lam_BxHxT, q_seg, kv_seg, o, o2, lse_a, lse_b)


def _pair_bwd(cfg, res, do):
  qs, ks, v, lam_BxHxT, q_seg, kv_seg, o, o2, lse_a, lse_b = res
  d_a, d_b = pc.row_terms(do, o, o2, lam_BxHxT)
  rows = jnp.stack([lse_a, lse_b, d_a, d_b, lam_BxHxT], axis=2)
  dqs, dks, dvv = mb.backward(
    cfg,
    qs,
    ks,
    v,
    do.astype(v.dtype),
    rows,
    q_seg,
    kv_seg,
    stages=cfg.bwd_stages,
    dq_parts=cfg.dq_parts,
  )
  dqs = tuple(dq.astype(q.dtype) for dq, q in zip(dqs, qs))
  if cfg.variant == "v2":
    dks = ((dks[0] + dks[1]).astype(ks[0].dtype),)
  return dqs, tuple(dks), dvv, -d_b, None, None


_pair.defvjp(_pair_fwd, _pair_bwd)


@functools.partial(
  jax.jit, static_argnames=("variant", "causal", "scale", "blocks", "interpret", "core")
)
def _padded(
  qs, ks, v, lam_BxHxT, q_seg, kv_seg, *, variant, causal, scale, blocks, interpret, core=_pair
):
  """Pads the lengths to the tiles, runs ``core`` (the pair kernels, or the grouped ones of
  :mod:`.mosaic_gda` with q2 of fewer heads) and slices the padding off."""
  t, s = qs[0].shape[1], ks[0].shape[1]
  tp, sp = pc.round_up(t, mc.BLOCK_Q), pc.round_up(s, blocks.block_kv)
  cfg = mc.MosaicConfig(
    variant=variant,
    causal=causal,
    scale=scale,
    q_len=t,
    kv_len=s,
    group=lam_BxHxT.shape[1] // ks[0].shape[2],
    segments=q_seg is not None,
    block_kv=blocks.block_kv,
    stages=blocks.stages,
    interpret=interpret,
    bwd_stages=blocks.bwd_stages,
    dq_parts=blocks.dq_parts,
    noise_group=qs[0].shape[2] // qs[-1].shape[2],
  )
  out = core(*pc.pad_inputs(tp, sp, qs, ks, v, lam_BxHxT, q_seg, kv_seg), cfg)
  return out[:, :t]


def run(variant, qs, ks, v, lam_BxHxT, q_seg, kv_seg, blocks, *, causal, scale, interpret,
        core=_pair):  # fmt: skip
  """:func:`_padded` with the options in their static form (scale resolved for D)."""
  return _padded(
    qs,
    ks,
    v,
    lam_BxHxT,
    q_seg,
    kv_seg,
    variant=variant,
    causal=bool(causal),
    scale=_v.default_scale(scale, qs[0].shape[-1]),
    blocks=blocks,
    interpret=bool(interpret),
    core=core,
  )


def _blocks(variant, qs, ks, v, q_seg, block_sizes):
  _refuse(variant, qs, ks, v, q_seg is not None)
  tiles.check_inputs(variant, qs, ks, v)
  d, dv = qs[0].shape[3], v.shape[3]
  itemsize = jnp.dtype(qs[0].dtype).itemsize
  segments = q_seg is not None
  blocks = _v.resolve_fields(
    block_sizes,
    tiles.MosaicBlockSizes.default(d, dv, variant, segments, itemsize),
    tiles.MosaicBlockSizes,
  )
  return blocks.resolved(d, dv, variant, segments, itemsize)


def _checked_run(variant, qs, ks, v, lam, *, causal, q_segment_ids, kv_segment_ids, scale,
                 block_sizes, interpret, plan=_blocks, core=_pair):  # fmt: skip
  """:func:`run` after what the entry points share past their own checks: the segment ids'
  check, the tiles (``plan``, called as :func:`_blocks`) and lambda as float32 [B, H, T]
  (``lam``: V1 a scalar or [H], V2 [B, T, H]). V2's output is cast to q's dtype."""
  b, t, h, _ = qs[0].shape
  q_seg, kv_seg = pc.check_segment_ids(q_segment_ids, kv_segment_ids, b, t, ks[0].shape[1])
  blocks = plan(variant, qs, ks, v, q_seg, block_sizes)
  if variant == "v1":
    lam_BxHxT = jnp.broadcast_to(
      jnp.broadcast_to(lam, (h,)).astype(jnp.float32)[None, :, None], (b, h, t)
    )
  else:
    lam_BxHxT = jnp.transpose(lam, (0, 2, 1))
  opts = dict(causal=causal, scale=scale, interpret=interpret, core=core)
  out = run(variant, qs, ks, v, lam_BxHxT, q_seg, kv_seg, blocks, **opts)
  return out if variant == "v1" else out.astype(qs[0].dtype)


def diff_v1_pallas_gpu(
  q1_BxTxHxD: jax.Array,
  q2_BxTxHxD: jax.Array,
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
  """Fused DIFF V1 attention core (before the per-head norm) on Mosaic GPU, differentiable.

  Args:
    q1_BxTxHxD, q2_BxTxHxD: the two query components of the H DIFF heads.
    k1_BxSxKxD, k2_BxSxKxD: the two key components of the K kv groups (H % K == 0).
    v_BxSxKxDv: one value per kv group (Dv = 2 D in the paper).
    lam_H: lambda, a scalar or float [H]; used in float32. Its gradient is
      ``-sum_{b,t} rowsum(dO * O2)`` per head.
    causal: queries are the last T of the S key positions.
    q_segment_ids, kv_segment_ids: optional int [B, T] and [B, S]; both or neither.
    scale: score scale, default 1 / sqrt(D).
    block_sizes: None (the deepest tiles that fit shared memory), a
      :class:`~diffjax.kernels.gpu.mosaic_tiles.MosaicBlockSizes` or a dict of its fields.
    interpret: run jax's Mosaic GPU interpreter (CPU; the host devices it needs and what
      it does not check: docs/kernels_gpu.md).
  Returns:
    [B, T, H, Dv] in the dtype of q1; inputs are bfloat16 or float16 of one dtype.
    Rows that see no key are zero. Softmax and all accumulation run in float32.
  """
  lam_H = jnp.asarray(lam_H)
  _v.check_diff_v1(q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H)
  qs, ks = (q1_BxTxHxD, q2_BxTxHxD), (k1_BxSxKxD, k2_BxSxKxD)
  segs = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  opts = dict(causal=causal, scale=scale, block_sizes=block_sizes, interpret=interpret)
  return _checked_run("v1", qs, ks, v_BxSxKxDv, lam_H, **segs, **opts)


def diff_v2_pallas_gpu(
  q_BxTxQxD: jax.Array,
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
  """Fused DIFF V2 attention on paired query heads on Mosaic GPU, differentiable.

  Args:
    q_BxTxQxD: Q = 2H query heads; heads 2i and 2i+1 form pair i and read kv group
      i // (H / K).
    k_BxSxKxD, v_BxSxKxD: the baseline's keys and values.
    lam_BxTxH: per-token, per-pair lambda (already squashed); used in float32.
    causal, q_segment_ids, kv_segment_ids, scale, block_sizes, interpret: as in
      :func:`diff_v1_pallas_gpu`.
  Returns:
    [B, T, H, D] in the dtype of q. Rows that see no key are zero.
  """
  _v.check_diff_v2(q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
  segs = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  opts = dict(causal=causal, scale=scale, block_sizes=block_sizes, interpret=interpret)
  return _checked_run("v2", (q_BxTxQxD,), (k_BxSxKxD,), v_BxSxKxD, lam_BxTxH, **segs, **opts)
