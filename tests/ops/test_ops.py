"""The functional attention ops against plain NumPy float64 loops.

The NumPy loops (tests/numpy_ops.py) are written from the definitions (brief section 2), not
from diffjax.ops.reference: explicit loops over batch, head, query and key, the mask
decided key by key, and a softmax per row. Sizes stay small so that the loops are
quick; the length-200 cases use one or two heads of width 4.
"""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy_ops import (
  check,
  mha_inputs,
  normal,
  np_diff_v1,
  np_diff_v2,
  np_mha,
  packed_segments,
  v1_inputs,
  v2_inputs,
)

from diffjax import ops
from diffjax.ops import reference as ref

# --------------------------------------------------------------------------------------
# Running the ops.
# --------------------------------------------------------------------------------------


def _is_array(v):
  arrays = (np.ndarray, jax.Array)
  return isinstance(v, arrays) or (
    isinstance(v, tuple) and v and all(isinstance(e, arrays) for e in v)
  )


def run(op, *args, **kwargs):
  """Calls ``op`` under jax.jit (one compile instead of one per primitive).

  Array arguments are traced; the rest (flags, floats, None) are static.
  """
  arrays = {k: v for k, v in kwargs.items() if _is_array(v)}
  static = {k: v for k, v in kwargs.items() if not _is_array(v)}
  return jax.jit(lambda a, kw: op(*a, **kw, **static))(args, arrays)


# --------------------------------------------------------------------------------------
# The ops against the loops.
# --------------------------------------------------------------------------------------

# (batch, length, kv_heads, n_rep, dim, causal): n_rep 1, 2, 4 with and without the causal
# mask at length 7, length 1, and one long case kept small in heads and width.
CASES = [
  (2, 7, 2, 1, 8, True),
  (2, 7, 2, 2, 8, True),
  (2, 7, 2, 4, 8, True),
  (2, 7, 2, 1, 8, False),
  (2, 7, 2, 2, 8, False),
  (2, 7, 2, 4, 8, False),
  (2, 1, 2, 4, 8, True),
  (2, 1, 2, 2, 8, False),
  (1, 200, 1, 2, 4, True),
]


@pytest.mark.parametrize("b,length,kv,n_rep,d,causal", CASES)
def test_mha_matches_loops(b, length, kv, n_rep, d, causal):
  rng = np.random.default_rng(0)
  q, k, v = mha_inputs(rng, b, length, length, kv * n_rep, kv, d)
  out = run(ops.dot_product_attention, q, k, v, causal=causal)
  chex.assert_shape(out, (b, length, kv * n_rep, d))
  chex.assert_type(out, jnp.float32)
  check(out, np_mha(q, k, v, causal=causal))


@pytest.mark.parametrize("b,length,kv,n_rep,d,causal", CASES)
def test_diff_v1_matches_loops(b, length, kv, n_rep, d, causal):
  rng = np.random.default_rng(1)
  h = kv * n_rep
  q1, q2, k1, k2, v = v1_inputs(rng, b, length, length, h, kv, d)
  # One lambda per head when there are several heads per group, else one for the layer.
  lam = np.float32(0.63) if n_rep == 1 else rng.uniform(-0.3, 1.2, (h,)).astype(np.float32)
  out = run(ops.diff_v1_attention_core, q1, q2, k1, k2, v, lam, causal=causal)
  chex.assert_shape(out, (b, length, h, 2 * d))
  chex.assert_type(out, jnp.float32)
  check(out, np_diff_v1(q1, q2, k1, k2, v, lam, causal=causal))


def test_diff_v1_python_float_lambda():
  rng = np.random.default_rng(2)
  q1, q2, k1, k2, v = v1_inputs(rng, 1, 5, 5, 2, 1, 8)
  out = ops.diff_v1_attention_core(q1, q2, k1, k2, v, 0.37)
  check(out, np_diff_v1(q1, q2, k1, k2, v, 0.37, causal=True))


@pytest.mark.parametrize("b,length,kv,n_rep,d,causal", CASES)
def test_diff_v2_matches_loops(b, length, kv, n_rep, d, causal):
  rng = np.random.default_rng(3)
  pairs = kv * n_rep
  q, k, v, lam = v2_inputs(rng, b, length, length, pairs, kv, d)
  out = run(ops.diff_v2_attention, q, k, v, lam, causal=causal)
  chex.assert_shape(out, (b, length, pairs, d))
  chex.assert_type(out, jnp.float32)
  check(out, np_diff_v2(q, k, v, lam, causal=causal))


