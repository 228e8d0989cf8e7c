"""The package's own evaluation sections (diffjax.eval.sections) on constructed cases: the needle
table and heatmap, the recall grid, the clamp probe, the text statistics and the attention
allocation of a real model."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from eval_cases import BASE, FILLER, T, perfect_model, wrong_model
from flax import nnx

from diffjax.eval import evaluate, measures

# flax warns about its own deprecated metadata names when models are built; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_needle_table_and_heatmap_shapes_and_values():
  table = evaluate.needle_table(
    perfect_model,
    300,
    grid=((1, 1), (2, 2), (6, 2)),
    samples_per_depth=1,
    depths=(0.0, 1.0),
    filler=FILLER,
  )
  assert table["cells"] == {"N1_R1": 1.0, "N2_R2": 1.0} and "N6_R2" in table["skipped"]
  heat = evaluate.retrieval_heatmap(
    wrong_model,
    [120, 200, 300],
    depths=(0.0, 0.5),
    num_needles=1,
    num_queries=1,
    samples_per_cell=2,
    filler=FILLER,
  )
  assert heat["lengths"] == [200, 300] and heat["skipped_lengths"] == [120]
  assert np.asarray(heat["accuracy"]).shape == (2, 2) and heat["mean"] == 0.0


def test_recall_grid_scores_each_cell_and_names_it():
  grid = (dict(num_pairs=4, distractors_per_query=0), dict(num_pairs=8, distractors_per_query=2))
  res = evaluate.associative_recall_grid(perfect_model, grid, num_examples=3, seed=5, batch_size=2)
  assert res["order"] == ["P4_D0", "P8_D2"]
  assert all(res["cells"][c]["accuracy"] == 1.0 for c in res["order"])
  assert res["cells"]["P8_D2"]["sequence_len"] > res["cells"]["P4_D0"]["sequence_len"]
  wrong = evaluate.associative_recall_grid(wrong_model, grid, num_examples=3, seed=5, batch_size=2)
  assert all(wrong["cells"][c]["accuracy"] == 0.0 for c in wrong["order"])
  with pytest.raises(ValueError, match="two cells named"):
    evaluate.associative_recall_grid(perfect_model, grid + grid[:1], num_examples=1)
  with pytest.raises(ValueError, match="probe_task"):
    evaluate.EvalConfig(probe_task="text")
  with pytest.raises(ValueError, match="num_pairs"):
    evaluate.EvalConfig(mqar_grid=(dict(distractors_per_query=1),))


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
    assert sum(layer["histogram"]["counts"]) == 2 * T * BASE.num_heads  # every token and pair
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


def test_an_unsquashed_v2_lambda_is_reported_and_binned_over_its_own_range(text_batches):
  import dataclasses  # pylint: disable=import-outside-toplevel

  from eval_cases import fast_model  # pylint: disable=import-outside-toplevel

  from diffjax.eval.sections import text  # pylint: disable=import-outside-toplevel
  from diffjax.model import matched_configs  # pylint: disable=import-outside-toplevel

  cfg = dataclasses.replace(matched_configs(BASE)["diff_v2"], v2_lambda="identity")
  runner = evaluate.ModelRunner(fast_model(cfg, 5))
  res = evaluate.text_statistics(runner, text_batches[:1], outlier_sample=1 << 12, probe_rows=4)
  lam = res["lambda"]
  assert lam["kind"] == "identity"
  for layer in lam["layers"]:
    assert layer["quantiles"]["0.05"] < 0.0  # x W_lambda, no sigmoid: negative values too
    counts, edges = layer["histogram"]["counts"], layer["histogram"]["edges"]
    assert sum(counts) == 2 * T * cfg.num_heads  # every value is binned
    assert edges[0] <= layer["quantiles"]["0.05"] and edges[-1] >= layer["quantiles"]["0.95"]
  assert text.scalars(res)["lambda/mean"] == pytest.approx(
    np.mean([layer["mean"] for layer in lam["layers"]])
  )


def test_the_lambda_plot_does_not_clip_an_unsquashed_lambda_to_the_unit_interval(
  tmp_path, monkeypatch
):
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  from diffjax.eval.sections import text  # pylint: disable=import-outside-toplevel

  def run(kind, lo, hi):
    layer = {"mean": (lo + hi) / 2, "quantiles": {"0.05": lo, "0.95": hi}}
    lam = {"kind": kind, "layers": [layer, layer]}
    return {"eval": {"sections": {"text": {"lambda": lam}}}}

  drawn = []
  monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
  groups = {"diff_v2": [run("sigmoid", 0.2, 0.8), run("identity", -1.5, 2.0)]}
  text.plot(plt, groups, {"diff_v2": "C0"}, str(tmp_path))
  (fig,) = drawn
  squashed, unsquashed = fig.axes
  assert squashed.get_ylabel() == "sigmoid(lambda)" and squashed.get_ylim() == (0.0, 1.0)
  assert unsquashed.get_ylabel() == "lambda (no sigmoid)" and "identity" in unsquashed.get_title()
  low, high = unsquashed.get_ylim()
  assert low <= -1.5 and high >= 2.0
  plt.close(fig)
