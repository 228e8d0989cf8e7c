"""One run of a comparison: train (or resume, or skip), evaluate (or reuse), collect its record.

A run directory is an ordinary train.py workdir (checkpoints, metrics.jsonl, DONE,
final_metrics.json, model_config.json) plus the eval suite's eval.json.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from etils import epath

from diffjax.compare.config import ComparisonConfig, run_config, run_name
from diffjax.compare.sections import ComparisonEval, eval_config
from diffjax.model import ModelConfig, count_params
from diffjax.train import checkpoint as ckpt
from diffjax.train.config import RunConfig
from diffjax.train.records import read_metrics, write_json

Log = Callable[[str], None]
# What one run yields: (step reached, its eval JSON or None, seconds per phase).
RunResult = tuple[int, "dict[str, Any] | None", "dict[str, float]"]


class ComparisonStopped(RuntimeError):
  """A signal stopped a run after it saved a checkpoint; rerunning continues."""


def _read_text(path: epath.Path) -> str | None:
  return path.read_text() if path.exists() else None


def done_step(run_dir: str) -> int | None:
  """The step in the trainer's DONE marker, or None if the run has not finished."""
  text = _read_text(epath.Path(run_dir, "DONE"))
  try:
    return int(text.strip()) if text is not None else None
  except ValueError:
    return None


DIVERGED = "DIVERGED"


def diverged_record(run_dir: str) -> dict[str, Any] | None:
  """The run's DIVERGED marker ({"step", "error"}), written when a comparison that allows
  divergence saw the trainer stop on non-finite updates; None otherwise."""
  text = _read_text(epath.Path(run_dir, DIVERGED))
  return json.loads(text) if text else None


# Settings that decide the weights a run trains to, besides what the trainer itself checks on
# a resume (the model, the data order and the loss mask): a run directory saved under other
# values holds another run than the one the comparison now describes. The data's paths are
# among them although a resume lets them move (the trainer compares the corpus itself): a
# finished run is not resumed, and its results would be reported as trained on the files
# the comparison now names. How the steps run is not among them (the model's implementation
# below, data.prefetch_batches, the mesh).
TRAINED_BY = (
  *ckpt.DATA_ORDER_KEYS,
  "data.paths",
  "data.streams_per_row",
  "global_batch_size",
  "grad_accum_steps",
  "grad_accum_reduce",
  "model",
  "optim",
  "checkpoint.init_from",
)
_HOW_IT_RUNS = (
  "model.implementation",
  "model.interpret",
  "model.block_sizes",
  "model.remat",
  "model.scan_layers",
)


def _trained_past(run: RunConfig, run_dir: str, step: int | None) -> None:
  if step is not None and step > run.num_steps:
    raise ckpt.CheckpointError(
      f"{run_dir} was trained to step {step}, past the comparison's num_steps={run.num_steps}: "
      f"its results would be reported as {run.num_steps} steps and paired with runs of that "
      f"length. Ask for num_steps={step}, or give the comparison a new --workdir."
    )


# What the comparison records in a run directory whose training it saw finish: the number of
# validation batches of the trainer's final eval loss ({"step", "eval_batches"}).
FINAL_EVAL = "final_eval.json"


def _newest_checkpoint(run_dir: str) -> tuple[int | None, dict[str, Any]]:
  """The newest checkpoint step of ``run_dir`` and the run config it was saved with; (None, {})
  without a readable one."""
  directory = os.path.join(run_dir, "checkpoints")
  if not epath.Path(directory).is_dir():
    return None, {}
  manager = ckpt.make_manager(directory, keep=1_000_000, async_save=False)
  try:
    steps = manager.all_steps()
    if not steps:
      return None, {}
    return max(steps), ckpt.read_meta(manager, max(steps)).get("config") or {}
  except ckpt.CorruptCheckpointError:
    return None, {}
  finally:
    manager.close()


def final_eval_batches(run_dir: str, saved: Mapping[str, Any] | None = None) -> int | None:
  """The validation batches of a finished run's final eval loss: as the comparison recorded
  them (:data:`FINAL_EVAL`), else the ``eval_batches`` its newest checkpoint was saved with
  (``saved``, that config, when already read); None when neither says."""
  text = _read_text(epath.Path(run_dir, FINAL_EVAL))
  if text:
    return int(json.loads(text)["eval_batches"])
  if saved is None:
    saved = _newest_checkpoint(run_dir)[1]
  n = saved.get("eval_batches")
  return int(n) if n is not None else None