def test_diff_v2_pairs_read_their_own_group():
  """Pair i reads kv group i // (h / h_kv): changing group 1's keys leaves pairs 0, 1 alone."""
  rng = np.random.default_rng(4)
  q, k, v, lam = v2_inputs(rng, 1, 6, 6, 4, 2, 8)
  out = np.asarray(run(ops.diff_v2_attention, q, k, v, lam))
  k2, v2 = k.copy(), v.copy()
  k2[:, :, 1] += 1.0
  v2[:, :, 1] -= 2.0
  out2 = np.asarray(run(ops.diff_v2_attention, q, k2, v2, lam))
  np.testing.assert_array_equal(out2[:, :, :2], out[:, :, :2])
  assert np.abs(out2[:, :, 2:] - out[:, :, 2:]).min() > 1e-3


@pytest.mark.parametrize("op", ["mha", "diff_v1", "diff_v2"])
@pytest.mark.parametrize(
  "b,length,kv,n_rep,d,causal",
  [(2, 7, 2, 2, 8, True), (2, 7, 2, 2, 8, False), (1, 200, 1, 2, 4, True)],
)
def test_segment_ids_match_loops(op, b, length, kv, n_rep, d, causal):
  rng = np.random.default_rng(5)
  seg = packed_segments(rng, b, length, docs=3 if length < 50 else 5)
  mask_kw = dict(causal=causal, q_seg_BxT=seg, kv_seg_BxS=seg)
  h = kv * n_rep
  if op == "mha":
    q, k, v = mha_inputs(rng, b, length, length, h, kv, d)
    out = run(ops.dot_product_attention, q, k, v, causal=causal, segment_ids=seg)
    expected = np_mha(q, k, v, **mask_kw)
  elif op == "diff_v1":
    q1, q2, k1, k2, v = v1_inputs(rng, b, length, length, h, kv, d)
    lam = rng.uniform(0.1, 0.9, (h,)).astype(np.float32)
    out = run(ops.diff_v1_attention_core, q1, q2, k1, k2, v, lam, causal=causal, segment_ids=seg)
    expected = np_diff_v1(q1, q2, k1, k2, v, lam, **mask_kw)
  else:
    q, k, v, lam = v2_inputs(rng, b, length, length, h, kv, d)
    out = run(ops.diff_v2_attention, q, k, v, lam, causal=causal, segment_ids=seg)
    expected = np_diff_v2(q, k, v, lam, **mask_kw)
  check(out, expected)


@pytest.mark.parametrize("with_segments", [False, True])
@pytest.mark.parametrize("op", ["mha", "diff_v1", "diff_v2"])
def test_fewer_queries_than_keys(op, with_segments):
  """T < S: the queries are the last T positions (decoding against a cache)."""
  rng = np.random.default_rng(6)
  b, t, s, kv, h, d = 2, 3, 7, 1, 2, 8
  seg = None
  mask_kw = dict(causal=True)
  if with_segments:
    kv_seg = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 2, 2, 2]], np.int32)
    q_seg = kv_seg[:, s - t :]
    seg = (q_seg, kv_seg)
    mask_kw.update(q_seg_BxT=q_seg, kv_seg_BxS=kv_seg)
  if op == "mha":
    q, k, v = mha_inputs(rng, b, t, s, h, kv, d)
    out = run(ops.dot_product_attention, q, k, v, segment_ids=seg)
    expected = np_mha(q, k, v, **mask_kw)
  elif op == "diff_v1":
    q1, q2, k1, k2, v = v1_inputs(rng, b, t, s, h, kv, d)
    out = run(ops.diff_v1_attention_core, q1, q2, k1, k2, v, 0.45, segment_ids=seg)
    expected = np_diff_v1(q1, q2, k1, k2, v, 0.45, **mask_kw)
  else:
    q, k, v, lam = v2_inputs(rng, b, t, s, h, kv, d)
    out = run(ops.diff_v2_attention, q, k, v, lam, segment_ids=seg)
    expected = np_diff_v2(q, k, v, lam, **mask_kw)
  chex.assert_shape(out, expected.shape)
  check(out, expected)


