"""The TPU grouped differential attention kernels (gda_v1, gda_v2 and gda_v1 decoding) and
their splash-based stock paths, checked against the reference.

Without a TPU the kernels run in the TPU interpreter; the Mosaic compiles for real
topologies at a Motif-2-12.7B layer live in test_kernels_tpu.py. Tolerances as in
test_kernels_tpu.py (``kernel_checks.TOL``). r: signal heads per noise head.
"""

from __future__ import annotations

import os
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import GROUPED_TILED_SHAPES, AttentionCases, Case, Shape, mask_kwargs
from kernel_checks import (
  TOL,
  assert_like_inputs,
  check,
  normal,
  packed_segment_ids,
  rel_err,
  slow_case,
  value_and_vjp,
)

from diffjax import ops
from diffjax.aot import without_persistent_cache
from diffjax.core import op_specs
from diffjax.kernels import tpu as kt
from diffjax.ops import reference as ref

V1_GRADS = ("dq1", "dq2", "dk1", "dk2", "dv", "dlam")
V2_GRADS = ("dq1", "dq2", "dk", "dv", "dlam")
SMALL = kt.BlockSizes(block_q=64, block_kv=128, block_q_bwd=32, block_kv_bwd=128)


def _inputs(version, b, t, s, h, n, kh, d, dtype, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  q1, q2 = normal(ks[0], (b, t, h, d), dtype), normal(ks[1], (b, t, n, d), dtype)
  k1, k2 = normal(ks[2], (b, s, kh, d), dtype), normal(ks[3], (b, s, kh, d), dtype)
  if version == 1:
    v = normal(ks[4], (b, s, kh, 2 * d), dtype)
    return (q1, q2, k1, k2, v, jax.random.uniform(ks[5], (h,), jnp.float32, 0.1, 0.9))
  v = normal(ks[4], (b, s, kh, d), dtype)
  return (q1, q2, k1, v, jax.nn.sigmoid(normal(ks[5], (b, t, h))))


def _run(version, t, s, r, d, causal, seg, dtype, *, b=2, kh=2, nk=1, blocks=SMALL, fn=None):
  """Output and every gradient of a grouped fast path against the reference; ``nk`` noise
  heads per kv group (N = K nk, H = N r)."""
  n = kh * nk
  h = n * r
  q_seg, kv_seg = (
    packed_segment_ids(b, t, s, unmatched_row=seg == "unmatched") if seg else (None, None)
  )
  segs = None if q_seg is None else (q_seg, kv_seg)
  args = _inputs(version, b, t, s, h, n, kh, d, dtype)
  dv = 2 * d if version == 1 else d
  names = V1_GRADS if version == 1 else V2_GRADS
  fn = fn or (kt.gda_v1_pallas_tpu if version == 1 else kt.gda_v2_pallas_tpu)
  reference = ref.gda_v1_reference if version == 1 else ref.gda_v2_reference
  kern = lambda *a: fn(
    *a, causal=causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg, block_sizes=blocks,
    interpret=True,
  )  # fmt: skip
  ct = normal(jax.random.PRNGKey(7), (b, t, h, dv), dtype)
  out, grads = value_and_vjp(kern, args, ct)
  ref_out, ref_grads = value_and_vjp(
    lambda *a: reference(*a, causal=causal, segment_ids=segs),
    [a.astype(jnp.float32) for a in args],
    ct.astype(jnp.float32),
  )
  assert_like_inputs(out, grads, args, (b, t, h, dv), dtype)
  check([("out", out, ref_out)] + list(zip(names, grads, ref_grads)), dtype)
  if seg == "unmatched":  # a row that sees no key: exact zeros, output and dq1, dq2
    np.testing.assert_array_equal(np.asarray(out[0, 0]), 0.0)
    np.testing.assert_array_equal(np.asarray(grads[0][0, 0]), 0.0)
    np.testing.assert_array_equal(np.asarray(grads[1][0, 0]), 0.0)
  return out, grads


def _case(version, t, s, r, d, causal, seg, dtype, kh, nk):
  return Case(
    f"gda_v{version}", Shape(2, t, s, kh, nk, d, ratio=r, tiles="small"), causal, seg, dtype
  )


class TestPallasTpuGrouped(AttentionCases):
  """The fused grouped kernels in the TPU interpreter. Unit tier: gda_v2 at r 3 with two
  noise heads in one kv group, packed documents, bfloat16. Integration tier adds gda_v1 at
  r 2 with two kv groups, T off every tile and T != S, a row that sees no key, float32, and a
  sample of the rest."""

  ops = ("gda_v1", "gda_v2")
  dtypes = ("float32", "bfloat16")
  shapes = GROUPED_TILED_SHAPES
  pinned = (_case(2, 150, 150, 3, 8, True, "packed", "bfloat16", 1, 2),)
  sampled = 0
  integration_pinned = (_case(1, 130, 300, 2, 16, True, "unmatched", "float32", 2, 1),)
  integration_sampled = 4
  kept = (
    _case(1, 150, 230, 3, 16, False, "packed", "float32", 2, 1),
    _case(1, 200, 200, 4, 16, True, "none", "bfloat16", 1, 2),
    _case(1, 96, 96, 2, 16, False, "none", "bfloat16", 2, 1),
    _case(2, 200, 384, 4, 8, False, "unmatched", "float32", 2, 1),
    _case(2, 200, 136, 2, 16, True, "none", "float32", 1, 1),  # T > S
    _case(2, 150, 230, 3, 16, False, "none", "float32", 2, 2),
    _case(2, 200, 200, 2, 16, True, "packed", "bfloat16", 2, 1),
  )

  def supports(self, case):
    return case.shape.b == 2

  def call(self, case, *arrays):
    fn = kt.gda_v1_pallas_tpu if case.op == "gda_v1" else kt.gda_v2_pallas_tpu
    return fn(*arrays, **mask_kwargs(case), block_sizes=SMALL, interpret=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("causal,seg", [(True, False), (True, True), (False, True)])
@pytest.mark.parametrize("r", [2, 3, 4])
@pytest.mark.parametrize("version", [1, 2])
def test_gda_product_slow(version, r, causal, seg, dtype):
  _run(version, 200, 200, r, 16, causal, seg, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_gda_query_chunks_and_default_tiles_slow(version):
  # Three backward calls with dK/dV partial sums; then the default tiles at d = 128.
  chunked = kt.BlockSizes(**{**vars(SMALL), "dq_chunk": 64})
  _run(version, 130, 300, 2, 16, True, True, jnp.float32, b=1, blocks=chunked)
  _run(version, 384, 384, 4, 128, True, True, jnp.bfloat16, b=1, kh=1, blocks=None)


@pytest.mark.parametrize(
  "version",
  [pytest.param(1, marks=pytest.mark.integration), pytest.param(2, marks=pytest.mark.slow)],
)
def test_r1_is_bitwise_the_diff_kernel(version):
  """r = 1 runs the DIFF kernel: the same bits, output and gradients."""
  b, t, h, kh, d = 1, 72, 2, 1, 16
  args = _inputs(version, b, t, t, h, h, kh, d, jnp.float32)
  kw = dict(causal=True, block_sizes=SMALL, interpret=True)
  ct = normal(jax.random.PRNGKey(3), (b, t, h, 2 * d if version == 1 else d))
  if version == 1:
    diff = lambda *a: kt.diff_v1_pallas_tpu(*a, **kw)
    got = value_and_vjp(lambda *a: kt.gda_v1_pallas_tpu(*a, **kw), args, ct)
  else:

    def diff(q1, q2, k, v, lam):
      q = jnp.stack([q1, q2], axis=3).reshape(b, t, 2 * h, d)
      return kt.diff_v2_pallas_tpu(q, k, v, lam, **kw)

    got = value_and_vjp(lambda *a: kt.gda_v2_pallas_tpu(*a, **kw), args, ct)
  want = value_and_vjp(diff, args, ct)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
@pytest.mark.parametrize("version,dq_chunk", [(1, None), (2, 64)])
def test_no_races_in_interpreter_slow(version, dq_chunk):
  """Two simulated cores take the parallel axis (batch x noise heads, batch x kv groups);
  the race detector finds nothing, with one or several backward calls."""
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top

  params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
  pltpu.reset_tpu_interpret_mode_state()
  blocks = kt.BlockSizes(
    block_q=64, block_kv=128, block_q_bwd=32, block_kv_bwd=128, dq_chunk=dq_chunk
  )
  fn = kt.gda_v1_pallas_tpu if version == 1 else kt.gda_v2_pallas_tpu
  b, t, r, kh, d = 2, 130, 2, 1, 8
  args = _inputs(version, b, t, t, kh * 2 * r, kh * 2, kh, d, jnp.float32)
  kern = lambda *a: fn(*a, causal=True, block_sizes=blocks, interpret=params)
  ct = normal(jax.random.PRNGKey(7), (b, t, kh * 2 * r, 2 * d if version == 1 else d))
  value_and_vjp(kern, args, ct)
  assert ipc.races is not None, "the interpreter ran without race detection"
  assert not ipc.races.races_found


def _pallas_outputs(jaxpr) -> dict[str, list[tuple]]:
  """name -> output shapes of every pallas_call in ``jaxpr`` (nested jaxprs included)."""
  found = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      name = str(eqn.params["name"])
      found.setdefault(name, []).append([tuple(v.aval.shape) for v in eqn.outvars])
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      for k, v in _pallas_outputs(sub).items():
        found.setdefault(k, []).extend(v)
  return found


def test_noise_map_once_per_group():
  """The forward keeps one noise output per noise head (o2 [B, N, T, Dv]) and the backward
  writes dq2 for the N noise heads itself: no noise head is repeated over its group."""
  b, t, h, n, kh, d = 1, 64, 4, 2, 1, 16
  args = _inputs(1, b, t, t, h, n, kh, d, jnp.float32)
  fn = lambda *a: kt.gda_v1_pallas_tpu(*a, block_sizes=SMALL, interpret=True)
  grads = lambda *a: jax.vjp(fn, *a)[1](jnp.ones((b, t, h, 2 * d)))
  calls = _pallas_outputs(jax.make_jaxpr(grads)(*args).jaxpr)
  assert calls.keys() == {"gda_attention_fwd", "gda_attention_bwd"}, calls.keys()
  (fwd,) = calls["gda_attention_fwd"]
  (bwd,) = calls["gda_attention_bwd"]
  assert fwd == [(b, h, t, 2 * d), (b, n, t, 2 * d), (b, n, 1, 3, t)]  # out, o2, lse
  assert bwd[-2:] == [(b, h, t, d), (b, n, t, d)]  # dq1, dq2


@pytest.mark.integration  # the interpreted kernels through the ops API
def test_dispatch_rows_match_xla():
  """implementation="pallas_tpu" (interpreted) of both ops equals the XLA reference through
  the ops API; a scalar lambda's gradient comes back."""
  b, t, h, n, kh, d = 1, 136, 4, 2, 2, 16
  seg = jnp.stack([jnp.arange(t) // 60]).astype(jnp.int32)
  q1, q2, k1, k2, v, _ = _inputs(1, b, t, t, h, n, kh, d, jnp.float32)

  def v1(lam, impl, **kw):
    return ops.gda_v1_attention_core(
      q1, q2, k1, k2, v, lam, implementation=impl, segment_ids=seg, **kw
    )

  run = lambda impl, **kw: jax.value_and_grad(lambda l: jnp.sum(v1(l, impl, **kw) ** 2))(0.4)
  got, want = run("pallas_tpu", interpret=True), run("xla")
  assert rel_err(got[0], want[0]) <= TOL[jnp.float32]
  assert rel_err(got[1], want[1]) <= TOL[jnp.float32]
  x2 = _inputs(2, b, t, t, h, n, kh, d, jnp.float32)
  a = ops.gda_v2_attention(*x2, implementation="pallas_tpu", interpret=True, segment_ids=seg)
  want2 = ops.gda_v2_attention(*x2, implementation="xla", segment_ids=seg)
  assert rel_err(a, want2) <= TOL[jnp.float32]


# ----------------------------------------------------------------------------------
# Decoding.


@pytest.mark.parametrize(
  "b,s,r,kh,nk,d,dv,block_kv,lens,dtype",
  [
    # Flat cache views (skd, 2 kv groups), three rows of lengths 0, mid-block and S.
    (3, 384, 2, 2, 1, 128, 256, 256, (0, 200, 384), jnp.float32),
    # Two noise heads per group and r = 3 (G = 6 query rows of map 1, 2 of map 2),
    # narrow widths (the "kds" views), one row in two splits.
    slow_case(1, 512, 3, 2, 2, 32, 64, 128, (300,), jnp.float32),
    slow_case(2, 200, 4, 1, 1, 64, 128, 128, (1, 200), jnp.bfloat16),
  ],
)
def test_decode_matches_reference(b, s, r, kh, nk, d, dv, block_kv, lens, dtype):
  n = kh * nk
  h = n * r
  ks = jax.random.split(jax.random.PRNGKey(5), 6)
  q1, q2 = normal(ks[0], (b, 1, h, d), dtype), normal(ks[1], (b, 1, n, d), dtype)
  k1, k2 = normal(ks[2], (b, s, kh, d), dtype), normal(ks[3], (b, s, kh, d), dtype)
  v = normal(ks[4], (b, s, kh, dv), dtype)
  lam = jax.random.uniform(ks[5], (h,), jnp.float32, 0.1, 0.8)
  kv_len = jnp.array(lens, jnp.int32)
  got = kt.gda_v1_decode_pallas_tpu(
    q1, q2, k1, k2, v, lam, kv_len, block_sizes={"block_kv": block_kv}, interpret=True
  )
  f32 = lambda x: x.astype(jnp.float32)
  want = op_specs.GDA_V1_DECODE.reference(f32(q1), f32(q2), f32(k1), f32(k2), f32(v), lam, kv_len)
  assert got.shape == (b, 1, h, dv) and got.dtype == dtype
  assert rel_err(got, want) <= (1e-5 if dtype == jnp.float32 else TOL[dtype])
  if 0 in lens:
    np.testing.assert_array_equal(np.asarray(got[lens.index(0)]), 0.0)
  # Through the dispatch table.
  via_ops = ops.gda_v1_attention_decode(
    q1, q2, k1, k2, v, lam, kv_len, implementation="pallas_tpu", interpret=True,
    block_sizes={"block_kv": block_kv},
  )  # fmt: skip
  np.testing.assert_array_equal(np.asarray(via_ops), np.asarray(got))


@pytest.mark.slow
def test_aot_compile_decode_motif_layer_reads_the_cache_in_place_slow():
  """gda_v1 decoding at a Motif-2-12.7B layer (32 signal, 8 noise heads, 8 kv groups,
  d = 128, Dv = 256, a 4096-slot bfloat16 cache) compiles with Mosaic for v5p, and the
  kernel reads the cache arrays as they are (no copy or transpose of a cache array)."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    topo = topologies.get_topology_desc("v5p:2x2x1", "tpu")
  except Exception as e:  # pylint: disable=broad-except
    pytest.skip(f"no TPU compiler here (install jax[tpu] / libtpu): {e}")
  device = topo.devices[0]
  b, s, h, n, kh, d, dv = 8, 4096, 32, 8, 8, 128, 256
  sds = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(
    shape, dt, sharding=jax.sharding.SingleDeviceSharding(device)
  )
  args = (
    sds((b, 1, h, d)),
    sds((b, 1, n, d)),
    sds((b, s, kh, d)),
    sds((b, s, kh, d)),
    sds((b, s, kh, dv)),
    sds((h,), jnp.float32),
    sds((b,), jnp.int32),
  )
  with jax.default_device(device), without_persistent_cache():
    hlo = jax.jit(kt.gda_v1_decode_pallas_tpu).lower(*args).compile().as_text()
  assert "diff_v1_decode" in hlo
  cache = b * s * kh * d
  copies = [
    line.strip()[:200]
    for line in hlo.splitlines()
    if ("copy" in line or "transpose" in line)
    and (m := re.search(r"= \(?\w+\[([\d,]+)\]", line))
    and np.prod([int(x) for x in m.group(1).split(",")]) >= cache
  ]
  assert not copies, copies