def check_trained_as(run: RunConfig, run_dir: str) -> None:
  """Refuses a run directory trained past ``run.num_steps`` (its DONE marker or newest
  checkpoint), whose newest checkpoint was saved under other values of :data:`TRAINED_BY`
  than ``run``'s (a key the saved config lacks is not compared), or, finished, whose final
  eval loss was measured on another number of validation batches than ``run.eval_batches``
  (:func:`final_eval_batches`); a directory without a readable checkpoint passes (the trainer
  deals with it)."""
  done = done_step(run_dir)
  _trained_past(run, run_dir, done)
  step, saved = _newest_checkpoint(run_dir)
  _trained_past(run, run_dir, step)
  diffs = ckpt.setting_differences(saved, json.loads(run.to_json()), TRAINED_BY, _HOW_IT_RUNS)
  if diffs:
    raise ckpt.CheckpointError(
      f"{run_dir} was trained with other settings than the comparison now gives it: "
      f"{', '.join(diffs)}. Its results would be reported under settings it did not train "
      "with: restore them, or give the changed comparison a new --workdir."
    )
  used = final_eval_batches(run_dir, saved) if done == run.num_steps else None
  if used is not None and used != run.eval_batches:
    raise ckpt.CheckpointError(
      f"{run_dir} finished with its final eval loss measured on eval_batches={used} "
      f"validation batches, and the comparison now asks eval_batches={run.eval_batches}: "
      "its loss would be reported and paired as measured on the new number. Set "
      f"--config.base.eval_batches={used}, or give the changed comparison a new --workdir."
    )


def train_run(
  run: RunConfig, run_dir: str, tag: str, log: Log, allow_divergence: bool = False
) -> int:
  """Trains (or resumes) one run unless its DONE marker is at the requested step.

  Returns the step reached; raises ComparisonStopped when a signal stopped the training, and
  ``CheckpointError`` when the directory was trained with other settings
  (:func:`check_trained_as`). With
  ``allow_divergence`` a run the trainer stops on non-finite updates gets a DIVERGED marker
  (and is not trained again); without it the error stops the comparison.
  """
  from diffjax.train import train_and_evaluate  # pylint: disable=import-outside-toplevel
  from diffjax.train.trainer import TrainingError  # pylint: disable=import-outside-toplevel

  check_trained_as(run, run_dir)
  num_steps = run.num_steps
  step = done_step(run_dir)
  if step == num_steps:
    log(f"{tag} finished earlier at step {step}: skipping training")
    return step
  gone = diverged_record(run_dir)
  if gone is not None and allow_divergence:
    log(f"{tag} diverged earlier at step {gone['step']}: skipping training")
    return int(gone["step"])
  what = "resuming" if epath.Path(run_dir, "checkpoints").exists() else "training"
  log(f"{tag} {what} to step {num_steps:,} in {run_dir}")
  try:
    result = train_and_evaluate(run, run_dir)
  except TrainingError as e:
    if not allow_divergence or "max_skipped_updates" not in str(e):
      raise
    reached = last_step(run_dir) or 0
    write_json(epath.Path(run_dir, DIVERGED), {"step": reached, "error": str(e)})
    log(f"{tag} DIVERGED at step {reached}: {e}")
    return reached
  if result.get("stopped"):
    raise ComparisonStopped(
      f"{os.path.basename(run_dir)} stopped at step {result['step']} by a signal"
    )
  # The attempt that finishes a run makes its final eval, with this config's eval_batches (a
  # checkpoint saved by an earlier attempt may hold another).
  write_json(
    epath.Path(run_dir, FINAL_EVAL), {"step": int(result["step"]), "eval_batches": run.eval_batches}
  )
  return int(result["step"])


