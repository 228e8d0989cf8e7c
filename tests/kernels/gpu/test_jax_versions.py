"""The fused GPU training kernels on a jax whose Mosaic GPU refuses their register stores
(jax 0.12): compiled, they refuse naming why, so dispatch runs the stock path; interpreted, they
still run (the CPU tests check their arithmetic on every jax)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from diffjax import compat
from diffjax.kernels.gpu import mosaic, mosaic_gda


def test_versions_read_as_numbers():
  # jax's four-part post-release versions compare as their release.
  assert compat.version_tuple("0.12.0.1") == (0, 12, 0) > compat.version_tuple("0.11.2")
  assert compat.version_tuple("0.10.2") == (0, 10, 2)


def test_compiled_training_kernels_refuse_and_interpreted_ones_do_not(monkeypatch):
  monkeypatch.setattr(compat, "MOSAIC_GPU_TRAINING_REFUSAL", "a refusal for the test")
  b, t, d = 1, 64, 32
  x = jnp.ones((b, t, 2, d), jnp.bfloat16)
  lam = jnp.full((b, 1, t), 0.5, jnp.float32).transpose(0, 2, 1)
  k = jnp.ones((b, t, 1, d), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="a refusal for the test"):
    mosaic.diff_v2_pallas_gpu(x, k, k, lam)
  with pytest.raises(NotImplementedError, match="a refusal for the test"):
    mosaic_gda.gda_v2_pallas_gpu(x[:, :, :1], x[:, :, :1], k, k, lam)
  # Interpreted, the same inputs are taken (the kernel tests check what they compute).
  mosaic._refuse("v2", (x,), (k,), k, False, interpret=True)  # pylint: disable=protected-access
  with pytest.raises(NotImplementedError, match="a refusal for the test"):
    mosaic._refuse("v2", (x,), (k,), k, False, interpret=False)  # pylint: disable=protected-access
