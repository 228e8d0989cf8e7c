"""What computes one block of the context-parallel ring (:mod:`diffjax.ops.ring`).

Two kinds of :class:`~diffjax.ops.ring.BlockFunctions`:

  * :func:`xla_blocks`: plain XLA for any op and dtype. Each call scores the block as one
    [T, S] tile per head (T queries, S keys of the block), so choose the context axis so
    that tile fits.
  * :func:`kernel_blocks`: a fused kernel's per-block forward and backward with
    log-sum-exps. A kernel offers them through the function the dispatch table
    (:mod:`diffjax.ops.dispatch`) registers for ``(op, "pallas_<platform>")``: that
    function's ``ring_blocks`` attribute is a namespace with ``block_config``,
    ``block_forward`` and ``block_backward`` (the protocol of
    :mod:`diffjax.kernels.tpu.blocks`) and optionally ``HEAD_MAJOR`` and
    ``INTERPRETER_BARRIER`` (both False when absent). :func:`registered_ring_blocks`
    finds it; a kernel without it runs the XLA blocks in the ring.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diffjax.core.dtypes import accumulation_dtype
from diffjax.ops import dispatch
from diffjax.ops.ring import BlockFunctions

__all__ = ["kernel_blocks", "registered_ring_blocks", "xla_blocks"]

_NEG_INF = float(np.finfo(np.float32).min) * 0.5
# Which key array each softmax map reads: the baseline has one map; DIFF V1 two maps with
# their own keys; DIFF V2 two maps on the same keys.
_KEY_OF_MAP = {"mha": (0,), "diff_v1": (0, 1), "diff_v2": (0, 0)}


# ------------------------------------------------------------------------------------------
# XLA blocks.


@dataclasses.dataclass(frozen=True)
class _XlaPlan:
  op: str
  t: int
  s: int
  causal: bool
  scale: float


def _query_maps(plan: _XlaPlan, qs) -> list[jax.Array]:
  """Each map's queries [B, T, H, D]: DIFF V2 holds pair i's two maps in heads 2i, 2i + 1."""
  if plan.op != "diff_v2":
    return list(qs)
  b, t, qh, d = qs[0].shape
  q_BxTxHx2xD = qs[0].reshape(b, t, qh // 2, 2, d)
  return [q_BxTxHx2xD[:, :, :, 0], q_BxTxHx2xD[:, :, :, 1]]


def _mask(plan: _XlaPlan, q_seg_BxT, kv_seg_BxS):
  """Boolean [B or 1, 1, 1, T, S] (True = attend) for the [B, K, G, T, S] layout, or None."""
  out = None
  if plan.causal:  # the queries are the last T of the S positions
    q_pos = jnp.arange(plan.t)[:, None] + (plan.s - plan.t)
    out = (jnp.arange(plan.s)[None, :] <= q_pos)[None, None, None]
  if q_seg_BxT is not None:
    seg = (q_seg_BxT[:, :, None] == kv_seg_BxS[:, None, :])[:, None, None]
    out = seg if out is None else jnp.logical_and(out, seg)
  return out


def _scores(q_BxTxKxGxD, k_BxSxKxD, scale: float, acc) -> jax.Array:
  """Scaled scores [B, K, G, T, S] in the accumulation dtype."""
  s = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxSxKxD, preferred_element_type=acc)
  return s * jnp.asarray(scale, acc)


def _groups(x_BxTxHxF, kv_heads: int) -> jax.Array:
  """[B, T, H, F] -> [B, T, K, G, F] with h = k G + g."""
  b, t, h, f = x_BxTxHxF.shape
  return x_BxTxHxF.reshape(b, t, kv_heads, h // kv_heads, f)


def _to_heads(x_BxKxGxTxF) -> jax.Array:
  """[B, K, G, T, F] -> [B, T, H, F]."""
  b, kh, g, t, f = x_BxKxGxTxF.shape
  return jnp.transpose(x_BxKxGxTxF, (0, 3, 1, 2, 4)).reshape(b, t, kh * g, f)


def _xla_forward(plan: _XlaPlan, qs, ks, v, lam, q_seg, kv_seg):
  del lam  # the maps are combined after the ring
  acc = accumulation_dtype(qs[0].dtype)
  kh = v.shape[2]
  mask = _mask(plan, q_seg, kv_seg)
  outs, lses = [], []
  for q, kidx in zip(_query_maps(plan, qs), _KEY_OF_MAP[plan.op]):
    b, t, h, _ = q.shape
    s = _scores(_groups(q, kh), ks[kidx], plan.scale, acc)
    if mask is not None:
      s = jnp.where(mask, s, _NEG_INF)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    if mask is not None:
      p = jnp.where(mask, p, 0.0)
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v, preferred_element_type=acc)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    outs.append(_to_heads(o / l_safe[..., None]))  # rows with no visible key stay 0
    lses.append(jnp.where(seen, m + jnp.log(l_safe), jnp.inf).reshape(b, h, t))
  return (*outs, jnp.stack(lses, axis=2))


def _xla_backward(
  plan: _XlaPlan, qs, ks, v, lam_BxHxT, q_seg, kv_seg, d_out, lse_BxHxMxT, *deltas_BxHxT
):
  acc = accumulation_dtype(qs[0].dtype)
  kh = v.shape[2]
  mask = _mask(plan, q_seg, kv_seg)
  scale = jnp.asarray(plan.scale, acc)
  qs_maps = _query_maps(plan, qs)
  b, t, h, _ = qs_maps[0].shape
  per_group = lambda x_BxHxT: x_BxHxT.reshape(b, kh, h // kh, t)[..., None]
  do_g = _groups(d_out.astype(v.dtype), kh)
  # Both maps multiply the same V, so dP = dO V^T is shared: map s's cotangent is c_s dO
  # with c = (1, -lam), hence dP_s = c_s dP and D_s = c_s rowsum(dO * O_s).
  dp = jnp.einsum("btkgd,bskd->bkgts", do_g, v, preferred_element_type=acc)
  dks = [jnp.zeros(k.shape, acc) for k in ks]
  dqs, p_combined = [], None
  for mi, (q, kidx) in enumerate(zip(qs_maps, _KEY_OF_MAP[plan.op])):
    q_g, k = _groups(q, kh), ks[kidx]
    p = jnp.exp(_scores(q_g, k, plan.scale, acc) - per_group(lse_BxHxMxT[:, :, mi]))
    if mask is not None:
      p = jnp.where(mask, p, 0.0)
    ds = p * (dp - per_group(deltas_BxHxT[mi])) * scale
    if mi:
      p = -per_group(lam_BxHxT) * p
      ds = -per_group(lam_BxHxT) * ds
    ds = ds.astype(k.dtype)
    dqs.append(jnp.einsum("bkgts,bskd->btkgd", ds, k, preferred_element_type=acc).reshape(q.shape))
    dks[kidx] = dks[kidx] + jnp.einsum("bkgts,btkgd->bskd", ds, q_g, preferred_element_type=acc)
    p_combined = p if p_combined is None else p_combined + p
  # dV = (P_1 - lam P_2)^T dO: one matmul on the combined probabilities.
  dv = jnp.einsum("bkgts,btkgd->bskd", p_combined.astype(v.dtype), do_g, preferred_element_type=acc)
  if plan.op == "diff_v2":
    dqs = [jnp.stack(dqs, axis=3).reshape(qs[0].shape)]
  return tuple(dqs), tuple(dks), dv


def xla_blocks(op: str, scale: float) -> BlockFunctions:
  """The XLA blocks of ``op`` ("mha", "diff_v1" or "diff_v2"), token-major."""
  return BlockFunctions(
    config=lambda t, s, causal: _XlaPlan(op, t, s, bool(causal), float(scale)),
    forward=_xla_forward,
    backward=_xla_backward,
    maps=len(_KEY_OF_MAP[op]),
  )


# ------------------------------------------------------------------------------------------
# Kernel blocks.


def registered_ring_blocks(op: str, implementation: str) -> Any | None:
  """The ``ring_blocks`` of the kernel the dispatch table registers for ``op`` and
  ``implementation`` ("pallas_tpu" or "pallas_gpu") on its platform; None when no kernel
  is registered or it has no per-block functions."""
  impl = dispatch.lookup(op, implementation, implementation.removeprefix("pallas_"), False)
  return None if impl is None else getattr(impl.fn, "ring_blocks", None)


def kernel_blocks(
  ring_blocks: Any,
  *,
  version: int,
  d: int,
  dv: int,
  heads: int,
  kv_heads: int,
  segmented: bool,
  scale: float,
  block_sizes=None,
  interpret=False,
) -> BlockFunctions:
  """A kernel's per-block functions (``ring_blocks``, see the module docstring) for DIFF
  V1 (``version=1``) or V2 (``version=2``) blocks of ``heads`` DIFF heads (V2: pairs)."""

  def config(t, s, causal):
    return ring_blocks.block_config(
      version=version,
      t=t,
      s=s,
      d=d,
      dv=dv,
      heads=heads,
      kv_heads=kv_heads,
      causal=causal,
      segmented=segmented,
      scale=scale,
      block_sizes=block_sizes,
      interpret=interpret,
    )

  return BlockFunctions(
    config=config,
    forward=ring_blocks.block_forward,
    backward=ring_blocks.block_backward,
    maps=2,
    head_major=bool(getattr(ring_blocks, "HEAD_MAJOR", False)),
    interpreter_barrier=bool(getattr(ring_blocks, "INTERPRETER_BARRIER", False)),
  )
