"""The attention test base itself: its grid, its tiers, and that it fails implementations
broken on purpose (the reference with one defect each)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
  GROUPED_SMALL_SHAPES,
  SMALL_SHAPES,
  SPECS,
  AttentionCases,
  Case,
  arrays,
  check_case,
  every_case,
  noise_map_arrays,
  per_head_output,
  reference,
  row_term_correction,
  segment_ids,
)


def _tiers(params):
  marks = {}
  for p in params:
    names = {m.name for m in p.marks}
    marks[p.values[0]] = "slow" if "slow" in names else "integration" if names else "unit"
  return marks


class _Example(AttentionCases):
  ops = ("diff_v1", "gda_v2")
  pinned = (Case("diff_v1", SMALL_SHAPES[1], False, "packed", "float32"),)
  sampled = 2
  integration_sampled = 3
  shapes = SMALL_SHAPES + GROUPED_SMALL_SHAPES
  kept = (Case("gda_v2", GROUPED_SMALL_SHAPES[0], True, "none", "float32"),)
  slow_sampled = 1


def test_tiers_are_pinned_then_drawn_with_a_fixed_seed():
  params = _Example().cases()
  tiers = _tiers(params)
  assert list(tiers.values()).count("unit") == 3 and params[0].values[0] == _Example.pinned[0]
  assert list(tiers.values()).count("integration") == 3
  assert tiers[_Example.kept[0]] in ("slow", "unit", "integration")
  assert list(tiers.values()).count("slow") <= 2
  assert [p.values for p in _Example().cases()] == [p.values for p in params]  # the same draw
  assert all(c.op in _Example.ops and c.dtype == "float32" for c in tiers)


def test_a_pinned_case_outside_the_grid_is_refused():
  class Bad(_Example):
    pinned = (Case("mha", SMALL_SHAPES[0], True, "none", "float32"),)

  with pytest.raises(AssertionError, match="names cases outside its grid"):
    Bad().cases()


def test_segmented_cases_need_queries_that_are_the_last_keys():
  class Long(AttentionCases):
    shapes = (SMALL_SHAPES[3],)  # T 12 > S 9

  cases = [p.values[0] for p in Long().cases()]
  assert cases and all(c.segments == "none" for c in cases)


# The defects: each leaves every other output and gradient exact.
CASE_V1 = Case("diff_v1", SMALL_SHAPES[0], True, "unmatched", "float32")


def _nudged_gradient(x, size):
  """Zero in the forward; adds ``size`` to the gradient of ``x`` everywhere."""
  return size * jnp.sum(x - jax.lax.stop_gradient(x))


@pytest.mark.parametrize(
  "defect", ["output", "output row", "dq2", "dk1", "dlam sign", "unmatched row"]
)
def test_the_checks_fail_a_broken_implementation(defect):
  want = reference(CASE_V1)

  def broken(q1, q2, k1, k2, v, lam):
    if defect == "dlam sign":  # the forward's lambda, the opposite gradient
      lam = 2 * jax.lax.stop_gradient(lam) - lam
    out = want(q1, q2, k1, k2, v, lam)
    scale = jax.lax.stop_gradient(jnp.max(jnp.abs(out)))
    if defect == "output":
      out = out * (1 + 1e-3)
    if defect == "output row":  # one head of one token a tenth off
      out = out.at[1, 5, 0].multiply(1.1)
    if defect == "dq2":
      out = out + _nudged_gradient(q2, 1e-2) * scale
    if defect == "dk1":
      out = out + _nudged_gradient(k1[:, 3], 1e-2) * scale
    if defect == "unmatched row":  # a row that sees no key, off zero by a rounding error
      out = out.at[0, 0].add(1e-12)
    return out

  check_case(CASE_V1, want, rows=True)  # the reference passes its own checks
  with pytest.raises(AssertionError):
    check_case(CASE_V1, broken)


def test_variants_cross_the_grid_and_name_their_cases():
  class Layouts(AttentionCases):
    ops = ("mha",)
    shapes = (SMALL_SHAPES[0],)
    segments = ("none",)
    variants = ("ring-a", "ring-b")
    sampled = 100  # all of them in the unit tier

    def supports(self, case):
      return case.variant == "ring-a" or case.causal

  params = Layouts().cases()
  cases = [p.values[0] for p in params]
  assert sorted((c.variant, c.causal) for c in cases) == [
    ("ring-a", False),
    ("ring-a", True),
    ("ring-b", True),
  ]
  assert not any(p.marks for p in params)
  assert all(str(c).endswith(f"-none-float32-{c.variant}") for c in cases)
  assert not str(CASE_V1).endswith("-")  # no variant, no suffix
  assert len({str(c) for c in every_case()}) == len(list(every_case()))  # ids are unique


def test_own_checks_replace_the_common_measure_and_tolerances_tighten_it():
  want = reference(CASE_V1)
  seen = []

  def off_dlam(q1, q2, k1, k2, v, lam):  # d lambda 2 % off, all else exact
    out = want(q1, q2, k1, k2, v, lam)
    return out + _nudged_gradient(lam, 2e-2) * jax.lax.stop_gradient(jnp.max(jnp.abs(out)))

  with pytest.raises(AssertionError, match="dlam"):
    check_case(CASE_V1, off_dlam)
  check_case(CASE_V1, off_dlam, own_checks={"dlam": lambda *a: seen.append(a[0])})
  assert seen == [CASE_V1]

  def slightly_off(*a):  # 3e-6 relative: within float32's 2e-5, not 1e-6
    return want(*a) * (1 + 3e-6)

  check_case(CASE_V1, slightly_off)
  with pytest.raises(AssertionError, match="outside tolerance 1e-06"):
    check_case(CASE_V1, slightly_off, tol=1e-6)


def test_broken_rows_holds_on_the_reference():
  # The self-check of the row measure runs on every gradient of a case and passes where the
  # measure would see a row moved by twice its tolerance.
  check_case(CASE_V1, reference(CASE_V1), rows=True, broken_rows=True)


def _noise_map_output(case, args):
  """O2 = P2 V per output head, from the reference's probabilities."""
  _, aux = SPECS[case.op].reference(
    *args, causal=case.causal, segment_ids=segment_ids(case), return_aux=True
  )
  return per_head_output(aux["probs2"], args[SPECS[case.op].value]), aux


