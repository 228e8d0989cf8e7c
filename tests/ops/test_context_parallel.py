"""Context-parallel attention (sequence sharded over a mesh axis) against the reference.

The sharded checks run on the test process's 8 CPU devices (tests/conftest.py); they
compile once per mesh, so they are in the integration tier. The comparisons against the
reference are the attention test base's (tests/attention_cases.py; classes
:class:`TestContextParallel` and :class:`TestContextParallelPallasTpu`), with float32
held to 1e-5 (observed below 1e-6); the rest checks the order, the choice of per-block
kernels, the collectives and the refusals.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import OPS, RING_SHAPES, AttentionCases, Case, segment_ids
from kernel_checks import rel_err as _rel_err

from diffjax.core import reference as ref
from diffjax.ops import context_parallel as cp

TOL = 1e-5
AXES = ("data", "fsdp", "tensor", "context")
B, H, KV, D = 2, 4, 2, 8
sharded = pytest.mark.integration  # one compile per mesh

# (mesh shape, batch_axis, head_axis): the three layouts checked. On (1, 2, 1, 4) without
# a batch axis the batch is replicated over fsdp, which checks that replicated inputs get
# their gradients once.
LAYOUTS = {
  "context8": ((1, 1, 1, 8), None, None),
  "all4": ((2, 1, 2, 2), ("data", "fsdp"), "tensor"),
  "fsdp2_context4": ((1, 2, 1, 4), None, None),
  "fsdp2_batch": ((1, 2, 1, 4), "fsdp", None),
  # The kernel cases run the TPU interpreter on every device, so they use fewer.
  "context2": ((1, 1, 1, 2), None, None),
  "batch2_context2": ((2, 1, 1, 2), "data", None),
}


def _mesh(shape):
  assert jax.device_count() == 8, jax.devices()
  n = int(np.prod(shape))  # the first n devices (the kernel cases use fewer, see below)
  return jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(shape), AXES)


def _inputs(op, t, *, scalar_lam=False, dtype=jnp.float32, seed=0):
  """(arrays, indices of the per-token arrays, reference function)."""
  rng = np.random.default_rng(seed)
  n = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype)
  if op == "mha":
    return (n(B, t, H, D), n(B, t, KV, D), n(B, t, KV, D)), (0, 1, 2), ref.mha_reference
  if op == "diff_v1":
    lam = jnp.asarray(0.37) if scalar_lam else jnp.linspace(0.2, 0.8, H)
    arrays = (n(B, t, H, D), n(B, t, H, D), n(B, t, KV, D), n(B, t, KV, D), n(B, t, KV, 2 * D), lam)
    return arrays, (0, 1, 2, 3, 4), ref.diff_v1_reference
  lam_BxTxH = jax.nn.sigmoid(n(B, t, H).astype(jnp.float32))
  if op == "gda_v1":  # r = 2: each of the KV noise heads serves two signal heads
    lam = jnp.asarray(0.37) if scalar_lam else jnp.linspace(0.2, 0.8, H)
    arrays = (
      n(B, t, H, D),
      n(B, t, KV, D),
      n(B, t, KV, D),
      n(B, t, KV, D),
      n(B, t, KV, 2 * D),
      lam,
    )
    return arrays, (0, 1, 2, 3, 4), ref.gda_v1_reference
  if op == "gda_v2":
    arrays = (n(B, t, H, D), n(B, t, KV, D), n(B, t, KV, D), n(B, t, KV, D), lam_BxTxH)
    return arrays, (0, 1, 2, 3, 4), ref.gda_v2_reference
  return (
    (n(B, t, 2 * H, D), n(B, t, KV, D), n(B, t, KV, D), lam_BxTxH),
    (0, 1, 2, 3),
    ref.diff_v2_reference,
  )


def _packed_segments(t):
  """Two rows of packed documents whose boundaries fall inside shards."""
  rows = [np.repeat([0, 1, 2], [7, 13, t - 20]), np.repeat([3, 5], [t - 9, 9])]
  return jnp.asarray(np.stack(rows), jnp.int32)


def _compare(
  op,
  strategy,
  load_balance,
  layout,
  *,
  t=32,
  causal=True,
  segments=True,
  scalar_lam=False,
  dtype=jnp.float32,
  tol=TOL,
):
  shape, batch_axis, head_axis = LAYOUTS[layout]
  mesh = _mesh(shape)
  c = mesh.shape["context"]
  arrays, per_token, ref_fn = _inputs(op, t, scalar_lam=scalar_lam, dtype=dtype)
  seg = _packed_segments(t) if segments else None
  perm = cp.zigzag_permutation(t, c) if load_balance else np.arange(t)
  inv = cp.inverse_permutation(perm)
  permute = lambda xs, order: tuple(x[:, order] if i in per_token else x for i, x in enumerate(xs))

  ref_args = tuple(a.astype(jnp.float32) for a in arrays)
  out_ref = ref_fn(*ref_args, causal=causal, segment_ids=seg)
  ct = jnp.asarray(np.random.default_rng(1).standard_normal(out_ref.shape), jnp.float32)
  argnums = tuple(range(len(arrays)))

  def cp_loss(*xs):
    out = cp.context_parallel_attention(
      op,
      xs,
      mesh=mesh,
      batch_axis=batch_axis,
      head_axis=head_axis,
      strategy=strategy,
      load_balance=load_balance,
      causal=causal,
      segment_ids=None if seg is None else seg[:, perm],
    )
    return jnp.sum(out.astype(jnp.float32) * ct[:, perm]), out

  def ref_loss(*xs):
    out = ref_fn(*xs, causal=causal, segment_ids=seg)
    return jnp.sum(out * ct), out

  (_, out), grads = jax.jit(jax.value_and_grad(cp_loss, argnums, has_aux=True))(
    *permute(arrays, perm)
  )
  _, ref_grads = jax.jit(jax.value_and_grad(ref_loss, argnums, has_aux=True))(*ref_args)
  assert out.dtype == dtype
  errs = {"out": _rel_err(out[:, inv], out_ref)}
  for i, (g, g_ref) in enumerate(zip(permute(grads, inv), ref_grads)):
    assert g.shape == arrays[i].shape
    errs[f"d{i}"] = _rel_err(g, g_ref)
  bad = {k: f"{e:.1e}" for k, e in errs.items() if not e <= tol}
  assert not bad, f"outside {tol}: {bad}; all: { {k: f'{e:.1e}' for k, e in errs.items()} }"


# ------------------------------------------------------------------------------------------
# The order, on any number of devices.


def test_zigzag_permutation_values():
  perm = cp.zigzag_permutation(8, 2)
  assert perm.dtype == np.int32
  # Chunks of 2: shard 0 holds chunks 0 and 3, shard 1 chunks 1 and 2.
  np.testing.assert_array_equal(perm, [0, 1, 6, 7, 2, 3, 4, 5])
  np.testing.assert_array_equal(cp.zigzag_permutation(6, 1), np.arange(6))
  x = np.arange(24).reshape(1, 24) * 10
  for c in (1, 2, 3, 4):
    p = cp.zigzag_permutation(24, c)
    np.testing.assert_array_equal(x[:, p][:, cp.inverse_permutation(p)], x)


def test_shard_positions_follow_the_permutation():
  for c, t in ((2, 8), (4, 32), (8, 48)):
    perm = cp.zigzag_permutation(t, c)
    tl = t // c
    for i in range(c):
      np.testing.assert_array_equal(
        cp._original_positions(i, c, tl, True), perm[i * tl : (i + 1) * tl]
      )
      np.testing.assert_array_equal(
        cp._original_positions(i, c, tl, False), np.arange(i * tl, (i + 1) * tl)
      )


def _probe(dtype, d=64):
  """The local shapes the ring asks its candidate kernels about."""
  config = dict(
    t=128,
    s=128,
    d=d,
    dv=2 * d,
    heads=2,
    kv_heads=1,
    causal=True,
    segmented=False,
    scale=0.125,
    block_sizes=None,
    interpret=False,
    dtype=dtype,
  )
  return {"query": jnp.zeros((1, 128, 2, d), dtype), "config": config}


def test_ring_takes_the_per_block_kernel_of_the_row_that_accepts(monkeypatch):
  from diffjax.core import op_specs
  from diffjax.kernels.gpu import mosaic_ring
  from diffjax.kernels.tpu import blocks as tpu_blocks
  from diffjax.ops import dispatch
  from diffjax.ops import ring_blocks as rb

  f32, bf16 = jnp.float32, jnp.bfloat16
  with dispatch.target_platform("tpu"):
    row = cp._ring_row(op_specs.DIFF_V2, "auto", "ring", False, _probe(f32))
    assert row.name == "pallas_tpu" and row.ring_blocks is tpu_blocks
    # The baseline's first TPU row (splash attention) has no per-block functions.
    assert cp._ring_row(op_specs.MHA, "auto", "ring", False, _probe(f32)) is None
    # The all-gather strategy has no blocks at all.
    assert cp._ring_row(op_specs.DIFF_V1, "auto", "all_gather", False, _probe(f32)) is None
  blocks = rb.kernel_blocks(row, **_probe(f32)["config"])
  assert blocks.maps == 2 and blocks.head_major and blocks.interpreter_barrier
  # A kernel whose blocks refuse the inputs: "auto" takes the XLA blocks, a name says why.
  with dispatch.target_platform("gpu"):
    assert cp._ring_row(op_specs.DIFF_V1, "auto", "ring", False, _probe(bf16)).ring_blocks is (
      mosaic_ring
    )
    assert cp._ring_row(op_specs.DIFF_V1, "auto", "ring", False, _probe(f32)) is None
    with pytest.raises(ValueError, match="pallas_gpu refuses: .*bfloat16 or float16"):
      cp._ring_row(op_specs.DIFF_V1, "pallas_gpu", "ring", False, _probe(f32))
  # A kernel registered without per-block functions leaves the ring its XLA blocks.
  monkeypatch.setattr(dispatch, "_TABLE", {k: list(v) for k, v in dispatch._TABLE.items()})
  dispatch.register_implementation("diff_v2", "pallas_tpu", lambda *a, **k: None, ("tpu",))
  with dispatch.target_platform("tpu"):
    assert cp._ring_row(op_specs.DIFF_V2, "auto", "ring", False, _probe(f32)) is None
    v1 = cp._ring_row(op_specs.DIFF_V1, "auto", "ring", False, _probe(f32))
    assert v1.ring_blocks is tpu_blocks and v1.ring_options == {"version": 1}


def test_permutation_errors():
  with pytest.raises(ValueError, match="multiple of 2 \\* num_shards = 8"):
    cp.zigzag_permutation(30, 4)
  with pytest.raises(ValueError, match="num_shards must be positive"):
    cp.zigzag_permutation(8, 0)
  with pytest.raises(ValueError, match="permutation"):
    cp.inverse_permutation([0, 0, 1])


# ------------------------------------------------------------------------------------------
# Sharded checks on 8 CPU devices: the attention test base (tests/attention_cases.py), with
# the strategy, the order and the mesh layout as the class's own axis.


def _variant(strategy, load_balance, layout):
  return f"{strategy}-{'zigzag' if load_balance else 'contiguous'}-{layout}"


def _ring_shape(op, layout):
  """A zig-zag chunk per shard position on every layout: 48 tokens on 8 shards, else 32."""
  t = 48 if layout == "context8" else 32
  return next(s for s in RING_SHAPES if s.t == t and s.for_grouped_ops == op.startswith("gda"))


def _ring_case(op, strategy, load_balance, layout, causal=True, segments="packed", dtype="float32"):
  variant = _variant(strategy, load_balance, layout)
  return Case(op, _ring_shape(op, layout), causal, segments, dtype, variant)


class TestContextParallel(AttentionCases):
  """Context-parallel attention with XLA blocks, against the reference. The inputs are built in
  the original token order, every per-token array (and the segment ids) permuted by
  :func:`zigzag_permutation` (identity without load balancing) before the sharded op runs
  under ``jit``, and its output permuted back, so the gradients come back in the original
  order too. float32 within 1e-5 (observed below 1e-6). The integration tier runs one case
  per op and strategy over every layout and both orders; the slow tier every op, strategy,
  order and layout, the mask variants and bfloat16."""

  ops = OPS
  dtypes = ("float32", "bfloat16")
  segments = ("none", "packed", "single")
  shapes = RING_SHAPES
  variants = tuple(
    _variant(strategy, lb, layout)
    for strategy in ("ring", "all_gather")
    for lb in (True, False)
    for layout in ("context8", "all4", "fsdp2_context4")
  ) + (_variant("all_gather", True, "fsdp2_batch"),)
  tolerances = {"float32": TOL}
  implementation = "xla"
  sampled = 0
  integration_pinned = (
    _ring_case("mha", "ring", True, "context8"),
    _ring_case("diff_v1", "ring", True, "all4"),
    _ring_case("diff_v2", "ring", False, "fsdp2_context4"),
    _ring_case("diff_v2", "all_gather", True, "context8"),
    _ring_case("gda_v1", "ring", True, "all4"),
    _ring_case("gda_v2", "all_gather", False, "fsdp2_context4"),
  )
  integration_sampled = 0
  kept = (
    tuple(
      _ring_case(op, strategy, lb, layout)
      for op in OPS
      for strategy in ("ring", "all_gather")
      for lb in (True, False)
      for layout in ("context8", "all4", "fsdp2_context4")
    )
    + (_ring_case("diff_v1", "all_gather", True, "fsdp2_batch"),)
    # The masks: no causal mask, no documents; documents that start with a one-token one.
    + tuple(
      _ring_case(op, strategy, True, "all4", causal, segments)
      for op in ("mha", "diff_v1", "diff_v2")
      for strategy in ("ring", "all_gather")
      for causal, segments in ((False, "packed"), (True, "none"), (True, "single"))
    )
    # bfloat16 against the float32 reference on the same (rounded) inputs.
    + tuple(
      _ring_case(op, "ring", True, "all4", dtype="bfloat16") for op in ("mha", "diff_v1", "diff_v2")
    )
  )

  def supports(self, case):
    return case.shape == _ring_shape(case.op, case.variant.split("-")[2])

  def call(self, case, *arrays):
    strategy, order, layout = case.variant.split("-")
    shape, batch_axis, head_axis = LAYOUTS[layout]
    mesh = _mesh(shape)
    t = case.shape.t
    perm = cp.zigzag_permutation(t, mesh.shape["context"]) if order == "zigzag" else np.arange(t)
    inv = cp.inverse_permutation(perm)
    seg = segment_ids(case)
    # Per-token arrays are [B, T, ...]; V1's lambda is one per head.
    per_token = lambda x: x[:, perm] if x.ndim >= 2 else x
    out = cp.context_parallel_attention(
      case.op,
      tuple(per_token(x) for x in arrays),
      mesh=mesh,
      batch_axis=batch_axis,
      head_axis=head_axis,
      strategy=strategy,
      load_balance=order == "zigzag",
      causal=case.causal,
      segment_ids=None if seg is None else seg[1][:, perm],
      implementation=self.implementation,
      interpret=self.implementation != "xla",
    )
    # Gathered before it is put back in order, so that the cotangent reaches the ring by
    # slicing: with the TPU interpreter's kernels a collective that does not wait for the
    # forward's kernel calls can stall (docs/scaling.md#context-parallelism).
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.lax.with_sharding_constraint(out, whole)[:, inv]


class TestContextParallelPallasTpu(TestContextParallel):
  """The ring with the fused TPU kernels as its blocks (``implementation="pallas_tpu"``, in the
  TPU interpreter on every device, so on fewer devices): zig-zag order and documents that
  cross the shard boundary, so every step kind runs (the causal first step and both later
  cases). The integration tier runs DIFF V2 on two shards; the slow tier adds DIFF V1, four
  shards, contiguous shards, no causal mask, batch sharding and bfloat16. The Mosaic GPU
  kernels take bf16/fp16 tiles of 64 rows, too large for these shapes:
  tests/kernels/gpu/test_kernels_mosaic_gpu.py checks one of their ring blocks against the
  whole attention, and the ring that merges blocks is one code path for every block kind."""

  ops = ("diff_v1", "diff_v2")
  segments = ("packed",)
  variants = tuple(
    _variant("ring", lb, layout)
    for lb in (True, False)
    for layout in ("context2", "batch2_context2", "fsdp2_context4")
  )
  implementation = "pallas_tpu"
  integration_pinned = (_ring_case("diff_v2", "ring", True, "context2"),)
  kept = (
    _ring_case("diff_v1", "ring", True, "context2"),
    _ring_case("diff_v2", "ring", True, "fsdp2_context4"),
    _ring_case("diff_v1", "ring", False, "fsdp2_context4"),
    _ring_case("diff_v2", "ring", False, "batch2_context2"),
    _ring_case("diff_v1", "ring", True, "batch2_context2", causal=False),
    _ring_case("diff_v2", "ring", True, "context2", causal=False),
    _ring_case("diff_v1", "ring", True, "context2", dtype="bfloat16"),
    _ring_case("diff_v2", "ring", True, "context2", dtype="bfloat16"),
  )


@sharded
def test_ring_scalar_lambda_no_causal_no_segments():
  _compare("diff_v1", "ring", True, "fsdp2_context4", causal=False, segments=False, scalar_lam=True)


def _collectives(op, strategy) -> set[str]:
  mesh = _mesh((1, 1, 2, 4))
  arrays, _, _ = _inputs(op, 32)
  seg = _packed_segments(32)

  def loss(*xs):
    out = cp.context_parallel_attention(
      op, xs, mesh=mesh, head_axis="tensor", strategy=strategy, segment_ids=seg
    )
    return jnp.sum(out)

  text = jax.jit(jax.grad(loss, tuple(range(len(arrays))))).lower(*arrays).as_text()
  return set(re.findall(r"stablehlo\.(collective_permute|all_gather|all_to_all)", text))


@sharded
@pytest.mark.parametrize("op", ["mha", "diff_v1", "diff_v2"])
def test_ring_passes_blocks_and_never_gathers(op):
  assert _collectives(op, "ring") == {"collective_permute"}


@sharded
def test_all_gather_strategy_gathers():
  assert "all_gather" in _collectives("diff_v1", "all_gather")


@sharded
def test_argument_errors():
  mesh = _mesh((1, 1, 2, 4))
  arrays, _, _ = _inputs("mha", 36)
  call = lambda xs, **kw: cp.context_parallel_attention("mha", xs, mesh=mesh, **kw)
  with pytest.raises(ValueError, match="multiple of 8"):
    call(arrays)  # 36 is not a multiple of 2 * 4
  fine = jax.eval_shape(lambda *xs: call(xs, load_balance=False), *arrays)
  assert fine.shape == arrays[0].shape
  arrays, _, _ = _inputs("mha", 32)
  one_kv = (arrays[0], arrays[1][:, :, :1], arrays[2][:, :, :1])
  with pytest.raises(ValueError, match="whole kv groups"):
    call(one_kv, head_axis="tensor")
  with pytest.raises(ValueError, match="same length"):
    call((arrays[0], arrays[1][:, :16], arrays[2][:, :16]))
  with pytest.raises(ValueError, match="different mesh axes"):
    call(arrays, head_axis="context")
  with pytest.raises(ValueError, match="does not have"):
    call(arrays, batch_axis="model")
  with pytest.raises(ValueError, match="Unknown strategy"):
    call(arrays, strategy="tree")
  with pytest.raises(ValueError, match="Unknown op"):
    cp.context_parallel_attention("diff_v3", arrays, mesh=mesh)
  with pytest.raises(ValueError, match="is not one of"):
    call(arrays, implementation="splash")
  with pytest.raises(ValueError, match="the backend is 'cpu'"):
    call(arrays, implementation="pallas")
  with pytest.raises(ValueError, match="No 'pallas_tpu' implementation of 'mha'"):
    call(arrays, implementation="pallas_tpu", interpret=True)
  v1, _, _ = _inputs("diff_v1", 32)
  call_v1 = lambda **kw: cp.context_parallel_attention("diff_v1", v1, mesh=mesh, **kw)
  with pytest.raises(ValueError, match="strategy='ring'"):
    call_v1(strategy="all_gather", implementation="pallas_tpu", interpret=True)
  if jax.default_backend() != "tpu":
    with pytest.raises(ValueError, match="interpret=True"):
      call_v1(implementation="pallas_tpu")