def _random_mask(rng, b, h, t, s):
  m = rng.random((b, h, t, s)) < 0.6
  m[0, 0, 1] = False  # one fully masked row
  m[-1, -1, 2, :] = False  # and another
  return m


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("op", ["mha", "diff_v1", "diff_v2"])
def test_explicit_mask_matches_loops(op, causal):
  rng = np.random.default_rng(7)
  b, t, kv, h, d = 2, 6, 1, 2, 8
  mask = _random_mask(rng, b, h, t, t)
  mask_kw = dict(causal=causal, mask_BxHxTxS=mask)
  if op == "mha":
    q, k, v = mha_inputs(rng, b, t, t, h, kv, d)
    out = run(ops.dot_product_attention, q, k, v, causal=causal, mask=mask)
    expected = np_mha(q, k, v, **mask_kw)
  elif op == "diff_v1":
    q1, q2, k1, k2, v = v1_inputs(rng, b, t, t, h, kv, d)
    out = run(ops.diff_v1_attention_core, q1, q2, k1, k2, v, 0.5, causal=causal, mask=mask)
    expected = np_diff_v1(q1, q2, k1, k2, v, 0.5, **mask_kw)
  else:
    q, k, v, lam = v2_inputs(rng, b, t, t, h, kv, d)
    out = run(ops.diff_v2_attention, q, k, v, lam, causal=causal, mask=mask)
    expected = np_diff_v2(q, k, v, lam, **mask_kw)
  check(out, expected)


@pytest.mark.parametrize("causal", [False, True])
def test_explicit_mask_of_lower_rank_broadcasts(causal):
  """The documented contract: ``mask`` is broadcastable to [B, H, T, S], e.g. [T, S]."""
  rng = np.random.default_rng(8)
  b, t, kv, h, d = 2, 5, 1, 2, 8
  q, k, v = mha_inputs(rng, b, t, t, h, kv, d)
  mask_TxS = rng.random((t, t)) < 0.7
  out = run(ops.dot_product_attention, q, k, v, causal=causal, mask=mask_TxS)
  full = np.broadcast_to(mask_TxS, (b, h, t, t))
  check(out, np_mha(q, k, v, causal=causal, mask_BxHxTxS=full))


def test_a_mask_that_cannot_broadcast_names_its_shape_and_the_wanted_one():
  q, k = jnp.ones((2, 5, 2, 8)), jnp.ones((2, 7, 2, 8))
  for shape in ((2, 2, 5, 8), (5, 6), (1, 2, 3, 5, 7)):
    with pytest.raises(
      ValueError, match=re.escape(f"mask of shape {shape} does not broadcast to [B, H, T=5, S=7]")
    ):
      ops.dot_product_attention(q, k, k, mask=np.ones(shape, bool), causal=False)
  for shape in ((7,), (5, 1), (2, 1, 5, 7)):  # what numpy broadcasts is taken
    assert (
      ops.dot_product_attention(q, k, k, mask=np.ones(shape, bool), causal=False).shape == q.shape
    )


def test_cpu_implementation_is_the_default_on_cpu():
  rng = np.random.default_rng(9)
  q, k, v, lam = v2_inputs(rng, 1, 5, 5, 2, 1, 8)
  auto = run(ops.diff_v2_attention, q, k, v, lam)
  chex.assert_trees_all_close(
    run(ops.diff_v2_attention, q, k, v, lam, implementation="xla_cpu"), auto, atol=0, rtol=0
  )
  # The reference path agrees to float32 rounding (the two paths sum in different orders).
  chex.assert_trees_all_close(
    run(ops.diff_v2_attention, q, k, v, lam, implementation="xla"), auto, atol=1e-6, rtol=1e-5
  )


