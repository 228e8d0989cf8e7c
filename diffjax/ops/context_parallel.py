"""Context-parallel attention: the sequence axis of q, k and v sharded over a mesh axis.

For long sequences the length axis is split over C devices (the mesh axis named
``context``); every device holds T / C query and key positions. Two strategies compute
exact self-attention (the math of :mod:`diffjax.core.reference`) for the baseline, DIFF
V1 and DIFF V2:

  * ``"all_gather"``: each device gathers the whole sequence's keys and values (with
    their segment ids) and attends with its own queries. Simple; K and V of the full
    sequence sit on every device.
  * ``"ring"``: the key/value blocks travel around the ring of C devices
    (``jax.lax.ppermute``), one hop per step. Each device folds every block into
    online-softmax statistics (running max, sum and unnormalized output), kept apart
    for each softmax map: DIFF has two maps, ``out = softmax1 V - lam softmax2 V``, and
    they are combined only at the end. The backward pass is a ring too
    (``jax.custom_vjp``): it saves the local inputs, each map's output and
    log-sum-exp, recomputes block probabilities, and passes the key/value blocks
    around with their dK/dV accumulators. A device holds its T / C queries and one
    T / C block of keys and values at a time. With the XLA blocks (``implementation=
    "xla"``) each step's scores are a [T / C, T / C] tile per head, so choose C so that
    tile fits; with ``implementation="pallas_tpu"`` or ``"pallas_gpu"`` (what the ops
    choose for DIFF V1 and V2 on a TPU or GPU) the fused kernels run on each block
    instead (:mod:`diffjax.ops.ring_kernels`).

Load balance. With causal masking, the late positions attend to many more keys than
the early ones, so contiguous shards give the last device most of the work. With
``load_balance=True`` the caller holds the sequence in the order of
:func:`zigzag_permutation` (2C chunks; shard i holds chunks i and 2C-1-i), which gives
every device the same amount of unmasked work. All per-token arrays (tokens,
positions, segment ids, DIFF V2's lambda) go in that order and the output comes out in
it; the causal mask still follows the original order: each device derives the
original positions of its queries and of every key block from its index on the
context axis.

The batch and head axes may be sharded as well (``batch_axis``, ``head_axis``), heads
in contiguous blocks that keep kv groups whole, as in
:mod:`diffjax.sharding.kernel_specs`.

Computation runs in float32 (float64 for float64 inputs,
:func:`diffjax.core.dtypes.accumulation_dtype`); the output has the dtype of q.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from diffjax.core import reference as ref
from diffjax.core import validation as _v
from diffjax.core.dtypes import accumulation_dtype
from diffjax.ops import dispatch, ring_kernels
from diffjax.ops.ring_kernels import shift_to_next as _shift

__all__ = ["OPS", "STRATEGIES", "context_parallel_attention", "inverse_permutation",
           "zigzag_permutation"]

OPS = ("mha", "diff_v1", "diff_v2")
STRATEGIES = ("ring", "all_gather")
BLOCK_IMPLEMENTATIONS = ("xla", *ring_kernels.IMPLEMENTATIONS)
AxisName = str | tuple[str, ...] | None

_NEG_INF = float(np.finfo(np.float32).min) * 0.5
# Which key array each softmax map reads: the baseline has one map; DIFF V1 two maps with
# their own keys; DIFF V2 two maps on the same keys.
_KEY_OF_MAP = {"mha": (0,), "diff_v1": (0, 1), "diff_v2": (0, 0)}


# ------------------------------------------------------------------------------------------
# Sequence order.

def zigzag_permutation(length: int, num_shards: int) -> np.ndarray:
  """The load-balanced causal order of ``length`` positions over ``num_shards`` shards.

  The sequence splits into ``2 * num_shards`` equal chunks; shard i holds chunk i, then
  chunk ``2 * num_shards - 1 - i``. Apply it as ``x[:, perm]``: shard i then gets
  ``permuted[:, i * T / C:(i + 1) * T / C]``, and ``perm[p]`` is the original position of
  permuted position p.

  Returns:
    int32 [length].
  """
  length, num_shards = int(length), int(num_shards)
  if num_shards <= 0:
    raise ValueError(f"num_shards must be positive; got {num_shards}.")
  if length <= 0 or length % (2 * num_shards):
    raise ValueError(f"The load-balanced order needs the length ({length}) to be a positive "
                     f"multiple of 2 * num_shards = {2 * num_shards} (two equal chunks per "
                     "shard). Pad the sequence or use load_balance=False.")
  chunk = length // (2 * num_shards)
  chunks_CxL = np.arange(length, dtype=np.int32).reshape(2 * num_shards, chunk)
  order = [c for i in range(num_shards) for c in (i, 2 * num_shards - 1 - i)]
  return chunks_CxL[order].reshape(length)


def inverse_permutation(perm) -> np.ndarray:
  """The permutation that undoes ``perm``: ``x[:, perm][:, inverse_permutation(perm)] == x``."""
  perm = np.asarray(perm)
  if perm.ndim != 1 or not np.array_equal(np.sort(perm), np.arange(perm.size)):
    raise ValueError(f"perm must be a permutation of range({perm.size}); got {perm!r}.")
  inv = np.empty_like(perm, dtype=np.int32)
  inv[perm] = np.arange(perm.size, dtype=np.int32)
  return inv


def _original_positions(shard, num_shards: int, t_local: int, load_balance: bool):
  """int32 [t_local]: original sequence positions of the tokens that shard ``shard`` holds.

  ``shard`` may be traced (the device's index on the context axis).
  """
  j = jnp.arange(t_local, dtype=jnp.int32)
  shard = jnp.asarray(shard, jnp.int32)
  if not load_balance:
    return shard * t_local + j
  chunk = t_local // 2
  first = shard * chunk + j
  second = (2 * num_shards - 1 - shard) * chunk + (j - chunk)
  return jnp.where(j < chunk, first, second)


# ------------------------------------------------------------------------------------------
# Per-device pieces.

def _block_mask(q_pos_T, k_pos_S, q_seg_BxT, kv_seg_BxS, causal: bool):
  """Boolean [B or 1, 1, 1, T, S] (True = attend) for the [B, K, G, T, S] layout, or None."""
  out = None
  if causal:
    out = (k_pos_S[None, :] <= q_pos_T[:, None])[None, None, None]
  if q_seg_BxT is not None:
    seg = (q_seg_BxT[:, :, None] == kv_seg_BxS[:, None, :])[:, None, None]
    out = seg if out is None else jnp.logical_and(out, seg)
  return out


def _scores(q_BxTxKxGxD, k_BxSxKxD, scale: float, acc) -> jax.Array:
  """Scaled scores [B, K, G, T, S] in the accumulation dtype."""
  s = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxSxKxD, preferred_element_type=acc)
  return s * jnp.asarray(scale, acc)


def _to_heads(x_BxKxGxTxF) -> jax.Array:
  """[B, K, G, T, F] -> [B, T, H, F] with h = k G + g."""
  b, kh, g, t, f = x_BxKxGxTxF.shape
  return jnp.transpose(x_BxKxGxTxF, (0, 3, 1, 2, 4)).reshape(b, t, kh * g, f)


def _from_heads(x_BxTxHxF, kv_heads: int) -> jax.Array:
  """[B, T, H, F] -> [B, K, G, T, F]."""
  b, t, h, f = x_BxTxHxF.shape
  return jnp.transpose(x_BxTxHxF.reshape(b, t, kv_heads, h // kv_heads, f), (0, 2, 3, 1, 4))


def _make_ring(*, axis: str, num_shards: int, load_balance: bool, causal: bool, scale: float,
               key_of_map: tuple[int, ...]):
  """The ring attention of one device, a ``custom_vjp`` function.

  ``ring(qs, ks, v, lam, seg)``: ``qs`` one [B, T, H, D] query array per softmax map;
  ``ks`` the [B, T, K, D] key arrays (map m reads ``ks[key_of_map[m]]``); ``v`` [B, T, K,
  Dv]; ``lam`` None (one map) or [B, T, H] in the accumulation dtype (two maps: ``out =
  o1 - lam o2``); ``seg`` None or int [B, T]. All local blocks; returns [B, T, H, Dv].
  """
  differential = len(key_of_map) == 2
  # Without load balancing, a causal key block from a later shard is entirely masked
  # and is skipped. With the zigzag order every block has visible keys.
  may_skip = causal and not load_balance

  def positions(shard, t_local):
    return _original_positions(shard, num_shards, t_local, load_balance)

  def mask_and_visible(me, step, seg, seg_blk, t_local):
    src = jnp.mod(me - step, num_shards)
    q_pos, k_pos = positions(me, t_local), positions(src, t_local)
    mask = _block_mask(q_pos, k_pos, seg, seg_blk, causal)
    visible = (jnp.max(q_pos) >= jnp.min(k_pos)) if may_skip else None
    return mask, visible

  def maybe(visible, update, carry):
    if visible is None:
      return update(carry)
    return jax.lax.cond(visible, update, lambda c: c, carry)

  def combine(outs, lam):
    if not differential:
      return outs[0]
    return outs[0] - lam[..., None] * outs[1]

  def forward(qs, ks, v, lam, seg):
    acc = accumulation_dtype(qs[0].dtype)
    b, t, h, _ = qs[0].shape
    kh, dv = v.shape[2], v.shape[3]
    g = h // kh
    qs_g = [q.reshape(b, t, kh, g, -1) for q in qs]
    me = jax.lax.axis_index(axis)

    def update(step, block, stats):
      ks_blk, v_blk, seg_blk = block
      mask, visible = mask_and_visible(me, step, seg, seg_blk, t)

      def fold(stats):
        new = []
        for q_g, kidx, (m_old, l_old, o_old) in zip(qs_g, key_of_map, stats):
          s = _scores(q_g, ks_blk[kidx], scale, acc)
          if mask is not None:
            s = jnp.where(mask, s, _NEG_INF)
          m_new = jnp.maximum(m_old, jnp.max(s, axis=-1))
          p = jnp.exp(s - m_new[..., None])
          if mask is not None:
            p = jnp.where(mask, p, 0.0)
          alpha = jnp.exp(m_old - m_new)
          l_new = l_old * alpha + jnp.sum(p, axis=-1)
          o_new = o_old * alpha[..., None] + jnp.einsum(
              "bkgts,bskd->bkgtd", p.astype(v_blk.dtype), v_blk, preferred_element_type=acc)
          new.append((m_new, l_new, o_new))
        return tuple(new)

      return maybe(visible, fold, stats)

    stats = tuple((jnp.full((b, kh, g, t), _NEG_INF, acc), jnp.zeros((b, kh, g, t), acc),
                   jnp.zeros((b, kh, g, t, dv), acc)) for _ in key_of_map)
    block = (tuple(ks), v, seg)

    def body(step, carry):
      block, stats = carry
      nxt = _shift(block, axis, num_shards)  # independent of this step's math: may overlap
      return nxt, update(step, block, stats)

    block, stats = jax.lax.fori_loop(0, num_shards - 1, body, (block, stats))
    stats = update(num_shards - 1, block, stats)

    outs, lses = [], []
    for m, l, o in stats:
      seen = l > 0
      l_safe = jnp.where(seen, l, 1.0)
      outs.append(_to_heads(o / l_safe[..., None]))  # rows with no visible key stay 0
      lses.append(jnp.where(seen, m + jnp.log(l_safe), 0.0))
    out = combine(outs, lam).astype(qs[0].dtype)
    return out, (qs, ks, v, lam, seg, tuple(outs), tuple(lses))

  def backward(res, dout_BxTxHxDv):
    qs, ks, v, lam, seg, outs, lses = res
    acc = accumulation_dtype(qs[0].dtype)
    b, t, h, _ = qs[0].shape
    kh = v.shape[2]
    g = h // kh
    qs_g = [q.reshape(b, t, kh, g, -1) for q in qs]
    me = jax.lax.axis_index(axis)
    dout = dout_BxTxHxDv.astype(acc)
    # Cotangent of each map's normalized output, and D = rowsum(dO * O) of the softmax.
    douts = [dout] if not differential else [dout, -lam[..., None] * dout]
    dlam = None
    if differential:
      dlam = -jnp.sum(dout * outs[1], axis=-1).astype(lam.dtype)
    deltas = [_from_heads(jnp.sum(do * o, axis=-1, keepdims=True), kh)[..., 0]
              for do, o in zip(douts, outs)]
    dos_g = [do.astype(v.dtype).reshape(b, t, kh, g, -1) for do in douts]

    def update(step, block, dqs):
      ks_blk, v_blk, seg_blk, dks, dv = block
      mask, visible = mask_and_visible(me, step, seg, seg_blk, t)

      def fold(carry):
        dqs, dks, dv = carry
        dqs, dks = list(dqs), list(dks)
        for mi, kidx in enumerate(key_of_map):
          k_blk = ks_blk[kidx]
          s = _scores(qs_g[mi], k_blk, scale, acc)
          p = jnp.exp(s - lses[mi][..., None])
          if mask is not None:
            p = jnp.where(mask, p, 0.0)
          dp = jnp.einsum("btkgd,bskd->bkgts", dos_g[mi], v_blk, preferred_element_type=acc)
          ds = (p * (dp - deltas[mi][..., None]) * jnp.asarray(scale, acc)).astype(k_blk.dtype)
          dqs[mi] = dqs[mi] + jnp.einsum("bkgts,bskd->btkgd", ds, k_blk,
                                         preferred_element_type=acc)
          dks[kidx] = dks[kidx] + jnp.einsum("bkgts,btkgd->bskd", ds, qs_g[mi],
                                             preferred_element_type=acc)
          dv = dv + jnp.einsum("bkgts,btkgd->bskd", p.astype(v_blk.dtype), dos_g[mi],
                               preferred_element_type=acc)
        return tuple(dqs), tuple(dks), dv

      dqs, dks, dv = maybe(visible, fold, (dqs, dks, dv))
      return (ks_blk, v_blk, seg_blk, dks, dv), dqs

    dqs = tuple(jnp.zeros(q_g.shape, acc) for q_g in qs_g)
    block = (tuple(ks), v, seg, tuple(jnp.zeros(k.shape, acc) for k in ks),
             jnp.zeros(v.shape, acc))

    def body(step, carry):
      block, dqs = carry
      kv_next = _shift(block[:3], axis, num_shards)  # independent of this step's math
      (_, _, _, dks, dv), dqs = update(step, block, dqs)
      grads_next = _shift((dks, dv), axis, num_shards)
      return (*kv_next, *grads_next), dqs

    block, dqs = jax.lax.fori_loop(0, num_shards - 1, body, (block, dqs))
    (_, _, _, dks, dv), dqs = update(num_shards - 1, block, dqs)
    # The accumulators of a block finish one device before the block's owner.
    dks, dv = _shift((dks, dv), axis, num_shards)

    dqs = tuple(dq.reshape(q.shape).astype(q.dtype) for dq, q in zip(dqs, qs))
    dks = tuple(dk.astype(k.dtype) for dk, k in zip(dks, ks))
    return dqs, dks, dv.astype(v.dtype), dlam, None

  @jax.custom_vjp
  def ring(qs, ks, v, lam, seg):
    return forward(qs, ks, v, lam, seg)[0]

  ring.defvjp(forward, backward)
  return ring


# ------------------------------------------------------------------------------------------
# The global-view op.

def _axis_names(axes: AxisName) -> tuple[str, ...]:
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def _axis_size(mesh: Mesh, axes: AxisName, what: str) -> int:
  names = _axis_names(axes)
  for n in names:
    if n not in mesh.shape:
      raise ValueError(f"{what}={axes!r} names mesh axis {n!r}, which the mesh (axes "
                       f"{tuple(mesh.shape)}) does not have.")
  return math.prod(mesh.shape[n] for n in names)


def _check_inputs(op: str, arrays: Sequence[jax.Array]) -> None:
  counts = {"mha": 3, "diff_v1": 6, "diff_v2": 4}
  if op not in counts:
    raise ValueError(f"Unknown op {op!r}; expected one of {OPS}.")
  if len(arrays) != counts[op]:
    raise ValueError(f"op {op!r} takes {counts[op]} arrays (the positional arguments of its "
                     f"reference function); got {len(arrays)}.")
  {"mha": _v.check_mha, "diff_v1": _v.check_diff_v1, "diff_v2": _v.check_diff_v2}[op](*arrays)


def _check_block_implementation(op: str, implementation: str, strategy: str, interpret,
                                dtype) -> None:
  if implementation not in BLOCK_IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r} is not one of "
                     f"{BLOCK_IMPLEMENTATIONS} (what computes each block of the ring).")
  if implementation == "xla":
    return
  name = f"implementation={implementation!r}"
  if op == "mha":
    raise ValueError(f"{name} runs the fused DIFF kernels per ring block; the baseline "
                     "('mha') has no fused kernel of ours. Use implementation='xla'.")
  if strategy != "ring":
    raise ValueError(f"{name} runs the kernels per block of the ring; strategy={strategy!r} "
                     "has no blocks. Use strategy='ring' or implementation='xla'.")
  if jnp.dtype(dtype) == jnp.float64:
    raise ValueError("The kernels accumulate in float32; float64 inputs need "
                     "implementation='xla'.")
  if not ring_kernels.available(implementation):
    raise ValueError(f"The kernels of {name} cannot be imported in this installation; use "
                     "implementation='xla'.")
  platform = implementation.removeprefix("pallas_")
  # Compiling ahead of time for a TPU on a CPU host counts as the TPU (target_platform).
  if not interpret and platform not in (jax.default_backend(), dispatch.current_platform()):
    raise ValueError(f"{name} needs a {platform.upper()} (the backend is "
                     f"{jax.default_backend()!r}); pass interpret=True to run the kernels "
                     "in the Pallas interpreter, or use implementation='xla'.")


def context_parallel_attention(
    op: str, arrays: Sequence[jax.Array], *, mesh: Mesh, context_axis: str = "context",
    batch_axis: AxisName = None, head_axis: AxisName = None, strategy: str = "ring",
    load_balance: bool = True, causal: bool = True, segment_ids: jax.Array | None = None,
    scale: float | None = None, implementation: str = "xla", block_sizes=None,
    interpret=False) -> jax.Array:
  """Exact self-attention with the sequence axis sharded over ``context_axis``.

  Args:
    op: "mha", "diff_v1" or "diff_v2".
    arrays: the positional arguments of the op's reference function:
      mha ``(q [B,T,H,D], k [B,T,K,D], v [B,T,K,Dv])``; diff_v1 ``(q1, q2, k1, k2, v,
      lam)`` with lam a scalar or [H]; diff_v2 ``(q [B,T,2H,D], k, v, lam [B,T,H])``.
      Self-attention only: keys and queries have the same length T.
    mesh: the device mesh.
    context_axis: the mesh axis that shards the length axis (C devices; T must be a
      multiple of C, of 2C with ``load_balance``).
    batch_axis, head_axis: mesh axis names (or tuples of names, or None) that shard the
      batch and the heads. Heads split in contiguous blocks, so the head axis size must
      divide K (kv heads): every shard holds whole kv groups with their query heads.
    strategy: "ring" (K/V blocks pass around the devices; one T / C block at a time) or
      "all_gather" (every device gathers the full K/V).
    load_balance: the inputs (every per-token array, segment ids included) are in the
      order of :func:`zigzag_permutation` ``(T, C)``, and so is the output. The causal
      mask follows the original order either way.
    causal: causal masking by original position.
    segment_ids: None or int [B, T] (packed documents; same order as the inputs).
    scale: score scale, default 1/sqrt(D).
    implementation: what computes each ring step: "xla" (the score tile of the block,
      any op and dtype), "pallas_tpu" or "pallas_gpu" (the fused DIFF V1 / V2 kernels of
      that platform; ring strategy only; elsewhere only with ``interpret=True``).
    block_sizes, interpret: passed to the kernels ("pallas_tpu").
  Returns:
    [B, T, H, Dv] in the dtype of the queries, in the inputs' (permuted) order.
  """
  arrays = tuple(jnp.asarray(a) for a in arrays)
  _check_inputs(op, arrays)
  if strategy not in STRATEGIES:
    raise ValueError(f"Unknown strategy {strategy!r}; expected one of {STRATEGIES}.")
  _check_block_implementation(op, implementation, strategy, interpret, arrays[0].dtype)
  if not isinstance(context_axis, str):
    raise ValueError(f"context_axis must be one mesh axis name; got {context_axis!r}.")
  q, k = arrays[0], arrays[2 if op == "diff_v1" else 1]
  b, t, _, d = q.shape
  kh = k.shape[2]
  if k.shape[1] != t:
    raise ValueError(f"Context-parallel attention is self-attention: queries and keys must "
                     f"have the same length; got {t} and {k.shape[1]}.")
  if segment_ids is not None:
    if isinstance(segment_ids, (tuple, list)):
      raise ValueError("Context-parallel attention takes one [batch, length] segment id array "
                       "(self-attention), not a (q_ids, kv_ids) pair.")
    segment_ids = jnp.asarray(segment_ids)
    _v.split_segment_ids(segment_ids, b, t, t)
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"segment_ids must be integers; got dtype {segment_ids.dtype}.")

  c = _axis_size(mesh, context_axis, "context_axis")
  batch_shards = _axis_size(mesh, batch_axis, "batch_axis")
  head_shards = _axis_size(mesh, head_axis, "head_axis")
  used = [context_axis, *_axis_names(batch_axis), *_axis_names(head_axis)]
  if len(set(used)) != len(used):
    raise ValueError(f"context_axis, batch_axis and head_axis must name different mesh axes; "
                     f"got {context_axis!r}, {batch_axis!r}, {head_axis!r}.")
  parts = 2 * c if load_balance else c
  if t % parts:
    raise ValueError(f"The length ({t}) must be a multiple of {parts} ("
                     f"{'2 * ' if load_balance else ''}the context axis size {c}"
                     f"{', two chunks per shard' if load_balance else ''}).")
  if b % batch_shards:
    raise ValueError(f"The batch ({b}) must be a multiple of the batch shards ({batch_shards}).")
  if kh % head_shards:
    raise ValueError(f"num_kv_heads={kh} must be a multiple of the head shards ({head_shards}) "
                     "so that every shard holds whole kv groups with the heads that read them.")
  scale = _v.default_scale(scale, d)
  acc = accumulation_dtype(q.dtype)

  x_spec = P(batch_axis, context_axis, head_axis, None)
  seg_spec = P(batch_axis, context_axis)
  if op == "mha":
    specs = (x_spec,) * 3
  elif op == "diff_v1":
    h = q.shape[2]
    lam_H = jnp.broadcast_to(arrays[5].astype(acc), (h,))
    arrays = (*arrays[:5], lam_H)
    specs = (x_spec,) * 5 + (P(head_axis),)
  else:
    specs = (x_spec,) * 3 + (P(batch_axis, context_axis, head_axis),)
  with_seg = segment_ids is not None
  if with_seg:
    arrays = (*arrays, segment_ids)
    specs = (*specs, seg_spec)

  def per_device_all_gather(*local):
    seg = local[-1] if with_seg else None
    xs = local[:-1] if with_seg else local
    me = jax.lax.axis_index(context_axis)
    t_local = xs[0].shape[1]
    q_pos = _original_positions(me, c, t_local, load_balance)
    # The gathered keys are in the inputs' order: the permutation itself.
    k_pos = jnp.asarray(zigzag_permutation(t, c) if load_balance else np.arange(t), jnp.int32)
    gather = lambda x: jax.lax.all_gather(x, context_axis, axis=1, tiled=True)
    mask = (k_pos[None, :] <= q_pos[:, None]) if causal else None
    segs = None if seg is None else (seg, gather(seg))
    kw = dict(causal=False, segment_ids=segs, mask=mask, scale=scale)
    if op == "mha":
      q_, k_, v_ = xs
      return ref.mha_reference(q_, gather(k_), gather(v_), **kw)
    if op == "diff_v1":
      q1, q2, k1, k2, v_, lam_ = xs
      return ref.diff_v1_reference(q1, q2, gather(k1), gather(k2), gather(v_), lam_, **kw)
    q_, k_, v_, lam_ = xs
    return ref.diff_v2_reference(q_, gather(k_), gather(v_), lam_, **kw)

  ring = _make_ring(axis=context_axis, num_shards=c, load_balance=load_balance, causal=causal,
                    scale=scale, key_of_map=_KEY_OF_MAP[op])

  def per_device_ring(*local):
    seg = local[-1] if with_seg else None
    xs = local[:-1] if with_seg else local
    if op == "mha":
      q_, k_, v_ = xs
      return ring((q_,), (k_,), v_, None, seg)
    if op == "diff_v1":
      q1, q2, k1, k2, v_, lam_H = xs
      lam_BxTxH = jnp.broadcast_to(lam_H[None, None, :], q1.shape[:3])
      return ring((q1, q2), (k1, k2), v_, lam_BxTxH, seg)
    q_, k_, v_, lam_ = xs
    bl, tl, qh, dl = q_.shape
    q_BxTxHx2xD = q_.reshape(bl, tl, qh // 2, 2, dl)
    return ring((q_BxTxHx2xD[:, :, :, 0], q_BxTxHx2xD[:, :, :, 1]), (k_,), v_,
                lam_.astype(acc), seg)

  def per_device_kernel_ring(*local):
    seg = local[-1] if with_seg else None
    xs = local[:-1] if with_seg else local
    bl, tl = xs[0].shape[:2]
    if op == "diff_v1":
      q1, q2, k1, k2, v_, lam_H = xs
      qs, ks, heads = (q1, q2), (k1, k2), q1.shape[2]
      lam_BxTxH = jnp.broadcast_to(lam_H[None, None, :], (bl, tl, heads))
    else:
      q_, k_, v_, lam_BxTxH = xs
      qs, ks, heads = (q_,), (k_,), q_.shape[2] // 2
    ring = ring_kernels.make_kernel_ring(
        implementation=implementation, version=1 if op == "diff_v1" else 2,
        axis=context_axis, num_shards=c, load_balance=load_balance, causal=causal, scale=scale,
        local_shapes=(bl, tl, heads, d, v_.shape[2], v_.shape[3]), segmented=with_seg,
        block_sizes=block_sizes, interpret=interpret)
    return ring(qs, ks, v_, lam_BxTxH.astype(jnp.float32), seg)

  if strategy == "all_gather":
    per_device = per_device_all_gather
  else:
    per_device = per_device_ring if implementation == "xla" else per_device_kernel_ring
  fn = jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=x_spec, check_vma=False)
  return fn(*arrays)
