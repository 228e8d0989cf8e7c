"""Evaluation suite: every metric on a constructed case with a known answer.

Array-level tests use hand-built inputs; model-level tests use one tiny model per arm (built
once per module) so the whole file stays fast on a CPU.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from diffjax.data import ByteTokenizer  # noqa: E402
from diffjax.data.tasks import (
  ANSWER,
  CONTEXT,
  QUERY,
  SINK,
  AssociativeRecallTask,  # noqa: E402
  MultiNeedleTask,
)
from diffjax.eval import (
  evaluate,  # noqa: E402
  measures,  # noqa: E402
  report,  # noqa: E402
  stats,  # noqa: E402
)
from diffjax.model import DecoderLM, ModelConfig, matched_configs  # noqa: E402

# flax warns about its own deprecated metadata names when models are built; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOK = ByteTokenizer()


class _Filler:
  """A small in-memory filler source (no digits, so needles are the only numbers)."""

  name = "filler"

  def __init__(self):
    text = (
      "the quick brown fox jumps over the lazy dog while a river runs past the old mill "
      "and nobody writes any numbers down in this place at all "
    )
    self.docs = [TOK.encode(text * (i + 2)) for i in range(5)]

  def __len__(self):
    return len(self.docs)

  def __getitem__(self, i):
    return self.docs[i]


FILLER = _Filler()


# ----------------------------------------------------------------------------------------------
# Retrieval scoring with hand-written "models".


def _oracle(sequences, wrong=(), vocab=258):
  """A causal 'model' that continues any prefix of a known sequence with its next token.

  `wrong` lists (sequence index, position) pairs where it predicts a wrong token instead.
  """
  seqs = [np.asarray(s) for s in sequences]
  bad = set(wrong)

  def fn(tokens, *unused):
    tokens = np.asarray(tokens)
    out = np.zeros(tokens.shape + (vocab,), np.float32)
    for b in range(tokens.shape[0]):
      for t in range(tokens.shape[1]):
        nxt = 0
        for i, s in enumerate(seqs):
          if t + 1 < s.size and np.array_equal(s[: t + 1], tokens[b, : t + 1]):
            nxt = int(s[t + 1])
            if (i, t + 1) in bad:
              nxt = (nxt + 1) % 256
            break
        out[b, t, nxt] = 1.0
    return out

  return fn


def _perfect(tokens, *unused):
  """Teacher-forced oracle: puts all mass on the true next token."""
  tokens = np.asarray(tokens)
  out = np.zeros(tokens.shape + (258,), np.float32)
  b, t = np.indices(tokens[:, 1:].shape)
  out[b, t, tokens[:, 1:]] = 1.0
  return out


def _wrong(tokens, *unused):
  return np.roll(_perfect(tokens), 1, axis=-1)


def test_perfect_model_scores_one_and_wrong_model_scores_zero():
  task = MultiNeedleTask(400, 4, 2, num_examples=5, seed=2, filler=FILLER)
  assert evaluate.retrieval_accuracy(_perfect, task, batch_size=2)["accuracy"] == 1.0
  res = evaluate.retrieval_accuracy(_wrong, task, batch_size=2)
  assert res["accuracy"] == 0.0 and res["all_correct"] == 0.0 and res["num_answers"] == 10
  mq = AssociativeRecallTask(num_pairs=6, num_queries=2, num_examples=3)
  assert evaluate.retrieval_accuracy(_perfect, mq)["accuracy"] == 1.0


def test_one_wrong_digit_fails_only_its_answer():
  task = MultiNeedleTask(300, 2, 2, num_examples=2, seed=0, filler=FILLER)
  batch = task.batch()
  logits = _perfect(batch["tokens"])
  pos = np.flatnonzero(batch["answer_segments"][0] == 1)[3]  # 4th digit of answer 1, example 0
  logits[0, pos - 1] = np.roll(logits[0, pos - 1], 1)
  correct, present = measures.answer_exact_match(logits, batch["tokens"], batch["answer_segments"])
  np.testing.assert_array_equal(correct, [[True, False], [True, True]])
  acc = measures.retrieval_accuracy(correct, present)
  assert acc["accuracy"] == 0.75 and acc["all_correct"] == 0.5


def test_teacher_forced_exact_match_equals_greedy_decoding():
  task = MultiNeedleTask(160, 1, 1, num_examples=3, seed=1, num_digits=4, filler=FILLER)
  batch = task.batch()
  seqs = batch["tokens"]
  ans = [np.flatnonzero(batch["answer_segments"][b] >= 0) for b in range(3)]
  # Example 0 right, example 1 wrong at its first digit, example 2 wrong at its last digit.
  fn = _oracle(seqs, wrong=[(1, int(ans[1][0])), (2, int(ans[2][-1]))])
  tf, present = measures.answer_exact_match(fn(seqs), seqs, batch["answer_segments"])
  greedy, present_g = evaluate.greedy_exact_match(fn, batch)
  np.testing.assert_array_equal(tf[:, 0], [True, False, False])
  np.testing.assert_array_equal(tf, greedy)
  np.testing.assert_array_equal(present, present_g)


def test_needle_table_and_heatmap_shapes_and_values():
  table = evaluate.needle_table(
    _perfect,
    300,
    grid=((1, 1), (2, 2), (6, 2)),
    samples_per_depth=1,
    depths=(0.0, 1.0),
    filler=FILLER,
  )
  assert table["cells"] == {"N1_R1": 1.0, "N2_R2": 1.0} and "N6_R2" in table["skipped"]
  heat = evaluate.retrieval_heatmap(
    _wrong,
    [120, 200, 300],
    depths=(0.0, 0.5),
    num_needles=1,
    num_queries=1,
    samples_per_cell=2,
    filler=FILLER,
  )
  assert heat["lengths"] == [200, 300] and heat["skipped_lengths"] == [120]
  assert np.asarray(heat["accuracy"]).shape == (2, 2) and heat["mean"] == 0.0


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


# ----------------------------------------------------------------------------------------------
# Statistics.


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


# ----------------------------------------------------------------------------------------------
# Tiny models. Every model-level test uses T = 256 and batch 2, so the compiled functions of
# the shared runners are reused across tests.

_BASE = ModelConfig(
  attention="transformer",
  d_model=32,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  mlp_dim=64,
)
T = 256


def _fast_model(cfg: ModelConfig, seed: int) -> DecoderLM:
  """A model with numpy-drawn parameters: building it compiles nothing (eager init would)."""
  model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(seed)
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Variable):
      name = str(path[-1])
      if "scale" in name:
        value = np.ones(node.shape)
      elif name.startswith("lambda_"):
        value = rng.normal(0.0, 0.1, node.shape)
      else:
        value = rng.normal(0.0, 0.3 if name in ("q", "k") else 0.05, node.shape)
      node.set_value(jnp.asarray(value, jnp.float32))
  if cfg.attention == "diff_v1":
    # lambda = exp(0.833) - exp(0) + lambda_init ~ 1.5: A1 - lambda A2 has many negative entries.
    c = math.sqrt(0.833 / cfg.head_dim)
    for block in model.blocks:
      for name, v in (("lambda_q1", c), ("lambda_k1", c), ("lambda_q2", 0.0), ("lambda_k2", 0.0)):
        getattr(block.attn, name).set_value(jnp.full((cfg.head_dim,), v, jnp.float32))
  return model


@pytest.fixture(scope="module")
def runners():
  arms = matched_configs(_BASE)
  return {
    arm: evaluate.ModelRunner(_fast_model(cfg, i)) for i, (arm, cfg) in enumerate(arms.items())
  }


@pytest.fixture(scope="module")
def text_batches():
  """Two (2, T + 1) token batches of real text (inputs are (2, T))."""
  corpus = TOK.encode("def f(x):\n    return x * 2  # doubles\n" * 40)
  return [corpus[i * 600 : i * 600 + 2 * (T + 1)].reshape(2, T + 1) for i in range(2)]


@pytest.fixture(scope="module")
def needle_task():
  return MultiNeedleTask(T, 2, 1, num_examples=2, seed=0, filler=FILLER)


def test_weight_quantization_is_per_output_channel_and_leaves_the_original(runners):
  model = runners["diff_v1"].model
  q = evaluate.quantize_model_weights(model, 4)
  w = np.asarray(model.blocks[0].attn.o[...])  # (H, 2d, E): output axis last
  qw = np.asarray(q.blocks[0].attn.o[...])
  np.testing.assert_allclose(np.abs(qw).max(axis=(0, 1)), np.abs(w).max(axis=(0, 1)), rtol=1e-6)
  levels = qw / (np.abs(w).max(axis=(0, 1)) / 7)
  np.testing.assert_allclose(levels, np.round(levels), atol=1e-3)
  wq = np.asarray(model.blocks[1].attn.q[...])  # (E, H, 2, d): input axis first
  np.testing.assert_allclose(
    np.abs(np.asarray(q.blocks[1].attn.q[...])).max(0), np.abs(wq).max(0), rtol=1e-6
  )
  np.testing.assert_array_equal(q.embed.embedding[...], model.embed.embedding[...])
  np.testing.assert_array_equal(q.lm_head[...], model.lm_head[...])
  np.testing.assert_array_equal(
    np.asarray(q.blocks[0].attn.lambda_q1[...]), np.asarray(model.blocks[0].attn.lambda_q1[...])
  )
  assert not np.array_equal(np.asarray(model.blocks[0].attn.o[...]), qw)


def test_weight_quantization_is_the_same_for_scanned_and_unrolled_models():
  """The scanned model's stacked kernels are quantized per layer, its stacked norm gains and
  lambda vectors not at all: the result is the unrolled model's, stacked."""
  from flax import nnx

  from diffjax.model import DecoderLM, ModelConfig, layout

  cfg = ModelConfig(
    attention="diff_v1",
    vocab_size=40,
    d_model=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=40,
  )
  plain = nnx.to_pure_dict(
    nnx.state(
      evaluate.quantize_model_weights(DecoderLM(cfg, rngs=nnx.Rngs(params=0)), 4), nnx.Param
    )
  )
  scanned = nnx.to_pure_dict(
    nnx.state(
      evaluate.quantize_model_weights(
        DecoderLM(cfg.replace(scan_layers=True), rngs=nnx.Rngs(params=0)), 4
      ),
      nnx.Param,
    )
  )
  for a, b in zip(jax.tree.leaves(layout.stack_layers(plain)), jax.tree.leaves(scanned)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_knobs_off_match_the_plain_model_and_quantization_changes_it(runners, text_batches):
  tokens = text_batches[0][:, :-1]
  for arm in ("transformer", "diff_v2"):
    runner = runners[arm]
    plain = runner.logits_fn()(tokens)
    np.testing.assert_allclose(runner.knob_fn()(tokens), plain, atol=2e-5)
    np.testing.assert_allclose(runner.knob_fn(knobs={"logits_bits": 16})(tokens), plain, atol=1e-3)
    assert np.abs(runner.knob_fn(knobs={"logits_bits": 2})(tokens) - plain).max() > 1e-4
    assert np.abs(runner.knob_fn(knobs={"kv_bits": 2})(tokens) - plain).max() > 1e-4
  with pytest.raises(ValueError, match="Unknown knob"):
    runner.knob_fn(knobs={"bits": 4})


def test_validation_loss_matches_a_direct_computation(runners, text_batches):
  fn = runners["transformer"].logits_fn()
  res = evaluate.validation_loss(fn, text_batches)
  nll = []
  for tokens in text_batches:
    logits = fn(tokens[:, :-1]).astype(np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll.append(-np.take_along_axis(logp, tokens[:, 1:, None].astype(np.int64), -1))
  want = float(np.mean(np.concatenate(nll)))
  assert res["loss"] == pytest.approx(want, rel=1e-6) and res["tokens"] == 2 * 2 * T
  assert res["perplexity"] == pytest.approx(math.exp(want), rel=1e-6)
  # Pipeline-style dicts honour the loss mask.
  mask = np.zeros((2, 5), np.float32)
  mask[0, :3] = 1
  fake = lambda tokens, *unused: np.zeros(
    tokens.shape + (4,), np.float32
  )  # uniform: ln 4 per token
  batch = {
    "inputs": np.zeros((2, 5), np.int32),
    "targets": np.ones((2, 5), np.int32),
    "loss_mask": mask,
    "segment_ids": np.ones((2, 5), np.int32),
    "positions": np.tile(np.arange(5), (2, 1)),
  }
  res = evaluate.validation_loss(fake, [batch])
  assert res["tokens"] == 3 and res["loss"] == pytest.approx(math.log(4))


def test_clamp_probe_is_zero_for_softmax_and_moves_signed_attention(
  runners, text_batches, needle_task
):
  base = evaluate.clamp_probe(runners["transformer"], text_batches, needle_task, 2, batch_size=2)
  assert base["loss_delta"] == 0.0 and base["accuracy_delta"] == 0.0
  res = evaluate.clamp_probe(runners["diff_v1"], text_batches, needle_task, 2, batch_size=2)
  assert abs(res["loss_delta"]) > 1e-4 and math.isfinite(res["loss_clamped"])


def test_text_statistics_report_lambda_outliers_and_correlation(runners, text_batches):
  kw = dict(outlier_sample=1 << 12, probe_rows=4)  # the quick config's sizes: shared compiles
  runner = runners["diff_v1"]
  res = evaluate.text_statistics(runner, text_batches, **kw)
  lam = [float(b.attn.lambda_value()) for b in runner.model.blocks]
  np.testing.assert_allclose(res["lambda"]["layers"], lam, rtol=1e-6)
  np.testing.assert_allclose(res["lambda"]["lambda_init"], [0.2, 0.8 - 0.6 * math.exp(-0.3)])
  assert min(res["negative_mass"]) < -0.1  # lambda ~ 1.5 makes the maps signed
  # Top |attention logit| and |hidden| equal a direct search over every captured map.
  capture = nnx.jit(lambda m, t: m(t, capture=True)[1])
  best, hidden_best = 0.0, 0.0
  valid = measures.causal_valid_mask(T, T)
  for tokens in text_batches:
    for cap in capture(runner.model, jnp.asarray(tokens[:, :-1])):
      for name in ("logits1", "logits2"):
        best = max(best, float(np.abs(np.asarray(cap[name]))[..., valid].max()))
      hidden_best = max(hidden_best, float(np.abs(np.asarray(cap["hidden"])).max()))
  assert res["outliers"]["attention_logits"]["top1"] == pytest.approx(best, rel=1e-6)
  assert res["outliers"]["hidden"]["top1"] == pytest.approx(hidden_best, rel=1e-6)
  assert res["outliers"]["attention_logits"]["top100"] < best
  assert len(res["correlation"]["probs"]) == 2
  assert all(-1.0 <= c <= 1.0 for c in res["correlation"]["probs"] + res["correlation"]["logits"])
  v2 = evaluate.text_statistics(runners["diff_v2"], text_batches[:1], **kw)
  assert v2["lambda"]["kind"] == "sigmoid"
  for layer in v2["lambda"]["layers"]:
    assert 0.0 < layer["mean"] < 1.0
    assert sum(layer["histogram"]["counts"]) == 2 * T * _BASE.num_heads  # every token and pair
  tr = evaluate.text_statistics(runners["transformer"], text_batches[:1], **kw)
  assert tr["lambda"] == {"kind": "none"} and tr["correlation"]["kind"] == "head_pairs"
  assert max(tr["negative_mass"]) == 0.0


def test_attention_allocation_by_layer_on_a_real_model(runners, needle_task):
  for arm in ("transformer", "diff_v1"):
    res = evaluate.attention_allocation_by_layer(runners[arm], needle_task, 2, batch_size=2)
    assert len(res["layers"]) == 2 and res["regions"] == ["sink", "context", "answer", "query"]
    for layer in res["layers"]:
      assert sum(layer["signed_share"]) == pytest.approx(1.0, abs=1e-4)
      if arm == "transformer":
        np.testing.assert_allclose(layer["signed_share"], layer["abs_share"], atol=1e-6)
        assert layer["row_total"] == pytest.approx(1.0, abs=1e-5)
      else:  # signed maps: absolute mass exceeds the signed total
        assert sum(layer["absolute"]) > layer["row_total"] + 1e-3
    assert set(res["by_depth"]) <= {"0", "0.25", "0.5", "0.75", "1"}


def test_evaluate_model_end_to_end_and_cli(runners, text_batches, tmp_path, monkeypatch):
  cfg = evaluate.EvalConfig.quick(
    T,
    batch_size=2,
    capture_batch_size=2,
    samples_per_depth=1,
    depths=(0.0, 1.0),
    needle_grid=((1, 1), (2, 1)),
    heatmap_lengths=(T,),
    heatmap_needles=(2, 1),
    lowbit_bits=(4,),
    allocation_examples=2,
    mqar=dict(num_pairs=4, num_queries=2),
    mqar_examples=2,
  )
  out = evaluate.evaluate_model(
    runners["diff_v2"], text_batches, cfg, meta={"seed": 3}, filler=FILLER
  )
  assert out["schema"] == "diffjax.eval/1" and out["meta"]["arm"] == "diff_v2"
  # Every section but the recall grid, which runs only when cells are given (tested below).
  assert out["meta"]["seed"] == 3 and set(out["sections"]) == set(evaluate.SECTIONS) - {"mqar_grid"}
  s = out["scalars"]
  assert s["val/loss"] == out["sections"]["validation"]["loss"] > 0
  assert s["lowbit/float/loss"] == pytest.approx(s["val/loss"], rel=1e-4)
  for name in ("logits4", "w4a8", "kv4", "w4a8_kv4"):  # what quantizing adds to the float loss
    assert s[f"lowbit/{name}/loss_increase"] == pytest.approx(
      s[f"lowbit/{name}/loss"] - s["lowbit/float/loss"], abs=1e-6
    ), name
  assert "lowbit/float/loss_increase" not in s
  for key in (
    "retrieval/N1_R1",
    "heatmap/len256",
    "mqar/accuracy",
    "lowbit/logits4/loss",
    "lowbit/w4a8_kv4/loss",
    "allocation/answer_signed_share",
    "probe/clamp_loss_delta",
    "outliers/attention_logits_top1",
    "lambda/mean",
    "probe/map_correlation_mean",
  ):
    assert key in s and math.isfinite(s[key]), key
  json.loads(json.dumps(out))

  # The CLI on a run directory, with the checkpoint loader replaced by an in-memory model.
  from diffjax.eval import command
  from diffjax.train import loading

  run_config = {
    "seq_len": 64,
    "seed": 3,
    "data": {"kind": "stdlib", "max_documents": 60, "val_fraction": 0.2},
  }
  model = runners["transformer"].model
  monkeypatch.setattr(
    loading,
    "load_run",
    lambda workdir, step=None: loading.LoadedRun(model, model.config, run_config, 7),
  )
  dest = tmp_path / "eval.json"
  assert (
    command.main(
      [
        "--workdir",
        str(tmp_path),
        "--out",
        str(dest),
        "--quick",
        "--sections",
        "validation,retrieval",
        "--config.needle_grid=((1, 1),)",
        "--config.depths=(0.5,)",
        "--config.batch_size=2",
        "--config.val_batches=1",
      ]
    )
    == 0
  )
  written = json.loads(dest.read_text())
  assert written["meta"]["seed"] == 3 and written["meta"]["arm"] == "transformer"
  assert written["meta"]["step"] == 7
  assert set(written["sections"]) == {"validation", "retrieval"}
  assert written["sections"]["validation"]["tokens"] > 0


# ----------------------------------------------------------------------------------------------
# Report.


def _fake_eval(arm, seed, rng):
  """A synthetic eval JSON: diff_v1's loss is lower than the Transformer's by about 0.1 at every
  seed; diff_v2's differs by +0.02, -0.03, +0.015 (no consistent difference)."""
  shift = {
    "transformer": (0.0, 0.0, 0.0),
    "diff_v1": (-0.1, -0.095, -0.105),
    "diff_v2": (0.02, -0.03, 0.015),
  }[arm][seed]
  loss = 3.0 + 0.05 * seed + shift
  acc = float(
    np.clip(0.6 + (0.2 if arm != "transformer" else 0) + 0.05 * rng.standard_normal(), 0, 1)
  )
  lam_layers = [0.2 + 0.1 * i + 0.01 * seed for i in range(3)]
  sections = {
    "validation": {"loss": loss, "perplexity": math.exp(loss), "tokens": 100},
    "retrieval": {"context_len": 256, "cells": {"N1_R1": 1.0, "N4_R2": acc}, "mean": (1 + acc) / 2},
    "heatmap": {
      "lengths": [256, 512],
      "depths": [0.0, 0.5, 1.0],
      "needles": [4, 1],
      "accuracy": rng.random((3, 2)).tolist(),
      "mean_by_length": [0.5, 0.4],
      "mean": 0.45,
    },
    "allocation": {
      "regions": ["sink", "context", "answer", "query"],
      "summary": {"signed_share": [0.2, 0.5, 0.1, 0.2], "abs_share": [0.2, 0.5, 0.1, 0.2]},
      "layers": [],
    },
    "text": {
      "lambda": (
        {"kind": "scalar", "layers": lam_layers, "lambda_init": [0.2, 0.36, 0.47]}
        if arm == "diff_v1"
        else {
          "kind": "sigmoid",
          "layers": [{"mean": 0.5, "quantiles": {"0.05": 0.3, "0.95": 0.7}}] * 3,
        }
        if arm == "diff_v2"
        else {"kind": "none"}
      )
    },
    "lowbit": {
      "float": {"loss": loss, "accuracy": acc},
      "logits8": {"loss": loss + 0.01, "accuracy": acc},
      "logits4": {"loss": loss + (0.5 if arm == "transformer" else 0.1), "accuracy": acc},
    },
  }
  from diffjax.eval.evaluate import scalars_from_sections

  sections_for_scalars = {k: v for k, v in sections.items() if k != "text"}
  sections_for_scalars["allocation"] = sections["allocation"]
  return {
    "schema": "diffjax.eval/1",
    "meta": {"arm": arm, "seed": seed},
    "sections": sections,
    "scalars": scalars_from_sections(sections_for_scalars),
  }


def test_report_writes_markdown_and_plots_from_synthetic_results(tmp_path):
  rng = np.random.default_rng(0)
  run_dirs = []
  for arm in ("transformer", "diff_v1", "diff_v2"):
    for seed in range(3):
      d = tmp_path / f"{arm}_s{seed}"
      d.mkdir()
      (d / "eval.json").write_text(json.dumps(_fake_eval(arm, seed, rng)))
      with open(d / "metrics.jsonl", "w") as f:
        for step in range(0, 100, 10):
          row = {"step": step, "train/loss": 4.0 - step / 50 + 0.01 * seed}
          if step % 50 == 0:
            row["eval/loss"] = row["train/loss"] + 0.05
          f.write(json.dumps(row) + "\n")
        f.write("not json\n")
      run_dirs.append(str(d))
  runs = report.load_results(run_dirs)
  assert len(runs) == 9 and runs[0]["curve"][1]["step"] == 10
  agg = report.aggregate(runs)
  d1 = agg["paired"]["diff_v1"]["val/loss"]
  assert d1["n"] == 3 and d1["mean"] == pytest.approx(-0.1, abs=0.02) and d1["p"] < 0.05
  out = tmp_path / "report"
  path = report.write_report(runs, str(out))
  text = open(path).read()
  assert "| val/loss |" in text and "± " in text and "(n=3)" in text
  assert "val/loss: diff_v1 is better (lower) than transformer" in text
  assert "val/loss: no significant difference between diff_v2 and transformer at n=3 seeds" in text
  assert "| transformer | 1 |" in text  # the (N, R) table row
  for name in (
    "loss_curves.png",
    "retrieval_heatmap.png",
    "allocation.png",
    "lambda.png",
    "lowbit.png",
  ):
    data = (out / name).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    assert f"]({name})" in text
  # Runs without a Transformer: no paired claims.
  solo = report.write_report([r for r in runs if r["arm"] == "diff_v1"], str(tmp_path / "solo"))
  assert "no paired comparisons" in open(solo).read()


def test_report_curve_has_one_row_per_step_after_a_resume(tmp_path):
  # A resumed run's metrics.jsonl may repeat the steps trained again; the later line counts.
  (tmp_path / "eval.json").write_text(
    json.dumps(_fake_eval("diff_v1", 0, np.random.default_rng(0)))
  )
  lines = [
    {"step": 1, "train/loss": 3.0},
    {"step": 2, "train/loss": 2.9},
    {"step": 2, "eval/loss": 3.1},
    {"step": 2, "train/loss": 2.5},
    {"step": 3, "train/loss": 2.4},
  ]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
  curve = report.load_results([str(tmp_path)])[0]["curve"]
  assert [r["step"] for r in curve] == [1, 2, 3]
  assert curve[1] == {"step": 2, "train/loss": 2.5, "eval/loss": 3.1}


def test_report_places_the_preamble_between_the_title_and_the_runs(tmp_path):
  runs = [
    {
      "arm": arm,
      "seed": 0,
      "name": arm,
      "eval": _fake_eval(arm, 0, np.random.default_rng(0)),
      "curve": None,
    }
    for arm in ("transformer", "diff_v1")
  ]
  preamble = ["## Comparison summary", "", "| arm | params |", "|---|---|", "| diff_v1 | 1 |"]
  text = open(report.write_report(runs, str(tmp_path), title="T", preamble=preamble)).read()
  assert text.startswith("# T\n\n## Comparison summary\n\n| arm | params |\n"), text[:200]
  assert text.index("| diff_v1 | 1 |") < text.index("## Runs") < text.index("## Summary")
  assert text.count("## Comparison summary") == 1


# ----------------------------------------------------------------------------------------------
# Associative recall by difficulty: the training mix, the grid, probes on the task (the tasks
# themselves: tests/data/test_data_tasks.py).


def test_task_only_training_data_and_its_errors():
  import ml_collections

  from diffjax.train.task_mix import TRAIN_SEED_OFFSET, mixed_source, task_only

  mix = ml_collections.ConfigDict(
    dict(
      task="associative_recall",
      fraction=1.0,
      num_pairs=8,
      num_queries=2,
      distractors_per_query=1,
      key_len=3,
      value_len=3,
      grid=((4, 0), (8, 2)),
      num_examples=6,
      context_len=0,
      num_needles=0,
    )
  )
  assert task_only(mix)
  src = mixed_source(None, mix, TOK, seed=1)
  assert len(src) == 6 and src.seed == TRAIN_SEED_OFFSET + 1
  # No leakage: no training example equals an example of the evaluation grid's seeds.
  evals = {
    TOK.decode(evaluate.AssociativeRecallTask(p, min(4, p), d, num_examples=20, seed=s)[i])
    for s in range(1234, 1234 + 120)
    for p, d in ((4, 0), (8, 2))
    for i in range(2)
  }
  assert not evals & {TOK.decode(src[i]) for i in range(6)}
  mix.num_examples = 0
  with pytest.raises(ValueError, match="num_examples"):
    mixed_source(None, mix, TOK, seed=1)
  mix.task, mix.num_examples = "multi_needle", 4
  with pytest.raises(ValueError, match="fraction below 1"):
    mixed_source(None, mix, TOK, seed=1)


def test_recall_grid_scores_each_cell_and_names_it():
  grid = (dict(num_pairs=4, distractors_per_query=0), dict(num_pairs=8, distractors_per_query=2))
  res = evaluate.associative_recall_grid(_perfect, grid, num_examples=3, seed=5, batch_size=2)
  assert res["order"] == ["P4_D0", "P8_D2"]
  assert all(res["cells"][c]["accuracy"] == 1.0 for c in res["order"])
  assert res["cells"]["P8_D2"]["sequence_len"] > res["cells"]["P4_D0"]["sequence_len"]
  wrong = evaluate.associative_recall_grid(_wrong, grid, num_examples=3, seed=5, batch_size=2)
  assert all(wrong["cells"][c]["accuracy"] == 0.0 for c in wrong["order"])
  with pytest.raises(ValueError, match="two cells named"):
    evaluate.associative_recall_grid(_perfect, grid + grid[:1], num_examples=1)
  with pytest.raises(ValueError, match="probe_task"):
    evaluate.EvalConfig(probe_task="text")
  with pytest.raises(ValueError, match="num_pairs"):
    evaluate.EvalConfig(mqar_grid=(dict(distractors_per_query=1),))


def test_probes_run_on_the_recall_task_when_asked(runners, text_batches):
  cfg = evaluate.EvalConfig.quick(
    T,
    batch_size=2,
    capture_batch_size=2,
    allocation_examples=2,
    mqar=dict(num_pairs=4, num_queries=2, distractors_per_query=1),
    mqar_examples=2,
    mqar_grid=(dict(num_pairs=2, distractors_per_query=1),),
    probe_task="mqar",
    lowbit_bits=(4,),
    sections=("mqar_grid", "allocation", "probes", "text"),
  )
  out = evaluate.evaluate_model(runners["diff_v1"], text_batches, cfg)
  assert out["meta"]["probe_task"].startswith("mqar(P=4,Q=2,D=1")
  s = out["scalars"]
  assert 0.0 <= s["mqar_grid/P2_D1"] <= 1.0 and s["mqar_grid/mean"] == s["mqar_grid/P2_D1"]
  assert math.isfinite(s["allocation/answer_signed_share"])
  # Associative recall places no needle at a depth, so allocation has one group.
  assert out["sections"]["allocation"]["by_depth"].keys() == {"none"}
  per_head = out["sections"]["text"]["correlation"]["probs_per_head"]
  assert len(per_head) == 2 and all(len(h) == runners["diff_v1"].config.num_heads for h in per_head)
  layer0 = out["sections"]["text"]["correlation"]["probs"][0]
  assert np.nanmean(per_head[0]) == pytest.approx(layer0, abs=0.2)


def test_report_tables_and_plots_the_recall_grid(tmp_path):
  from diffjax.eval.evaluate import scalars_from_sections

  runs = []
  for arm, base in (("transformer", 0.5), ("diff_v1", 0.7)):
    for seed in range(3):
      cells, order = {}, []
      for p in (4, 16):
        for d in (0, 2):
          name = f"P{p}_D{d}"
          order.append(name)
          cells[name] = {
            "accuracy": base + 0.01 * seed - 0.1 * (p == 16),
            "all_correct": 0.0,
            "sequence_len": 10 * p,
            "settings": {"num_pairs": p, "distractors_per_query": d},
          }
      sec = {"mqar_grid": {"cells": cells, "order": order, "num_examples": 8}}
      runs.append(
        {
          "arm": arm,
          "seed": seed,
          "name": f"{arm}_s{seed}",
          "curve": None,
          "eval": {"sections": sec, "scalars": scalars_from_sections(sec)},
        }
      )
  path = report.write_report(runs, str(tmp_path))
  text = open(path).read()
  assert "## Associative recall by difficulty" in text
  row = next(l for l in text.splitlines() if l.startswith("| P16_D2 |"))
  assert "0.41 ± " in row and "+0.2 [+0.2, +0.2]" in row
  assert "](mqar_grid.png)" in text and (tmp_path / "mqar_grid.png").read_bytes()[:4] == b"\x89PNG"


def test_directions_of_training_and_low_bit_measures():
  from diffjax.eval.aggregate import direction

  assert direction("lowbit/kv4/loss_increase") is False  # less added loss is better
  assert direction("lowbit/kv4/loss") is False and direction("lowbit/kv4/accuracy") is True
  assert direction("train/steps_to_learn") is False and direction("train/learned") is True
  assert direction("probe/map_correlation_mean") is None  # descriptive
