"""diffjax.eval.measures: every array measure on hand-built inputs with a known answer."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eval_cases import FILLER, perfect_model

from diffjax.data.tasks import ANSWER, CONTEXT, QUERY, SINK, MultiNeedleTask
from diffjax.eval import measures

# flax warns about its own deprecated metadata names when models are built; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# ----------------------------------------------------------------------------------------------
# Retrieval answers.


def test_one_wrong_digit_fails_only_its_answer():
  task = MultiNeedleTask(300, 2, 2, num_examples=2, seed=0, filler=FILLER)
  batch = task.batch()
  logits = perfect_model(batch["tokens"])
  pos = np.flatnonzero(batch["answer_segments"][0] == 1)[3]  # 4th digit of answer 1, example 0
  logits[0, pos - 1] = np.roll(logits[0, pos - 1], 1)
  correct, present = measures.answer_exact_match(logits, batch["tokens"], batch["answer_segments"])
  np.testing.assert_array_equal(correct, [[True, False], [True, True]])
  acc = measures.retrieval_accuracy(correct, present)
  assert acc["accuracy"] == 0.75 and acc["all_correct"] == 0.5


# ----------------------------------------------------------------------------------------------
# Attention allocation.


def test_attention_allocation_on_a_hand_built_map():
  # One example, keys: [sink, ctx, ctx, answer, answer, query]; one query row (t=5).
  regions = np.array([[SINK, CONTEXT, CONTEXT, ANSWER, ANSWER, QUERY]])
  rows = np.array([[False, False, False, False, False, True]])
  plain = np.zeros((1, 1, 6, 6))
  plain[0, 0, 5] = [0.1, 0.2, 0.1, 0.3, 0.2, 0.1]
  res = measures.attention_allocation(plain, rows, regions, 4)
  np.testing.assert_allclose(res["signed"][0], [0.1, 0.3, 0.5, 0.1])
  np.testing.assert_allclose(res["signed_share"][0], [0.1, 0.3, 0.5, 0.1])
  np.testing.assert_allclose(res["abs_share"][0], [0.1, 0.3, 0.5, 0.1])
  # A signed DIFF-like row: A1 - 0.5 A2 with negative context weights; total 0.5.
  a1 = np.array([0.1, 0.05, 0.05, 0.4, 0.3, 0.1])
  a2 = np.array([0.2, 0.3, 0.3, 0.0, 0.0, 0.2])
  diff = np.zeros((1, 1, 6, 6))
  diff[0, 0, 5] = a1 - 0.5 * a2  # [0, -0.1, -0.1, 0.4, 0.3, 0]
  res = measures.attention_allocation(diff, rows, regions, 4)
  np.testing.assert_allclose(res["signed"][0], [0.0, -0.2, 0.7, 0.0], atol=1e-12)
  np.testing.assert_allclose(res["absolute"][0], [0.0, 0.2, 0.7, 0.0], atol=1e-12)
  np.testing.assert_allclose(res["row_total"], [0.5])
  np.testing.assert_allclose(res["signed_share"][0], [0.0, -0.4, 1.4, 0.0], atol=1e-12)
  np.testing.assert_allclose(res["abs_share"][0], [0.0, 2 / 9, 7 / 9, 0.0], atol=1e-12)
  with pytest.raises(ValueError, match="No query rows"):
    measures.attention_allocation(diff, np.zeros_like(rows), regions, 4)


def test_combine_diff_maps_v1_scalar_and_v2_per_token():
  rng = np.random.default_rng(0)
  p1, p2 = rng.random((2, 2, 3, 4, 4))
  np.testing.assert_allclose(measures.combine_diff_maps(p1, p2, 0.8), p1 - 0.8 * p2, atol=1e-6)
  lam_BxTxH = rng.random((2, 4, 3))
  want = p1 - np.transpose(lam_BxTxH, (0, 2, 1))[..., None] * p2
  np.testing.assert_allclose(measures.combine_diff_maps(p1, p2, lam_BxTxH), want, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Outliers and quantization.


def test_outlier_stats_on_a_known_array():
  x = np.arange(1, 1002, dtype=np.float64) * np.where(np.arange(1001) % 2, -1, 1)
  out = measures.outlier_stats(x.reshape(7, 11, 13))
  assert out["top1"] == 1001 and out["top100"] == 902 and out["median"] == 501
  acc = measures.OutlierAccumulator(ks=(1, 100))
  for chunk in np.array_split(x, 9):
    acc.add(chunk)
  res = acc.result()
  assert (res["top1"], res["top100"], res["median"], res["exact_median"]) == (1001, 902, 501, True)
  sampled = measures.OutlierAccumulator(ks=(1, 100), max_sample=50)
  for chunk in np.array_split(x, 4):
    sampled.add(chunk)
  res = sampled.result()
  assert res["top1"] == 1001 and res["top100"] == 902 and not res["exact_median"]
  assert 300 < res["median"] < 700
  masked = measures.OutlierAccumulator(ks=(1,))
  masked.add(np.array([[5.0, -100.0], [2.0, 3.0]]), mask=np.array([[True, False], [True, True]]))
  assert masked.result()["top1"] == 5.0


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("axis", [None, -1, 0, (0, 1)])
def test_absmax_quantizer_error_is_within_its_bound(bits, axis):
  x = np.random.default_rng(bits).standard_normal((6, 5, 8)).astype(np.float32) * 3
  q = measures.quantize_absmax(x, bits, axis=axis)
  bound = measures.absmax_error_bound(x, bits, axis=axis)
  assert q.dtype == x.dtype and q.shape == x.shape
  assert np.all(np.abs(x - q) <= bound * (1 + 1e-5) + 1e-7)
  assert np.abs(x - q).max() > 0
  # Values lie on the grid k * scale with |k| <= 2^(bits-1) - 1; the absmax is exact.
  qmax = 2 ** (bits - 1) - 1
  scale = np.max(np.abs(x), axis=axis, keepdims=True) / qmax
  k = q / scale
  np.testing.assert_allclose(k, np.round(k), atol=1e-3)
  assert np.abs(k).max() <= qmax + 1e-3
  np.testing.assert_allclose(np.max(np.abs(q), axis=axis), np.max(np.abs(x), axis=axis), rtol=1e-6)


def test_quantizer_16_bit_is_nearly_identity_and_zero_stays_zero():
  x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
  np.testing.assert_allclose(
    measures.quantize_absmax(x, 16, axis=-1), x, atol=np.abs(x).max() / 32767
  )
  assert not np.any(measures.quantize_absmax(np.zeros((3, 3), np.float32), 4))
  # Also on jax arrays, under jit, with a traced grid size (qmax 0 = off).
  xj = jnp.asarray(x)
  np.testing.assert_allclose(
    jax.jit(lambda a: measures.quantize_absmax(a, 4, axis=-1))(xj),
    measures.quantize_absmax(x, 4, axis=-1),
    rtol=1e-6,
  )
  np.testing.assert_array_equal(jax.jit(lambda a, qm: measures.fake_quant(a, qm))(xj, 0.0), x)


def test_w4_a8_kv4_helpers_use_their_granularity():
  rng = np.random.default_rng(1)
  w = rng.standard_normal((16, 8)).astype(np.float32)
  w[:, 3] *= 100.0  # one loud output channel must not coarsen the others
  qw = measures.quantize_weight_per_channel(w, 4)
  for j in range(8):
    assert np.abs(w[:, j] - qw[:, j]).max() <= np.abs(w[:, j]).max() / 7 / 2 * (1 + 1e-5)
  x = rng.standard_normal((2, 5, 16)).astype(np.float32)
  x[0, 0] *= 1000.0  # one loud token must not coarsen the others
  qx = measures.quantize_activation_per_token(x, 8)
  assert np.abs(x[1, 2] - qx[1, 2]).max() <= np.abs(x[1, 2]).max() / 127 / 2 * (1 + 1e-5)
  kv = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
  qkv = measures.quantize_kv_per_head_token(kv, 4)
  err = np.abs(kv - qkv).max(-1)
  assert np.all(err <= np.abs(kv).max(-1) / 7 / 2 * (1 + 1e-5))


def test_attention_logit_quantizer_ignores_masked_entries():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((1, 2, 5, 5)).astype(np.float32)
  valid = measures.causal_valid_mask(5, 5)
  loud = np.where(valid, x, 1e4).astype(np.float32)  # huge scores above the diagonal
  q_loud = measures.quantize_attention_logits(loud, 4, "head")
  q = measures.quantize_attention_logits(x, 4, "head")
  np.testing.assert_array_equal(q_loud[..., valid], q[..., valid])
  np.testing.assert_array_equal(q_loud[..., ~valid], loud[..., ~valid])
  scale = np.abs(np.where(valid, x, 0)).max(axis=(-2, -1), keepdims=True) / 7
  assert np.all(
    np.abs(q - x)[..., valid] <= (scale / 2 * (1 + 1e-5) + 1e-7).repeat(15).reshape(1, 2, 15)
  )
  row = measures.quantize_attention_logits(x, 4, "row")
  assert not np.array_equal(row, q)


# ----------------------------------------------------------------------------------------------
# Probes.


def test_clamp_negative_and_correlation_on_hand_built_maps():
  p = np.array([0.5, -0.2, 0.1, -0.0, 0.3])
  np.testing.assert_array_equal(measures.clamp_negative(p), [0.5, 0.0, 0.1, 0.0, 0.3])
  rng = np.random.default_rng(0)
  a1 = rng.random((1, 2, 3, 10))
  a2 = np.stack([3 * a1[:, 0] + 1, 2 - a1[:, 1]], axis=1)  # head 0: r = +1, head 1: r = -1
  keys = np.ones(a1.shape, bool)
  res = measures.map_correlation(a1, a2, keys)
  np.testing.assert_allclose(res["per_head"], [1.0, -1.0], atol=1e-12)
  assert res["mean"] == pytest.approx(0.0, abs=1e-12)
  # Noise shared only on non-salient keys: the top-k key differs wildly, the rest are equal.
  b1 = rng.random((1, 1, 1, 12))
  b2 = b1.copy()
  top = int(b1[0, 0, 0].argmax())
  b2[..., top] = -5.0
  sal = measures.salient_key_mask(b1, top_k=1)
  assert sal[0, 0, 0, top] and sal[0, 0, 0, -1]  # top-1 and the query's own position
  corr_all = measures.map_correlation(b1, b2, np.ones_like(sal))["mean"]
  corr_ns = measures.map_correlation(b1, b2, ~sal)["mean"]
  assert corr_ns == pytest.approx(1.0) and corr_all < 0.9
  # Rows with fewer than min_keys keys are skipped.
  few = measures.map_correlation(b1, b2, np.zeros_like(sal))
  assert few["rows_used"][0] == 0 and math.isnan(few["mean"])
  always = np.zeros((1, 12), bool)
  always[0, 0] = True
  assert measures.salient_key_mask(b1, 0, always)[0, 0, 0, 0]
  rows_sal = measures.salient_key_mask(b1, 0, row_positions_BxR=np.array([[4]]))
  assert rows_sal[0, 0, 0].tolist() == [i == 4 for i in range(12)]
