"""What computes one block of the context-parallel ring (:mod:`diffjax.ops.ring`).

:func:`xla_blocks`, or :func:`kernel_blocks` of a dispatch row's ``ring_blocks`` namespace.
Its protocol: docs/architecture.md, "Dispatch: which function runs".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diffjax.core.dtypes import accumulation_dtype
from diffjax.core.op_specs import OpSpec
from diffjax.ops.ring import BlockFunctions

__all__ = ["kernel_blocks", "xla_blocks"]

_NEG_INF = float(np.finfo(np.float32).min) * 0.5


# ------------------------------------------------------------------------------------------
# XLA blocks.


@dataclasses.dataclass(frozen=True)
class _XlaPlan:
  spec: OpSpec
  t: int
  s: int
  causal: bool
  scale: float


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
  for q, kidx in zip(plan.spec.split_maps(qs), plan.spec.map_keys):
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
  qs_maps = plan.spec.split_maps(qs)
  b, t, h, _ = qs_maps[0].shape
  per_group = lambda x_BxHxT: x_BxHxT.reshape(b, kh, h // kh, t)[..., None]
  do_g = _groups(d_out.astype(v.dtype), kh)
  # Both maps multiply the same V, so dP = dO V^T is shared: map s's cotangent is c_s dO
  # with c = (1, -lam), hence dP_s = c_s dP and D_s = c_s rowsum(dO * O_s).
  dp = jnp.einsum("btkgd,bskd->bkgts", do_g, v, preferred_element_type=acc)
  dks = [jnp.zeros(k.shape, acc) for k in ks]
  dqs, p_combined = [], None
  for mi, (q, kidx) in enumerate(zip(qs_maps, plan.spec.map_keys)):
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
  return tuple(plan.spec.join_maps(dqs, qs)), tuple(dks), dv


def xla_blocks(spec: OpSpec, scale: float) -> BlockFunctions:
  """The XLA blocks of the op ``spec``, token-major."""
  return BlockFunctions(
    config=lambda t, s, causal: _XlaPlan(spec, t, s, bool(causal), float(scale)),
    forward=_xla_forward,
    backward=_xla_backward,
    maps=spec.maps,
  )


# ------------------------------------------------------------------------------------------
# Kernel blocks.


def kernel_blocks(row: Any, **config: Any) -> BlockFunctions:
  """The per-block functions of the dispatch row ``row`` (see the module docstring).

  ``config``: the keyword arguments of the rows' ``block_config`` that stay fixed over the
  ring (``d, dv, heads, kv_heads, segmented, scale, block_sizes, interpret, dtype``); the
  block's ``t``, ``s`` and ``causal`` vary per call and are dropped from it.
  """
  ring_blocks = row.ring_blocks
  fixed = {k: v for k, v in config.items() if k not in ("t", "s", "causal")}

  def block_config(t, s, causal):
    return ring_blocks.block_config(**row.ring_options, **fixed, t=t, s=s, causal=causal)

  return BlockFunctions(
    config=block_config,
    forward=ring_blocks.block_forward,
    backward=ring_blocks.block_backward,
    maps=2,
    head_major=bool(getattr(ring_blocks, "HEAD_MAJOR", False)),
    interpreter_barrier=bool(getattr(ring_blocks, "INTERPRETER_BARRIER", False)),
  )
