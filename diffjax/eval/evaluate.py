"""`evaluate_model`: runs the registered evaluation sections on a model and returns the eval JSON
(schema "diffjax.eval/1", docs/evaluation.md#the-eval-json); `python -m diffjax.eval` writes it.
The sections' functions (`validation_loss`, `needle_table`, ...) stay importable from here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

from diffjax.data.tasks import AssociativeRecallTask, ContextTooShort, MultiNeedleTask
from diffjax.eval import sections
from diffjax.eval.config import EvalConfig, _jsonable
from diffjax.eval.runner import KNOBS, LogitsFn, ModelRunner, quantize_model_weights
from diffjax.eval.scoring import greedy_exact_match, retrieval_accuracy, validation_loss
from diffjax.eval.sections import SECTIONS, Context
from diffjax.eval.sections.allocation import attention_allocation_by_layer
from diffjax.eval.sections.heatmap import retrieval_heatmap
from diffjax.eval.sections.lowbit import low_bit, lowbit_settings
from diffjax.eval.sections.mechanisms import mechanisms
from diffjax.eval.sections.mqar import associative_recall
from diffjax.eval.sections.mqar_grid import associative_recall_grid
from diffjax.eval.sections.probes import clamp_probe
from diffjax.eval.sections.retrieval import needle_table
from diffjax.eval.sections.text import text_statistics

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
  "mechanisms",
  "low_bit",
  "lowbit_settings",
  "clamp_probe",
]

SCHEMA = "diffjax.eval/1"


def evaluate_model(
  model: nnx.Module | ModelRunner,
  val_batches: Sequence[Any],
  cfg: EvalConfig,
  meta: Mapping[str, Any] | None = None,
  filler=None,
  log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
  """Runs the sections of `cfg` and returns the eval JSON (docs/evaluation.md).

  The sections run in registration order (`diffjax.eval.sections`); each gets one `Context`.

  Args:
    model: a `DecoderLM`, or a `ModelRunner` (reuses its compiled functions).
    val_batches: validation batches (pipeline dicts or (B, T+1) token arrays); the first
      cfg.val_batches are used. Sections that need them are skipped without them.
    cfg: sizes and sections (empty `cfg.sections`: every registered section).
    meta: merged into the JSON's "meta" (e.g. seed, workdir, step).
    filler: DocumentSource for needle filler (default: the standard-library corpus).
    log: called with one line per finished or skipped section.
  """
  log = log or (lambda _msg: None)
  runner = model if isinstance(model, ModelRunner) else ModelRunner(model)
  model = runner.model
  selected = cfg.sections or sections.section_names()
  val_batches = list(val_batches)[: cfg.val_batches]
  out: dict[str, Any] = {"schema": SCHEMA, "meta": dict(meta or {}), "sections": {}}
  out["meta"].setdefault("arm", model.config.attention)
  out["meta"]["model"] = _jsonable(model.config.to_dict())
  out["meta"]["eval_config"] = cfg.to_dict()
  standard_examples = max(len(cfg.depths), cfg.allocation_examples)

  def make_standard_task():
    # Built when a section first reads it, so a context too short for its needles stops only
    # an evaluation that includes such a section.
    task, used = _standard_task(cfg, standard_examples, filler)
    out["meta"].update(used)
    return task

  context = Context(
    runner=runner,
    logits_fn=runner.logits_fn(),
    config=cfg,
    val_batches=val_batches,
    capture_batches=[
      piece for batch in val_batches for piece in _rebatch(batch, cfg.capture_batch_size)
    ],
    make_standard_task=make_standard_task,
    standard_examples=standard_examples,
    filler=filler,
  )
  timings = {}
  for section in sections.registered():
    if section.name not in selected or not section.enabled(cfg):
      continue
    if section.needs_validation and not val_batches:
      log(f"skipping {section.name}: no validation batches")
      continue
    t0 = time.time()
    out["sections"][section.name] = _jsonable(section.run(context))
    timings[section.name] = time.time() - t0
    log(f"{section.name}: {timings[section.name]:.1f}s")
  out["meta"]["seconds"] = timings
  out["scalars"] = scalars_from_sections(out["sections"])
  return out


def _standard_task(cfg: EvalConfig, num_examples: int, filler) -> tuple[Any, dict[str, Any]]:
  """(the task of `cfg.probe_task`, what the eval JSON's meta records of it)."""
  if cfg.probe_task == "mqar":
    task = AssociativeRecallTask(**dict(cfg.mqar), num_examples=num_examples, seed=cfg.seed + 1)
    return task, {"probe_task": task.name}
  task = _needle_task(cfg, num_examples, filler)
  return task, {"standard_needles_used": [task.num_needles, task.num_queries]}


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


def scalars_from_sections(results: Mapping[str, Any]) -> dict[str, float]:
  """The flat {name: number} summary that reports aggregate over seeds: each registered
  section's `scalars` of its result in `results` (a JSON's "sections"), in section order."""
  out: dict[str, float] = {}
  for section in sections.registered():
    if section.name in results:
      out.update(section.scalars(results[section.name]))
  return out
