"""diffjax.eval.evaluate: ``evaluate_model`` end to end on tiny models (every section, the probes
on the recall task) and the command on a run directory."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from eval_cases import FILLER, T

from diffjax.eval import evaluate

# flax warns about its own deprecated metadata names when models are built; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.integration  # the whole command
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


def test_a_context_too_short_for_needles_stops_only_the_sections_that_score_them(
  runners, text_batches
):
  from diffjax.data.tasks import ContextTooShort  # pylint: disable=import-outside-toplevel

  cfg = evaluate.EvalConfig(context_len=48, batch_size=2, sections=("validation",))
  out = evaluate.evaluate_model(runners["transformer"], text_batches, cfg, filler=FILLER)
  assert out["sections"]["validation"]["loss"] > 0
  assert "standard_needles_used" not in out["meta"]  # the needle task was never built
  for section in ("allocation", "lowbit", "probes"):
    with pytest.raises(ContextTooShort, match="context_len=48 cannot hold even one needle"):
      evaluate.evaluate_model(
        runners["transformer"],
        text_batches,
        dataclasses.replace(cfg, sections=(section,)),
        filler=FILLER,
      )
