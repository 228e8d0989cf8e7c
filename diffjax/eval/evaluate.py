"""Runs every evaluation on a model and returns plain dicts of numbers (JSON-ready).

`evaluate_model(model, val_batches, EvalConfig(...))` runs the sections below and returns one
dict (the schema is in `diffjax/eval/__init__.py`); the CLI (`python -m diffjax.eval`) writes
it. The pieces, importable from here as well:
  * `diffjax.eval.scoring` (any tokens -> logits function): `validation_loss`,
    `retrieval_accuracy`, `needle_table`, `retrieval_heatmap`, `associative_recall`,
    `greedy_exact_match`;
  * `diffjax.eval.analysis` (a `ModelRunner`): `attention_allocation_by_layer`,
    `text_statistics` (outliers, lambda, map correlation), `low_bit`, `clamp_probe`;
  * `diffjax.eval.runner`: `ModelRunner`, `quantize_model_weights`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

from diffjax.data.tasks import AssociativeRecallTask, ContextTooShort, MultiNeedleTask
from diffjax.eval.analysis import (
  attention_allocation_by_layer,
  clamp_probe,
  low_bit,
  lowbit_settings,
  mechanisms,
  text_statistics,
)
from diffjax.eval.config import SECTIONS, EvalConfig, _jsonable
from diffjax.eval.runner import KNOBS, LogitsFn, ModelRunner, quantize_model_weights
from diffjax.eval.scoring import (
  associative_recall,
  associative_recall_grid,
  greedy_exact_match,
  needle_table,
  retrieval_accuracy,
  retrieval_heatmap,
  validation_loss,
)

__all__ = [
  "EvalConfig",
  "SECTIONS",
  "SCHEMA",
  "KNOBS",
  "LogitsFn",
  "ModelRunner",
  "quantize_model_weights",
  "evaluate_model",
  "scalars_from_sections",
  "validation_loss",
  "retrieval_accuracy",
  "needle_table",
  "retrieval_heatmap",
  "associative_recall",
  "associative_recall_grid",
  "greedy_exact_match",
  "attention_allocation_by_layer",
  "text_statistics",
  "low_bit",
  "lowbit_settings",
  "clamp_probe",
]


def evaluate_model(
  model: nnx.Module | ModelRunner,
  val_batches: Sequence[Any],
  cfg: EvalConfig,
  meta: Mapping[str, Any] | None = None,
  filler=None,
  log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
  """Runs the sections of `cfg` and returns the eval JSON (schema in `diffjax.eval`).

  Args:
    model: a `DecoderLM`, or a `ModelRunner` (reuses its compiled functions).
    val_batches: validation batches (pipeline dicts or (B, T+1) token arrays); the first
      cfg.val_batches are used. Loss-based sections are skipped without them.
    cfg: sizes and sections.
    meta: merged into the JSON's "meta" (e.g. seed, workdir, step).
    filler: DocumentSource for needle filler (default: the standard-library corpus).
    log: called with one line per finished section.
  """
  log = log or (lambda _msg: None)
  runner = model if isinstance(model, ModelRunner) else ModelRunner(model)
  model = runner.model
  sections = cfg.sections or SECTIONS
  val_batches = list(val_batches)[: cfg.val_batches]
  fn = runner.logits_fn()
  out: dict[str, Any] = {"schema": SCHEMA, "meta": dict(meta or {}), "sections": {}}
  out["meta"].setdefault("arm", model.config.attention)
  out["meta"]["model"] = _jsonable(model.config.to_dict())
  out["meta"]["eval_config"] = cfg.to_dict()
  timings = {}
  n_std_examples = max(len(cfg.depths), cfg.allocation_examples)
  if cfg.probe_task == "mqar":
    std_task = AssociativeRecallTask(
      **dict(cfg.mqar), num_examples=n_std_examples, seed=cfg.seed + 1
    )
    out["meta"]["probe_task"] = std_task.name
  else:
    std_task = _needle_task(cfg, n_std_examples, filler)
    out["meta"]["standard_needles_used"] = [std_task.num_needles, std_task.num_queries]
  sec = out["sections"]

  def run(name, f):
    if name not in sections:
      return
    if name in ("validation", "text", "lowbit", "probes") and not val_batches:
      log(f"skipping {name}: no validation batches")
      return
    t0 = time.time()
    sec[name] = _jsonable(f())
    timings[name] = time.time() - t0
    log(f"{name}: {timings[name]:.1f}s")

  run("validation", lambda: validation_loss(fn, val_batches))
  run(
    "retrieval",
    lambda: needle_table(
      fn,
      cfg.context_len,
      cfg.needle_grid,
      cfg.samples_per_depth,
      cfg.depths,
      cfg.seed,
      cfg.batch_size,
      filler,
    ),
  )
  if cfg.heatmap_lengths:
    cell = cfg.heatmap_samples or cfg.samples_per_depth
    run(
      "heatmap",
      lambda: retrieval_heatmap(
        fn,
        cfg.heatmap_lengths,
        cfg.depths,
        *cfg.heatmap_needles,
        samples_per_cell=cell,
        seed=cfg.seed + 2,
        batch_size=cfg.batch_size,
        filler=filler,
      ),
    )
  if cfg.mqar is not None:
    run(
      "mqar",
      lambda: associative_recall(
        fn, cfg.mqar_examples, cfg.seed + 3, cfg.batch_size, **dict(cfg.mqar)
      ),
    )
  if cfg.mqar_grid:
    common = {
      k: v
      for k, v in dict(cfg.mqar or {}).items()
      if k not in ("num_pairs", "num_queries", "distractors_per_query")
    }
    run(
      "mqar_grid",
      lambda: associative_recall_grid(
        fn, cfg.mqar_grid, cfg.mqar_examples, cfg.seed + 100, cfg.batch_size, **common
      ),
    )
  run(
    "allocation",
    lambda: attention_allocation_by_layer(
      runner, std_task, cfg.allocation_examples, cfg.capture_batch_size
    ),
  )
  cap_batches = [_rebatch(b, cfg.capture_batch_size) for b in val_batches]
  cap_batches = [x for group in cap_batches for x in group]
  run(
    "text",
    lambda: text_statistics(
      runner,
      cap_batches,
      outlier_sample=cfg.outlier_sample,
      probe_rows=cfg.probe_rows,
      corr_top_k=cfg.corr_top_k,
      seed=cfg.seed,
    ),
  )
  run("mechanisms", lambda: mechanisms(runner, cap_batches[: cfg.mechanism_batches]))
  run("lowbit", lambda: low_bit(runner, val_batches, std_task, cfg, n_std_examples))
  run("probes", lambda: clamp_probe(runner, val_batches, std_task, n_std_examples, cfg.batch_size))
  out["meta"]["seconds"] = timings
  out["scalars"] = scalars_from_sections(sec)
  return out


def _needle_task(cfg: EvalConfig, num_examples: int, filler) -> MultiNeedleTask:
  """The standard multi-needle task: `cfg.standard_needles`, with fewer needles when the
  context cannot hold them all."""
  n_std, r_std = cfg.standard_needles
  for n_try in range(n_std, 0, -1):
    try:
      return MultiNeedleTask(
        cfg.context_len,
        n_try,
        min(r_std, n_try),
        depths=cfg.depths,
        num_examples=num_examples,
        seed=cfg.seed + 1,
        filler=filler,
      )
    except ContextTooShort:
      continue
  raise ContextTooShort(
    f"context_len={cfg.context_len} cannot hold even one needle and its "
    "question; raise EvalConfig.context_len (e.g. --config.context_len=256)."
  )


def _rebatch(batch, size: int) -> list[Any]:
  """Splits a batch (dict or array) into pieces of at most `size` rows."""
  if isinstance(batch, Mapping):
    n = len(next(iter(batch.values())))
    return [{k: np.asarray(v)[i : i + size] for k, v in batch.items()} for i in range(0, n, size)]
  arr = np.asarray(batch)
  return [arr[i : i + size] for i in range(0, arr.shape[0], size)]


SCHEMA = "diffjax.eval/1"


def scalars_from_sections(sec: Mapping[str, Any]) -> dict[str, float]:
  """The flat {name: number} summary that reports aggregate over seeds (names in `diffjax.eval`)."""
  s: dict[str, float] = {}
  if "validation" in sec:
    s["val/loss"] = sec["validation"]["loss"]
    s["val/perplexity"] = sec["validation"]["perplexity"]
  if "retrieval" in sec:
    for cell, acc in sec["retrieval"]["cells"].items():
      s[f"retrieval/{cell}"] = acc
    s["retrieval/mean"] = sec["retrieval"]["mean"]
  if "heatmap" in sec:
    h = sec["heatmap"]
    for length, acc in zip(h["lengths"], h["mean_by_length"]):
      s[f"heatmap/len{length}"] = acc
    s["heatmap/mean"] = h["mean"]
  if "mqar" in sec:
    s["mqar/accuracy"] = sec["mqar"]["accuracy"]
  if "mqar_grid" in sec:
    g = sec["mqar_grid"]
    for name in g["order"]:
      s[f"mqar_grid/{name}"] = g["cells"][name]["accuracy"]
    s["mqar_grid/mean"] = float(np.mean([g["cells"][n]["accuracy"] for n in g["order"]]))
  if "allocation" in sec:
    summ = sec["allocation"]["summary"]
    names = sec["allocation"]["regions"]
    for key in ("signed_share", "abs_share"):
      for region in ("answer", "context"):
        s[f"allocation/{region}_{key}"] = summ[key][names.index(region)]
  if "text" in sec:
    t = sec["text"]
    for what in ("attention_logits", "hidden"):
      for stat in ("top1", "top100", "median"):
        s[f"outliers/{what}_{stat}"] = t["outliers"][what][stat]
    corr = [c for c in t["correlation"]["probs"] if c == c]
    if corr:
      s["probe/map_correlation_mean"] = float(np.mean(corr))
    s["probe/negative_mass_mean"] = float(np.mean(t["negative_mass"]))
    lam = t["lambda"]
    if lam["kind"] == "scalar":
      s["lambda/mean"] = float(np.mean(lam["layers"]))
    elif lam["kind"] == "sigmoid":
      s["lambda/mean"] = float(np.mean([l["mean"] for l in lam["layers"]]))
  if "mechanisms" in sec:
    summ = sec["mechanisms"]["summary"]
    for key in ("sink_combined", "sink_a1", "sink_a2", "above_sqrt2"):
      if key in summ:
        s[f"mechanisms/{key}"] = summ[key]
    for key in (
      "context_rms",
      "relative_context_rms",
      "bounded_context_rms",
      "norm_magnification",
      "gradient_magnification",
    ):
      for stat in ("median", "p99", "max"):
        if key in summ:
          s[f"mechanisms/{key}_{stat}"] = summ[key][stat]
  if "lowbit" in sec:
    for name, v in sec["lowbit"].items():
      if name in ("delta", "settings"):
        continue
      s[f"lowbit/{name}/loss"] = v["loss"]
      s[f"lowbit/{name}/accuracy"] = v["accuracy"]
    # The loss each quantization adds to the same model's float loss: paired across arms by
    # seed, this is the robustness question itself.
    for name, d in sec["lowbit"].get("delta", {}).items():
      s[f"lowbit/{name}/loss_increase"] = d["loss"]
  if "probes" in sec:
    s["probe/clamp_loss_delta"] = sec["probes"]["loss_delta"]
    s["probe/clamp_accuracy_delta"] = sec["probes"]["accuracy_delta"]
  return s