@pytest.mark.parametrize("op", ["mha", "diff_v1", "diff_v2"])
def test_bfloat16_inputs_give_bfloat16_outputs_close_to_float64(op):
  rng = np.random.default_rng(10)
  b, t, kv, h, d = 1, 9, 1, 2, 8
  bf = lambda *xs: tuple(jnp.asarray(x, jnp.bfloat16) for x in xs)
  up = lambda *xs: tuple(np.asarray(jnp.asarray(x, jnp.float32)) for x in xs)
  if op == "mha":
    arrs = bf(*mha_inputs(rng, b, t, t, h, kv, d))
    out = run(ops.dot_product_attention, *arrs)
    expected = np_mha(*up(*arrs), causal=True)
  elif op == "diff_v1":
    arrs = bf(*v1_inputs(rng, b, t, t, h, kv, d))
    out = run(ops.diff_v1_attention_core, *arrs, 0.5)
    expected = np_diff_v1(*up(*arrs), 0.5, causal=True)
  else:
    q, k, v, lam = v2_inputs(rng, b, t, t, h, kv, d)
    arrs = bf(q, k, v)
    out = run(ops.diff_v2_attention, *arrs, lam)
    expected = np_diff_v2(*up(*arrs), lam, causal=True)
  chex.assert_type(out, jnp.bfloat16)
  # bf16 has an 8-bit mantissa; probabilities are rounded to bf16 before P @ V.
  check(np.asarray(jnp.asarray(out, jnp.float32)), expected, atol=3e-2, rtol=3e-2)


# --------------------------------------------------------------------------------------
# Properties.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_rep", [1, 2])
def test_diff_v1_with_zero_lambda_is_attention_with_wide_values(n_rep):
  rng = np.random.default_rng(13)
  b, t, kv, d = 2, 7, 2, 8
  q1, q2, k1, k2, v = v1_inputs(rng, b, t, t, kv * n_rep, kv, d)
  seg = packed_segments(rng, b, t)
  out = run(ops.diff_v1_attention_core, q1, q2, k1, k2, v, 0.0, segment_ids=seg)
  base = run(ops.dot_product_attention, q1, k1, v, segment_ids=seg)
  chex.assert_shape(base, (b, t, kv * n_rep, 2 * d))
  chex.assert_trees_all_close(out, base, atol=1e-6, rtol=1e-6)
  # ... and a nonzero lambda does change it (the test can tell the two apart).
  out_lam = run(ops.diff_v1_attention_core, q1, q2, k1, k2, v, 0.5, segment_ids=seg)
  assert float(jnp.max(jnp.abs(out_lam - base))) > 1e-2


@pytest.mark.parametrize("n_rep", [1, 2])
def test_diff_v2_with_zero_lambda_is_the_baseline_on_even_heads(n_rep):
  rng = np.random.default_rng(14)
  b, t, kv, d = 2, 7, 2, 8
  q, k, v, _ = v2_inputs(rng, b, t, t, kv * n_rep, kv, d)
  zero = np.zeros((b, t, kv * n_rep), np.float32)
  out = run(ops.diff_v2_attention, q, k, v, zero)
  base = run(ops.dot_product_attention, q[:, :, 0::2], k, v)
  chex.assert_trees_all_close(out, base, atol=1e-6, rtol=1e-6)
  # The odd heads are the ones subtracted: with lambda = 1 the result differs.
  out_one = run(ops.diff_v2_attention, q, k, v, np.ones_like(zero))
  assert float(jnp.max(jnp.abs(out_one - base))) > 1e-2


def test_fully_masked_rows_give_zeros():
  rng = np.random.default_rng(15)
  b, t, kv, h, d = 1, 5, 1, 2, 8
  mask = np.ones((b, h, t, t), bool)
  mask[0, 0, 2, :] = False
  mask[0, 1, 4, :] = False
  q, k, v = mha_inputs(rng, b, t, t, h, kv, d)
  q1, q2, k1, k2, v1 = v1_inputs(rng, b, t, t, h, kv, d)
  qv2, k2v, v2v, lam = v2_inputs(rng, b, t, t, h, kv, d)
  outs = [
    run(ops.dot_product_attention, q, k, v, causal=False, mask=mask),
    run(ops.diff_v1_attention_core, q1, q2, k1, k2, v1, 0.7, causal=False, mask=mask),
    run(ops.diff_v2_attention, qv2, k2v, v2v, lam, causal=False, mask=mask),
  ]
  for out in outs:
    out = np.asarray(out)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[0, 2, 0], 0.0)
    np.testing.assert_array_equal(out[0, 4, 1], 0.0)
    assert np.abs(out[0, 3, 0]).max() > 1e-3  # the other rows are not zero
  # A query whose segment has no key (decoding, T < S) gives zeros too.
  kv_seg = np.array([[0, 0, 0, 0, 0]], np.int32)
  q_seg = np.array([[0, 9]], np.int32)
  out = np.asarray(run(ops.dot_product_attention, q[:, :2], k, v, segment_ids=(q_seg, kv_seg)))
  np.testing.assert_array_equal(out[0, 1], 0.0)
  assert np.abs(out[0, 0]).max() > 1e-3


