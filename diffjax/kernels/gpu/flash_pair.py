"""Flash attention over a *pair* of softmax maps that share one value: the GPU kernels.

DIFF V1 and DIFF V2 both compute, per head (V1) or head pair (V2) and query row t,

    out_t = softmax(qa_t Ka^T s) V - lam_t * softmax(qb_t Kb^T s) V

V1 has two key components (Ka = K1, Kb = K2) and one lambda per head; V2 has one key
(Ka = Kb = K) and one lambda per token. This module holds the three Pallas kernels
that both variants share, written once:

* forward: one program per (batch, head, query block). It streams the key blocks once,
  keeps an exact online softmax for each map (running max and sum in float32) and two
  float32 accumulators of P V, and writes the output with lambda applied, the second
  map's normalised output O2 and both log-sum-exps (base 2).
* dK/dV: one program per (batch, kv group, key block). It loops over the group's heads
  and the query blocks, recomputes both maps from the saved log-sum-exps and computes
  one ``dP = dO V^T`` shared by both maps and one ``dV += (P1 - lam P2)^T dO``. GQA
  gradients are summed in registers: each key block is written once.
* dQ: one program per (batch, head, query block), streaming the key blocks again.

The row terms of the softmax backward are ``D2 = rowsum(dO * O2)`` and
``D1 = rowsum(dO * O) + lam D2`` (because O1 = O + lam O2); d lam is ``-D2``. They are
elementwise reductions, so the caller computes them with XLA.

Backend. These are generic Pallas kernels (``pl.dot``, ref slicing, ``lax.fori_loop``
over a grid) lowered through the Triton backend (``jax.experimental.pallas.triton``:
``CompilerParams(num_warps, num_stages)``). It is deprecated from jax 0.11 but still
works there. It runs in the generic Pallas interpreter (``interpret=True``) on a CPU,
and its lowering to Triton IR runs without a GPU
(``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``), so both the
arithmetic and the lowering are checked on machines without one. The Mosaic GPU
forward kernel for Hopper (:mod:`diffjax.kernels.gpu.mosaic_pair`: TMA, wgmma, a
producer warpgroup and one consumer warpgroup per map) keeps this module's conventions.

Layout and padding. Arrays arrive padded by the caller: lengths to a multiple of every
block, head dims to a power of two (Triton tiles are powers of two). Padded keys are
masked with the true key length; padded query rows are computed and dropped, and
their zero cotangent makes them contribute nothing to dK and dV.

Masking. Keys beyond the true length, causal (queries are the last T of S
positions) and segment ids. Masked scores are set to a large negative number; a row
that has seen no visible key yet keeps its running max there and the exponent is
taken against 0 instead, so its probabilities are exactly 0; a row with no visible key
at all produces a zero output, and its stored log-sum-exp is huge so the backward
recomputes zero probabilities. Key blocks that need no mask run a separate loop
without the mask arithmetic; blocks above the causal diagonal are never visited.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from diffjax.kernels.gpu.block_sizes import BlockSizes
from diffjax.kernels.gpu.pair_common import (  # noqa: F401  (re-exported)
    EMPTY_LSE, LOG2E, NEG, PairGeometry, check_segment_ids, kv_blocks, pad_axis,
    pad_segment_ids, q_blocks, round_up, row_terms)


@dataclasses.dataclass(frozen=True)
class PairConfig(PairGeometry):
  """Static description of one call (hashable: it is a custom_vjp non-diff argument).

  Attributes:
    variant: "v1" (two query arrays, keys K1 and K2) or "v2" (one query array whose
      heads 2i and 2i+1 form pair i, one key array shared by the pair).
    causal: causal mask, queries are the last ``q_len`` of ``kv_len`` positions.
    scale: score scale.
    q_len, kv_len: true (unpadded) lengths T and S.
    group: DIFF heads (V1) or pairs (V2) per kv group.
    segments: whether segment ids are passed.
    blocks: block sizes, already clamped to the padded lengths.
    interpret: run in the Pallas interpreter.
  """
  variant: str
  causal: bool
  scale: float
  q_len: int
  kv_len: int
  group: int
  segments: bool
  blocks: BlockSizes
  interpret: bool


# ----------------------------------------------------------------------------------
# In-kernel helpers.


def _mask(cfg: PairConfig, q_start, bq: int, kv_start, bk: int, qseg, kvseg):
  """Boolean [bq, bk] (or [1, bk]) mask of visible (query, key) pairs in a tile."""
  kpos = kv_start + jnp.arange(bk, dtype=jnp.int32)
  mask = (kpos < cfg.kv_len)[None, :]
  if cfg.causal:
    qpos = q_start + cfg.offset + jnp.arange(bq, dtype=jnp.int32)
    mask = jnp.logical_and(mask, kpos[None, :] <= qpos[:, None])
  if cfg.segments:
    mask = jnp.logical_and(mask, qseg[:, None] == kvseg[None, :])
  return mask


def dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
  """2-D matmul with float32 accumulation; the transposes fold into the tensor-core op.

  Written with ``lax.dot_general`` rather than ``pl.dot`` (which moved between jax
  releases). The Triton lowering maps float32 inputs to IEEE (not TF32) precision.
  """
  dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _scores(q, k, c):
  """Scores in the base-2 domain: (q k^T) * scale * log2(e), float32 [bq, bk]."""
  return dot(q, k, trans_b=True) * c


def online_softmax_step(s, v, acc, m, l, masked: bool):
  """One key block of an exact online softmax; returns the new (acc, m, l)."""
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  # A row with no visible key so far keeps m == NEG; exponents against 0 make its
  # masked probabilities exactly 0 instead of exp2(NEG - NEG) == 1.
  m_ref = jnp.where(m_new == NEG, 0.0, m_new) if masked else m_new
  alpha = jnp.exp2(m - m_new)
  p = jnp.exp2(s - m_ref[:, None])
  l = alpha * l + jnp.sum(p, axis=1)
  acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
  return acc, m_new, l


# ----------------------------------------------------------------------------------
# Forward kernel: grid (batch, head, query block).


def _forward_kernel(*refs, cfg: PairConfig):
  it = iter(refs)
  qa_ref, qb_ref, ka_ref = next(it), next(it), next(it)
  kb_ref = ka_ref if cfg.shared_k else next(it)
  v_ref, lam_ref = next(it), next(it)
  qseg_ref, kvseg_ref = (next(it), next(it)) if cfg.segments else (None, None)
  o_ref, o2_ref, lse_a_ref, lse_b_ref = it

  bq, bk = cfg.blocks.block_q, cfg.blocks.block_kv
  dv = v_ref.shape[-1]
  c = cfg.scale * LOG2E
  q_start = pl.program_id(2) * bq
  qa, qb = qa_ref[...], qb_ref[...]
  qseg = qseg_ref[...] if cfg.segments else None

  def step(j, carry, masked):
    acc_a, acc_b, m_a, m_b, l_a, l_b = carry
    kv_start = pl.multiple_of(j * bk, bk)
    rows = pl.ds(kv_start, bk)
    ka = ka_ref[rows, :]
    kb = ka if cfg.shared_k else kb_ref[rows, :]
    v = v_ref[rows, :]
    s_a, s_b = _scores(qa, ka, c), _scores(qb, kb, c)
    if masked:
      kvseg = kvseg_ref[rows] if cfg.segments else None
      mask = _mask(cfg, q_start, bq, kv_start, bk, qseg, kvseg)
      s_a = jnp.where(mask, s_a, NEG)
      s_b = jnp.where(mask, s_b, NEG)
    acc_a, m_a, l_a = online_softmax_step(s_a, v, acc_a, m_a, l_a, masked)
    acc_b, m_b, l_b = online_softmax_step(s_b, v, acc_b, m_b, l_b, masked)
    return acc_a, acc_b, m_a, m_b, l_a, l_b

  zeros_acc = jnp.zeros((bq, dv), jnp.float32)
  m0 = jnp.full((bq,), NEG, jnp.float32)
  l0 = jnp.zeros((bq,), jnp.float32)
  carry = (zeros_acc, zeros_acc, m0, m0, l0, l0)
  n_full, n_end = kv_blocks(cfg, q_start, bq, bk)
  carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
  carry = lax.fori_loop(n_full, n_end, functools.partial(step, masked=True), carry)
  acc_a, acc_b, m_a, m_b, l_a, l_b = carry

  safe_a = jnp.where(l_a == 0.0, 1.0, l_a)
  safe_b = jnp.where(l_b == 0.0, 1.0, l_b)
  o_b = acc_b / safe_b[:, None]
  lam = lam_ref[...]
  o = acc_a / safe_a[:, None] - lam[:, None] * o_b
  o_ref[...] = o.astype(o_ref.dtype)
  o2_ref[...] = o_b.astype(o2_ref.dtype)
  lse_a_ref[...] = jnp.where(l_a == 0.0, EMPTY_LSE, m_a + jnp.log2(safe_a))
  lse_b_ref[...] = jnp.where(l_b == 0.0, EMPTY_LSE, m_b + jnp.log2(safe_b))


def _grad_tile(qa, qb, ka, kb, v, do, lse_a, lse_b, d_a, d_b, lam, mask, c):
  """Recomputes both maps of one tile; returns (P1 - lam P2, dS1, dS2) in float32."""
  s_a, s_b = _scores(qa, ka, c), _scores(qb, kb, c)
  if mask is not None:
    s_a = jnp.where(mask, s_a, NEG)
    s_b = jnp.where(mask, s_b, NEG)
  p_a = jnp.exp2(s_a - lse_a[:, None])
  p_b = jnp.exp2(s_b - lse_b[:, None])
  dp = dot(do, v, trans_b=True)  # shared by both maps
  lam = lam[:, None]
  p = p_a - lam * p_b
  ds_a = p_a * (dp - d_a[:, None])
  ds_b = (-lam) * p_b * (dp - d_b[:, None])
  return p, ds_a, ds_b


# ----------------------------------------------------------------------------------
# dK/dV kernel: grid (batch, kv group, key block).


def _dkv_kernel(*refs, cfg: PairConfig):
  it = iter(refs)
  if cfg.variant == "v1":
    qa_ref, qb_ref = next(it), next(it)
  else:
    qa_ref = qb_ref = next(it)
  ka_ref = next(it)
  kb_ref = ka_ref if cfg.shared_k else next(it)
  v_ref, do_ref = next(it), next(it)
  lse_a_ref, lse_b_ref, d_a_ref, d_b_ref, lam_ref = (next(it) for _ in range(5))
  qseg_ref, kvseg_ref = (next(it), next(it)) if cfg.segments else (None, None)
  if cfg.shared_k:
    dka_ref, dv_ref = it
    dkb_ref = None
  else:
    dka_ref, dkb_ref, dv_ref = it

  bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_kv_dkv
  c = cfg.scale * LOG2E
  kv_start = pl.program_id(2) * bk
  ka = ka_ref[...]
  kb = ka if cfg.shared_k else kb_ref[...]
  v = v_ref[...]
  kvseg = kvseg_ref[...] if cfg.segments else None
  i_start, i_full, n_q = q_blocks(cfg, kv_start, bq, bk)

  def q_head(h, slot):
    # V1: separate arrays, local head h. V2: one array, pair h is heads 2h, 2h+1.
    if cfg.variant == "v1":
      return (qa_ref, qb_ref)[slot], h
    return qa_ref, 2 * h + slot

  def head_body(h, carry):
    def q_step(i, carry, masked):
      dka, dkb, dv = carry
      q_start = pl.multiple_of(i * bq, bq)
      rows = pl.ds(q_start, bq)
      ref_a, ha = q_head(h, 0)
      ref_b, hb = q_head(h, 1)
      qa, qb = ref_a[rows, ha, :], ref_b[rows, hb, :]
      do = do_ref[rows, h, :]
      mask = None
      if masked:
        qseg = qseg_ref[rows] if cfg.segments else None
        mask = _mask(cfg, q_start, bq, kv_start, bk, qseg, kvseg)
      p, ds_a, ds_b = _grad_tile(
          qa, qb, ka, kb, v, do, lse_a_ref[h, rows], lse_b_ref[h, rows],
          d_a_ref[h, rows], d_b_ref[h, rows], lam_ref[h, rows], mask, c)
      dv = dv + dot(p.astype(do.dtype), do, trans_a=True)
      dka = dka + dot(ds_a.astype(qa.dtype), qa, trans_a=True)
      ds_b_q = dot(ds_b.astype(qb.dtype), qb, trans_a=True)
      if cfg.shared_k:
        dka = dka + ds_b_q
      else:
        dkb = dkb + ds_b_q
      return dka, dkb, dv

    carry = lax.fori_loop(i_start, i_full, functools.partial(q_step, masked=True), carry)
    return lax.fori_loop(i_full, n_q, functools.partial(q_step, masked=False), carry)

  zk = jnp.zeros(ka.shape, jnp.float32)
  dka, dkb, dv = lax.fori_loop(
      0, cfg.group, head_body,
      (zk, None if cfg.shared_k else zk, jnp.zeros(v.shape, jnp.float32)))
  dka_ref[...] = (dka * cfg.scale).astype(dka_ref.dtype)
  if not cfg.shared_k:
    dkb_ref[...] = (dkb * cfg.scale).astype(dkb_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------
# dQ kernel: grid (batch, head, query block).


def _dq_kernel(*refs, cfg: PairConfig):
  it = iter(refs)
  qa_ref, qb_ref, ka_ref = next(it), next(it), next(it)
  kb_ref = ka_ref if cfg.shared_k else next(it)
  v_ref, do_ref = next(it), next(it)
  lse_a_ref, lse_b_ref, d_a_ref, d_b_ref, lam_ref = (next(it) for _ in range(5))
  qseg_ref, kvseg_ref = (next(it), next(it)) if cfg.segments else (None, None)
  if cfg.variant == "v1":
    dqa_ref, dqb_ref = it
  else:
    (dq_ref,) = it

  bq, bk = cfg.blocks.block_q_dq, cfg.blocks.block_kv_dq
  c = cfg.scale * LOG2E
  q_start = pl.program_id(2) * bq
  qa, qb = qa_ref[...], qb_ref[...]
  do = do_ref[...]
  lse_a, lse_b, d_a, d_b, lam = (r[...] for r in (lse_a_ref, lse_b_ref, d_a_ref, d_b_ref,
                                                   lam_ref))
  qseg = qseg_ref[...] if cfg.segments else None

  def step(j, carry, masked):
    dqa, dqb = carry
    kv_start = pl.multiple_of(j * bk, bk)
    rows = pl.ds(kv_start, bk)
    ka = ka_ref[rows, :]
    kb = ka if cfg.shared_k else kb_ref[rows, :]
    v = v_ref[rows, :]
    mask = None
    if masked:
      kvseg = kvseg_ref[rows] if cfg.segments else None
      mask = _mask(cfg, q_start, bq, kv_start, bk, qseg, kvseg)
    _, ds_a, ds_b = _grad_tile(qa, qb, ka, kb, v, do, lse_a, lse_b, d_a, d_b, lam, mask, c)
    dqa = dqa + dot(ds_a.astype(ka.dtype), ka)
    dqb = dqb + dot(ds_b.astype(kb.dtype), kb)
    return dqa, dqb

  zq = jnp.zeros(qa.shape, jnp.float32)
  n_full, n_end = kv_blocks(cfg, q_start, bq, bk)
  carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), (zq, zq))
  dqa, dqb = lax.fori_loop(n_full, n_end, functools.partial(step, masked=True), carry)
  dqa, dqb = dqa * cfg.scale, dqb * cfg.scale
  if cfg.variant == "v1":
    dqa_ref[...] = dqa.astype(dqa_ref.dtype)
    dqb_ref[...] = dqb.astype(dqb_ref.dtype)
  else:
    dq_ref[:, 0, :] = dqa.astype(dq_ref.dtype)
    dq_ref[:, 1, :] = dqb.astype(dq_ref.dtype)


# ----------------------------------------------------------------------------------
# pallas_call builders. Shapes (all padded):
#   V1: qa, qb [B, T, H, D]; ka, kb [B, S, K, D]; v [B, S, K, Dv]
#   V2: q [B, T, 2H, D] (pairs 2i, 2i+1); k [B, S, K, D]; v [B, S, K, Dv]
#   per-row float32 arrays (lam, lse, D) [B, H, T]; segment ids [B, T] / [B, S].
# H counts DIFF heads (V1) or pairs (V2); each reads kv group h // cfg.group.


def _params(warps: int, stages: int):
  return plgpu.CompilerParams(num_warps=warps, num_stages=stages)


def forward(cfg: PairConfig, qs, ks, v, lam_BxHxT, q_seg, kv_seg):
  """Runs the forward kernel. ``qs`` = (q1, q2) for V1, (q,) for V2; ``ks`` likewise.

  Returns (out [B, T, H, Dv] in q dtype, o2 [B, T, H, Dv] in q dtype,
  lse_a, lse_b float32 [B, H, T] in the base-2 domain).
  """
  b, t = qs[0].shape[:2]
  s, d, dv = ks[0].shape[1], ks[0].shape[3], v.shape[3]
  h = lam_BxHxT.shape[1]
  bq, g = cfg.blocks.block_q, cfg.group
  if cfg.variant == "v1":
    q_specs = [pl.BlockSpec((None, bq, None, d), lambda bi, hi, qi: (bi, qi, hi, 0))] * 2
    q_args = list(qs)
  else:  # the same array twice, at heads 2h and 2h + 1
    q_specs = [pl.BlockSpec((None, bq, None, d), lambda bi, hi, qi: (bi, qi, 2 * hi, 0)),
               pl.BlockSpec((None, bq, None, d), lambda bi, hi, qi: (bi, qi, 2 * hi + 1, 0))]
    q_args = [qs[0], qs[0]]
  k_spec = pl.BlockSpec((None, s, None, d), lambda bi, hi, qi: (bi, 0, hi // g, 0))
  v_spec = pl.BlockSpec((None, s, None, dv), lambda bi, hi, qi: (bi, 0, hi // g, 0))
  row_spec = pl.BlockSpec((None, None, bq), lambda bi, hi, qi: (bi, hi, qi))
  in_specs = q_specs + [k_spec] * len(ks) + [v_spec, row_spec]
  args = q_args + list(ks) + [v, lam_BxHxT]
  if cfg.segments:
    in_specs += [pl.BlockSpec((None, bq), lambda bi, hi, qi: (bi, qi)),
                 pl.BlockSpec((None, s), lambda bi, hi, qi: (bi, 0))]
    args += [q_seg, kv_seg]
  o_spec = pl.BlockSpec((None, bq, None, dv), lambda bi, hi, qi: (bi, qi, hi, 0))
  out_shape = [jax.ShapeDtypeStruct((b, t, h, dv), qs[0].dtype)] * 2 + [
      jax.ShapeDtypeStruct((b, h, t), jnp.float32)] * 2
  return pl.pallas_call(
      functools.partial(_forward_kernel, cfg=cfg),
      grid=(b, h, t // bq),
      in_specs=in_specs,
      out_specs=[o_spec, o_spec, row_spec, row_spec],
      out_shape=out_shape,
      compiler_params=_params(cfg.blocks.num_warps, cfg.blocks.num_stages),
      interpret=cfg.interpret,
      name=f"diff_{cfg.variant}_fwd",
  )(*args)


def backward_dkv(cfg: PairConfig, qs, ks, v, do, rows, q_seg, kv_seg):
  """dK (one per key component: V1 (dk1, dk2), V2 (dk,)) and dV, in the input dtypes.

  ``rows`` = (lse_a, lse_b, d_a, d_b, lam), each float32 [B, H, T].
  """
  b, t = qs[0].shape[:2]
  s, kh, d, dv = ks[0].shape[1], ks[0].shape[2], ks[0].shape[3], v.shape[3]
  bq, bk, g = cfg.blocks.block_q_dkv, cfg.blocks.block_kv_dkv, cfg.group
  q_heads = g if cfg.variant == "v1" else 2 * g
  q_spec = pl.BlockSpec((None, t, q_heads, d), lambda bi, gi, ki: (bi, 0, gi, 0))
  k_spec = pl.BlockSpec((None, bk, None, d), lambda bi, gi, ki: (bi, ki, gi, 0))
  v_spec = pl.BlockSpec((None, bk, None, dv), lambda bi, gi, ki: (bi, ki, gi, 0))
  do_spec = pl.BlockSpec((None, t, g, dv), lambda bi, gi, ki: (bi, 0, gi, 0))
  row_spec = pl.BlockSpec((None, g, t), lambda bi, gi, ki: (bi, gi, 0))
  in_specs = [q_spec] * len(qs) + [k_spec] * len(ks) + [v_spec, do_spec] + [row_spec] * 5
  args = list(qs) + list(ks) + [v, do] + list(rows)
  if cfg.segments:
    in_specs += [pl.BlockSpec((None, t), lambda bi, gi, ki: (bi, 0)),
                 pl.BlockSpec((None, bk), lambda bi, gi, ki: (bi, ki))]
    args += [q_seg, kv_seg]
  out_specs = [k_spec] * len(ks) + [v_spec]
  out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype) for k in ks] + [
      jax.ShapeDtypeStruct(v.shape, v.dtype)]
  return pl.pallas_call(
      functools.partial(_dkv_kernel, cfg=cfg),
      grid=(b, kh, s // bk),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_params(cfg.blocks.num_warps_bwd, cfg.blocks.num_stages_bwd),
      interpret=cfg.interpret,
      name=f"diff_{cfg.variant}_bwd_dkv",
  )(*args)


def backward_dq(cfg: PairConfig, qs, ks, v, do, rows, q_seg, kv_seg):
  """dQ: V1 (dq1, dq2) [B, T, H, D]; V2 (dq,) [B, T, 2H, D]; in the query dtype."""
  b, t = qs[0].shape[:2]
  s, d, dv = ks[0].shape[1], ks[0].shape[3], v.shape[3]
  h = rows[0].shape[1]
  bq, g = cfg.blocks.block_q_dq, cfg.group
  if cfg.variant == "v1":
    q_specs = [pl.BlockSpec((None, bq, None, d), lambda bi, hi, qi: (bi, qi, hi, 0))] * 2
    q_args = list(qs)
    out_specs = q_specs
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype) for q in qs]
  else:
    q_specs = [pl.BlockSpec((None, bq, None, d), lambda bi, hi, qi: (bi, qi, 2 * hi, 0)),
               pl.BlockSpec((None, bq, None, d), lambda bi, hi, qi: (bi, qi, 2 * hi + 1, 0))]
    q_args = [qs[0], qs[0]]
    out_specs = [pl.BlockSpec((None, bq, 2, d), lambda bi, hi, qi: (bi, qi, hi, 0))]
    out_shape = [jax.ShapeDtypeStruct(qs[0].shape, qs[0].dtype)]
  k_spec = pl.BlockSpec((None, s, None, d), lambda bi, hi, qi: (bi, 0, hi // g, 0))
  v_spec = pl.BlockSpec((None, s, None, dv), lambda bi, hi, qi: (bi, 0, hi // g, 0))
  do_spec = pl.BlockSpec((None, bq, None, dv), lambda bi, hi, qi: (bi, qi, hi, 0))
  row_spec = pl.BlockSpec((None, None, bq), lambda bi, hi, qi: (bi, hi, qi))
  in_specs = q_specs + [k_spec] * len(ks) + [v_spec, do_spec] + [row_spec] * 5
  args = q_args + list(ks) + [v, do] + list(rows)
  if cfg.segments:
    in_specs += [pl.BlockSpec((None, bq), lambda bi, hi, qi: (bi, qi)),
                 pl.BlockSpec((None, s), lambda bi, hi, qi: (bi, 0))]
    args += [q_seg, kv_seg]
  return pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg),
      grid=(b, h, t // bq),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_params(cfg.blocks.num_warps_bwd, cfg.blocks.num_stages_bwd),
      interpret=cfg.interpret,
      name=f"diff_{cfg.variant}_bwd_dq",
  )(*args)
