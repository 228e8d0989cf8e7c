"""The CPU attention path (`implementation="xla_cpu"`, what "auto" runs on a CPU) against the
plain-JAX reference: forward and every gradient, awkward shapes, masks and dtypes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
  GROUPED_SMALL_SHAPES,
  OPS,
  SMALL_SHAPES,
  AttentionCases,
  Case,
  mask_kwargs,
)
from kernel_checks import rel_err, slow_case

from diffjax import ops
from diffjax.core import reference as ref
from diffjax.kernels.cpu import (
  diff_v1_xla_cpu,
  diff_v2_xla_cpu,
  gda_v1_xla_cpu,
  gda_v2_xla_cpu,
  mha_xla_cpu,
)
from diffjax.ops import dispatch

# (B, T, S, H, K, D, Dv): GQA groups of 1, 3 and 2, T != S, odd sizes.
SHAPES = [(2, 13, 13, 6, 2, 8, 16), (1, 7, 11, 3, 1, 5, 5), (3, 16, 16, 4, 4, 8, 8)]


def _segments(b, t, s, kind):
  if kind == "none":
    return None
  if kind == "self":
    cut = t // 2
    ids = np.array([[0] * cut + [1] * (t - cut)] * b)
    ids[-1, :] = np.arange(t) // 3  # many short documents in the last row
    return jnp.asarray(ids)
  # A pair whose last query segment has no key: those rows see nothing (zeros).
  q = np.array([[0] * (t - 2) + [7, 7]] * b)
  kv = np.array([[0] * s] * b)
  return jnp.asarray(q), jnp.asarray(kv)


def _close(a, b, tol):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert a.shape == b.shape
  np.testing.assert_allclose(a, b, atol=tol, rtol=tol)


def _check(fn_a, fn_b, args, tol):
  # Under jit: one program per function and its gradient, not an eager dispatch per op.
  out_a, out_b = jax.jit(fn_a)(*args), jax.jit(fn_b)(*args)
  chex.assert_equal_shape([out_a, out_b])
  chex.assert_trees_all_equal_dtypes(out_a, out_b)
  _close(out_a, out_b, tol)
  w = jax.random.normal(jax.random.key(9), out_a.shape, jnp.float32)
  loss = lambda f: lambda *x: jnp.sum(f(*x).astype(jnp.float32) * w)
  argnums = tuple(range(len(args)))
  ga = jax.jit(jax.grad(loss(fn_a), argnums))(*args)
  gb = jax.jit(jax.grad(loss(fn_b), argnums))(*args)
  chex.assert_trees_all_equal_shapes_and_dtypes(ga, tuple(args))
  chex.assert_trees_all_equal_shapes_and_dtypes(gb, tuple(args))
  chex.assert_tree_all_finite((out_a, ga))
  for x, y in zip(ga, gb):
    _close(x, y, tol)


def _arrays(shape, n, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), n)
  return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shape)]


# The slow cases' coverage the default cases repeat: each shape, causal or not, and each kind
# of segment ids runs in a faster case.
@pytest.mark.parametrize(
  "shape,causal,seg",
  [
    (SHAPES[0], True, "self"),
    (SHAPES[0], False, "pair"),
    slow_case(SHAPES[1], True, "pair"),
    (SHAPES[1], False, "none"),
    slow_case(SHAPES[2], True, "none"),
    (SHAPES[2], False, "self"),
  ],
)
def test_mha_matches_reference(shape, causal, seg):
  b, t, s, h, k, d, dv = shape
  ids = _segments(b, t, s, seg)
  q_seg, kv_seg = ids if isinstance(ids, tuple) else (ids, ids)
  args = _arrays([(b, t, h, d), (b, s, k, d), (b, s, k, dv)], 3, jnp.float32)
  _check(
    lambda q, kk, v: mha_xla_cpu(
      q, kk, v, causal=causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg
    ),
    lambda q, kk, v: ref.mha_reference(q, kk, v, causal=causal, segment_ids=ids),
    args,
    2e-5,
  )


class TestXlaCpu(AttentionCases):
  """Every op of the CPU path on the small shapes, float32, also within an elementwise
  ``allclose`` of 3e-5. The unit tier runs DIFF V1 on GQA 3 with T != S, with and without
  a row that sees no key, DIFF V2 on such a row, the grouped ops at r 3 and 4 with packed
  documents, and a sample of the rest; the integration tier all of it."""

  ops = OPS
  shapes = SMALL_SHAPES + GROUPED_SMALL_SHAPES
  pinned = tuple(
    Case(op, shape, True, seg, "float32")
    for op, shape, seg in [
      ("diff_v1", SMALL_SHAPES[0], "none"),
      ("diff_v1", SMALL_SHAPES[0], "unmatched"),
      ("diff_v1", SMALL_SHAPES[1], "none"),
      ("diff_v1", SMALL_SHAPES[1], "unmatched"),
      ("diff_v2", SMALL_SHAPES[1], "unmatched"),
      *[(op, shape, "packed") for op in ("gda_v1", "gda_v2") for shape in GROUPED_SMALL_SHAPES[:2]],
    ]
  )
  sampled = 2
  elementwise_tol = 3e-5
  _FUNCTIONS = {
    "mha": mha_xla_cpu,
    "diff_v1": diff_v1_xla_cpu,
    "diff_v2": diff_v2_xla_cpu,
    "gda_v1": gda_v1_xla_cpu,
    "gda_v2": gda_v2_xla_cpu,
  }

  def call(self, case, *arrays):
    return self._FUNCTIONS[case.op](*arrays, **mask_kwargs(case))


def test_bfloat16_within_bfloat16_rounding():
  b, t, s, h, k, d, dv = SHAPES[0]
  args = _arrays([(b, t, h, d), (b, s, k, d), (b, s, k, dv)], 3, jnp.bfloat16, seed=3)
  _check(
    lambda q, kk, v: mha_xla_cpu(q, kk, v, causal=True),
    lambda q, kk, v: ref.mha_reference(q, kk, v, causal=True),
    args,
    3e-2,
  )


def test_rows_with_no_visible_key_are_zero_with_finite_gradients():
  b, t, s, h, k, d, dv = SHAPES[0]
  q_ids, kv_ids = _segments(b, t, s, "pair")
  q, kk, v = _arrays([(b, t, h, d), (b, s, k, d), (b, s, k, dv)], 3, jnp.float32)
  f = lambda q: mha_xla_cpu(q, kk, v, causal=True, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
  assert np.all(np.asarray(f(q))[:, -2:] == 0)
  assert np.all(np.isfinite(np.asarray(jax.grad(lambda q: jnp.sum(f(q) ** 2))(q))))


def test_auto_runs_it_on_cpu_and_keeps_masks_and_float64_on_the_reference():
  assert jax.default_backend() == "cpu"
  for op in ("mha", "diff_v1", "diff_v2"):
    spec = dispatch.OPS[op]
    arrays = spec.example(jnp.float32, 8, 2, 16)
    assert dispatch.choose(spec, "auto", arrays) == "xla_cpu"
    assert dispatch.choose(spec, "auto", arrays, mask=jnp.ones((16, 16), bool)) == "xla"
    with jax.enable_x64(True):
      f64 = spec.example(jnp.float64, 8, 2, 16)
      assert dispatch.choose(spec, "auto", f64) == "xla"
  q, kk, v = _arrays([(2, 9, 4, 8), (2, 9, 2, 8), (2, 9, 2, 8)], 3, jnp.float32)
  _close(ops.dot_product_attention(q, kk, v), ref.mha_reference(q, kk, v), 2e-5)
  _close(
    ops.dot_product_attention(q, kk, v, implementation="xla_cpu"), ref.mha_reference(q, kk, v), 2e-5
  )


def test_several_rows_per_step_and_a_remainder_give_the_same_result(monkeypatch):
  from diffjax.kernels.cpu import attention as cpu_attention

  b, t, s, h, k, d, dv = SHAPES[2]  # B = 3
  ids = _segments(b, t, s, "self")
  args = _arrays([(b, t, h, d), (b, s, k, d), (b, s, k, dv)], 3, jnp.float32, seed=5)
  f = lambda q, kk, v: mha_xla_cpu(q, kk, v, causal=True, q_segment_ids=ids, kv_segment_ids=ids)
  one_row = 4 * k * t * s
  monkeypatch.setattr(cpu_attention, "SCORE_BYTES_PER_STEP", 2 * one_row)  # 2 rows, then 1
  assert cpu_attention._rows_per_step(jnp.zeros((b, k, t, d)), jnp.zeros((b, k, s, d))) == 2
  _check(f, lambda q, kk, v: ref.mha_reference(q, kk, v, causal=True, segment_ids=ids), args, 2e-5)
  # The pair path holds two maps' scores per step: one row per step here, then the rest.
  q2 = _arrays([(b, t, h, d)], 1, jnp.float32, seed=6)[0]
  assert cpu_attention._rows_per_step(jnp.zeros((b, k, t, d)), jnp.zeros((b, k, s, d)), 2) == 1
  lam = jnp.linspace(0.3, 0.6, h)
  _check(
    lambda q, q2, kk, v: diff_v1_xla_cpu(
      q, q2, kk, kk, v, lam, causal=True, q_segment_ids=ids, kv_segment_ids=ids
    ),
    lambda q, q2, kk, v: ref.diff_v1_reference(q, q2, kk, kk, v, lam, causal=True, segment_ids=ids),
    (args[0], q2, args[1], args[2]),
    3e-5,
  )


@pytest.mark.parametrize(
  "t,s,seg",
  [
    (13, 13, "self"),
    pytest.param(7, 11, "pair", marks=pytest.mark.slow),
    pytest.param(11, 6, "none", marks=pytest.mark.slow),
  ],
)
def test_causal_query_blocks_match_reference(monkeypatch, t, s, seg):
  """Causal rows run in query blocks against only the keys they can see; blocks of 4 give
  uneven last blocks, T < S, and (T > S) rows that see no key at all."""
  from diffjax.kernels.cpu import attention as cpu_attention

  monkeypatch.setattr(cpu_attention, "Q_BLOCK", 4)
  blocks = cpu_attention._query_blocks(t, s, True)
  assert len(blocks) == -(-t // 4) and blocks[-1][:2] == ((len(blocks) - 1) * 4, t)
  assert (t <= s) or blocks[0][2] == 1  # rows that see no key: one masked key
  assert len(cpu_attention._query_blocks(4000, 4000, True)) == cpu_attention.MAX_Q_BLOCKS
  b, h, k, d, dv = 2, 6, 2, 8, 16
  ids = _segments(b, t, s, seg) if seg != "self" or t == s else None
  q_seg, kv_seg = ids if isinstance(ids, tuple) else (ids, ids)
  args = _arrays(
    [(b, t, h, d), (b, t, h, d), (b, s, k, d), (b, s, k, d), (b, s, k, dv)], 5, jnp.float32, seed=11
  )
  lam = jnp.linspace(0.2, 0.9, h)
  _check(
    lambda *x: diff_v1_xla_cpu(
      *x[:5], x[5], causal=True, q_segment_ids=q_seg, kv_segment_ids=kv_seg
    ),
    lambda *x: ref.diff_v1_reference(*x[:5], x[5], causal=True, segment_ids=ids),
    (*args, lam),
    3e-5,
  )
  _check(
    lambda q, kk, v: mha_xla_cpu(q, kk, v, causal=True, q_segment_ids=q_seg, kv_segment_ids=kv_seg),
    lambda q, kk, v: ref.mha_reference(q, kk, v, causal=True, segment_ids=ids),
    args[::2][:1] + [args[2], args[4]],
    2e-5,
  )


@pytest.mark.parametrize(
  "spec,x_shape,w_shape",
  [
    ("bte,ehd->bthd", (2, 5, 6), (6, 3, 4)),  # query projection, 3-D kernel
    ("bthd,hde->bte", (2, 5, 3, 4), (3, 4, 7)),  # output projection, two contracted axes
    ("bte,ehsd->bthsd", (1, 3, 6), (6, 2, 2, 3)),  # DIFF V1 query components
    ("bte,ve->btv", (2, 5, 6), (9, 6)),  # tied LM head: a transposed 2-D weight
    ("bte,ef->btf", (3, 1, 6), (6, 5)),
  ],
)
def test_cpu_matmul_matches_einsum_forward_and_gradients(spec, x_shape, w_shape):
  """The projections' CPU path (row-major 2-D matmuls with hand-written gradients) against
  jnp.einsum and its autodiff."""
  from diffjax.nn import layers

  assert layers._rows_form(spec) is not None
  x, w = _arrays([x_shape, w_shape], 2, jnp.float32, seed=4)
  ours = lambda x, w: layers.matmul(spec, x, w, jnp.float32)
  plain = lambda x, w: jnp.einsum(spec, x, w)
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(ours(x, w)), (0, 1)))(x, w))
  assert "custom_vjp" in jaxpr  # the CPU path ran, not the einsum
  _check(ours, plain, (x, w), 2e-6)


def test_cpu_matmul_keeps_einsum_for_other_specs_and_dtypes():
  from diffjax.nn import layers

  for spec in ("btd,bsd->bts", "bte,te->bt", "bte,ee->bte"):
    assert layers._rows_form(spec) is None, spec
  assert layers._rows_form("bte,te->b") == (2, False)
  x, w = _arrays([(2, 3, 4), (4, 5)], 2, jnp.bfloat16)
  jaxpr = str(jax.make_jaxpr(lambda x, w: layers.matmul("bte,ef->btf", x, w, jnp.bfloat16))(x, w))
  assert "custom_vjp" not in jaxpr and "preferred_element_type=float32" in jaxpr


def test_cpu_rope_tables_match_the_plain_expressions():
  """On a CPU the RoPE cos/sin come from a loop over batch rows; the values are the same."""
  from diffjax.nn import rope

  pos = jnp.asarray(np.random.default_rng(0).integers(0, 500, (3, 7)), jnp.int32)
  x = _arrays([(3, 7, 2, 8)], 1, jnp.float32)[0]
  angles = pos.astype(jnp.float32)[..., None] * rope.rope_frequencies(8, 10000.0)[None, None]
  cos, sin = rope._cos_sin(angles)
  np.testing.assert_array_equal(np.asarray(cos), np.asarray(jnp.cos(angles)))
  np.testing.assert_array_equal(np.asarray(sin), np.asarray(jnp.sin(angles)))
  for style in ("interleaved", "half"):
    out = rope.apply_rope(x, pos, style=style)
    with dispatch.target_platform("tpu"):  # the plain expressions
      plain = rope.apply_rope(x, pos, style=style)
    np.testing.assert_allclose(np.asarray(out), np.asarray(plain), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant", ["diff_v1", "diff_v2"])
def test_diff_bfloat16_forward_and_every_gradient_within_bfloat16_rounding(variant):
  """bf16 inputs against the float32 reference on the same (bf16-rounded) inputs."""
  b, t, s, h, k, d, dv = SHAPES[0]
  ids = _segments(b, t, s, "self")
  if variant == "diff_v1":
    shapes = [(b, t, h, d), (b, t, h, d), (b, s, k, d), (b, s, k, d), (b, s, k, dv)]
    args = _arrays(shapes, 5, jnp.bfloat16, seed=4) + [jnp.linspace(0.2, 0.9, h)]
    fast = lambda *x: diff_v1_xla_cpu(*x, causal=True, q_segment_ids=ids, kv_segment_ids=ids)
    want = lambda *x: ref.diff_v1_reference(*x, causal=True, segment_ids=ids)
  else:
    shapes = [(b, t, 2 * h, d), (b, s, k, d), (b, s, k, d)]
    args = _arrays(shapes, 3, jnp.bfloat16, seed=4) + [
      jax.nn.sigmoid(jax.random.normal(jax.random.key(5), (b, t, h)))
    ]
    fast = lambda *x: diff_v2_xla_cpu(*x, causal=True, q_segment_ids=ids, kv_segment_ids=ids)
    want = lambda *x: ref.diff_v2_reference(*x, causal=True, segment_ids=ids)
  f32 = [a.astype(jnp.float32) for a in args]
  out = fast(*args)
  w = jax.random.normal(jax.random.key(9), out.shape, jnp.float32)
  loss = lambda f: lambda *x: jnp.sum(f(*x).astype(jnp.float32) * w)
  argnums = tuple(range(len(args)))
  grads = jax.grad(loss(fast), argnums)(*args)
  out_r, grads_r = want(*f32), jax.grad(loss(want), argnums)(*f32)
  assert out.dtype == jnp.bfloat16 and [g.dtype for g in grads] == [a.dtype for a in args]
  errs = {"out": rel_err(out, out_r)}
  errs.update({f"d{i}": rel_err(g, gr) for i, (g, gr) in enumerate(zip(grads, grads_r))})
  # Measured errors are 2e-3 to 5e-3 (bf16 rounding of the inputs to each matmul).
  bad = {n: e for n, e in errs.items() if not e <= 1e-2}
  assert not bad, errs
  # A wrong gradient must fail the measure: a sign flip of the last input's gradient does.
  assert rel_err(-grads[-1], grads_r[-1]) > 1e-2
