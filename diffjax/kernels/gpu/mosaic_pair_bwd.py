"""The fused backward of the DIFF pair on Mosaic GPU (Hopper, sm_90).

One kernel computes every gradient of ``out = P_a V - lam P_b V`` (dQ_a, dQ_b, dK_a,
dK_b or the shared dK of V2, and dV) at the 32d arithmetic of the fused path: per
(query, key) pair it recomputes the two score tiles (4d FLOPs), forms one shared
``dP = dO V^T`` (4d) and one ``dV += (P_a - lam P_b)^T dO`` (4d), and the key and
query gradients of both maps (8d). The loop is key-major: a CTA owns 64 keys of one
kv group and walks every query block (and every query head of the group) that sees
them, so dK and dV stay in registers for the whole loop. dQ is added into float32
arrays in HBM with TMA reduce-adds (``copy_smem_to_gmem(..., reduction_op="add")``)
in the same step: no second pass over the keys.

Warpgroups. One CTA per (kv group, 64 keys, batch row), three warpgroups:

* warpgroup 2 (producer) TMA-copies the CTA's key and value tiles once, then each
  step's query tiles, dO and the per-row terms into a ring of ``stages`` slots;
* warpgroup w in {0, 1} owns map w (V1: map a reads Q1/K1, map b reads Q2/K2; V2: the
  pair's even and odd query heads on the shared K). Each step it forms its transposed
  score tile ``S_w^T = K_w Q_w^T`` [keys, queries] and probabilities ``P_w^T``, and half
  of the shared product: ``V[:, half_w] dO[:, half_w]^T``. The two warpgroups swap
  their halves of dP (float32) and their probabilities (``P_a``, ``lam P_b``, in the
  input dtype) through shared memory, so each holds the whole dP and ``P_a - lam P_b``
  without computing either twice. Warpgroup w then accumulates column half w of dV
  (``(P_a - lam P_b)^T dO[:, half_w]``), its own dK (``dS_w^T Q_w``), and its dQ
  contribution ``dS_w K_w``, which goes through shared memory to a TMA reduce-add.

Splitting dV by columns and the maps by warpgroups is what makes V1 at d 128
(Dv 256) fit: a warpgroup holds a [64, 128] dK and a [64, 128] dV half (64 float32
registers a thread each) next to the [64, 64] tiles, where dK1, dK2 and the whole dV
in one warpgroup would need 256.

Row terms. ``rows`` packs, per (batch, head, query), float32 (lse_a, lse_b, d_a, d_b,
lam): the base-2 log-sum-exps the forward saved, ``d_a = rowsum(dO O_1)``,
``d_b = rowsum(dO O_2)`` (:func:`~diffjax.kernels.gpu.pair_common.row_terms`) and
lambda. Then ``dS_a = P_a (dP - d_a)`` and ``dS_b = -lam P_b (dP - d_b)``; d lambda
is ``-d_b``, formed outside the kernel.

V2's dK is the sum of both warpgroups' partial sums; each writes its float32 partial
and the wrapper adds them (a [S, d] sum per kv head, small next to the kernel's reads).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from diffjax.kernels.gpu.mosaic_pair import (
    BLOCK_KV_BWD, BLOCK_Q, COMPUTE_WGS, ROWS, MosaicConfig, _bcast_cols, _bcast_rows, _col,
    _iota, _product, _row, _scratch_refs, accumulate, barriers, producer_ring,
    run_warpgroups, smem_tile, smem_transforms, value_split)
from diffjax.kernels.gpu.pair_common import LOG2E, NEG, q_blocks


def _tile_mask_t(cfg: MosaicConfig, q_start, kv_start, shape, qseg=None, kvseg=None):
  """Visible pairs of a transposed [keys, queries] tile, in the wgmma layout."""
  kpos = kv_start + _iota(shape, 0)
  mask = kpos < cfg.kv_len
  if cfg.causal:
    qpos = q_start + cfg.offset + _iota(shape, 1)
    mask = jnp.logical_and(mask, kpos <= qpos)
  if cfg.segments:
    mask = jnp.logical_and(mask, _bcast_rows(kvseg, shape) == _bcast_cols(qseg, shape))
  return mask


def backward(cfg: MosaicConfig, qs, ks, v, do, rows, q_seg, kv_seg, *, stages: int,
             dq_parts: int):
  """All gradients of the pair on padded inputs.

  Args:
    cfg: the forward's config (lengths, mask, scale, variant, interpret).
    qs, ks, v: as in :func:`~diffjax.kernels.gpu.mosaic_pair.forward` (T a multiple of
      64, S a multiple of 64).
    do: dOut, [B, T, H, Dv] in the input dtype (zero on padded query rows).
    rows: float32 [B, H, 5, T]: lse_a, lse_b, d_a, d_b, lam. A padded query row has a
      zero dO, so zero d_a, d_b and dS: it contributes nothing to any gradient.
    q_seg, kv_seg: int32 [B, T], [B, S] or None.
    stages, dq_parts: from :func:`~diffjax.kernels.gpu.mosaic_pair.backward_blocks`.
  Returns:
    (dqs, dks, dv): dqs float32 like qs; V1 dks = (dK1, dK2) in the input dtype, V2
    dks = (float32 partial of warpgroup 0, of warpgroup 1); dv in the input dtype.
  """
  v1 = cfg.variant == "v1"
  b, t, _, d = qs[0].shape
  s, kh, dv = ks[0].shape[1], ks[0].shape[2], v.shape[3]
  dtype = qs[0].dtype
  bq, bk = BLOCK_Q, BLOCK_KV_BWD
  if t % bq or s % bk:
    raise ValueError(f"backward wants T ({t}) and S ({s}) padded to multiples of 64.")
  g = cfg.group
  widths = value_split(dv)
  starts = (0, widths[0])
  c = cfg.scale * LOG2E
  q_width = d // dq_parts
  # The V and dO halves are TMA boxes inside rows of Dv: one swizzle tile must divide
  # both halves (and so Dv and the second half's offset).
  v_tile = math.gcd(*widths)

  def kernel(*refs):
    it = iter(refs)
    qa_ref = next(it)
    qb_ref = next(it) if v1 else qa_ref
    ka_ref = next(it)
    kb_ref = next(it) if v1 else ka_ref
    v_ref, do_ref, rows_ref = next(it), next(it), next(it)
    qseg_ref, kvseg_ref = (next(it), next(it)) if cfg.segments else (None, None)
    dqa_ref = next(it)
    dqb_ref = next(it) if v1 else dqa_ref
    dka_ref, dkb_ref, dv_ref = next(it), next(it), next(it)
    (k_smem, v_smem, q_smem, do_smem, rows_smem, qseg_smem, kvseg_smem, xdp_smem,
     xp_smem, dq_smem, res_bar, q_bar, do_bar, row_bar, qseg_bar, consumed, x_bar,
     r_bar) = it

    kvh = lax.axis_index("kv_heads")
    kv_start = lax.axis_index("kv_seq") * bk
    bi = lax.axis_index("batch")
    i_start, i_full, n_q = q_blocks(cfg, kv_start, bq, bk)
    per_head = n_q - i_start
    total = g * per_head
    keys = (bi, pl.ds(kv_start, bk), kvh)

    def q_head(hl, w):
      """(query array, head index) of map w for local head hl of this kv group."""
      head = kvh * g + hl
      if v1:
        return (qa_ref, qb_ref)[w], head
      return qa_ref, 2 * head + w

    def consumer(w: int):
      # 2 x 128 consumer threads at 232 registers and 128 producer threads at 40 use
      # 64,512 of the SM's 65,536 (see backward_registers).
      plgpu.set_max_registers(232, action="increase")
      k_w = k_smem.at[w if v1 else 0]
      v_w, do_w, width_w = v_smem[w], do_smem[w], widths[w]
      plgpu.barrier_wait(res_bar.at[w if v1 else 0])
      plgpu.barrier_wait(res_bar.at[2 + w])
      kvseg = None
      if cfg.segments:
        plgpu.barrier_wait(res_bar.at[4])
        kvseg = _row(kvseg_smem[...])
      dq_out = dqa_ref if w == 0 else dqb_ref

      def step(n, carry, hl, i, masked: bool):
        dk, dv_acc = carry
        slot = lax.rem(n, jnp.int32(stages))
        q_start = i * bq
        plgpu.barrier_wait(q_bar.at[w * stages + slot])
        q_w = q_smem[w].at[slot]
        s_t = _product((bk, bq), k_w, q_w.transpose((1, 0))) * c
        plgpu.barrier_wait(row_bar.at[slot])
        row = lambda r: _col(rows_smem.at[slot, r][...])
        if masked:
          qseg = None
          if cfg.segments:
            plgpu.barrier_wait(qseg_bar.at[slot])
            qseg = _col(qseg_smem.at[slot][...])
          s_t = jnp.where(_tile_mask_t(cfg, q_start, kv_start, (bk, bq), qseg, kvseg),
                          s_t, NEG)
        p_t = jnp.exp2(s_t - _bcast_cols(row(w), s_t.shape))
        plgpu.barrier_wait(do_bar.at[w * stages + slot])
        dp_t = _product((bk, bq), v_w, do_w.at[slot].transpose((1, 0)))
        lam = _bcast_cols(row(4), p_t.shape)
        mine = p_t if w == 0 else lam * p_t
        # Swap dP halves and probabilities with the other warpgroup (x_bar: both
        # written; r_bar: both read, so each may reuse its own buffers).
        xdp_smem[w] = dp_t
        xp_smem[w] = mine.astype(dtype)
        plgpu.barrier_arrive(x_bar)
        plgpu.barrier_wait(x_bar)
        dp_t = dp_t + plgpu.layout_cast(xdp_smem[1 - w], plgpu.Layout.WGMMA)
        theirs = plgpu.layout_cast(xp_smem[1 - w], plgpu.Layout.WGMMA).astype(jnp.float32)
        plgpu.barrier_arrive(r_bar)
        p_comb = mine - theirs if w == 0 else theirs - mine  # P_a - lam P_b
        dv_acc = accumulate(dv_acc, p_comb.astype(dtype), do_w.at[slot], cfg)
        dd = _bcast_cols(row(2 + w), p_t.shape)
        ds_t = p_t * (dp_t - dd) if w == 0 else -(lam * p_t) * (dp_t - dd)
        ds_t = (ds_t * cfg.scale).astype(dtype)
        dk = accumulate(dk, ds_t, q_w, cfg)
        plgpu.barrier_wait(r_bar)
        xp_smem[w] = ds_t
        plgpu.commit_smem()
        dq = _product((bq, d), xp_smem.at[w].transpose((1, 0)), k_w)
        plgpu.barrier_arrive(consumed.at[slot])
        head = q_head(hl, w)[1]
        for part in range(dq_parts):
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          dq_smem[w] = dq[:, part * q_width:(part + 1) * q_width]
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(
              dq_smem.at[w],
              dq_out.at[bi, pl.ds(q_start, bq), head, pl.ds(part * q_width, q_width)],
              reduction_op="add")
        return dk, dv_acc

      def head_loop(hl, carry):
        base = hl * per_head - i_start
        run = lambda lo, hi, masked, carry: lax.fori_loop(
            lo, hi, lambda i, cr: step(base + i, cr, hl, i, masked), carry)
        carry = run(i_start, i_full, True, carry)
        return run(i_full, n_q, False, carry)

      zeros = lambda n: plgpu.layout_cast(jnp.zeros((bk, n), jnp.float32),
                                          plgpu.Layout.WGMMA)
      dk, dv_acc = lax.fori_loop(0, g, head_loop, (zeros(d), zeros(width_w)))
      dv_ref[(*keys, pl.ds(starts[w], width_w))] = dv_acc.astype(dv_ref.dtype)
      dk_ref = dka_ref if w == 0 else dkb_ref
      dk_ref[keys] = dk.astype(dk_ref.dtype)
      plgpu.wait_smem_to_gmem(0)

    def producer():
      plgpu.set_max_registers(40, action="decrease")
      plgpu.copy_gmem_to_smem(ka_ref.at[keys], k_smem.at[0], res_bar.at[0])
      if v1:
        plgpu.copy_gmem_to_smem(kb_ref.at[keys], k_smem.at[1], res_bar.at[1])
      for w in range(COMPUTE_WGS):
        plgpu.copy_gmem_to_smem(v_ref.at[(*keys, pl.ds(starts[w], widths[w]))],
                                v_smem[w], res_bar.at[2 + w])
      if cfg.segments:
        plgpu.copy_gmem_to_smem(kvseg_ref.at[bi, pl.ds(kv_start, bk)], kvseg_smem,
                                res_bar.at[4])

      def load(n, slot):
        hl = lax.div(n, per_head)
        i = i_start + lax.rem(n, per_head)
        rows_q = pl.ds(i * bq, bq)
        for w in range(COMPUTE_WGS):
          q_ref, head = q_head(hl, w)
          plgpu.copy_gmem_to_smem(q_ref.at[bi, rows_q, head], q_smem[w].at[slot],
                                  q_bar.at[w * stages + slot])
          plgpu.copy_gmem_to_smem(
              do_ref.at[bi, rows_q, kvh * g + hl, pl.ds(starts[w], widths[w])],
              do_smem[w].at[slot], do_bar.at[w * stages + slot])
        plgpu.copy_gmem_to_smem(rows_ref.at[bi, kvh * g + hl, pl.ds(0, ROWS), rows_q],
                                rows_smem.at[slot], row_bar.at[slot])
        if cfg.segments:
          plgpu.copy_gmem_to_smem(qseg_ref.at[bi, rows_q], qseg_smem.at[slot],
                                  qseg_bar.at[slot])

      producer_ring(load, total, stages, consumed)

    run_warpgroups(consumer, producer)

  smem = lambda shape, width, dt=dtype: smem_tile(shape, width, dt)
  bars = barriers
  seg = cfg.segments
  scratch = [
      smem((2 if v1 else 1, bk, d), d),                           # k_smem
      [smem((bk, w), v_tile) for w in widths],                    # v_smem halves
      # One buffer per warpgroup (and per V/dO half below) rather than a stacked
      # one: a constant index in a wgmma operand breaks jax 0.11's run_state lowering.
      [smem((stages, bq, d), d) for _ in range(COMPUTE_WGS)],     # q_smem
      [smem((stages, bq, w), v_tile) for w in widths],            # do_smem halves
      plgpu.SMEM((stages, ROWS, bq), jnp.float32),                # rows_smem
      plgpu.SMEM((stages, bq), jnp.int32) if seg else None,       # qseg_smem
      plgpu.SMEM((bk,), jnp.int32) if seg else None,              # kvseg_smem
      smem((COMPUTE_WGS, bk, bq), bq, jnp.float32),               # xdp_smem
      # xp_smem holds P for the swap, then dS^T, the A operand of dQ = dS K: its swizzle
      # must be K's (the widest that divides a row of d).
      plgpu.SMEM((COMPUTE_WGS, bk, bq), dtype, transforms=smem_transforms(d, dtype)),
      smem((COMPUTE_WGS, bq, q_width), q_width, jnp.float32),     # dq_smem
      bars(5),                                                    # res_bar
      bars(COMPUTE_WGS * stages),                                 # q_bar [w * stages + slot]
      bars(COMPUTE_WGS * stages),                                 # do_bar
      bars(stages),                                               # row_bar
      bars(stages) if seg else None,                              # qseg_bar
      bars(stages, arrivals=COMPUTE_WGS),                         # consumed
      bars(arrivals=COMPUTE_WGS),                                 # x_bar
      bars(arrivals=COMPUTE_WGS),                                 # r_bar
  ]
  args = list(qs) + list(ks) + [v, do, rows] + ([q_seg, kv_seg] if seg else [])
  dk_type = (jax.ShapeDtypeStruct(ks[0].shape, dtype) if v1
             else jax.ShapeDtypeStruct(ks[0].shape, jnp.float32))
  out_type = [dk_type, dk_type, jax.ShapeDtypeStruct(v.shape, dtype)]
  dq_refs = [jax.new_ref(jnp.zeros(q.shape, jnp.float32), memory_space=plgpu.GMEM)
             for q in qs]

  def body(*refs):
    pl.run_scoped(
        lambda *scr: kernel(*refs, *_scratch_refs(list(scr), scratch)),
        *[x for x in scratch if x is not None], collective_axes="wg")

  mesh = plgpu.Mesh(grid=(kh, s // bk, b), grid_names=("kv_heads", "kv_seq", "batch"),
                    num_threads=COMPUTE_WGS + 1, thread_name="wg")
  dka, dkb, dvv = pl.kernel(body, out_type=out_type, mesh=mesh,
                            name=f"diff_{cfg.variant}_bwd_mgpu", **cfg.kernel_kwargs())(
                                *args, *dq_refs)
  dqs = tuple(r[...] for r in dq_refs)
  return dqs, (dka, dkb), dvv
