"""The section registry: a section registered from outside the package runs in `evaluate_model`,
reports its scalars, directions and headline, and gets its table and plot in the report, like
the built-in ones."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flax import nnx

from diffjax.eval import aggregate, report, sections
from diffjax.eval.config import EvalConfig
from diffjax.eval.evaluate import evaluate_model, scalars_from_sections
from diffjax.model import DecoderLM, ModelConfig

VOCAB = 23


def _run(context: sections.Context) -> dict:
  """Next-token accuracy of the model on the first validation batch, and the batch's mean id."""
  tokens_BxT = np.asarray(context.val_batches[0])
  logits_BxTxV = context.logits_fn(tokens_BxT[:, :-1])
  hits_BxT = logits_BxTxV.argmax(-1) == tokens_BxT[:, 1:]
  return {
    "accuracy": hits_BxT.mean(),  # a numpy scalar: evaluate_model converts it
    "per_row": hits_BxT.mean(axis=1),  # an array: converted to a list
    "mean_token": float(tokens_BxT.mean()),
    "layers": context.runner.config.num_layers,
  }


def _scalars(result) -> dict[str, float]:
  return {"toy/accuracy": result["accuracy"], "toy/mean_token": result["mean_token"]}


def _table(groups, agg) -> list[str]:
  rows = [f"| {arm} | {len(runs)} |" for arm, runs in groups.items()]
  return ["## Toy section", "", "| arm | runs |", "|---|---|", *rows, ""]


def _plot(plt, groups, colors, out_dir):
  fig, ax = plt.subplots(figsize=(3, 2))
  for i, (arm, runs) in enumerate(groups.items()):
    ax.bar(i, np.mean([r["eval"]["scalars"]["toy/accuracy"] for r in runs]), color=colors[arm])
  fig.savefig(f"{out_dir}/toy.png")
  return "toy.png", "Toy accuracy per arm."


TOY = sections.Section(
  name="toy",
  run=_run,
  scalars=_scalars,
  directions={"toy/accuracy": sections.HIGHER_IS_BETTER, "toy/*": sections.DESCRIPTIVE},
  headline=("toy/accuracy",),
  needs_validation=True,
  enabled=lambda cfg: cfg.seed != 0,
  plot=_plot,
  table=_table,
)


@pytest.fixture
def toy():
  sections.register(TOY)
  try:
    yield TOY
  finally:
    sections.unregister("toy")


def _model(arm: str) -> DecoderLM:
  cfg = ModelConfig(
    attention=arm,
    vocab_size=VOCAB,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=48,
  )
  return DecoderLM(cfg, rngs=nnx.Rngs(0))


def _batches(seed: int = 0) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, VOCAB, (2, 17)) for _ in range(2)]


@pytest.mark.integration
def test_a_registered_section_runs_reports_scalars_and_reads_in_the_json(toy):
  model = _model("diff_v1")
  cfg = EvalConfig(sections=("validation", "toy"), val_batches=1)
  logs = []
  out = evaluate_model(model, _batches(), cfg, meta={"seed": 5}, log=logs.append)
  # Registered after the built-ins, it runs after them; its result is plain JSON.
  assert list(out["sections"]) == ["validation", "toy"]
  assert [line.split(":")[0] for line in logs] == ["validation", "toy"]
  assert set(out["meta"]["seconds"]) == {"validation", "toy"}
  toy_json = json.loads(json.dumps(out))["sections"]["toy"]
  first = _batches()[0]
  logits = np.asarray(model(first[:, :-1]))
  want_rows = (logits.argmax(-1) == first[:, 1:]).mean(axis=1)
  np.testing.assert_allclose(toy_json["per_row"], want_rows)
  assert toy_json["accuracy"] == pytest.approx(want_rows.mean())
  assert toy_json["mean_token"] == pytest.approx(first.mean()) and toy_json["layers"] == 2
  # Its scalars join the built-in ones, in section order.
  s = out["scalars"]
  assert list(s) == ["val/loss", "val/perplexity", "toy/accuracy", "toy/mean_token"]
  assert s["toy/accuracy"] == toy_json["accuracy"] and math.isfinite(s["val/loss"])
  assert scalars_from_sections(out["sections"]) == s
  # Directions and the headline come from the section.
  assert aggregate.direction("toy/accuracy") is True
  assert aggregate.direction("toy/mean_token") is None
  assert aggregate.HEADLINE[-3:] == ("toy/accuracy", "train/steps_to_learn", "train/learned")
  # Skipped without validation batches (with a log line), and when the config disables it.
  logs.clear()
  out = evaluate_model(model, [], EvalConfig(sections=("toy",)), log=logs.append)
  assert out["sections"] == {} and logs == ["skipping toy: no validation batches"]
  out = evaluate_model(model, _batches(), EvalConfig(sections=("toy",), seed=0))
  assert out["sections"] == {} and out["scalars"] == {}