@pytest.mark.parametrize("b,t,s", [(2, 0, 5), (0, 3, 5), (2, 3, 0), (0, 0, 0)])
@pytest.mark.parametrize("implementation", ["auto", "xla"])
def test_empty_batches_sequences_and_key_ranges(b, t, s, implementation):
  # No query row: an empty output. No key: every row sees none, so zeros (as masked rows).
  q1, q2 = jnp.ones((b, t, 2, 8)), jnp.ones((b, t, 2, 8))
  k, v = jnp.ones((b, s, 2, 8)), jnp.ones((b, s, 2, 16))
  cases = [
    (ops.dot_product_attention, (q1, k, v), 16),
    (ops.diff_v1_attention_core, (q1, q2, k, k, v, jnp.full((2,), 0.5)), 16),
    (ops.diff_v2_attention, (jnp.ones((b, t, 4, 8)), k, k, jnp.ones((b, t, 2))), 8),
  ]
  for op, args, width in cases:
    out = op(*args, implementation=implementation)
    assert out.shape == (b, t, 2, width) and out.dtype == q1.dtype
    assert not np.asarray(out).any()
    grad = jax.grad(
      lambda x, op=op, args=args: op(x, *args[1:], implementation=implementation).sum()
    )
    g = grad(args[0])
    assert g.shape == args[0].shape and not np.asarray(g).any()


def test_fully_masked_rows_have_zero_gradients():
  rng = np.random.default_rng(16)
  q1, q2, k1, k2, v = v1_inputs(rng, 1, 4, 4, 2, 1, 8)
  mask = np.ones((1, 2, 4, 4), bool)
  mask[0, :, 1, :] = False

  def f(q1_, k1_):
    out = ops.diff_v1_attention_core(q1_, q2, k1, k2, v, 0.4, causal=False, mask=mask)
    return jnp.sum(out**2)

  gq, gk = jax.jit(jax.grad(f, argnums=(0, 1)))(q1, k1)
  assert np.isfinite(np.asarray(gq)).all() and np.isfinite(np.asarray(gk)).all()
  np.testing.assert_array_equal(np.asarray(gq)[0, 1], 0.0)
  assert np.abs(np.asarray(gq)[0, 2]).max() > 1e-6


@pytest.mark.parametrize("with_gain", [True, False])
def test_diff_v1_attention_is_rmsnorm_times_gain_times_one_minus_lambda_init(with_gain):
  rng = np.random.default_rng(17)
  b, t, kv, h, d = 2, 6, 1, 2, 8
  q1, q2, k1, k2, v = v1_inputs(rng, b, t, t, h, kv, d)
  lam, lambda_init = 0.6, ref.lambda_init_for_layer(2)
  gain = rng.uniform(0.5, 1.5, (2 * d,)).astype(np.float32) if with_gain else None
  out = run(ops.diff_v1_attention, q1, q2, k1, k2, v, lam, norm_gain=gain, lambda_init=lambda_init)
  core = np_diff_v1(q1, q2, k1, k2, v, lam, causal=True)
  normed = core / np.sqrt(np.mean(core**2, axis=-1, keepdims=True) + 1e-5)
  if with_gain:
    normed = normed * gain.astype(np.float64)
  check(out, normed * (1.0 - lambda_init), atol=1e-4, rtol=1e-4)


def test_diff_v1_attention_rejects_a_gain_of_the_wrong_width():
  rng = np.random.default_rng(18)
  arrs = v1_inputs(rng, 1, 4, 4, 2, 1, 8)
  with pytest.raises(ValueError, match=re.escape("(8,)")):
    run(ops.diff_v1_attention, *arrs, 0.5, norm_gain=np.ones(8, np.float32), lambda_init=0.2)