def _harness(
  model, tokenizer, run: RunConfig, batch_size: int, settings: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, float]]:
  """The lm-eval results of ``settings["tasks"]`` on ``model`` and their flat scalars."""
  from diffjax.eval.harness import DiffjaxLM, harness_scalars, run_tasks  # pylint: disable=import-outside-toplevel

  lm = DiffjaxLM(
    model=model,
    tokenizer=tokenizer,
    max_length=run.seq_len,
    batch_size=batch_size,
    seed=settings["seed"],
  )
  results = run_tasks(
    lm,
    settings["tasks"],
    include_path=settings["include_path"],
    limit=settings["limit"],
    num_fewshot=settings["num_fewshot"],
    seed=settings["seed"],
  )
  section = {
    "settings": dict(settings),
    "results": results.get("results", {}),
    "n-shot": results.get("n-shot", {}),
    "versions": results.get("versions", {}),
  }
  return section, harness_scalars(results)


def evaluate_checkpoint(
  run: RunConfig,
  run_dir: str,
  cfg,
  step: int,
  quick: bool,
  log: Log,
  harness: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
  """Evaluates the checkpoint at ``step`` of ``run_dir`` with ``cfg`` and writes eval.json.

  Validation batches are the run's own held-out batches (same data config, task mix, sequence
  length and batch size). Text alone does not depend on the seed, so every run is scored on the
  same text; task examples are drawn per seed, so runs of one seed share them. ``harness``
  (:attr:`ComparisonEval.harness`) adds lm-eval tasks: their results go in the ``harness`` section
  and their metrics in the scalars as ``harness/<task>/<metric>``.
  """
  from diffjax.eval.evaluate import evaluate_model  # pylint: disable=import-outside-toplevel
  from diffjax.eval.run_data import run_val_batches  # pylint: disable=import-outside-toplevel
  from diffjax.train import load_model  # pylint: disable=import-outside-toplevel

  model, _, step = load_model(run_dir, step=step)
  val, tokenizer = run_val_batches(
    run.data,
    run.task_mix,
    seq_len=run.seq_len,
    batch_size=run.global_batch_size,
    seed=run.seed,
    count=cfg.val_batches,
  )
  meta = {
    "seed": run.seed,
    "workdir": os.path.abspath(run_dir) if "://" not in run_dir else run_dir,
    "step": step,
    "quick": quick,
  }
  result = evaluate_model(model, val, cfg, meta=meta, log=log)
  if harness:
    t0 = time.perf_counter()
    section, scalars = _harness(
      model,
      tokenizer if tokenizer is not None else run.data.tokenizer,
      run,
      cfg.batch_size,
      harness,
    )
    result["sections"]["harness"] = section
    result["scalars"].update(scalars)
    result["meta"]["harness"] = _normalized(dict(harness))
    result["meta"].setdefault("seconds", {})["harness"] = time.perf_counter() - t0
    log(f"harness: {time.perf_counter() - t0:.1f}s")
  write_json(epath.Path(run_dir, "eval.json"), result)
  return result


def _normalized(obj: Any) -> Any:
  """``obj`` as it reads back from JSON (tuples become lists), for comparing with a file."""
  return json.loads(json.dumps(obj, allow_nan=True))


def _eval_is_current(
  ev: Mapping[str, Any] | None, step: int, cfg, harness: Mapping[str, Any] | None = None
) -> bool:
  if not ev:
    return False
  meta = ev.get("meta", {})
  return (
    meta.get("step") == step
    and meta.get("eval_config") == _normalized(cfg.to_dict())
    and meta.get("harness") == (_normalized(dict(harness)) if harness else None)
  )


def evaluate_run(
  section: ComparisonEval, run: RunConfig, run_dir: str, step: int, tag: str, log: Log
) -> dict[str, Any] | None:
  """The run's eval JSON: reused while its step and eval settings match, else recomputed;
  None when the comparison's ``eval.mode`` is "none"."""
  cfg = eval_config(section, run)
  if cfg is None:
    return None
  path = epath.Path(run_dir, "eval.json")
  ev = json.loads(path.read_text()) if path.exists() else None
  harness = section.harness
  if _eval_is_current(ev, step, cfg, harness):
    log(f"{tag} eval.json is up to date (step {step}): skipping evaluation")
    return ev
  log(f"{tag} evaluating ({section.mode}) step {step}")
  return evaluate_checkpoint(
    run,
    run_dir,
    cfg,
    step,
    section.mode == "quick",
    log=lambda msg: log(f"{tag} eval {msg}"),
    harness=harness,
  )


def train_and_evaluate_run(
  config: ComparisonConfig, workdir: str, arm: str, seed: int, tag: str, log: Log
) -> RunResult:
  """Trains (or resumes, or skips) and evaluates run (arm, seed) of ``config`` in
  ``workdir/runs/<arm>_seed<k>``."""
  run_dir = os.path.join(workdir, "runs", run_name(arm, seed))
  run = RunConfig.from_config(run_config(config, arm, seed))
  t = time.perf_counter()
  step = train_run(run, run_dir, tag, log, config.allow_divergence)
  seconds = {"train": time.perf_counter() - t}
  t = time.perf_counter()
  diverged = diverged_record(run_dir) is not None and done_step(run_dir) is None
  ev = None if diverged else evaluate_run(config.eval, run, run_dir, step, tag, log)
  seconds["eval"] = time.perf_counter() - t
  return step, ev, seconds


def last_step(run_dir: str) -> int | None:
  """The last step in ``run_dir``'s metrics.jsonl, or None before the first line."""
  rows = read_metrics(run_dir)
  return rows[-1]["step"] if rows else None


def steps_to_learn(metrics: Sequence[Mapping[str, float]], below: float, window: int) -> float:
  """The first step at which the mean train loss over the last ``window`` steps (that one
  included) is below ``below``, or NaN if no step gets there (a run that never learned: the
  statistics then leave it out, and ``train/learned`` counts it as 0)."""
  losses = {int(m["step"]): float(m["train/loss"]) for m in metrics if "train/loss" in m}
  for step in sorted(losses):
    last = [losses[s] for s in range(step - window + 1, step + 1) if s in losses]
    if len(last) == window and sum(last) / window < below:
      return float(step)
  return float("nan")


def collect_run(
  arm: str,
  seed: int,
  run_dir: str,
  step: int,
  ev: dict[str, Any] | None,
  seconds: Mapping[str, float],
  log_every: int,
  learned_below: float = 0.0,
  learned_window: int = 25,
) -> dict[str, Any]:
  """One run's record: trainer results, metrics rows (one per step), eval JSON (with trainer
  scalars).

  Trainer results are added to the eval scalars so the report's tables and paired tests cover
  them too ("val/..." names ending in "loss" read as lower-is-better):
    train/final_loss     mean train loss over the last ``log_every`` steps (one batch is too
                         noisy to compare arms by)
    val/final_eval_loss  the trainer's final eval loss (its eval_batches validation batches)
    train/steps_to_learn when ``learned_below`` > 0: `steps_to_learn` (NaN if never), and
    train/learned        1 if the run got there, else 0
  """
  final = json.loads(_read_text(epath.Path(run_dir, "final_metrics.json")) or "{}")
  metrics = read_metrics(run_dir)
  last = [m["train/loss"] for m in metrics if m["step"] > step - log_every and "train/loss" in m]
  scalars = dict((ev or {}).get("scalars", {}))
  if last:
    scalars["train/final_loss"] = sum(last) / len(last)
  if "eval/loss" in final:
    scalars["val/final_eval_loss"] = final["eval/loss"]
  if learned_below > 0:
    first = steps_to_learn(metrics, learned_below, learned_window)
    scalars["train/steps_to_learn"] = first
    scalars["train/learned"] = float(not math.isnan(first))
  diverged = diverged_record(run_dir) if not final else None
  if diverged is not None:
    # Losses of a run stopped part-way are not averaged with finished runs' (it is counted).
    scalars["val/final_eval_loss"] = float("nan")
    scalars["train/final_loss"] = float("nan")
  scalars["train/skipped_updates"] = float(sum(1 for m in metrics if m.get("train/skipped")))
  model = ModelConfig.from_dict(json.loads(epath.Path(run_dir, "model_config.json").read_text()))
  return {
    "arm": arm,
    "seed": seed,
    "name": run_name(arm, seed),
    "workdir": run_dir,
    "step": step,
    "params": count_params(model),
    "vocab_size": model.vocab_size,
    "final_metrics": final,
    "diverged": diverged,
    "metrics": metrics,
    "eval": {**(ev or {}), "scalars": scalars},
    "eval_file": ev,
    # Every attempt's, for a run stopped and resumed (the last attempt's before it was kept).
    "train_seconds": final.get("wall_s_all_attempts", final.get("wall_s", seconds["train"])),
    "eval_seconds": seconds["eval"],
  }