def test_the_report_draws_and_tables_a_registered_section(toy, tmp_path):
  runs = []
  for arm in ("transformer", "diff_v2"):
    model = _model(arm)
    for seed in (1, 2):
      ev = evaluate_model(model, _batches(seed), EvalConfig(sections=("toy",), val_batches=1))
      ev["meta"]["seed"] = seed
      runs.append({"arm": arm, "seed": seed, "name": f"{arm}_{seed}", "eval": ev, "curve": None})
  text = open(report.write_report(runs, str(tmp_path))).read()
  assert "| toy/accuracy |" in text and "| transformer | 2 |" in text
  assert "](toy.png)" in text and (tmp_path / "toy.png").read_bytes()[:4] == b"\x89PNG"


def test_registry_errors_name_the_section_and_the_fix(toy):
  with pytest.raises(ValueError, match="'toy' is already registered"):
    sections.register(TOY)
  replaced = sections.register(TOY, replace=True)
  assert sections.section_names()[-1] == "toy" and replaced is TOY
  with pytest.raises(KeyError, match="No section named 'tyo'"):
    sections.get("tyo")
  with pytest.raises(ValueError, match="without commas"):
    sections.Section(name="a,b", run=_run)
  # Every built-in section is registered once, in the documented order.
  assert sections.SECTIONS == sections.section_names()[:-1]
  assert sections.SECTIONS[0] == "validation" and sections.SECTIONS[-1] == "probes"


def test_metrics_no_section_produces_take_their_direction_from_a_registered_table(monkeypatch):
  monkeypatch.setattr(aggregate, "_METRIC_TABLES", list(aggregate._METRIC_TABLES))
  assert aggregate.direction("tool/errors") is None
  aggregate.register_metrics(
    {"tool/errors": sections.LOWER_IS_BETTER, "tool/*": sections.HIGHER_IS_BETTER},
    headline=("tool/errors",),
  )
  assert aggregate.direction("tool/errors") is False and aggregate.direction("tool/f1") is True
  assert aggregate.HEADLINE[-1] == "tool/errors"
  # A section's own directions come first: "val/loss" stays the validation section's.
  aggregate.register_metrics({"val/*": sections.HIGHER_IS_BETTER})
  assert aggregate.direction("val/loss") is False


def test_the_config_accepts_only_registered_sections():
  with pytest.raises(ValueError, match=r"Unknown eval sections \['toy'\].*register"):
    EvalConfig(sections=("toy",))
  sections.register(TOY)
  try:
    assert EvalConfig(sections=("toy",)).sections == ("toy",)
  finally:
    sections.unregister("toy")
  assert aggregate.direction("toy/accuracy") is None  # gone with its section


def test_options_reach_their_section_and_name_only_sections():
  from diffjax.eval.config import EvalConfig

  with pytest.raises(ValueError, match=r"Unknown eval sections \['nope'\]"):
    EvalConfig(options={"nope": {"k": 1}})
  cfg = EvalConfig(options={"validation": {"k": 3}})
  assert cfg.options["validation"] == {"k": 3} and cfg.to_dict()["options"] == {
    "validation": {"k": 3}
  }
