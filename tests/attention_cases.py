"""One test base for every implementation of the attention ops.

An implementation's test class subclasses :class:`AttentionCases`, declares what it supports
(its ops, dtypes, head dims, sequence lengths, tile sets, segment kinds) and how it calls an op
(:meth:`AttentionCases.call`); the base gives it ``test_matches_reference``: the output and
the gradient of every input against the float32 reference of :mod:`diffjax.core.reference`
on the same (rounded) inputs, measured by :func:`kernel_checks.check` (whole array, and row by
row where the class says so); the shapes and dtypes of the inputs; exact zeros for a query row
that sees no key and for causal rows before every key.

Cases come from one grid shared by every class (:data:`SHAPES`: the canonical shapes, so the
reference programs compile once for the whole suite through the persistent compilation cache,
crossed with ops, causality, segment kinds and dtypes), filtered by the class's
:meth:`~AttentionCases.supports`. Which of them run where:

- a class's ``pinned`` cases (the awkward ones it must always see) and ``sampled`` more drawn
  with a fixed seed from the rest run in the unit tier;
- the class's ``integration_pinned`` cases and ``integration_sampled`` more of the same draw
  run in the integration tier (all of the rest when None: the classes whose cases take a
  second or two);
- the class's ``kept`` cases and ``slow_sampled`` more carry ``slow`` (``grid`` under
  tests/kernels: the interpreters, hours on two cores); the rest of the product is not run.

Add an implementation by subclassing; add a case axis by widening :data:`SHAPES` or the axes.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_checks import (
  assert_like_inputs,
  check,
  normal,
  packed_segment_ids,
  rel_err_rows,
  tolerance,
)

from diffjax.core import op_specs
from diffjax.core import reference as ref

OPS = ("mha", "diff_v1", "diff_v2", "gda_v1", "gda_v2")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
SEGMENTS = ("none", "packed", "unmatched")
# Segment kinds beyond the default three, for the classes that name them: "single" starts
# every row with a one-token document (a query that sees only itself), then two longer ones.
SEGMENT_KINDS = SEGMENTS + ("single",)
GRADIENTS = {
  "mha": ("dq", "dk", "dv"),
  "diff_v1": ("dq1", "dq2", "dk1", "dk2", "dv", "dlam"),
  "diff_v2": ("dq", "dk", "dv", "dlam"),
  "gda_v1": ("dq1", "dq2", "dk1", "dk2", "dv", "dlam"),
  "gda_v2": ("dq1", "dq2", "dk", "dv", "dlam"),
}
SPECS = {spec.name: spec for spec in op_specs.BUILTIN_OPS if not spec.decode}
REFERENCES = {
  "mha": ref.mha_reference,
  "diff_v1": ref.diff_v1_reference,
  "diff_v2": ref.diff_v2_reference,
  "gda_v1": ref.gda_v1_reference,
  "gda_v2": ref.gda_v2_reference,
}


@dataclasses.dataclass(frozen=True)
class Shape:
  """Sizes of one case. ``group``: output heads per kv head (for the grouped ops, noise heads
  per kv head); ``ratio``: signal heads per noise head (grouped ops; 1 elsewhere);
  ``grouped``: a shape for the grouped ops although its ratio is 1 (one signal head a noise
  head: the grouped kernels' degenerate case)."""

  b: int
  t: int
  s: int
  kv_heads: int
  group: int
  d: int
  ratio: int = 1
  tiles: str = "default"  # a tile set the kernel classes name (ignored by the others)
  grouped: bool = False

  @property
  def for_grouped_ops(self) -> bool:
    return self.ratio > 1 or self.grouped


# The canonical shapes. Small ones for the XLA-level paths: GQA groups of 1, 2 and 3, T != S
# both ways, odd sizes, three batch rows. Tiled ones for the kernels: several query and key
# tiles, T off every tile, documents that end inside tiles, T > S.
SMALL_SHAPES = (
  Shape(2, 13, 13, 2, 3, 8),
  Shape(1, 7, 11, 1, 3, 5),
  Shape(3, 16, 16, 4, 1, 8),
  Shape(2, 12, 9, 2, 2, 8),
)
GROUPED_SMALL_SHAPES = (
  Shape(2, 11, 11, 2, 1, 8, ratio=4),
  Shape(2, 11, 11, 1, 2, 8, ratio=3),
  Shape(2, 11, 11, 3, 1, 8, ratio=2),
  Shape(1, 7, 11, 1, 2, 5, ratio=3),
)
TILED_SHAPES = (
  Shape(2, 130, 300, 2, 2, 16, tiles="small"),
  Shape(2, 150, 230, 2, 3, 8, tiles="small"),
  Shape(2, 150, 150, 2, 3, 16, tiles="small"),
  Shape(2, 200, 200, 2, 1, 16, tiles="small"),
  Shape(2, 200, 200, 2, 2, 16, tiles="small"),
  Shape(2, 200, 200, 2, 2, 16, tiles="default"),
  Shape(2, 200, 200, 2, 4, 16, tiles="wide"),
  Shape(2, 200, 384, 2, 4, 8, tiles="small"),
  Shape(2, 200, 136, 2, 2, 16, tiles="small"),
  Shape(2, 384, 384, 2, 2, 8, tiles="small"),
  Shape(2, 384, 384, 2, 2, 16, tiles="wide"),
  Shape(2, 384, 384, 2, 4, 16, tiles="wide"),
  Shape(2, 384, 384, 2, 1, 24, tiles="small"),
  Shape(2, 384, 384, 2, 1, 24, tiles="default"),
  Shape(1, 200, 200, 2, 2, 16),
)
GROUPED_TILED_SHAPES = (
  Shape(2, 130, 300, 2, 1, 16, ratio=2, tiles="small"),
  Shape(2, 150, 150, 1, 2, 8, ratio=3, tiles="small"),
  Shape(2, 150, 230, 2, 1, 16, ratio=3, tiles="small"),
  Shape(2, 150, 230, 2, 2, 16, ratio=3, tiles="small"),
  Shape(2, 200, 200, 1, 2, 16, ratio=4, tiles="small"),
  Shape(2, 200, 200, 2, 1, 16, ratio=2, tiles="small"),
  Shape(2, 96, 96, 2, 1, 16, ratio=2, tiles="small"),
  Shape(2, 200, 384, 2, 1, 8, ratio=4, tiles="small"),
  Shape(2, 200, 136, 1, 1, 16, ratio=2, tiles="small"),
  Shape(1, 200, 200, 2, 1, 16, ratio=2),
  Shape(1, 200, 200, 2, 1, 16, ratio=3),
)
# The Mosaic GPU kernels' shapes: head dims of 64 to 128 (multiples of 16), tiles of 64
# queries and keys, so the same awkwardness at the sizes they take (GQA 1 to 3, T off the
# tiles, T < S, value halves of unequal width at d 80).
GPU_SHAPES = (
  Shape(1, 64, 64, 1, 1, 64),
  Shape(1, 200, 200, 2, 1, 64),
  Shape(1, 384, 384, 1, 3, 64),
  Shape(1, 200, 200, 1, 2, 128),
  Shape(1, 200, 200, 2, 1, 80),
  Shape(1, 200, 200, 1, 3, 96),
  Shape(1, 384, 384, 1, 2, 128),
  Shape(1, 200, 200, 1, 3, 80),
  Shape(2, 200, 200, 1, 2, 64),
  Shape(1, 130, 260, 1, 2, 64),
  Shape(1, 100, 300, 2, 1, 64),
)
GROUPED_GPU_SHAPES = (
  Shape(1, 64, 64, 1, 1, 64, ratio=2),
  Shape(1, 64, 64, 1, 1, 64, ratio=4),
  Shape(1, 200, 200, 1, 2, 64, ratio=4),
  Shape(2, 200, 200, 2, 1, 64, ratio=2),
  Shape(1, 128, 128, 1, 1, 128, ratio=4),
  Shape(1, 200, 200, 1, 2, 80, ratio=3),
  Shape(1, 64, 64, 1, 1, 96, ratio=4),
  Shape(1, 130, 130, 2, 1, 64, ratio=3),
  Shape(1, 64, 64, 1, 2, 64, grouped=True),
)
# The context-parallel ring's: 32 or 48 tokens (whole zig-zag chunks on 2, 4 and 8 shards),
# heads that split over a tensor axis of 2.
RING_SHAPES = (
  Shape(2, 32, 32, 2, 2, 8),
  Shape(2, 48, 48, 2, 2, 8),
  Shape(2, 32, 32, 2, 1, 8, ratio=2),
  Shape(2, 48, 48, 2, 1, 8, ratio=2),
)
SHAPES = (
  SMALL_SHAPES
  + GROUPED_SMALL_SHAPES
  + TILED_SHAPES
  + GROUPED_TILED_SHAPES
  + GPU_SHAPES
  + GROUPED_GPU_SHAPES
  + RING_SHAPES
)


@dataclasses.dataclass(frozen=True)
class Case:
  op: str
  shape: Shape
  causal: bool
  segments: str
  dtype: str
  variant: str = ""  # a class's own axis (a mesh layout, a strategy), "" where it has none

  @property
  def grouped(self) -> bool:
    return self.op.startswith("gda")

  @property
  def heads(self) -> int:
    """Output heads."""
    return self.shape.kv_heads * self.shape.group * self.shape.ratio

  @property
  def value_dim(self) -> int:
    return 2 * self.shape.d if self.op in ("diff_v1", "gda_v1") else self.shape.d

  def __str__(self) -> str:
    s = self.shape
    grouped = f"r{s.ratio}-" if self.grouped else ""
    variant = f"-{self.variant}" if self.variant else ""
    return (
      f"{self.op}-b{s.b}-t{s.t}-s{s.s}-k{s.kv_heads}x{s.group}-{grouped}d{s.d}-{s.tiles}-"
      f"{'causal' if self.causal else 'full'}-{self.segments}-{self.dtype}{variant}"
    )


def every_case():
  """The whole shared grid (before any class's filter)."""
  for shape in SHAPES:
    for op in OPS:
      if op.startswith("gda") != shape.for_grouped_ops:
        continue
      for causal, segments, dtype in itertools.product(
        (True, False), SEGMENT_KINDS, ("float32", "bfloat16", "float16")
      ):
        if segments != "none" and shape.t > shape.s:
          continue  # the packed documents are laid out for queries that are the last T keys
        yield Case(op, shape, causal, segments, dtype)


def arrays(case: Case) -> tuple:
  """The op's positional arrays for ``case`` (fixed seeds)."""
  s, dtype = case.shape, DTYPES[case.dtype]
  b, t, n, kh, d, h = s.b, s.t, s.s, s.kv_heads, s.d, case.heads
  keys = jax.random.split(jax.random.PRNGKey(0), 6)
  x = lambda i, shape: normal(keys[i], shape, dtype)
  lam_heads = lambda: jax.random.uniform(keys[5], (h,), jnp.float32, 0.1, 0.9)
  lam_tokens = lambda: jax.nn.sigmoid(normal(keys[5], (b, t, h)))
  kv = lambda i, width=d: x(i, (b, n, kh, width))
  if case.op == "mha":
    return (x(0, (b, t, h, d)), kv(2), kv(4))
  if case.op == "diff_v1":
    return (x(0, (b, t, h, d)), x(1, (b, t, h, d)), kv(2), kv(3), kv(4, 2 * d), lam_heads())
  if case.op == "diff_v2":
    return (x(0, (b, t, 2 * h, d)), kv(2), kv(4), lam_tokens())
  noise = x(1, (b, t, kh * s.group, d))
  if case.op == "gda_v1":
    return (x(0, (b, t, h, d)), noise, kv(2), kv(3), kv(4, 2 * d), lam_heads())
  return (x(0, (b, t, h, d)), noise, kv(2), kv(4), lam_tokens())


def segment_ids(case: Case):
  """``None`` or the pair (query ids, key ids) of ``case``'s segment kind."""
  if case.segments == "none":
    return None
  s = case.shape
  if case.segments == "single":
    kv = (jnp.arange(s.s) >= s.s // 3).astype(jnp.int32).at[0].set(7)
    kv = jnp.broadcast_to(kv, (s.b, s.s))
    return kv[:, s.s - s.t :], kv
  return packed_segment_ids(s.b, s.t, s.s, unmatched_row=case.segments == "unmatched")


def mask_kwargs(case: Case) -> dict:
  """``causal``, ``q_segment_ids`` and ``kv_segment_ids`` as the kernel functions take them."""
  q_seg, kv_seg = segment_ids(case) or (None, None)
  return dict(causal=case.causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg)


def reference(case: Case):
  segs = segment_ids(case)
  return lambda *a: REFERENCES[case.op](*a, causal=case.causal, segment_ids=segs)


def _value_and_vjp(fn, args, ct):
  def run(args, ct):
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(ct)

  return jax.jit(run)(tuple(args), ct)


def noise_map_arrays(case: Case, args) -> tuple:
  """``args`` rearranged so that the op's first softmax map is its second one (its queries and
  keys) and lambda is zero: the op's output is then the noise map's output O2 (per output
  head), computed as the implementation computes its first map."""
  spec = SPECS[case.op]
  args = list(args)
  qs = [args[i] for i in spec.queries]
  noise = spec.split_maps(qs)[1]
  # Only the first map's queries matter with lambda zero; the grouped ops keep their own
  # noise heads (the join would sum the repeated ones).
  for i, q in zip(spec.queries, tuple(spec.join_maps((noise, noise), qs))[:1] + tuple(qs[1:])):
    args[i] = q
  ks = [args[i] for i in spec.keys]
  args[spec.keys[spec.map_keys[0]]] = ks[spec.map_keys[1]]
  args[spec.lam] = jnp.zeros_like(args[spec.lam])
  return tuple(args)


def per_head_output(probs_BxHxTxS, v_BxSxKxDv):
  """``P V`` per output head (head h reads kv group h // (H / K)), [B, T, H, Dv]."""
  h, kv = probs_BxHxTxS.shape[1], v_BxSxKxDv.shape[2]
  return jnp.einsum("bhts,bshd->bthd", probs_BxHxTxS, jnp.repeat(v_BxSxKxDv, h // kv, axis=2))


def row_term_correction(case: Case, args, ct, out, o2) -> tuple:
  """What forming the softmax-backward row terms from stored, rounded outputs adds to each
  gradient of a differential op, float32, in the order of the op's arrays.

  A fused backward takes ``D_1 = rowsum(dO O_1)`` and ``D_2 = rowsum(dO O_2)`` from the
  forward's output ``O`` (``O_1 = O + lam O_2``) and its noise map's output ``O_2``, both kept
  in the input dtype (``out`` and ``o2``, the implementation's own). Each map's score
  gradient is ``c P (dP - D)`` (``c`` 1 and ``-lam``), so the rounding moves it by
  ``-c P dD``: a query row's gradient moves by ``-c dD scale P K``. That is the size of the
  rounding of a row of O times dO, whatever the row's own size; where the row's value is small
  (a query early in a causal sequence, whose few terms nearly cancel) it is several percent of
  the row. This gives that part exactly, so that the row measure judges the rest."""
  spec = SPECS[case.op]
  f32 = [a.astype(jnp.float32) for a in args]
  segs = segment_ids(case)

  def scores(*a):
    o, aux = spec.reference(*a, causal=case.causal, segment_ids=segs, return_aux=True)
    return (aux["logits1"], aux["logits2"]), (o, aux["probs1"], aux["probs2"])

  _, vjp, (o, p1, p2) = jax.vjp(scores, *f32, has_aux=True)
  b, t, h, _ = o.shape
  lam = jnp.transpose(spec.lam_per_token(f32[spec.lam], b, t, h), (0, 2, 1))
  o2_exact = per_head_output(p2, f32[spec.value])
  row_sum = lambda x: jnp.einsum("bthd,bthd->bht", ct.astype(jnp.float32), x)[..., None]
  d2 = row_sum(o2.astype(jnp.float32) - o2_exact)
  d1 = row_sum(out.astype(jnp.float32) - o) + lam[..., None] * d2
  return vjp((-p1 * d1, lam[..., None] * p2 * d2))


def check_case(
  case: Case,
  fn,
  *,
  rows: bool = False,
  elementwise_tol: float | None = None,
  tol: float | None = None,
  own_checks: dict | None = None,
  broken_rows: bool = False,
  stored_o2=None,
):
  """Asserts that ``fn(*arrays)`` and the gradient of each array equal the reference's for
  ``case``; see the module docstring for what is measured.

  ``tol``: the whole-array tolerance instead of the dtype's. ``own_checks``: gradient name ->
  ``check(case, args, cotangent, got, want)``, a measure of the class's own that replaces the
  common one for that gradient. ``broken_rows``: also show, on this case's own numbers, that
  the row measure fails each array of queries, keys or values when its smallest row of
  weight (a tenth of the largest value or more) is moved by twice the row tolerance.
  ``stored_o2``: ``fn(*arrays)`` -> the implementation's own noise-map output in the input
  dtype, for one that forms its row terms from it and from its output: the row measure then
  compares the gradients with the reference plus :func:`row_term_correction`."""
  args = arrays(case)
  s, dtype = case.shape, DTYPES[case.dtype]
  ct = normal(jax.random.PRNGKey(7), (s.b, s.t, case.heads, case.value_dim), dtype)
  out, grads = _value_and_vjp(fn, args, ct)
  ref_out, ref_grads = _value_and_vjp(
    reference(case), [a.astype(jnp.float32) for a in args], ct.astype(jnp.float32)
  )
  assert_like_inputs(out, grads, args, (s.b, s.t, case.heads, case.value_dim), dtype)
  triples = [("out", out, ref_out)] + list(zip(GRADIENTS[case.op], grads, ref_grads))
  own_checks = own_checks or {}
  for name, got, want in triples:
    if name in own_checks:
      own_checks[name](case, args, ct, got, want)
  triples = [t for t in triples if t[0] not in own_checks]
  row_wants = {}
  if stored_o2 is not None and SPECS[case.op].lam is not None:
    o2 = stored_o2(*noise_map_arrays(case, args))
    corrections = row_term_correction(case, args, ct, out, o2)
    row_wants = {
      name: want + c for name, want, c in zip(GRADIENTS[case.op], ref_grads, corrections)
    }
  check(triples, dtype, rows=rows, tol=tol, row_wants=row_wants)
  if broken_rows:
    row_tol = tolerance(dtype, rows=True)
    for name, got, want in triples[1:]:
      if name == "dlam":
        continue
      want = row_wants.get(name, want)
      broken = np.array(got, np.float32).reshape(-1, got.shape[-1])
      scale = np.max(np.abs(np.asarray(want, np.float32).reshape(broken.shape)), 1)
      row = int(np.argmin(np.where(scale >= 0.1 * scale.max(), scale, np.inf)))
      broken[row] += 2 * row_tol * scale[row]
      err = rel_err_rows(broken.reshape(got.shape), want)
      assert err > row_tol, f"{name} of {case}: a broken row passed the row measure ({err})"
  if elementwise_tol is not None and case.dtype == "float32":
    for name, got, want in triples:
      np.testing.assert_allclose(
        np.asarray(got, np.float64),
        np.asarray(want, np.float64),
        atol=elementwise_tol,
        rtol=elementwise_tol,
        err_msg=f"{name} of {case}",
      )
  if case.segments == "unmatched":  # query 0 of batch 0 sees no key: exact zeros
    np.testing.assert_array_equal(np.asarray(out[0, 0]), 0.0)
    for i in SPECS[case.op].queries:
      np.testing.assert_array_equal(np.asarray(grads[i][0, 0]), 0.0)
  if case.causal and s.t > s.s:  # the queries are the last T keys: the first T - S see none
    np.testing.assert_array_equal(np.asarray(out[:, : s.t - s.s]), 0.0)


class AttentionCases:
  """Base of the per-implementation classes (see the module docstring).

  Subclasses set:
    ops, dtypes, segments: what the implementation takes;
    shapes: the canonical shapes it runs (defaults to the small ones);
    pinned: cases of its grid that always run in the unit tier (the awkward ones it must
      see, named in one place);
    sampled: how many more cases of its grid, drawn with a fixed seed, run in the unit tier;
    integration_pinned, integration_sampled: the cases that always run in the integration
      tier, and how many of the rest run there too (None: all);
    kept, slow_sampled: the cases that run in the slow tier (and how many more drawn);
    variants: the class's own axis, crossed with its grid (a mesh layout, a strategy;
      :meth:`call` reads ``case.variant``);
    rows: also measure each row against its own scale;
    elementwise_tol: float32 outputs and gradients also within this ``allclose``;
    tolerances: dtype name -> whole-array tolerance, where the class holds itself to less
      than the common one;
    broken_rows: see :func:`check_case`;
    stored_residuals: the implementation forms its softmax-backward row terms from its output
      and its noise map's output kept in the input dtype; the row measure allows for exactly
      that (:func:`row_term_correction`, the noise map's output from :meth:`call` on
      :func:`noise_map_arrays`);
  and :meth:`call`, and :meth:`own_checks` where a gradient needs a measure of its own.
  """

  ops: tuple[str, ...] = ("mha", "diff_v1", "diff_v2")
  dtypes: tuple[str, ...] = ("float32",)
  segments: tuple[str, ...] = SEGMENTS
  shapes: tuple[Shape, ...] = SMALL_SHAPES
  pinned: tuple = ()
  sampled: int = 4
  integration_pinned: tuple = ()
  integration_sampled: int | None = None
  kept: tuple = ()
  slow_sampled: int = 0
  variants: tuple[str, ...] = ("",)
  rows: bool = False
  elementwise_tol: float | None = None
  tolerances: dict = {}
  broken_rows: bool = False
  stored_residuals: bool = False

  def supports(self, case: Case) -> bool:
    """Whether the implementation takes ``case`` (beyond the class's axes)."""
    del case
    return True

  def call(self, case: Case, *arrays):
    """The implementation's output for ``case`` on ``arrays``."""
    raise NotImplementedError

  def own_checks(self, case: Case) -> dict:
    """Gradient name -> a measure that replaces the common one (see :func:`check_case`)."""
    del case
    return {}

  def cases(self) -> list:
    """This class's cases as pytest params, marked by tier."""
    crossed = (
      dataclasses.replace(c, variant=variant) for c in every_case() for variant in self.variants
    )
    mine = [
      c
      for c in crossed
      if c.op in self.ops
      and c.dtype in self.dtypes
      and c.segments in self.segments
      and c.shape in self.shapes
      and self.supports(c)
    ]
    named = self.pinned + self.integration_pinned + self.kept
    missing = [str(c) for c in named if c not in mine]
    assert not missing, f"{type(self).__name__} names cases outside its grid: {missing}"
    rest = [c for c in mine if c not in self.pinned + self.integration_pinned]
    random.Random(f"{type(self).__name__}-cases").shuffle(rest)
    unit = list(self.pinned) + rest[: self.sampled]
    rest = rest[self.sampled :]
    n = len(rest) if self.integration_sampled is None else self.integration_sampled
    integration, rest = list(self.integration_pinned) + rest[:n], rest[n:]
    slow = [c for c in self.kept if c in rest]
    slow += [c for c in rest if c not in slow][: self.slow_sampled]
    params = [pytest.param(c, id=str(c)) for c in unit]
    params += [pytest.param(c, id=str(c), marks=pytest.mark.integration) for c in integration]
    params += [pytest.param(c, id=str(c), marks=pytest.mark.slow) for c in slow]
    return params

  def pytest_generate_tests(self, metafunc):
    if "case" in metafunc.fixturenames:
      metafunc.parametrize("case", self.cases())

  def test_matches_reference(self, case):
    check_case(
      case,
      lambda *a: self.call(case, *a),
      rows=self.rows,
      elementwise_tol=self.elementwise_tol,
      tol=self.tolerances.get(case.dtype),
      own_checks=self.own_checks(case),
      broken_rows=self.broken_rows,
      stored_o2=(lambda *a: self.call(case, *a)) if self.stored_residuals else None,
    )