# --------------------------------------------------------------------------------------
# Bad inputs: ValueError naming the values.
# --------------------------------------------------------------------------------------


def _raises_naming(fn, *fragments):
  """Calls fn, expects ValueError whose message contains every fragment (regexes)."""
  with pytest.raises(ValueError) as info:
    fn()
  msg = str(info.value)
  for frag in fragments:
    assert re.search(frag, msg), f"{frag!r} not in error message: {msg!r}"


def _f32(rng, *shape):
  return normal(rng, shape)


def test_error_heads_not_divisible_by_kv_heads():
  rng = np.random.default_rng(20)
  q, k, v = _f32(rng, 1, 5, 6, 8), _f32(rng, 1, 5, 4, 8), _f32(rng, 1, 5, 4, 8)
  _raises_naming(lambda: ops.dot_product_attention(q, k, v), r"\b6\b", r"\b4\b")
  _raises_naming(
    lambda: ops.diff_v1_attention_core(q, q, k, k, _f32(rng, 1, 5, 4, 16), 0.5), r"\b6\b", r"\b4\b"
  )


def test_error_lambda_of_the_wrong_shape():
  rng = np.random.default_rng(21)
  q1, q2, k1, k2, v = v1_inputs(rng, 1, 5, 5, 2, 1, 8)
  _raises_naming(
    lambda: ops.diff_v1_attention_core(q1, q2, k1, k2, v, np.ones(3, np.float32)), re.escape("(3,)")
  )
  _raises_naming(
    lambda: ops.diff_v1_attention_core(q1, q2, k1, k2, v, np.ones((1, 2), np.float32)),
    re.escape("(1, 2)"),
  )
  q, k, v2, _ = v2_inputs(rng, 1, 5, 5, 2, 1, 8)
  _raises_naming(
    lambda: ops.diff_v2_attention(q, k, v2, np.ones((1, 5, 4), np.float32)), re.escape("(1, 5, 4)")
  )
  _raises_naming(
    lambda: ops.diff_v2_attention(q, k, v2, np.ones((1, 2), np.float32)), re.escape("(1, 2)")
  )


def test_error_mismatched_dtypes():
  rng = np.random.default_rng(22)
  q = _f32(rng, 1, 5, 2, 8)
  k_bf = jnp.asarray(_f32(rng, 1, 5, 1, 8), jnp.bfloat16)
  v = _f32(rng, 1, 5, 1, 8)
  _raises_naming(lambda: ops.dot_product_attention(q, k_bf, v), "float32", "bfloat16")
  v_wide = _f32(rng, 1, 5, 1, 16)
  _raises_naming(
    lambda: ops.diff_v1_attention_core(q, q, k_bf, k_bf, v_wide, 0.5), "float32", "bfloat16"
  )
  q_pairs = _f32(rng, 1, 5, 4, 8)
  _raises_naming(
    lambda: ops.diff_v2_attention(q_pairs, k_bf, v, np.ones((1, 5, 2), np.float32)),
    "float32",
    "bfloat16",
  )


def test_error_mismatched_shapes():
  rng = np.random.default_rng(23)
  q1, _, k1, k2, v = v1_inputs(rng, 1, 5, 5, 2, 1, 8)
  q2_short = _f32(rng, 1, 4, 2, 8)
  _raises_naming(
    lambda: ops.diff_v1_attention_core(q1, q2_short, k1, k2, v, 0.5),
    re.escape("(1, 5, 2, 8)"),
    re.escape("(1, 4, 2, 8)"),
  )
  # Batch mismatch between queries and keys/values.
  q = _f32(rng, 2, 5, 2, 8)
  k, vv = _f32(rng, 3, 5, 1, 8), _f32(rng, 3, 5, 1, 8)
  _raises_naming(lambda: ops.dot_product_attention(q, k, vv), r"\b2\b", r"\b3\b")
  _raises_naming(
    lambda: ops.diff_v1_attention_core(q, q, k, k, _f32(rng, 3, 5, 1, 16), 0.5), r"\b2\b", r"\b3\b"
  )
  _raises_naming(
    lambda: ops.diff_v2_attention(_f32(rng, 2, 5, 4, 8), k, vv, np.ones((2, 5, 2), np.float32)),
    r"\b2\b",
    r"\b3\b",
  )


