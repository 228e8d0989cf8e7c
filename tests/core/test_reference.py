"""diffjax.core.reference, the plain-JAX math every fast path is tested against (public as
diffjax.ops.reference): the DIFF maps' rows against the NumPy float64 loops of tests/numpy_ops.py,
the merge of partial attentions over key ranges, and the grouped arms' split of the query heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from numpy_ops import check, np_probs, v1_inputs, v2_inputs

from diffjax.core import reference as ref


def test_diff_v1_rows_sum_to_one_minus_lambda_and_can_be_negative():
  rng = np.random.default_rng(11)
  b, t, kv, h, d = 2, 8, 1, 4, 8
  q1, q2, k1, k2, v = v1_inputs(rng, b, t, t, h, kv, d)
  lam_H = np.array([0.2, 0.5, 0.8, 1.1], np.float32)
  _, aux = ref.diff_v1_reference(q1, q2, k1, k2, v, lam_H, return_aux=True)
  p1, p2 = np.asarray(aux["probs1"], np.float64), np.asarray(aux["probs2"], np.float64)
  group = lambda hh: hh // (h // kv)
  check(p1, np_probs(q1, k1, group, causal=True))
  check(p2, np_probs(q2, k2, group, causal=True))
  combined = p1 - lam_H[None, :, None, None].astype(np.float64) * p2
  row_sums = combined.sum(-1)
  expected = np.broadcast_to((1.0 - lam_H.astype(np.float64))[None, :, None], row_sums.shape)
  np.testing.assert_allclose(row_sums, expected, atol=1e-5)
  # Signed attention: some entries are negative.
  assert combined.min() < -1e-3


def test_diff_v2_rows_sum_to_one_minus_lambda_per_token():
  rng = np.random.default_rng(12)
  b, t, kv, pairs, d = 2, 8, 1, 2, 8
  q, k, v, lam = v2_inputs(rng, b, t, t, pairs, kv, d)
  _, aux = ref.diff_v2_reference(q, k, v, lam, return_aux=True)
  combined = np.asarray(aux["probs1"], np.float64) - np.transpose(lam, (0, 2, 1))[..., None].astype(
    np.float64
  ) * np.asarray(aux["probs2"], np.float64)
  np.testing.assert_allclose(combined.sum(-1), 1.0 - np.transpose(lam, (0, 2, 1)), atol=1e-5)


def test_merge_partials_of_key_ranges_is_attention_over_all_keys():
  """Softmax attention over S keys equals the merge of its pieces' attentions over uneven
  key ranges, an empty range (log mass -inf) included; rows no piece saw are zero."""
  k = jax.random.split(jax.random.key(3), 2)
  logits = jax.random.normal(k[0], (2, 3, 11)) * 3.0  # [B, T, S]
  v = jax.random.normal(k[1], (2, 11, 5))  # [B, S, Dv]
  full = jnp.einsum("bts,bsd->btd", jax.nn.softmax(logits, -1), v)
  parts, mass = [], []
  for lo, hi in ((0, 4), (4, 4), (4, 5), (5, 11)):
    if lo == hi:  # a piece that saw no key: its output is 0, its mass -inf
      parts.append(jnp.zeros(full.shape))
      mass.append(jnp.full(full.shape[:-1], -jnp.inf))
      continue
    piece = logits[..., lo:hi]
    parts.append(jnp.einsum("bts,bsd->btd", jax.nn.softmax(piece, -1), v[:, lo:hi]))
    mass.append(jax.nn.logsumexp(piece, -1))
  merged = ref.merge_partials(jnp.stack(parts, 2), jnp.stack(mass, 2), axis=2)
  np.testing.assert_allclose(merged, full, rtol=1e-5, atol=1e-6)
  # Every piece empty: zeros, not NaN.
  none = ref.merge_partials(jnp.zeros((1, 2, 3, 5)), jnp.full((1, 2, 3), -jnp.inf), axis=1)
  assert np.array_equal(none, np.zeros((1, 3, 5)))


def test_split_groups_is_motifs_layout():
  q = jnp.arange(2 * 10).reshape(1, 1, 10, 2).astype(jnp.float32)  # 2 groups of 4 + 1
  signal, noise = ref.split_groups(q, 2)
  np.testing.assert_array_equal(signal[0, 0, :, 0], [0, 2, 4, 6, 10, 12, 14, 16])
  np.testing.assert_array_equal(noise[0, 0, :, 0], [8, 18])
