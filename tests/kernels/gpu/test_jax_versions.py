"""How diffjax reads jax's version (:mod:`diffjax.compat`), which the kernels and their tests
consult where jax versions differ."""

from __future__ import annotations

from diffjax import compat


def test_versions_read_as_numbers():
  # jax's four-part post-release versions compare as their release.
  assert compat.version_tuple("0.12.0.1") == (0, 12, 0) > compat.version_tuple("0.11.2")
  assert compat.version_tuple("0.10.2") == (0, 10, 2)
