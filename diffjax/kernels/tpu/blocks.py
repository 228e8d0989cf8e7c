"""The fused DIFF kernels as one block of the context-parallel ring, with results that merge.

The protocol of :mod:`diffjax.ops.ring_blocks` on head-major arrays. Design: docs/scaling.md,
"Context parallelism"; docs/kernels_tpu.md, "In the context-parallel ring".
"""

from __future__ import annotations

import jax.numpy as jnp

from diffjax.kernels.tpu import _layout as layout

# The custom_vjp's own pieces, shared with the whole-attention path.
from diffjax.kernels.tpu._core import CoreConfig, _lam_rows, backward_with_stats, make_config  # pylint: disable=protected-access
from diffjax.kernels.tpu._core import _forward as core_forward

__all__ = ["HEAD_MAJOR", "INTERPRETER_BARRIER", "block_backward", "block_config", "block_forward"]

# What the ring needs to know of these kernels: they take head-major arrays, and the TPU
# interpreter holds every device at a barrier in each call, so in the interpreter all
# devices must make the same calls.
HEAD_MAJOR = True
INTERPRETER_BARRIER = True


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
) -> CoreConfig:
  """The static plan of one block call: T queries (the last T of S keys when causal)
  against S keys, of DIFF V1 (``version=1``) or V2 (``version=2``). The kernels take every
  float ``dtype`` the ops pass them."""
  del dtype
  if version not in (1, 2):
    raise ValueError(f"version must be 1 or 2; got {version!r}.")
  return make_config(
    t=t,
    s=s,
    d=d,
    dv=dv,
    h=heads,
    kv_heads=kv_heads,
    causal=causal,
    segmented=segmented,
    scale=scale,
    block_sizes=block_sizes,
    shared_k=version == 2,
    lam_rows=version == 2,
    interpret=interpret,
  )


def _lam(cfg: CoreConfig, lam_BxHxT):
  """What the kernels take: V1 lambda per head [H], V2 per row [B, H, T]."""
  lam_BxHxT = lam_BxHxT.astype(jnp.float32)
  return lam_BxHxT if cfg.fwd.lam_rows else lam_BxHxT[0, :, 0]


def block_forward(cfg: CoreConfig, qs, ks, v, lam_BxHxT, q_seg, kv_seg):
  """One block's forward.

  Returns:
    ``(o1, o2, lse)``: each map's normalized output, float32 [B, H, T, Dv], and float32
    [B, H, 2, T] log-sum-exps of the scaled scores, ``+inf`` on rows that see no key of
    the block (their outputs are 0).
  """
  plan = cfg.fwd
  b, t = qs[0].shape[0], qs[0].shape[plan.seq_axis]
  lam = _lam(cfg, lam_BxHxT)
  out, o2, lse = core_forward(cfg, qs, ks, v, lam, q_seg, kv_seg, save_residuals=True)
  o2 = o2.astype(jnp.float32)
  lam_rows = _lam_rows(plan, lam, b, plan.heads, t)
  o1 = out.astype(jnp.float32) + lam_rows[..., None] * o2
  return o1, o2, layout.tiles_to_rows(lse, t)


def block_backward(
  cfg: CoreConfig, qs, ks, v, lam_BxHxT, q_seg, kv_seg, d_out, lse_BxHx2xT, d1_BxHxT, d2_BxHxT
):
  """One block's share of the gradients of q, k and v.

  Args:
    d_out: the cotangent of the combined output [B, H, T, Dv], in q's dtype.
    lse_BxHx2xT: both maps' log-sum-exps over *all* keys (``+inf`` where a row sees no
      key at all).
    d1_BxHxT, d2_BxHxT: ``rowsum(dO * O_1)`` and ``rowsum(dO * O_2)`` of the whole
      attention's normalized map outputs, float32.
  Returns:
    ``(dqs, dks, dv)`` like ``qs``, ``ks`` and ``v`` in their dtypes. The gradient of
    lambda is not the block's: it is ``-D_2`` of the whole attention.
  """
  return backward_with_stats(
    cfg, qs, ks, v, _lam(cfg, lam_BxHxT), q_seg, kv_seg, d_out, lse_BxHx2xT, d1_BxHxT, d2_BxHxT
  )
