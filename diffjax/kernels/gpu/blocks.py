"""The fused GPU DIFF kernels as one block of a larger attention, with results that merge.

The GPU counterpart of :mod:`diffjax.kernels.tpu.blocks` (see there for why ring
attention needs it): :func:`block_forward` returns both maps' normalized outputs and
log-sum-exps (``O_1 = out + lam O_2`` recovered from the combined output),
:func:`block_backward` takes the whole attention's log-sum-exps and row terms and returns
the block's share of the gradients. The kernels are those of
:mod:`diffjax.kernels.gpu.flash_pair`; this module pads to their tiles (lengths to the
blocks, head widths to powers of two) and converts their base-2 log-sum-exps.

Arrays are token-major, as the kernels take them: queries V1 ``(q1, q2)`` [B, T, H, D] /
V2 ``(q,)`` [B, T, 2H, D], keys V1 ``(k1, k2)`` / V2 ``(k,)`` [B, S, K, D], v
[B, S, K, Dv]; lambda float32 [B, H, T] for both; segment ids int [B, T] / [B, S] or None.
Log-sum-exps are float32 [B, H, 2, T] in the natural log, ``+inf`` on rows that see no key.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from diffjax.kernels.gpu import block_sizes as bs
from diffjax.kernels.gpu import flash_pair as fp

__all__ = ["BlockConfig", "block_backward", "block_config", "block_forward"]


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """One block call: the kernels' config and the padded sizes."""
  pair: fp.PairConfig
  t: int
  s: int
  tp: int
  sp: int
  dp: int
  dvp: int


def block_config(*, version: int, t: int, s: int, d: int, dv: int, heads: int, kv_heads: int,
                 causal: bool, segmented: bool, scale: float, block_sizes=None,
                 interpret=False) -> BlockConfig:
  """The static plan of one block call: T queries (the last T of S keys when causal)
  against S keys, of DIFF V1 (``version=1``) or V2 (``version=2``)."""
  if version not in (1, 2):
    raise ValueError(f"version must be 1 or 2; got {version!r}.")
  blocks = bs.resolve(block_sizes, bs.BlockSizes.default(d, dv)).clamped(t, s)
  pair = fp.PairConfig(variant=f"v{version}", causal=bool(causal), scale=float(scale),
                       q_len=t, kv_len=s, group=heads // kv_heads, segments=segmented,
                       blocks=blocks, interpret=bool(interpret))
  return BlockConfig(pair=pair, t=t, s=s, tp=fp.round_up(t, blocks.q_multiple),
                     sp=fp.round_up(s, blocks.kv_multiple),
                     dp=bs.next_power_of_2(max(d, 16)), dvp=bs.next_power_of_2(max(dv, 16)))


def _pad(cfg: BlockConfig, qs, ks, v, lam_BxHxT, q_seg, kv_seg):
  pad_q = lambda x: fp.pad_axis(fp.pad_axis(x, 1, cfg.tp), 3, cfg.dp)
  pad_k = lambda x, width: fp.pad_axis(fp.pad_axis(x, 1, cfg.sp), 3, width)
  q_seg, kv_seg = fp.pad_segment_ids(q_seg, kv_seg, cfg.tp, cfg.sp)
  return (tuple(pad_q(q) for q in qs), tuple(pad_k(k, cfg.dp) for k in ks),
          pad_k(v, cfg.dvp), fp.pad_axis(lam_BxHxT.astype(jnp.float32), 2, cfg.tp),
          q_seg, kv_seg)


def block_forward(cfg: BlockConfig, qs, ks, v, lam_BxHxT, q_seg, kv_seg):
  """One block's forward: ``(o1, o2, lse)``, each map's normalized output float32
  [B, T, H, Dv] and the log-sum-exps [B, H, 2, T] (``+inf`` where a row sees no key)."""
  dv = v.shape[3]
  args = _pad(cfg, qs, ks, v, lam_BxHxT, q_seg, kv_seg)
  out, o2, lse_a, lse_b = fp.forward(cfg.pair, *args)
  o2 = o2[:, :cfg.t, :, :dv].astype(jnp.float32)
  lam = jnp.transpose(lam_BxHxT.astype(jnp.float32), (0, 2, 1))[..., None]
  o1 = out[:, :cfg.t, :, :dv].astype(jnp.float32) + lam * o2
  lse2 = jnp.stack([lse_a, lse_b], axis=2)[..., :cfg.t]
  lse = jnp.where(lse2 >= 0.5 * fp.EMPTY_LSE, jnp.inf, lse2 / fp.LOG2E)
  return o1, o2, lse


def block_backward(cfg: BlockConfig, qs, ks, v, lam_BxHxT, q_seg, kv_seg, d_out, lse_BxHx2xT,
                   d1_BxHxT, d2_BxHxT):
  """One block's share of the gradients of q, k and v, in their dtypes.

  Args:
    d_out: the cotangent of the combined output [B, T, H, Dv], in q's dtype.
    lse_BxHx2xT: both maps' log-sum-exps over *all* keys (``+inf`` where a row sees none).
    d1_BxHxT, d2_BxHxT: ``rowsum(dO * O_m)`` of the whole attention's map outputs.
  """
  d, dv = ks[0].shape[3], v.shape[3]
  qs_p, ks_p, v_p, lam_p, q_seg_p, kv_seg_p = _pad(cfg, qs, ks, v, lam_BxHxT, q_seg, kv_seg)
  lse2 = jnp.where(jnp.isinf(lse_BxHx2xT), fp.EMPTY_LSE, lse_BxHx2xT * fp.LOG2E)
  # Padded query rows: no probability (empty log-sum-exp) and a zero cotangent.
  lse2 = fp.pad_axis(lse2, 3, cfg.tp, fp.EMPTY_LSE)
  rows = (lse2[:, :, 0], lse2[:, :, 1], fp.pad_axis(d1_BxHxT.astype(jnp.float32), 2, cfg.tp),
          fp.pad_axis(d2_BxHxT.astype(jnp.float32), 2, cfg.tp), lam_p)
  do = fp.pad_axis(fp.pad_axis(d_out, 1, cfg.tp), 3, cfg.dvp)
  *dks, dv_ = fp.backward_dkv(cfg.pair, qs_p, ks_p, v_p, do, rows, q_seg_p, kv_seg_p)
  dqs = fp.backward_dq(cfg.pair, qs_p, ks_p, v_p, do, rows, q_seg_p, kv_seg_p)
  return (tuple(dq[:, :cfg.t, :, :d] for dq in dqs), tuple(dk[:, :cfg.s, :, :d] for dk in dks),
          dv_[:, :cfg.s, :, :dv])
