"""diffjax.eval.report: the Markdown report and its plots from synthetic eval results."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from diffjax.eval import report

# flax warns about its own deprecated metadata names when models are built; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


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


@pytest.mark.parametrize("scalars", [{}, {"val/final_eval_loss": 2.5}])
def test_the_summary_table_has_one_cell_per_column(scalars):
  """Every line of the summary table has as many cells as its header, with or without loss
  columns (runs whose evaluations hold no scalar it shows included)."""
  from diffjax.compare.summary import summary_table

  runs = [
    {"arm": arm, "seed": 0, "params": 1000, "train_seconds": 3.0, "eval": {"scalars": scalars}}
    for arm in ("transformer", "diff_v2")
  ]
  lines, table = summary_table(runs, ["transformer", "diff_v2"], "transformer", 0.95, 2)
  cells = [line.strip("|").split("|") for line in lines]
  assert len(lines) == 4 and {len(c) for c in cells} == {len(cells[0])}
  assert len(cells[0]) == 5 + len(scalars)
  assert all(c.strip() for row in cells for c in row), lines
  assert set(table) == {"transformer", "diff_v2"}