@pytest.mark.parametrize("op", ["diff_v1", "diff_v2", "gda_v1", "gda_v2"])
def test_noise_map_arrays_make_the_output_the_noise_maps_output(op):
  shapes = GROUPED_SMALL_SHAPES if op.startswith("gda") else SMALL_SHAPES
  case = Case(op, shapes[0], True, "packed", "float32")
  args = arrays(case)
  got = reference(case)(*noise_map_arrays(case, args))
  want, _ = _noise_map_output(case, args)
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)


def test_row_term_correction_is_what_rounded_row_terms_do():
  # DIFF V1: the score gradients are P1 (dP - D1) and -lam P2 (dP - D2), with
  # D1 = rowsum(dO (O + lam O2)) and D2 = rowsum(dO O2); stored O and O2 off by e and e2 move
  # dq1 by -scale dD1 P1 K1 and dq2 by scale lam dD2 P2 K2, and nothing else.
  case = CASE_V1
  args = arrays(case)
  q1, q2, k1, k2, v, lam = args
  b, t, h, d = q1.shape
  ct = jax.random.normal(jax.random.PRNGKey(3), (b, t, h, v.shape[-1]))
  o2, aux = _noise_map_output(case, args)
  out = reference(case)(*args)
  zero = row_term_correction(case, args, ct, out, o2)
  assert max(float(jnp.max(jnp.abs(c))) for c in zero) < 1e-5
  e, e2 = (1e-2 * jax.random.normal(jax.random.PRNGKey(i), out.shape) for i in (4, 5))
  got = row_term_correction(case, args, ct, out + e, o2 + e2)
  d2 = jnp.einsum("bthd,bthd->bht", ct, e2)
  d1 = jnp.einsum("bthd,bthd->bht", ct, e) + lam[None, :, None] * d2
  keys = lambda k: jnp.repeat(k, h // k.shape[2], axis=2)
  scale = d**-0.5
  want_dq1 = -scale * jnp.einsum("bht,bhts,bshd->bthd", d1, aux["probs1"], keys(k1))
  want_dq2 = scale * jnp.einsum(
    "bht,bhts,bshd->bthd", lam[None, :, None] * d2, aux["probs2"], keys(k2)
  )
  np.testing.assert_allclose(got[0], want_dq1, atol=1e-6)
  np.testing.assert_allclose(got[1], want_dq2, atol=1e-6)
  assert float(jnp.max(jnp.abs(got[2]))) > 0  # the keys move too
  np.testing.assert_array_equal(got[4], 0.0)  # not the values
  np.testing.assert_array_equal(got[5], 0.0)  # nor lambda
  # The row measure with the correction still fails a broken gradient.
  stored = reference(case)
  check_case(case, reference(case), rows=True, broken_rows=True, stored_o2=stored)

  def broken(q1, q2, k1, k2, v, lam):
    out = reference(case)(q1, q2, k1, k2, v, lam)
    return out + _nudged_gradient(q2, 1e-2) * jax.lax.stop_gradient(jnp.max(jnp.abs(out)))

  with pytest.raises(AssertionError, match=r"dq2 \(rows\)"):
    check_case(case, broken, rows=True, stored_o2=stored)
