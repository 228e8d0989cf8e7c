"""diffjax.eval.stats: the t distribution, confidence intervals, paired tests and the verdicts
they support, on known data."""

from __future__ import annotations

import math

import numpy as np
import pytest

from diffjax.eval import stats

# flax warns about its own deprecated metadata names when models are built; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_t_distribution_matches_scipy():
  st = pytest.importorskip("scipy.stats")
  for df in (1, 2, 3, 7, 30):
    for t in (-6.0, -1.3, 0.0, 0.7, 2.5, 12.0):
      assert stats.t_cdf(t, df) == pytest.approx(st.t.cdf(t, df), abs=1e-11)
    for q in (0.6, 0.9, 0.975, 0.995):
      assert stats.t_ppf(q, df) == pytest.approx(st.t.ppf(q, df), rel=1e-8)


def test_confidence_interval_and_paired_test_on_known_data():
  st = pytest.importorskip("scipy.stats")
  x = [2.0, 4.0, 9.0, 5.0]
  ci = stats.mean_ci(x)
  lo, hi = st.t.interval(0.95, 3, loc=np.mean(x), scale=st.sem(x))
  assert (ci["mean"], ci["n"]) == (5.0, 4)
  assert ci["lo"] == pytest.approx(lo, rel=1e-9) and ci["hi"] == pytest.approx(hi, rel=1e-9)
  # Hand check without scipy: t_{0.975, 3} = 3.182446305284263.
  assert ci["half_width"] == pytest.approx(3.182446305284263 * np.std(x, ddof=1) / 2, rel=1e-9)
  arm, base = [3.10, 3.05, 3.20, 3.00], [3.15, 3.12, 3.22, 3.07]
  d = stats.paired_difference(arm, base)
  ref = st.ttest_rel(arm, base)
  assert d["t"] == pytest.approx(ref.statistic, rel=1e-9) and d["p"] == pytest.approx(
    ref.pvalue, rel=1e-8
  )
  assert d["mean"] == pytest.approx(-0.0525)
  one = stats.mean_ci([1.5])
  assert one["mean"] == 1.5 and math.isnan(one["half_width"])
  assert stats.mean_ci([])["n"] == 0 and stats.mean_ci([1.0, float("nan"), 3.0])["n"] == 2


def test_verdicts_claim_only_what_the_numbers_support():
  noisy = stats.paired_difference([3.0, 3.2], [3.1, 3.05])
  text = stats.verdict(noisy, "val/loss", "diff_v1", higher_is_better=False)
  assert "no significant difference" in text and "n=2" in text
  clear = stats.paired_difference([2.90, 2.91, 2.89, 2.90, 2.92], [3.00, 3.02, 2.99, 3.01, 3.01])
  text = stats.verdict(clear, "val/loss", "diff_v1", higher_is_better=False)
  assert "better (lower)" in text and "n=5" in text
  assert "better" not in stats.verdict(clear, "outliers/top1", "diff_v1", higher_is_better=None)
  assert "worse" in stats.verdict(clear, "retrieval/mean", "diff_v1", higher_is_better=True)
  same = stats.paired_difference([1.0, 0.0], [0.0, -1.0])  # +1 at both seeds: no spread
  text = stats.verdict(same, "retrieval/mean", "diff_v1", higher_is_better=True)
  assert "better" not in text and "p=0.5" in text and math.isnan(same["p"])
  assert "one paired seed" in stats.verdict(stats.paired_difference([1.0], [0.5]), "m", "diff_v2")
