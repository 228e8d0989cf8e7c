"""The attention test base itself: its grid, its tiers, and that it fails implementations
broken on purpose (the reference with one defect each)."""

import jax
import jax.numpy as jnp
import pytest
from attention_cases import (
  GROUPED_SMALL_SHAPES,
  SMALL_SHAPES,
  AttentionCases,
  Case,
  check_case,
  every_case,
  reference,
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
