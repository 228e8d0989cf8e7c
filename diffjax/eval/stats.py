"""Statistics over seeds: t confidence intervals, paired t-tests, and verdicts in words.

A matched comparison trains every arm with the same seeds (same data order and initialisation
seed), so arm X at seed s and the Transformer at seed s form a pair; paired differences remove
the seed-to-seed variation both arms share. With n seeds the tests have n - 1 degrees of freedom,
so at n = 2 or 3 only large, consistent differences can be called significant, and the verdicts
say so instead of ranking arms by their means.

The Student t distribution is implemented here (regularized incomplete beta by continued
fraction) so scipy is not a dependency; the tests compare it with scipy.stats.t.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def _betacf(a: float, b: float, x: float) -> float:
  """Continued fraction of the incomplete beta function (modified Lentz)."""
  tiny, eps = 1e-300, 1e-15
  qab, qap, qam = a + b, a + 1.0, a - 1.0
  c, d = 1.0, 1.0 - qab * x / qap
  d = 1.0 / (d if abs(d) > tiny else tiny)
  h = d
  for m in range(1, 10_000):
    m2 = 2 * m
    aa = m * (b - m) * x / ((qam + m2) * (a + m2))
    d = 1.0 + aa * d
    d = 1.0 / (d if abs(d) > tiny else tiny)
    c = 1.0 + aa / c
    c = c if abs(c) > tiny else tiny
    h *= d * c
    aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
    d = 1.0 + aa * d
    d = 1.0 / (d if abs(d) > tiny else tiny)
    c = 1.0 + aa / c
    c = c if abs(c) > tiny else tiny
    delta = d * c
    h *= delta
    if abs(delta - 1.0) < eps:
      break
  return h


def betainc(a: float, b: float, x: float) -> float:
  """Regularized incomplete beta I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
  if not 0.0 <= x <= 1.0:
    raise ValueError(f"betainc needs 0 <= x <= 1; got {x=}.")
  if x in (0.0, 1.0):
    return x
  log_front = (
    math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
  )
  if x < (a + 1.0) / (a + b + 2.0):
    return math.exp(log_front) * _betacf(a, b, x) / a
  return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
  """P(T <= t) for Student's t with `df` > 0 degrees of freedom."""
  if df <= 0:
    raise ValueError(f"degrees of freedom must be positive; got {df=}.")
  if math.isnan(t):
    return float("nan")
  if math.isinf(t):
    return 1.0 if t > 0 else 0.0
  tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
  return 1.0 - tail if t > 0 else tail


def t_sf_two_sided(t: float, df: float) -> float:
  """P(|T| >= |t|): the two-sided p-value of a t statistic."""
  if math.isnan(t):
    return float("nan")
  if math.isinf(t):
    return 0.0
  return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_ppf(q: float, df: float) -> float:
  """The q-quantile of Student's t (bisection on `t_cdf` to about 1e-12)."""
  if not 0.0 < q < 1.0:
    raise ValueError(f"quantile level must be in (0, 1); got {q=}.")
  if q == 0.5:
    return 0.0
  if q < 0.5:
    return -t_ppf(1.0 - q, df)
  lo, hi = 0.0, 1.0
  while t_cdf(hi, df) < q:
    hi *= 2.0
    if hi > 1e12:
      return float("inf")
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if t_cdf(mid, df) < q:
      lo = mid
    else:
      hi = mid
    if hi - lo <= 1e-12 * max(1.0, hi):
      break
  return 0.5 * (lo + hi)