def test_error_diff_v2_odd_query_heads():
  rng = np.random.default_rng(24)
  q, k, v = _f32(rng, 1, 5, 5, 8), _f32(rng, 1, 5, 1, 8), _f32(rng, 1, 5, 1, 8)
  _raises_naming(lambda: ops.diff_v2_attention(q, k, v, np.ones((1, 5, 2), np.float32)), r"\b5\b")


def test_error_diff_v2_pairs_not_a_multiple_of_kv_heads():
  rng = np.random.default_rng(25)
  # 6 query heads = 3 pairs over 2 kv heads: a pair would straddle two groups.
  q, k, v = _f32(rng, 1, 5, 6, 8), _f32(rng, 1, 5, 2, 8), _f32(rng, 1, 5, 2, 8)
  _raises_naming(
    lambda: ops.diff_v2_attention(q, k, v, np.ones((1, 5, 3), np.float32)), r"\b3\b", r"\b2\b"
  )


def test_error_unknown_implementation():
  rng = np.random.default_rng(26)
  q, k, v = mha_inputs(rng, 1, 4, 4, 2, 1, 8)
  _raises_naming(lambda: ops.dot_product_attention(q, k, v, implementation="triton"), "triton")
  q1, q2, k1, k2, vw = v1_inputs(rng, 1, 4, 4, 2, 1, 8)
  _raises_naming(
    lambda: ops.diff_v1_attention_core(q1, q2, k1, k2, vw, 0.5, implementation="flash"), "flash"
  )


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU refusal")
def test_error_pallas_on_cpu():
  rng = np.random.default_rng(27)
  q, k, v, lam = v2_inputs(rng, 1, 4, 4, 2, 1, 8)
  _raises_naming(
    lambda: ops.diff_v2_attention(q, k, v, lam, implementation="pallas"), "pallas", "cpu"
  )
  qm, km, vm = mha_inputs(rng, 1, 4, 4, 2, 1, 8)
  _raises_naming(
    lambda: ops.dot_product_attention(qm, km, vm, implementation="pallas"), "pallas", "cpu"
  )


def test_error_lambda_init_for_negative_layer():
  _raises_naming(lambda: ops.lambda_init_for_layer(-1), r"-1")


# --------------------------------------------------------------------------------------
# The public ops called directly and under jit (chex variants).
# --------------------------------------------------------------------------------------


def _np_decode(np_op, q_Bx1, k_BxS, v_BxS, kv_len_B, *rest):
  """Row b of a decode op: causal attention of its one query over its first kv_len[b] slots."""
  rows = []
  for b, n in enumerate(kv_len_B):
    row_rest = [r[b : b + 1] if getattr(r, "ndim", 0) == 3 else r for r in rest]
    rows.append(np_op(q_Bx1[b : b + 1], k_BxS[b : b + 1, :n], v_BxS[b : b + 1, :n], *row_rest))
  return np.concatenate(rows, axis=0)


