"""GPU Pallas kernels and stock GPU paths, checked against the reference math.

On a machine without a GPU everything runs in the Pallas interpreter
(``interpret=True``), and the Triton lowering is checked by lowering for CUDA on
the CPU. Tests marked ``gpu`` compile and run on a real GPU (``pytest -m gpu``);
``slow`` tests widen the product of shapes (``pytest -m slow``).

Tolerances: errors are measured as ``max|kernel - reference| / max|reference|`` per
output and per gradient. float32: 2e-5 (observed about 1e-6). bfloat16: 2e-2 against
the float32 reference on the same bf16-rounded inputs (observed about 4e-3, the same
size as the reference's own error when it runs in bf16).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffjax import ops
from diffjax.kernels import gpu as kg
from diffjax.ops import reference as ref
from kernel_checks import TOL, check as _check, normal as _normal, rel_err as _rel_err, value_and_vjp as _value_and_vjp  # noqa: E402

V1_GRADS = ("q1", "q2", "k1", "k2", "v", "lam")
V2_GRADS = ("q", "k", "v", "lam")




def _segments(b, t, s, *, absent_id: bool):
  """kv ids: three segments of uneven length; q ids are the last T of them.

  With ``absent_id`` the first query row of batch 0 gets an id no key has, so that row
  sees no key (zero output, zero gradients).
  """
  pos = jnp.arange(s)
  kv = (pos >= s // 3).astype(jnp.int32) + (pos >= (2 * s) // 3 + 5).astype(jnp.int32)
  kv = jnp.stack([kv, jnp.roll(kv, 7)])[:b]
  q = kv[:, s - t:]
  if absent_id:
    q = q.at[0, 0].set(99)
  return q, kv




def _v1_inputs(b, t, s, h, kh, d, dv, dtype, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  return (_normal(ks[0], (b, t, h, d), dtype), _normal(ks[1], (b, t, h, d), dtype),
          _normal(ks[2], (b, s, kh, d), dtype), _normal(ks[3], (b, s, kh, d), dtype),
          _normal(ks[4], (b, s, kh, dv), dtype),
          jnp.linspace(0.15, 0.85, h).astype(jnp.float32))


def _v2_inputs(b, t, s, h, kh, d, dtype, seed=1):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  return (_normal(ks[0], (b, t, 2 * h, d), dtype), _normal(ks[1], (b, s, kh, d), dtype),
          _normal(ks[2], (b, s, kh, d), dtype),
          jax.nn.sigmoid(_normal(ks[3], (b, t, h))))


def _run_v1(t, s, n_rep, d, dv, causal, seg, dtype, *, b=1, kh=2, blocks=None, absent=False):
  h = kh * n_rep
  args = _v1_inputs(b, t, s, h, kh, d, dv, dtype)
  q_seg, kv_seg = _segments(b, t, s, absent_id=absent) if seg else (None, None)
  kern = lambda *a: kg.diff_v1_fused(*a, causal=causal, q_segment_ids=q_seg,
                                     kv_segment_ids=kv_seg, block_sizes=blocks,
                                     interpret=True)
  refn = lambda *a: ref.diff_v1_reference(
      *a, causal=causal, segment_ids=None if q_seg is None else (q_seg, kv_seg))
  ct = _normal(jax.random.PRNGKey(7), (b, t, h, dv), dtype)
  out, grads = _value_and_vjp(kern, args, ct)
  # Reference in float32 on the same (rounded) inputs.
  ref_out, ref_grads = _value_and_vjp(refn, [a.astype(jnp.float32) for a in args],
                                      ct.astype(jnp.float32))
  assert out.dtype == dtype and out.shape == (b, t, h, dv)
  for g, a in zip(grads, args):
    assert g.dtype == a.dtype and g.shape == a.shape
  _check([("out", out, ref_out)] + list(zip(V1_GRADS, grads, ref_grads)), dtype)
  return out, grads, q_seg


def _run_v2(t, s, n_rep, d, causal, seg, dtype, *, b=1, kh=2, blocks=None, absent=False):
  h = kh * n_rep
  args = _v2_inputs(b, t, s, h, kh, d, dtype)
  q_seg, kv_seg = _segments(b, t, s, absent_id=absent) if seg else (None, None)
  kern = lambda *a: kg.diff_v2_fused(*a, causal=causal, q_segment_ids=q_seg,
                                     kv_segment_ids=kv_seg, block_sizes=blocks,
                                     interpret=True)
  refn = lambda *a: ref.diff_v2_reference(
      *a, causal=causal, segment_ids=None if q_seg is None else (q_seg, kv_seg))
  ct = _normal(jax.random.PRNGKey(8), (b, t, h, d), dtype)
  out, grads = _value_and_vjp(kern, args, ct)
  ref_out, ref_grads = _value_and_vjp(refn, [a.astype(jnp.float32) for a in args],
                                      ct.astype(jnp.float32))
  assert out.dtype == dtype and out.shape == (b, t, h, d)
  _check([("out", out, ref_out)] + list(zip(V2_GRADS, grads, ref_grads)), dtype)
  return out, grads


# Default run (the interpreter is slow, so few cases): T < S, GQA 2 and 4, segment ids,
# causal and not, float32 and bfloat16, an awkward head dim and small blocks (many key
# blocks, forward and backward blocks that differ). The slow run takes the full product
# and the sequence-384 cases.
_SMALL_BLOCKS = kg.BlockSizes(block_q=32, block_kv=16, block_q_dkv=16, block_kv_dkv=32,
                              block_q_dq=64, block_kv_dq=16, num_warps=4)
def _slow(*case):
  """A case whose coverage the default cases repeat (sequence 384; GQA, bfloat16 and the
  small blocks each run in a faster case); it runs with ``-m slow``."""
  return pytest.param(*case, marks=pytest.mark.slow)


V1_CASES = [
    # t,   s,  rep, d,  dv, causal, seg, dtype, blocks
    _slow(200, 200, 1, 32, 64, True, False, jnp.float32, None),
    _slow(384, 384, 2, 32, 64, True, True, jnp.float32, None),
    (200, 200, 4, 24, 48, True, True, jnp.float32, _SMALL_BLOCKS),
    _slow(384, 384, 4, 64, 128, True, False, jnp.bfloat16, None),
    _slow(200, 200, 2, 32, 64, True, True, jnp.bfloat16, None),
    _slow(384, 384, 1, 16, 32, True, True, jnp.bfloat16, _SMALL_BLOCKS),
    (100, 200, 2, 32, 64, True, True, jnp.float32, None),
    _slow(200, 200, 2, 32, 64, False, True, jnp.float32, None),
]


@pytest.mark.parametrize("t,s,rep,d,dv,causal,seg,dtype,blocks", V1_CASES)
def test_diff_v1_matches_reference(t, s, rep, d, dv, causal, seg, dtype, blocks):
  _run_v1(t, s, rep, d, dv, causal, seg, dtype, blocks=blocks)


V2_CASES = [
    _slow(200, 200, 1, 32, True, False, jnp.float32, None),
    _slow(384, 384, 2, 32, True, True, jnp.float32, None),
    (200, 200, 4, 24, True, True, jnp.bfloat16, _SMALL_BLOCKS),
    _slow(100, 200, 2, 32, True, True, jnp.float32, None),
    (384, 384, 1, 16, False, False, jnp.bfloat16, None),
]


@pytest.mark.parametrize("t,s,rep,d,causal,seg,dtype,blocks", V2_CASES)
def test_diff_v2_matches_reference(t, s, rep, d, causal, seg, dtype, blocks):
  # With segment ids, row 0 of batch 0 sees no key (its output must be zero).
  out, _ = _run_v2(t, s, rep, d, causal, seg, dtype, blocks=blocks, absent=seg)
  if seg:
    np.testing.assert_array_equal(np.asarray(out[0, 0]), 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("seg", [False, True])
@pytest.mark.parametrize("rep", [1, 2, 4])
@pytest.mark.parametrize("t", [200, 384])
def test_diff_v1_product_slow(t, rep, seg, dtype):
  _run_v1(t, t, rep, 32, 64, True, seg, dtype, b=2)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("seg", [False, True])
@pytest.mark.parametrize("rep", [1, 2, 4])
@pytest.mark.parametrize("t", [200, 384])
def test_diff_v2_product_slow(t, rep, seg, dtype):
  _run_v2(t, t, rep, 32, True, seg, dtype, b=2)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_paper_head_dims_slow(d, dtype):
  _run_v1(384, 384, 2, d, 2 * d, True, True, dtype)
  _run_v2(384, 384, 2, d, True, True, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("blocks", [
    kg.BlockSizes(block_q=16, block_kv=16, block_q_dkv=16, block_kv_dkv=16, block_q_dq=16,
                  block_kv_dq=16),
    kg.BlockSizes(block_q=128, block_kv=32, block_q_dkv=64, block_kv_dkv=128,
                  block_q_dq=32, block_kv_dq=64),
])
def test_block_size_sweep_slow(blocks):
  _run_v1(300, 300, 2, 32, 64, True, True, jnp.float32, blocks=blocks)
  _run_v1(150, 300, 2, 32, 64, True, False, jnp.float32, blocks=blocks)
  _run_v2(300, 300, 2, 32, True, True, jnp.float32, blocks=blocks)


def test_rows_without_visible_keys_are_zero():
  # Query row 0 of batch 0 carries a segment id no key has.
  out, grads, q_seg = _run_v1(64, 96, 2, 16, 32, True, True, jnp.float32, b=2, absent=True)
  assert int(q_seg[0, 0]) == 99
  np.testing.assert_array_equal(np.asarray(out[0, 0]), 0.0)
  for name, g in zip(V1_GRADS, grads):
    assert np.all(np.isfinite(np.asarray(g))), name
  np.testing.assert_array_equal(np.asarray(grads[0][0, 0]), 0.0)  # dq1 of that row


@pytest.mark.slow  # T != S runs in the (100, 200) cases of both versions
def test_query_longer_than_keys_causal():
  # T > S: the first T - S queries precede every key and see nothing.
  out, _, _ = _run_v1(80, 48, 1, 16, 32, True, False, jnp.float32)
  np.testing.assert_array_equal(np.asarray(out[:, :32]), 0.0)


# ----------------------------------------------------------------------------------
# Decode.


@pytest.mark.parametrize("s,kv_lens,splits,rep", [
    _slow(1000, (1000, 1, 333), 4, 2),  # split length 256: lengths not multiples of it
    (1000, (0, 64, 257), 3, 1),         # an empty cache gives zeros
    _slow(700, (700, 699, 350), None, 4),  # heuristic number of splits
])
def test_decode_matches_reference(s, kv_lens, splits, rep):
  b, kh, d = len(kv_lens), 2, 32
  h = kh * rep
  q1, q2, k1, k2, v, lam = _v1_inputs(b, 1, s, h, kh, d, 2 * d, jnp.float32, seed=3)
  kv_len = jnp.array(kv_lens, jnp.int32)
  blocks = {"block_kv": 32, "num_splits": splits}
  out = kg.diff_v1_decode(q1, q2, k1, k2, v, lam, kv_len, block_sizes=blocks, interpret=True)
  want = jax.jit(kg.diff_v1_decode_reference)(q1, q2, k1, k2, v, lam, kv_len)
  assert out.shape == (b, 1, h, 2 * d)
  assert _rel_err(out, want) <= TOL[jnp.float32], _rel_err(out, want)
  # Cache slots past kv_len must not matter.
  junk = lambda x: jnp.where((jnp.arange(s)[None, :] < kv_len[:, None])[:, :, None, None], x, 1e3)
  out_junk = kg.diff_v1_decode(q1, q2, junk(k1), junk(k2), junk(v), lam, kv_len,
                               block_sizes=blocks, interpret=True)
  np.testing.assert_allclose(np.asarray(out_junk), np.asarray(out), rtol=0, atol=1e-5)
  if 0 in kv_lens:
    np.testing.assert_array_equal(np.asarray(out[kv_lens.index(0)]), 0.0)


def test_decode_bf16_and_reference_agrees_with_causal_last_row():
  b, s, kh, h, d = 2, 300, 2, 4, 64
  q1, q2, k1, k2, v, lam = _v1_inputs(b, 1, s, h, kh, d, 2 * d, jnp.bfloat16, seed=4)
  kv_len = jnp.array([s, 129], jnp.int32)
  out = kg.diff_v1_decode(q1, q2, k1, k2, v, lam, kv_len, interpret=True)
  want = jax.jit(kg.diff_v1_decode_reference)(
      *[x.astype(jnp.float32) for x in (q1, q2, k1, k2, v)], lam, kv_len)
  assert out.dtype == jnp.bfloat16
  assert _rel_err(out, want) <= TOL[jnp.bfloat16]
  # With a full cache, decode is the last row of causal attention over the cache.
  full = jax.jit(ref.diff_v1_reference)(q1[:1].astype(jnp.float32), q2[:1].astype(jnp.float32),
                               *[x[:1].astype(jnp.float32) for x in (k1, k2, v)], lam)
  assert _rel_err(want[:1], full) <= 1e-6


def test_decode_rejects_bad_arguments():
  q1, q2, k1, k2, v, lam = _v1_inputs(2, 2, 64, 2, 2, 16, 32, jnp.float32)
  with pytest.raises(ValueError, match="one query token"):
    kg.diff_v1_decode(q1, q2, k1, k2, v, lam, jnp.array([3, 4]), interpret=True)
  with pytest.raises(ValueError, match="kv_len must be an integer array of shape"):
    kg.diff_v1_decode(q1[:, :1], q2[:, :1], k1, k2, v, lam, jnp.array([3.0, 4.0]),
                      interpret=True)


# ----------------------------------------------------------------------------------
# Block sizes.


def test_block_sizes_validation_names_values():
  with pytest.raises(ValueError, match="block_q=48 must be a power of two"):
    kg.BlockSizes(block_q=48)
  with pytest.raises(ValueError, match="block_kv_dq=8 must be a power of two"):
    kg.BlockSizes(block_kv_dq=8)
  with pytest.raises(ValueError, match="num_warps=3 must be one of"):
    kg.BlockSizes(num_warps=3)
  with pytest.raises(ValueError, match="num_stages_bwd=0 must be in"):
    kg.BlockSizes(num_stages_bwd=0)
  with pytest.raises(ValueError, match="block_kv='64' must be an int"):
    kg.BlockSizes(block_kv="64")
  with pytest.raises(ValueError, match="num_splits=0 must be in"):
    kg.DecodeBlockSizes(num_splits=0)
  q1, q2, k1, k2, v, lam = _v1_inputs(1, 32, 32, 2, 2, 16, 32, jnp.float32)
  with pytest.raises(ValueError, match=r"Unknown BlockSizes fields \['block_z'\]"):
    kg.diff_v1_fused(q1, q2, k1, k2, v, lam, block_sizes={"block_z": 32}, interpret=True)
  with pytest.raises(TypeError, match="block_sizes must be None, a BlockSizes or a dict"):
    kg.diff_v1_fused(q1, q2, k1, k2, v, lam, block_sizes=(64, 64), interpret=True)


def test_block_sizes_defaults_and_overrides():
  # The forward keeps two float32 accumulators [block_q, Dv]: the defaults bound them.
  for d in (16, 24, 64, 96, 128, 256):
    dv = kg.BlockSizes.default(d)  # V1: value width 2 d
    assert dv.block_q * 2 * d <= 128 * 128, (d, dv)
    assert kg.BlockSizes.default(d, d).block_q >= dv.block_q  # V2: value width d
  clamped = kg.BlockSizes.default(32).clamped(20, 40)
  assert (clamped.block_q, clamped.block_kv) == (32, 64)
  # A dict overrides the defaults; the result is the same as the explicit instance.
  q1, q2, k1, k2, v, lam = _v1_inputs(1, 40, 40, 2, 1, 16, 32, jnp.float32)
  a = kg.diff_v1_fused(q1, q2, k1, k2, v, lam, block_sizes={"block_q": 16}, interpret=True)
  full = dict(vars(kg.BlockSizes.default(16, 32)), block_q=16)
  b = kg.diff_v1_fused(q1, q2, k1, k2, v, lam, block_sizes=kg.BlockSizes(**full),
                       interpret=True)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_segment_ids_must_come_in_pairs():
  q1, q2, k1, k2, v, lam = _v1_inputs(1, 32, 32, 2, 2, 16, 32, jnp.float32)
  with pytest.raises(ValueError, match="Pass both q_segment_ids"):
    kg.diff_v1_fused(q1, q2, k1, k2, v, lam, q_segment_ids=jnp.zeros((1, 32), jnp.int32),
                     interpret=True)


# ----------------------------------------------------------------------------------
# Dispatcher and stock paths.


def test_dispatcher_pallas_gpu_equals_xla():
  q1, q2, k1, k2, v, _ = _v1_inputs(2, 72, 72, 4, 2, 16, 32, jnp.float32)
  seg = jnp.stack([jnp.arange(72) // 30, jnp.arange(72) // 50]).astype(jnp.int32)
  kw = dict(causal=True, segment_ids=seg)
  a = ops.diff_v1_attention_core(q1, q2, k1, k2, v, 0.4, implementation="pallas_gpu",
                                 interpret=True, **kw)
  b = ops.diff_v1_attention_core(q1, q2, k1, k2, v, 0.4, implementation="xla", **kw)
  assert _rel_err(a, b) <= TOL[jnp.float32]
  q, k, v2, lam = _v2_inputs(2, 72, 72, 2, 1, 16, jnp.float32)
  a = ops.diff_v2_attention(q, k, v2, lam, implementation="pallas_gpu", interpret=True, **kw)
  b = ops.diff_v2_attention(q, k, v2, lam, implementation="xla", **kw)
  assert _rel_err(a, b) <= TOL[jnp.float32]


@pytest.mark.parametrize("t,s,seg", [_slow(64, 64, False), (40, 64, True)])
def test_stock_paths_compose_like_the_reference(t, s, seg):
  b = 2
  q_seg, kv_seg = _segments(b, t, s, absent_id=False) if seg else (None, None)
  kw = dict(causal=True, q_segment_ids=q_seg, kv_segment_ids=kv_seg, implementation="xla")
  segs = None if q_seg is None else (q_seg, kv_seg)
  q1, q2, k1, k2, v, lam = _v1_inputs(b, t, s, 4, 2, 16, 32, jnp.float32)
  q, k, v2, lam2 = _v2_inputs(b, t, s, 4, 2, 16, jnp.float32)

  @jax.jit
  def run():
    return {
        "v1": (kg.diff_v1_stock(q1, q2, k1, k2, v, lam, **kw),
               ref.diff_v1_reference(q1, q2, k1, k2, v, lam, segment_ids=segs)),
        "v2": (kg.diff_v2_stock(q, k, v2, lam2, **kw),
               ref.diff_v2_reference(q, k, v2, lam2, segment_ids=segs)),
        "mha": (kg.mha_stock(q, k, v2, **kw), ref.mha_reference(q, k, v2, segment_ids=segs)),
    }

  errs = {name: _rel_err(got, want) for name, (got, want) in run().items()}
  assert all(e <= 1e-5 for e in errs.values()), errs


def test_stock_is_refused_on_cpu():
  q1, q2, k1, k2, v, lam = _v1_inputs(1, 16, 16, 2, 2, 16, 32, jnp.float32)
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU refusal")
  with pytest.raises(ValueError, match="runs on \\[.*'gpu'.*\\], but the current backend is 'cpu'"):
    ops.diff_v1_attention_core(q1, q2, k1, k2, v, lam, implementation="stock")


# ----------------------------------------------------------------------------------
# Triton lowering (no GPU needed) and shard_map.


def _lowered_triton_calls(fn, *args) -> int:
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return text.count("xla.gpu.triton")


def test_triton_lowering_for_cuda_at_paper_shapes():
  # Lowering to Triton IR rejects non-power-of-two tiles and unsupported operations.
  b, t, h, d = 1, 512, 2, 128
  bf = jnp.bfloat16
  q = jnp.zeros((b, t, h, d), bf)
  v = jnp.zeros((b, t, h, 2 * d), bf)
  seg = jnp.zeros((b, t), jnp.int32)

  def v1_loss(q1, q2, k1, k2, v, lam):
    out = kg.diff_v1_fused(q1, q2, k1, k2, v, lam, q_segment_ids=seg, kv_segment_ids=seg)
    return out.astype(jnp.float32).sum()

  grad_v1 = jax.grad(v1_loss, argnums=tuple(range(6)))
  assert _lowered_triton_calls(grad_v1, q, q, q, q, v, jnp.ones((h,))) == 3
  q2h = jnp.zeros((b, t, 2 * h, d), bf)
  v2_loss = lambda q, k, v, lam: kg.diff_v2_fused(q, k, v, lam).astype(jnp.float32).sum()
  assert _lowered_triton_calls(jax.grad(v2_loss, argnums=(0, 1, 2, 3)), q2h, q, q,
                               jnp.ones((b, t, h))) == 3
  cache = jnp.zeros((2, 4096, h, d), bf)
  dec = lambda *a: kg.diff_v1_decode(*a)
  q_tok = jnp.zeros((2, 1, h, d), bf)
  assert _lowered_triton_calls(dec, q_tok, q_tok, cache, cache,
                               jnp.zeros((2, 4096, h, 2 * d), bf), jnp.ones((h,)),
                               jnp.array([4096, 17], jnp.int32)) == 1


_SHARD_SCRIPT = textwrap.dedent("""
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    from diffjax.kernels import gpu as kg
    from diffjax.ops import reference as ref

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    ks = jax.random.split(jax.random.PRNGKey(0), 10)
    b, t, h, kh, d = 2, 48, 4, 2, 16
    n = lambda i, shape: jax.random.normal(ks[i], shape)
    seg = jnp.stack([jnp.arange(t) // 20, jnp.arange(t) // 30]).astype(jnp.int32)
    errs = {}

    v1 = (n(0, (b, t, h, d)), n(1, (b, t, h, d)), n(2, (b, t, kh, d)), n(3, (b, t, kh, d)),
          n(4, (b, t, kh, 2 * d)), jnp.linspace(0.1, 0.8, h))
    ins, outs = kg.diff_v1_partition_specs("data", "model", segment_ids=True)
    f = jax.shard_map(lambda *a: kg.diff_v1_fused(*a[:6], q_segment_ids=a[6],
                                                  kv_segment_ids=a[7], interpret=True),
                      mesh=mesh, in_specs=ins, out_specs=outs, check_vma=False)
    def value_and_vjp(fn, args, ct):
      out, vjp = jax.vjp(fn, *args)
      return out, vjp(ct)

    ct = n(5, (b, t, h, 2 * d))
    out, grads = jax.jit(lambda a: value_and_vjp(f, a, ct))((*v1, seg, seg))
    want, rgrads = jax.jit(lambda a: value_and_vjp(
        lambda *x: ref.diff_v1_reference(*x, segment_ids=seg), a, ct))(v1)
    errs["v1 out"] = float(jnp.abs(out - want).max())
    for name, x, y in zip(["q1", "q2", "k1", "k2", "v", "lam"], grads, rgrads):
      errs["v1 d" + name] = float(jnp.abs(x - y).max())

    v2 = (n(6, (b, t, 2 * h, d)), n(7, (b, t, kh, d)), n(8, (b, t, kh, d)),
          jax.nn.sigmoid(n(9, (b, t, h))))
    ins, outs = kg.diff_v2_partition_specs("data", "model")
    f = jax.shard_map(lambda *a: kg.diff_v2_fused(*a, interpret=True), mesh=mesh,
                      in_specs=ins, out_specs=outs, check_vma=False)
    ct = n(5, (b, t, h, d))
    out, grads = jax.jit(lambda a: value_and_vjp(f, a, ct))(v2)
    want, rgrads = jax.jit(lambda a: value_and_vjp(ref.diff_v2_reference, a, ct))(v2)
    errs["v2 out"] = float(jnp.abs(out - want).max())
    for name, x, y in zip(["q", "k", "v", "lam"], grads, rgrads):
      errs["v2 d" + name] = float(jnp.abs(x - y).max())

    q1, q2, k1, k2, vv, lam = v1
    kv_len = jnp.array([48, 20], jnp.int32)
    ins, outs = kg.decode_partition_specs("data", "model")
    f = jax.shard_map(lambda *a: kg.diff_v1_decode(*a, interpret=True), mesh=mesh,
                      in_specs=ins, out_specs=outs, check_vma=False)
    args = (q1[:, :1], q2[:, :1], k1, k2, vv, lam, kv_len)
    errs["decode"] = float(jnp.abs(jax.jit(f)(*args)
                                   - jax.jit(kg.diff_v1_decode_reference)(*args)).max())
    bad = {k: e for k, e in errs.items() if not e < 1e-4}
    assert not bad, bad
    print("OK", len(jax.devices()))
""")


@pytest.mark.slow  # the kernels under shard_map also run in tests/test_dispatch.py
def test_kernels_run_under_shard_map_on_a_2x2_mesh():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, "-c", _SHARD_SCRIPT], env=env, capture_output=True,
                        text=True, timeout=600, check=False)
  assert proc.returncode == 0 and "OK 4" in proc.stdout, proc.stderr[-3000:]


# ----------------------------------------------------------------------------------
# Real GPU: compile and run (pytest -m gpu). Timings are printed by the benchmark only.

_needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


@pytest.mark.gpu
@_needs_gpu
@pytest.mark.parametrize("d", [64, 96, 128])
def test_gpu_compiled_kernels_match_reference(d):
  b, t, kh, h = 2, 1000, 2, 4
  bf = jnp.bfloat16
  args = _v1_inputs(b, t, t, h, kh, d, 2 * d, bf)
  seg = jnp.stack([jnp.arange(t) // 300, jnp.arange(t) // 700]).astype(jnp.int32)
  kern = jax.jit(lambda *a: kg.diff_v1_fused(*a, q_segment_ids=seg, kv_segment_ids=seg))
  out, vjp = jax.vjp(kern, *args)
  ref_out, ref_vjp = jax.vjp(lambda *a: ref.diff_v1_reference(*a, segment_ids=seg),
                             *[a.astype(jnp.float32) for a in args])
  ct = _normal(jax.random.PRNGKey(9), out.shape, bf)
  _check([("out", out, ref_out)] + list(zip(V1_GRADS, vjp(ct), ref_vjp(ct.astype(jnp.float32)))),
         bf)
  q, k, v, lam = _v2_inputs(b, t, t, h, kh, d, bf)
  out, vjp = jax.vjp(jax.jit(kg.diff_v2_fused), q, k, v, lam)
  ref_out, ref_vjp = jax.vjp(ref.diff_v2_reference,
                             *[a.astype(jnp.float32) for a in (q, k, v, lam)])
  ct = _normal(jax.random.PRNGKey(9), out.shape, bf)
  _check([("out", out, ref_out)] + list(zip(V2_GRADS, vjp(ct), ref_vjp(ct.astype(jnp.float32)))),
         bf)


@pytest.mark.gpu
@_needs_gpu
def test_gpu_float32_kernel_is_exact():
  args = _v1_inputs(1, 512, 512, 4, 2, 64, 128, jnp.float32)
  out = jax.jit(kg.diff_v1_fused)(*args)
  want = ref.diff_v1_reference(*args)
  assert _rel_err(out, want) <= 1e-4  # float32 dots run in IEEE (not TF32) precision


@pytest.mark.gpu
@_needs_gpu
def test_gpu_decode_and_stock_match_reference():
  b, s, kh, h, d = 2, 32768, 4, 8, 128
  bf = jnp.bfloat16
  q1, q2, k1, k2, v, lam = _v1_inputs(b, 1, s, h, kh, d, 2 * d, bf)
  kv_len = jnp.array([s, 5000], jnp.int32)
  out = jax.jit(kg.diff_v1_decode)(q1, q2, k1, k2, v, lam, kv_len)
  want = kg.diff_v1_decode_reference(*[x.astype(jnp.float32) for x in (q1, q2, k1, k2, v)],
                                     lam, kv_len)
  assert _rel_err(out, want) <= TOL[bf]
  args = _v1_inputs(2, 1024, 1024, 4, 2, 128, 256, bf)
  got = jax.jit(kg.diff_v1_stock)(*args)
  assert _rel_err(got, ref.diff_v1_reference(*[a.astype(jnp.float32) for a in args])) <= 2e-2
