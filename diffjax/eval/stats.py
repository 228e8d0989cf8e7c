"""Statistics over seeds: t confidence intervals, paired t-tests, and verdicts in words.

Why arms are paired by seed and what n seeds can show: docs/evaluation.md#the-report. The t
distribution and the paired t-test are scipy.stats's.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import scipy.stats

from diffjax import arms


def t_cdf(t: float, df: float) -> float:
  """P(T <= t) for Student's t with `df` > 0 degrees of freedom."""
  if df <= 0:
    raise ValueError(f"degrees of freedom must be positive; got {df=}.")
  return float(scipy.stats.t.cdf(t, df))


def t_ppf(q: float, df: float) -> float:
  """The q-quantile of Student's t with `df` > 0 degrees of freedom."""
  if not 0.0 < q < 1.0:
    raise ValueError(f"quantile level must be in (0, 1); got {q=}.")
  if df <= 0:
    raise ValueError(f"degrees of freedom must be positive; got {df=}.")
  return float(scipy.stats.t.ppf(q, df))


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
    with warnings.catch_warnings():
      # Nearly equal differences at every seed make scipy warn of precision loss; the interval
      # and the verdict already show how narrow they are.
      warnings.filterwarnings("ignore", "Precision loss", RuntimeWarning)
      test = scipy.stats.ttest_rel(a[keep], b[keep])
    out.update(t=float(test.statistic), p=float(test.pvalue))
  return out


def verdict(
  diff: dict[str, float],
  metric: str,
  arm: str,
  baseline: str = arms.BASELINE,
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