def _clean(values: Sequence[float]) -> np.ndarray:
  v = np.asarray(list(values), np.float64).reshape(-1)
  return v[np.isfinite(v)]


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> dict[str, float]:
  """Mean and a two-sided t confidence interval over seeds.

  Non-finite values are dropped (and counted out of n). Returns {"mean", "std" (sample, ddof 1),
  "sem", "half_width", "lo", "hi", "n"}; with n < 2 the interval is NaN (one seed carries no
  information about seed-to-seed variation) and with n = 0 everything is NaN.
  """
  v = _clean(values)
  n = int(v.size)
  nan = float("nan")
  if n == 0:
    return {"mean": nan, "std": nan, "sem": nan, "half_width": nan, "lo": nan, "hi": nan, "n": 0}
  mean = float(v.mean())
  if n < 2:
    return {"mean": mean, "std": nan, "sem": nan, "half_width": nan, "lo": nan, "hi": nan, "n": 1}
  std = float(v.std(ddof=1))
  sem = std / math.sqrt(n)
  half = t_ppf(0.5 + confidence / 2.0, n - 1) * sem
  return {
    "mean": mean,
    "std": std,
    "sem": sem,
    "half_width": half,
    "lo": mean - half,
    "hi": mean + half,
    "n": n,
  }


def paired_difference(
  arm: Sequence[float], baseline: Sequence[float], confidence: float = 0.95
) -> dict[str, float]:
  """Paired differences arm - baseline over matched seeds, with a two-sided paired t-test.

  Args:
    arm, baseline: values at the same seeds, in the same order (pairs with a non-finite member
      are dropped).

  Returns mean_ci of the differences plus "t", "p" and "zero_spread". With n < 2, or when every
  difference is the same (zero spread: the t statistic is undefined), t and p are NaN; `verdict`
  then reports the exact sign-test probability instead.
  """
  a = np.asarray(list(arm), np.float64)
  b = np.asarray(list(baseline), np.float64)
  if a.shape != b.shape:
    raise ValueError(f"Paired values need equal lengths; got {a.size} and {b.size}.")
  keep = np.isfinite(a) & np.isfinite(b)
  d = a[keep] - b[keep]
  out = mean_ci(d, confidence)
  n = out["n"]
  out["zero_spread"] = bool(n >= 2 and out["sem"] == 0.0)
  if n < 2 or out["zero_spread"]:
    out.update(t=float("nan"), p=float("nan"))
  else:
    t = out["mean"] / out["sem"]
    out.update(t=t, p=t_sf_two_sided(t, n - 1))
  return out


def verdict(
  diff: dict[str, float],
  metric: str,
  arm: str,
  baseline: str = "transformer",
  higher_is_better: bool | None = None,
  alpha: float = 0.05,
) -> str:
  """One sentence that states what a `paired_difference` result supports, and no more.

  "Better"/"worse" is said only when `higher_is_better` is given and p < alpha; otherwise the
  sentence says "higher"/"lower" or that no difference was detected, and names the seed count.
  """
  n, mean, p = diff.get("n", 0), diff.get("mean", float("nan")), diff.get("p", float("nan"))
  if n == 0:
    return f"{metric}: no paired seeds for {arm} and {baseline}."
  if n < 2:
    return (
      f"{metric}: one paired seed only ({arm} - {baseline} = {mean:+.4g}); "
      "no significance test is possible."
    )
  ci = f"{mean:+.4g} [{diff['lo']:+.4g}, {diff['hi']:+.4g}]"
  if diff.get("zero_spread"):
    if mean == 0:
      return f"{metric}: {arm} and {baseline} are identical at all n={n} seeds."
    sign_p = 2.0 ** (1 - n)
    return (
      f"{metric}: {arm} - {baseline} = {mean:+.4g} at every one of n={n} seeds (no spread, "
      f"so no t-test; a two-sided sign test gives p={sign_p:.2g})."
    )
  if not (p < alpha):
    return (
      f"{metric}: no significant difference between {arm} and {baseline} at n={n} seeds "
      f"(difference {ci}, p={p:.2g})."
    )
  direction = "higher" if mean > 0 else "lower"
  if higher_is_better is None:
    judged = direction
  else:
    judged = "better" if (mean > 0) == higher_is_better else "worse"
    judged = f"{judged} ({direction})"
  small = "; two seeds make this a lead to re-test, not a result" if n == 2 else ""
  return (
    f"{metric}: {arm} is {judged} than {baseline} (difference {ci}, p={p:.2g}, n={n} seeds{small})."
  )
