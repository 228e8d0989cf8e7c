"""The noise-cancelling toy reproduces its published table and the λ study is consistent."""

import numpy as np
import pytest

from diffjax.eval import toy

# The published table (one query row, needle at index 0, gap 3, sigma 1, λ = 0.8, 1,000 draws):
# (n, rho) -> (share single, share diff, needle weight single, needle weight diff); None where
# the table does not print the value.
PUBLISHED = {
  (32, 0.0): (0.324, 0.274, 0.324, 0.300),
  (32, 0.5): (0.324, 0.329, 0.324, 0.299),
  (32, 0.9): (0.324, 0.468, 0.324, 0.299),
  (32, 0.99): (0.324, 0.620, 0.324, 0.299),
  (128, 0.9): (0.121, 0.246, None, None),
  (512, 0.9): (0.036, 0.087, None, None),
  (2048, 0.9): (0.010, 0.025, None, None),
  (8192, 0.9): (0.002, 0.007, None, None),
}


@pytest.mark.parametrize("n,rho", sorted(PUBLISHED))
def test_reproduces_the_published_table(n, rho):
  r = toy.trial(n, rho)
  got = (r.share_single, r.share_diff, r.weight_single, r.weight_diff)
  for name, want, value in zip(
    ("share single", "share diff", "weight single", "weight diff"), PUBLISHED[(n, rho)], got
  ):
    if want is not None:
      assert round(value, 3) == want, (n, rho, name, value, want)


def test_matches_a_float64_numpy_loop():
  # Row by row in NumPy float64, the way the toy is defined, on a smaller setting.
  n, rho, lam, num = 64, 0.7, 0.8, 50
  noise = toy.draws(n, num)
  shares = []
  for c, e in noise:
    z1 = c.copy()
    z1[0] += 3.0
    z2 = rho * c + np.sqrt(1 - rho**2) * e
    a1 = np.exp(z1 - z1.max()) / np.exp(z1 - z1.max()).sum()
    a2 = np.exp(z2 - z2.max()) / np.exp(z2 - z2.max()).sum()
    d = a1 - lam * a2
    shares.append((a1[0] / a1.sum(), abs(d[0]) / np.abs(d).sum(), d[0]))
  want = np.mean(shares, axis=0)
  r = toy.trial(n, rho, lam=lam, num_draws=num)
  np.testing.assert_allclose([r.share_single, r.share_diff, r.weight_diff], want, rtol=1e-5)


def test_lambda_study_orders_the_choices():
  s = toy.lambda_study(32, 0.9, num_draws=200, grid=101)
  # The best single λ is at least as good as λ = 0.8 and as λ = 0 (the single map); a per-row
  # λ is at least as good as any single λ, and a wider range at least as good as [0, 1].
  assert s.best_single >= max(s.fixed, s.single_map) - 1e-6
  assert s.per_row_unit >= s.best_single - 1e-6
  assert s.per_row >= s.per_row_unit - 1e-6
  assert 0.0 <= s.best_single_lambda <= 2.0
  # With independent noise (rho = 0), λ = 0.8 hurts: the table's first row.
  assert toy.lambda_study(32, 0.0, num_draws=200, grid=101).fixed < s.single_map
