"""The Mosaic GPU kernels as one block of the context-parallel ring, with results that merge.

The protocol of :mod:`diffjax.ops.ring_blocks` on token-major arrays.
Design: docs/kernels_gpu.md, "In the context-parallel ring".
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from diffjax.core import validation as _v
from diffjax.kernels.gpu import mosaic_bwd as mb
from diffjax.kernels.gpu import mosaic_common as mc
from diffjax.kernels.gpu import mosaic_fwd as mf
from diffjax.kernels.gpu import mosaic_tiles as tiles
from diffjax.kernels.gpu import pair_common as pc
from diffjax.kernels.gpu.mosaic import refusal

__all__ = ["HEAD_MAJOR", "INTERPRETER_BARRIER", "block_backward", "block_config", "block_forward"]

HEAD_MAJOR = False  # token-major, as the ops lay arrays out
INTERPRETER_BARRIER = False  # the Mosaic GPU interpreter holds no device barrier


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """One block call: the kernels' config and the padded lengths."""

  cfg: mc.MosaicConfig
  t: int
  s: int
  tp: int
  sp: int


def block_config(
  *,
  version: int,
  t: int,
  s: int,
  d: int,
  dv: int,
  heads: int,
  kv_heads: int,
  causal: bool,
  segmented: bool,
  scale: float,
  block_sizes=None,
  interpret=False,
  dtype=None,
) -> BlockConfig:
  """The static plan of one block call: T queries (the last T of S keys when causal)
  against S keys, of DIFF V1 (``version=1``) or V2 (``version=2``; ``heads``: pairs).
  Raises NotImplementedError for inputs of ``dtype`` and widths the kernels do not take."""
  if version not in (1, 2):
    raise ValueError(f"version must be 1 or 2; got {version!r}.")
  variant = f"v{version}"
  if dtype is not None:
    reason = refusal(variant, [dtype], d, dv, segmented)
    if reason is not None:
      raise NotImplementedError(f"the Mosaic GPU kernels refuse these blocks: {reason}")
  blocks = _v.resolve_fields(
    block_sizes, tiles.MosaicBlockSizes.default(d, dv, variant, segmented), tiles.MosaicBlockSizes
  ).resolved(d, dv, variant, segmented)
  cfg = mc.MosaicConfig(
    variant=variant,
    causal=bool(causal),
    scale=float(scale),
    q_len=t,
    kv_len=s,
    group=heads // kv_heads,
    segments=bool(segmented),
    block_kv=blocks.block_kv,
    stages=blocks.stages,
    interpret=bool(interpret),
    bwd_stages=blocks.bwd_stages,
    dq_parts=blocks.dq_parts,
  )
  return BlockConfig(
    cfg=cfg,
    t=t,
    s=s,
    tp=pc.round_up(t, mc.BLOCK_Q),
    sp=pc.round_up(s, max(blocks.block_kv, tiles.BLOCK_KV_BWD)),
  )


def block_forward(plan: BlockConfig, qs, ks, v, lam_BxHxT, q_seg, kv_seg):
  """One block's forward: ``(o1, o2, lse)``, each map's normalized output float32
  [B, T, H, Dv] and the log-sum-exps [B, H, 2, T] (``+inf`` where a row sees no key)."""
  tiles.check_inputs(plan.cfg.variant, qs, ks, v)
  padded = pc.pad_inputs(plan.tp, plan.sp, qs, ks, v, lam_BxHxT, q_seg, kv_seg)
  out, o2, lse_a, lse_b = mf.forward(plan.cfg, *padded)
  t = plan.t
  o2 = o2[:, :t].astype(jnp.float32)
  lam = jnp.transpose(lam_BxHxT.astype(jnp.float32), (0, 2, 1))[..., None]
  o1 = out[:, :t].astype(jnp.float32) + lam * o2
  lse2 = jnp.stack([lse_a, lse_b], axis=2)[..., :t]
  lse = jnp.where(lse2 >= 0.5 * pc.EMPTY_LSE, jnp.inf, lse2 / pc.LOG2E)
  return o1, o2, lse


def block_backward(
  plan: BlockConfig, qs, ks, v, lam_BxHxT, q_seg, kv_seg, d_out, lse_BxHx2xT, d1_BxHxT, d2_BxHxT
):
  """One block's share of the gradients of q, k and v, in their dtypes.

  Args:
    d_out: the cotangent of the combined output [B, T, H, Dv], in q's dtype.
    lse_BxHx2xT: both maps' log-sum-exps over *all* keys (``+inf`` where a row sees none).
    d1_BxHxT, d2_BxHxT: ``rowsum(dO * O_m)`` of the whole attention's map outputs.
  Returns:
    ``(dqs, dks, dv)``; the gradient of lambda is the whole attention's ``-D_2``.
  """
  cfg = plan.cfg
  padded = pc.pad_inputs(plan.tp, plan.sp, qs, ks, v, lam_BxHxT, q_seg, kv_seg)
  qs_p, ks_p, v_p, lam_p, q_seg_p, kv_seg_p = padded
  lse2 = jnp.where(jnp.isinf(lse_BxHx2xT), pc.EMPTY_LSE, lse_BxHx2xT * pc.LOG2E)
  # Padded query rows: no probability (empty log-sum-exp) and a zero cotangent.
  lse2 = pc.pad_axis(lse2.astype(jnp.float32), 3, plan.tp, pc.EMPTY_LSE)
  rows = jnp.stack(
    [
      lse2[:, :, 0],
      lse2[:, :, 1],
      pc.pad_axis(d1_BxHxT.astype(jnp.float32), 2, plan.tp),
      pc.pad_axis(d2_BxHxT.astype(jnp.float32), 2, plan.tp),
      lam_p,
    ],
    axis=2,
  )
  do = pc.pad_axis(d_out.astype(v.dtype), 1, plan.tp)
  dqs, dks, dv = mb.backward(
    cfg, qs_p, ks_p, v_p, do, rows, q_seg_p, kv_seg_p, stages=cfg.bwd_stages, dq_parts=cfg.dq_parts
  )
  t, s = plan.t, plan.s
  if cfg.variant == "v2":
    dks = (dks[0] + dks[1],)
  return (
    tuple(dq[:, :t].astype(q.dtype) for dq, q in zip(dqs, qs)),
    tuple(dk[:, :s].astype(k.dtype) for dk, k in zip(dks, ks)),
    dv[:, :s].astype(v.dtype),
  )