class PublicOpsVariantsTest(chex.TestCase):
  """Each public op gives the loops' values (and gradients that agree with the plain-JAX
  reference's) whether it is called eagerly or under jit: the dispatch, validation and
  custom VJPs behind it work on concrete arrays and on tracers alike."""

  def _grads_match_reference(self, op, reference, args):
    w = np.random.default_rng(40).standard_normal(np.shape(op(*args))).astype(np.float32)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * w)
    argnums = tuple(range(len(args)))
    got = self.variant(jax.grad(loss(op), argnums))(*args)
    want = jax.jit(jax.grad(loss(reference), argnums))(*args)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, tuple(jnp.asarray(a) for a in args))
    chex.assert_tree_all_finite(got)
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_dot_product_attention(self):
    rng = np.random.default_rng(41)
    q, k, v = mha_inputs(rng, 2, 6, 6, 4, 2, 8)
    seg = packed_segments(rng, 2, 6)
    op = lambda q, k, v, seg: ops.dot_product_attention(q, k, v, segment_ids=seg)
    out = self.variant(op)(q, k, v, seg)
    chex.assert_shape(out, (2, 6, 4, 8))
    chex.assert_type(out, jnp.float32)
    check(out, np_mha(q, k, v, causal=True, q_seg_BxT=seg, kv_seg_BxS=seg))
    self._grads_match_reference(
      lambda q, k, v: ops.dot_product_attention(q, k, v, segment_ids=seg),
      lambda q, k, v: ref.mha_reference(q, k, v, causal=True, segment_ids=seg),
      (q, k, v),
    )

  @chex.variants(with_jit=True, without_jit=True)
  def test_diff_v1_attention(self):
    rng = np.random.default_rng(42)
    q1, q2, k1, k2, v = v1_inputs(rng, 2, 5, 5, 4, 2, 8)
    lam = rng.uniform(-0.3, 1.2, (4,)).astype(np.float32)
    gain = rng.uniform(0.5, 1.5, (16,)).astype(np.float32)
    core = self.variant(lambda *a: ops.diff_v1_attention_core(*a, causal=False))(
      q1, q2, k1, k2, v, lam
    )
    chex.assert_shape(core, (2, 5, 4, 16))
    check(core, np_diff_v1(q1, q2, k1, k2, v, lam, causal=False))
    full = lambda *a: ops.diff_v1_attention(*a, norm_gain=gain, lambda_init=0.2)
    out = self.variant(full)(q1, q2, k1, k2, v, lam)
    want = np_diff_v1(q1, q2, k1, k2, v, lam, causal=True)
    want = want / np.sqrt(np.mean(want**2, axis=-1, keepdims=True) + 1e-5) * gain * 0.8
    chex.assert_type(out, jnp.float32)
    check(out, want, atol=1e-4, rtol=1e-4)
    self._grads_match_reference(
      full,
      lambda *a: ref.rms_norm(ref.diff_v1_reference(*a, causal=True), gain, 1e-5) * 0.8,
      (q1, q2, k1, k2, v, lam),
    )

  @chex.variants(with_jit=True, without_jit=True)
  def test_diff_v2_attention(self):
    rng = np.random.default_rng(43)
    q, k, v, lam = v2_inputs(rng, 2, 7, 7, 4, 2, 8)
    out = self.variant(ops.diff_v2_attention)(q, k, v, lam)
    chex.assert_shape(out, (2, 7, 4, 8))
    chex.assert_type(out, jnp.float32)
    check(out, np_diff_v2(q, k, v, lam, causal=True))
    self._grads_match_reference(
      ops.diff_v2_attention, lambda *a: ref.diff_v2_reference(*a, causal=True), (q, k, v, lam)
    )

  @chex.variants(with_jit=True, without_jit=True)
  def test_decode_ops(self):
    rng = np.random.default_rng(44)
    kv_len = np.array([3, 9], np.int32)
    q, k, v = mha_inputs(rng, 2, 1, 9, 4, 2, 8)
    out = self.variant(ops.dot_product_attention_decode)(q, k, v, kv_len)
    chex.assert_shape(out, (2, 1, 4, 8))
    check(out, _np_decode(lambda *a: np_mha(*a, causal=True), q, k, v, kv_len))
    q1, q2, k1, k2, vw = v1_inputs(rng, 2, 1, 9, 4, 2, 8)
    lam = rng.uniform(0.1, 0.9, (4,)).astype(np.float32)
    out = self.variant(ops.diff_v1_attention_decode)(q1, q2, k1, k2, vw, lam, kv_len)
    chex.assert_shape(out, (2, 1, 4, 16))
    rows = [
      np_diff_v1(
        q1[b : b + 1],
        q2[b : b + 1],
        k1[b : b + 1, :n],
        k2[b : b + 1, :n],
        vw[b : b + 1, :n],
        lam,
        causal=True,
      )
      for b, n in enumerate(kv_len)
    ]
    check(out, np.concatenate(rows))
    q, k, v, lam2 = v2_inputs(rng, 2, 1, 9, 4, 2, 8)
    out = self.variant(ops.diff_v2_attention_decode)(q, k, v, lam2, kv_len)
    chex.assert_shape(out, (2, 1, 4, 8))
    check(out, _np_decode(lambda *a: np_diff_v2(*a, causal=True), q, k, v, kv_len, lam2))
