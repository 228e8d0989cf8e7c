"""The matched comparison: every arm x seed trained, evaluated and reported in one command.

    python -m diffjax.compare --config=configs/compare/tiny.py --workdir=runs/compare_tiny \
        [--config.seeds="(0, 1, 2)" --config.base.num_steps=2000 --config.eval.mode=full ...]

A compare config (see `comparison_config` and `configs/compare/*.py`) holds `arms`, `seeds`, one
`base` run config whose `model` is the Transformer spec the arms are matched to
(`diffjax.model.matched_configs`), and `eval` / `report` settings. Every arm shares every other
setting of `base`; run (arm, seed k) trains with `seed = k`, which seeds both the initialisation
and the data order, so the arms at seed k see identical batches. The command checks that from the
batch hashes the trainer logs and says so loudly when it does not hold.

Layout of --workdir:
    runs/<arm>_seed<k>/   one train.py workdir per run (checkpoints, metrics.jsonl, DONE,
                          final_metrics.json) plus the eval suite's eval.json
    report.md, *.png      `diffjax.eval.report` over all runs, with the comparison summary first
    results.json          every number: per-run training and eval results, the aggregates, the
                          data check
    compare_config.json   the config of the latest invocation
    compile_cache/        JAX's persistent compilation cache (command line only): the seeds of
                          one arm compile the same steps, so runs after the first reuse them

Rerunning the command continues where it stopped: finished runs (a DONE marker at the requested
step) are skipped, unfinished runs resume from their checkpoints, and a run's eval.json is reused
while its step and eval settings are unchanged. Mistakes in the config print one ``error:`` line
and exit with 2.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, Sequence

import ml_collections
from etils import epath

from diffjax.model import ARMS, ModelConfig, count_params, matched_configs

SCHEMA = "diffjax.compare/1"
EVAL_MODES = ("quick", "full", "none")
# Trainer results are added to each run's eval scalars so the report's tables and paired tests
# cover them too ("val/..." names ending in "loss" are read as lower-is-better):
#   train/final_loss     mean train loss over the last log_every steps (one batch is too noisy)
#   val/final_eval_loss  the trainer's final eval loss (its eval_batches validation batches)


# ----------------------------------------------------------------------------------------------
# Config.


def comparison_config(base: ml_collections.ConfigDict, seeds: Sequence[int] = (0, 1),
                      arms: Sequence[str] = ARMS) -> ml_collections.ConfigDict:
  """A compare config around ``base``, a full run config whose model is the Transformer spec.

  Fields: ``arms``, ``seeds``, ``base`` (``base.seed`` is replaced by each seed and
  ``base.log_batch_hash`` is forced on), ``eval.mode`` ("quick", "full" or "none"),
  ``eval.overrides`` (`diffjax.eval.config.EvalConfig` fields; add keys in the config file to
  make them overridable from the command line), ``report.baseline``, ``report.confidence``,
  ``report.title``.
  """
  c = ml_collections.ConfigDict()
  c.arms = tuple(arms)
  c.seeds = tuple(int(s) for s in seeds)
  c.base = base
  c.eval = ml_collections.ConfigDict(dict(mode="quick", overrides=ml_collections.ConfigDict()))
  c.report = ml_collections.ConfigDict(dict(baseline="transformer", confidence=0.95,
                                            title="Matched comparison"))
  return c


def _as_names(value: Any) -> tuple[str, ...]:
  """Arm names; "a,b" (how --config.arms=a,b arrives) counts as two."""
  items = (value,) if isinstance(value, str) else tuple(value)
  return tuple(n.strip() for item in items for n in str(item).split(",") if n.strip())


def _tuples(x: Any) -> Any:
  """Lists to tuples, recursively (EvalConfig fields are tuples)."""
  if isinstance(x, (list, tuple)):
    return tuple(_tuples(v) for v in x)
  if isinstance(x, Mapping):
    return {k: _tuples(v) for k, v in x.items()}
  return x


def arm_model_dict(base_model: Mapping[str, Any], arm: str) -> dict[str, Any]:
  """The model dict of ``arm`` matched to the Transformer spec ``base_model``.

  ``vocab_size=-1`` (take the tokenizer's) is kept; with the presets' specs this equals
  ``diffjax.presets.arm_model(size, arm)``.
  """
  spec = dict(base_model)
  vocab = spec.get("vocab_size", -1)
  if spec.get("attention", "transformer") != "transformer":
    raise ValueError(f"base.model.attention={spec['attention']!r}: the base model must be the "
                     "'transformer' spec the arms are matched to (start from "
                     "diffjax.presets.arm_model(size, 'transformer')).")
  spec["attention"] = "transformer"
  if vocab == -1:
    spec["vocab_size"] = 258  # any valid value: the arms do not depend on it
  arm_cfg = matched_configs(ModelConfig.from_dict(spec))[arm].to_dict()
  arm_cfg["vocab_size"] = vocab
  return arm_cfg


def run_config(config: ml_collections.ConfigDict, arm: str, seed: int
               ) -> ml_collections.ConfigDict:
  """The train config of run (arm, seed): ``base`` with the arm's model and ``seed``."""
  run = copy.deepcopy(config.base)
  with run.unlocked():
    run.model.update(arm_model_dict(config.base.model.to_dict(), arm))
    run.seed = int(seed)
    run.log_batch_hash = True
  return run


def run_name(arm: str, seed: int) -> str:
  return f"{arm}_seed{seed}"


def eval_config(config: ml_collections.ConfigDict, run: ml_collections.ConfigDict):
  """The `EvalConfig` of a run, or None when ``eval.mode`` is "none".

  As in ``python -m diffjax.eval``: quick or full sizes around the run's sequence length; a
  full evaluation uses the trainer's ``eval_batches`` validation batches unless overridden, so
  its val/loss reproduces the trainer's final eval loss.
  """
  from diffjax.eval.config import EvalConfig  # pylint: disable=import-outside-toplevel
  mode = config.eval.mode
  if mode == "none":
    return None
  overrides = _tuples(config.eval.overrides.to_dict())
  if mode == "full" and "val_batches" not in overrides:
    overrides["val_batches"] = int(run.eval_batches)
  make = EvalConfig.quick if mode == "quick" else EvalConfig.full
  return make(int(run.seq_len), **overrides)


def check_comparison_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first problem; nothing is written before this passes."""
  from diffjax.data import DataConfig  # pylint: disable=import-outside-toplevel
  from diffjax.eval.config import EvalConfig  # pylint: disable=import-outside-toplevel
  from diffjax.train.config_utils import check_config  # pylint: disable=import-outside-toplevel

  for key in ("arms", "seeds", "base", "eval", "report"):
    if key not in config:
      raise ValueError(f"The compare config has no {key!r}; build it with "
                       "diffjax.compare.comparison_config (see configs/compare/tiny.py).")
  arms = _as_names(config.arms)
  if not arms:
    raise ValueError(f"arms is empty; choose one or more of {ARMS}.")
  unknown = [a for a in arms if a not in ARMS]
  if unknown:
    raise ValueError(f"Unknown arm(s) {unknown} in arms={arms}; choose from {ARMS}.")
  if len(set(arms)) != len(arms):
    raise ValueError(f"arms={arms} names an arm twice.")
  seeds = tuple(config.seeds) if not isinstance(config.seeds, (int, str)) else (config.seeds,)
  if not seeds:
    raise ValueError('seeds is empty; give at least one, e.g. --config.seeds="(0, 1)" (two or '
                     "more are needed for confidence intervals).")
  bad = [s for s in seeds if isinstance(s, bool) or not isinstance(s, int) or s < 0]
  if bad:
    raise ValueError(f"seeds={seeds} must be non-negative integers; got {bad}.")
  if len(set(seeds)) != len(seeds):
    raise ValueError(f"seeds={seeds} repeats a seed.")
  if config.eval.mode not in EVAL_MODES:
    raise ValueError(f"eval.mode={config.eval.mode!r} must be one of {EVAL_MODES}.")
  fields = {f.name for f in dataclasses.fields(EvalConfig)}
  unknown = sorted(set(config.eval.overrides.to_dict()) - fields)
  if unknown:
    raise ValueError(f"Unknown eval.overrides {unknown}; EvalConfig fields are {sorted(fields)}.")
  if not 0.0 < float(config.report.confidence) < 1.0:
    raise ValueError(f"report.confidence={config.report.confidence} must be in (0, 1).")
  try:
    DataConfig.from_dict(config.base.data.to_dict())
  except ValueError as e:
    raise ValueError(f"base.data: {e} Set it with --config.base.data.<key>=<value>.") from e
  for arm in arms:
    run = run_config(config, arm, seeds[0])
    check_config(run)
    ModelConfig.from_dict({**run.model.to_dict(), "vocab_size": 258})
    try:
      eval_config(config, run)
    except TypeError as e:
      raise ValueError(f"Bad eval.overrides: {e}.") from e


# ----------------------------------------------------------------------------------------------
# Files of one run.


def _read_text(path: epath.Path) -> str | None:
  return path.read_text() if path.exists() else None


def done_step(run_dir: str) -> int | None:
  """The step in the trainer's DONE marker, or None if the run has not finished."""
  text = _read_text(epath.Path(run_dir, "DONE"))
  try:
    return int(text.strip()) if text is not None else None
  except ValueError:
    return None


def read_metrics(run_dir: str) -> dict[int, dict[str, float]]:
  """metrics.jsonl merged by step (a resumed run may repeat steps: the last value wins)."""
  text = _read_text(epath.Path(run_dir, "metrics.jsonl")) or ""
  rows: dict[int, dict[str, float]] = {}
  for line in text.splitlines():
    try:
      row = json.loads(line)
    except json.JSONDecodeError:  # a line cut by a kill
      continue
    if isinstance(row, dict) and "step" in row:
      rows.setdefault(int(row["step"]), {"step": int(row["step"])}).update(row)
  return dict(sorted(rows.items()))


def batch_hashes(metrics: Mapping[int, Mapping[str, float]]) -> dict[int, int]:
  return {s: int(r["data/batch_hash"]) for s, r in metrics.items() if "data/batch_hash" in r}


def _write_json(path: epath.Path, obj: Any) -> None:
  """Writes through a temporary name, so an interrupted write leaves no half file."""
  tmp = path.parent / (path.name + ".tmp")
  tmp.write_text(json.dumps(obj, indent=1, allow_nan=True))
  tmp.replace(path)


def _normalized(obj: Any) -> Any:
  return json.loads(json.dumps(obj, allow_nan=True))


# ----------------------------------------------------------------------------------------------
# Training and evaluation of one run.


def evaluate_run(run: ml_collections.ConfigDict, run_dir: str, cfg, step: int, quick: bool,
                 log: Callable[[str], None]) -> dict[str, Any]:
  """Evaluates the checkpoint at ``step`` of ``run_dir`` with ``cfg`` and writes eval.json.

  Validation batches are the run's own held-out batches (same data config, sequence length and
  batch size); they do not depend on the seed, so every run is scored on the same text.
  """
  from diffjax.data import DataConfig, build_datasets  # pylint: disable=import-outside-toplevel
  from diffjax.eval.evaluate import evaluate_model  # pylint: disable=import-outside-toplevel
  from diffjax.train import load_model  # pylint: disable=import-outside-toplevel

  model, _, step = load_model(run_dir, step=step)
  data = build_datasets(DataConfig.from_dict(run.data.to_dict()), seq_len=int(run.seq_len),
                        global_batch_size=int(run.global_batch_size), seed=int(run.seed))
  val = data.val_batches(cfg.val_batches)
  meta = {"seed": int(run.seed), "workdir": os.path.abspath(run_dir) if "://" not in run_dir
          else run_dir, "step": step, "quick": quick}
  result = evaluate_model(model, val, cfg, meta=meta, log=log)
  _write_json(epath.Path(run_dir, "eval.json"), result)
  return result


def _eval_is_current(ev: Mapping[str, Any] | None, step: int, cfg) -> bool:
  if not ev:
    return False
  meta = ev.get("meta", {})
  return meta.get("step") == step and meta.get("eval_config") == _normalized(cfg.to_dict())


# ----------------------------------------------------------------------------------------------
# The data check.


def check_batches(hashes: Mapping[tuple[str, int], Mapping[int, int]], arms: Sequence[str],
                  seeds: Sequence[int], num_steps: int) -> dict[str, Any]:
  """Compares the logged batch hashes of the runs.

  Returns {"ok", "problems": [sentences], "per_seed": {seed: {"match", "steps_compared"}},
  "distinct_across_seeds"}; "ok" is False when two arms with the same seed saw a different
  batch at some step, or a run lacks hashes for some of steps 1..num_steps.
  """
  problems, per_seed = [], {}
  steps = range(1, num_steps + 1)
  for seed in seeds:
    ref_arm = arms[0]
    ref = hashes.get((ref_arm, seed), {})
    match = True
    for arm in arms:
      h = hashes.get((arm, seed), {})
      missing = [s for s in steps if s not in h]
      if missing:
        match = False
        problems.append(f"seed {seed}: {arm} has no batch hash for {len(missing)} of "
                        f"{num_steps} steps (first: step {missing[0]}); was it trained without "
                        "log_batch_hash?")
        continue
      if arm == ref_arm or any(s not in ref for s in steps):
        continue
      differ = [s for s in steps if h[s] != ref[s]]
      if differ:
        match = False
        problems.append(f"seed {seed}: {arm} saw different batches than {ref_arm} at "
                        f"{len(differ)} of {num_steps} steps (first: step {differ[0]}).")
    per_seed[str(seed)] = {"match": match, "steps_compared": num_steps}
  sequences = {seed: tuple(hashes.get((arms[0], seed), {}).get(s) for s in steps) for seed in seeds}
  distinct = len(set(sequences.values())) == len(seeds)
  return {"ok": not problems, "problems": problems, "per_seed": per_seed,
          "distinct_across_seeds": distinct}


# ----------------------------------------------------------------------------------------------
# Outputs.


def loss_curve(metrics: Mapping[int, Mapping[str, float]], every: int) -> list[dict[str, float]]:
  """Rows {step, train/loss, eval/loss}: the train loss averaged over each window of ``every``
  steps (per-step losses are too noisy to compare arms by eye), eval losses where measured."""
  rows, window = [], []
  last = max(metrics, default=0)
  for step, m in metrics.items():
    if "train/loss" in m:
      window.append(float(m["train/loss"]))
    row = {"step": step}
    if window and (step % every == 0 or step == last):
      row["train/loss"] = sum(window) / len(window)
      window = []
    if "eval/loss" in m:
      row["eval/loss"] = float(m["eval/loss"])
    if len(row) > 1:
      rows.append(row)
  return rows


def _clean_json(x: Any) -> Any:
  """NaN and infinities become null so results.json is strict JSON."""
  if isinstance(x, float):
    return x if math.isfinite(x) else None
  if isinstance(x, Mapping):
    return {str(k): _clean_json(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_clean_json(v) for v in x]
  return x


def _fmt(ci: Mapping[str, float], digits: int = 4) -> str:
  if ci["n"] == 0:
    return "–"
  if ci["n"] == 1:
    return f"{ci['mean']:.{digits}g}"
  return f"{ci['mean']:.{digits}g} ± {ci['half_width']:.2g}"


def summary_table(runs: Sequence[Mapping[str, Any]], arms: Sequence[str], baseline: str,
                  confidence: float, log_every: int) -> tuple[list[str], dict[str, Any]]:
  """The per-arm summary (markdown lines, and the same numbers as a dict)."""
  from diffjax.eval import stats  # pylint: disable=import-outside-toplevel

  cols = [(f"train loss (last {log_every} steps)", "train/final_loss"),
          ("final eval loss", "val/final_eval_loss"),
          ("retrieval/mean", "retrieval/mean"),
          ("mqar/accuracy", "mqar/accuracy")]
  present = [(title, key) for title, key in cols
             if any(key in (r["eval"] or {}).get("scalars", {}) for r in runs)]
  by_seed = {(r["arm"], r["seed"]): (r["eval"] or {}).get("scalars", {}) for r in runs}
  table: dict[str, Any] = {}
  lines = ["| arm | params | seeds | " + " | ".join(t for t, _ in present)
           + f" | final eval loss − {baseline} (paired) | train time / run |",
           "|---" * (len(present) + 5) + "|"]
  for arm in arms:
    mine = [r for r in runs if r["arm"] == arm]
    row = {"params": mine[0]["params"] if mine else None, "seeds": [r["seed"] for r in mine]}
    for _, key in present:
      row[key] = stats.mean_ci([by_seed[(arm, r["seed"])].get(key, float("nan")) for r in mine],
                               confidence)
    seeds = [r["seed"] for r in mine if (baseline, r["seed"]) in by_seed]
    key = "val/final_eval_loss"
    row["paired_eval_loss"] = stats.paired_difference(
        [by_seed[(arm, s)].get(key, float("nan")) for s in seeds],
        [by_seed[(baseline, s)].get(key, float("nan")) for s in seeds], confidence)
    row["train_seconds"] = stats.mean_ci([r["train_seconds"] for r in mine], confidence)
    table[arm] = row
    d = row["paired_eval_loss"]
    if arm == baseline:
      paired = "(baseline)"
    elif d["n"] >= 2 and math.isfinite(d.get("p", float("nan"))):
      paired = f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}] p={d['p']:.2g}"
    elif d["n"] >= 1:
      paired = f"{d['mean']:+.4f} (n={d['n']}, no test)"
    else:
      paired = "–"
    secs = row["train_seconds"]["mean"]
    lines.append(f"| {arm} | {row['params']:,} | {len(mine)} | "
                 + " | ".join(_fmt(row[k]) for _, k in present)
                 + f" | {paired} | {secs:.0f} s |")
  return lines, table


def write_outputs(config: ml_collections.ConfigDict, workdir: str,
                  runs: Sequence[dict[str, Any]], data_check: Mapping[str, Any],
                  timings: Mapping[str, float]) -> dict[str, Any]:
  """report.md and PNGs (via `diffjax.eval.report`), then results.json; returns the results."""
  from diffjax.eval import report  # pylint: disable=import-outside-toplevel

  arms = list(_as_names(config.arms))
  baseline, confidence = config.report.baseline, float(config.report.confidence)
  base = config.base
  curves = {r["name"]: loss_curve(r["metrics"], int(base.log_every)) for r in runs}
  report_runs = [{"arm": r["arm"], "seed": r["seed"], "name": f"runs/{r['name']}",
                  "eval": r["eval"], "curve": curves[r["name"]]} for r in runs]
  remote = "://" in workdir
  out_dir = tempfile.mkdtemp(prefix="diffjax_compare_") if remote else workdir
  title = (f"{config.report.title}: {', '.join(arms)} x seeds "
           f"{', '.join(str(s) for s in config.seeds)}")
  path = report.write_report(report_runs, out_dir, baseline, confidence, title=title)
  lines, table = summary_table(runs, arms, baseline, confidence, int(base.log_every))
  tokens = int(base.num_steps) * int(base.global_batch_size) * int(base.seq_len)
  head = ["## Comparison summary", "",
          f"{len(runs)} runs; each trained {int(base.num_steps):,} steps x "
          f"{int(base.global_batch_size)} x {int(base.seq_len)} tokens = {tokens:,} tokens on "
          f"`{base.data.kind}` data, evaluation mode `{config.eval.mode}`. Mean over seeds ± "
          f"half-width of the {confidence:.0%} t interval; the paired column is arm minus "
          f"{baseline} at matched seeds. Losses are the trainer's: train averaged over the last "
          f"{int(base.log_every)} steps, eval on its {int(base.eval_batches)} validation batches "
          "at the last step (the eval suite's val/loss below uses its own `val_batches` of the "
          "same split).", ""] + lines + [""]
  if data_check["ok"]:
    head += ["Data check: for every seed all arms saw identical batches at every step "
             "(batch hashes from metrics.jsonl)" + ("" if data_check["distinct_across_seeds"]
                                                   else "; note that the seeds did NOT vary the "
                                                   "data order") + ".", ""]
  else:
    head = (["## WARNING: the arms did not see the same data", ""]
            + [f"- {p}" for p in data_check["problems"]]
            + ["", "The comparison is not matched; do not read the differences below as "
               "effects of the attention.", ""] + head)
  with open(path, encoding="utf-8") as f:
    text = f.read()
  first, _, rest = text.partition("\n## ")
  with open(path, "w", encoding="utf-8") as f:
    f.write(first.rstrip("\n") + "\n\n" + "\n".join(head) + "\n## " + rest)

  agg = report.aggregate(report_runs, baseline, confidence)
  results = {
      "schema": SCHEMA, "workdir": workdir, "arms": arms, "seeds": list(config.seeds),
      "config": json.loads(config.to_json_best_effort()),
      "data_check": data_check, "summary": table, "aggregate": agg,
      "this_invocation_s": dict(timings),  # seconds spent by this command (0 for skipped work)
      "runs": [{
          "arm": r["arm"], "seed": r["seed"], "name": r["name"], "workdir": r["workdir"],
          "step": r["step"], "params": r["params"], "train_seconds": r["train_seconds"],
          "eval_seconds": r["eval_seconds"], "final_metrics": r["final_metrics"],
          "scalars": (r["eval"] or {}).get("scalars", {}),
          "eval": r["eval_file"],
          "curve": curves[r["name"]],
      } for r in runs],
  }
  with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as f:
    json.dump(_clean_json(results), f, indent=1)
  if remote:
    for name in os.listdir(out_dir):
      epath.Path(workdir, name).write_bytes(epath.Path(out_dir, name).read_bytes())
  return results


# ----------------------------------------------------------------------------------------------
# The command.


def _clock(seconds: float) -> str:
  m, s = divmod(int(seconds), 60)
  h, m = divmod(m, 60)
  return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class ComparisonStopped(RuntimeError):
  """A signal stopped a run after it saved a checkpoint; rerunning continues."""


def _train(run: ml_collections.ConfigDict, run_dir: str, tag: str, log) -> int:
  """Trains (or resumes) one run unless its DONE marker is at the requested step."""
  from diffjax.train import train_and_evaluate  # pylint: disable=import-outside-toplevel
  num_steps = int(run.num_steps)
  step = done_step(run_dir)
  if step == num_steps:
    log(f"{tag} finished earlier at step {step}: skipping training")
    return step
  what = "resuming" if epath.Path(run_dir, "checkpoints").exists() else "training"
  log(f"{tag} {what} to step {num_steps:,} in {run_dir}")
  result = train_and_evaluate(run, run_dir)
  if result.get("stopped"):
    raise ComparisonStopped(f"{os.path.basename(run_dir)} stopped at step {result['step']} by a "
                            "signal")
  return int(result["step"])


def _evaluate(config: ml_collections.ConfigDict, run: ml_collections.ConfigDict, run_dir: str,
              step: int, tag: str, log) -> dict[str, Any] | None:
  """The run's eval JSON: reused while its step and eval settings match, else recomputed."""
  cfg = eval_config(config, run)
  if cfg is None:
    return None
  path = epath.Path(run_dir, "eval.json")
  ev = json.loads(path.read_text()) if path.exists() else None
  if _eval_is_current(ev, step, cfg):
    log(f"{tag} eval.json is up to date (step {step}): skipping evaluation")
    return ev
  log(f"{tag} evaluating ({config.eval.mode}) step {step}")
  return evaluate_run(run, run_dir, cfg, step, config.eval.mode == "quick",
                      log=lambda msg: log(f"{tag} eval {msg}"))


def _collect(arm: str, seed: int, run_dir: str, step: int, ev: dict[str, Any] | None,
             seconds: Mapping[str, float], log_every: int) -> dict[str, Any]:
  """One run's record: trainer results, metrics by step, eval JSON (with trainer scalars)."""
  final = json.loads(_read_text(epath.Path(run_dir, "final_metrics.json")) or "{}")
  metrics = read_metrics(run_dir)
  last = [m["train/loss"] for s, m in metrics.items() if s > step - log_every and "train/loss" in m]
  scalars = dict((ev or {}).get("scalars", {}))
  if last:
    scalars["train/final_loss"] = sum(last) / len(last)
  if "eval/loss" in final:
    scalars["val/final_eval_loss"] = final["eval/loss"]
  model = ModelConfig.from_dict(json.loads(epath.Path(run_dir, "model_config.json").read_text()))
  return {"arm": arm, "seed": seed, "name": run_name(arm, seed), "workdir": run_dir,
          "step": step, "params": count_params(model), "final_metrics": final,
          "metrics": metrics, "eval": {**(ev or {}), "scalars": scalars},
          "eval_file": ev, "train_seconds": final.get("wall_s", seconds["train"]),
          "eval_seconds": seconds["eval"]}


def _loud(log, lines: Sequence[str]) -> None:
  bar = "!" * 78
  log("\n".join([bar, *lines, bar]))


def run_comparison(config: ml_collections.ConfigDict, workdir: str,
                   log: Callable[[str], None] | None = None) -> dict[str, Any]:
  """Trains, evaluates and reports every arm x seed of ``config`` in ``workdir``.

  Returns the results written to results.json (``data_check["ok"]`` says whether the arms saw
  the same batches). Raises ValueError for a bad config before anything is written, and
  ComparisonStopped when a signal stopped a run.
  """
  log = log or (lambda msg: print(msg, flush=True))
  check_comparison_config(config)
  arms, seeds = _as_names(config.arms), tuple(config.seeds)
  num_steps = int(config.base.num_steps)
  # Seed-major order: an interrupted comparison has complete arm pairs for its first seeds.
  plan = [(arm, seed) for seed in seeds for arm in arms]
  t0 = time.perf_counter()
  elapsed = lambda: _clock(time.perf_counter() - t0)
  epath.Path(workdir, "runs").mkdir(parents=True, exist_ok=True)
  _write_json(epath.Path(workdir, "compare_config.json"), json.loads(config.to_json_best_effort()))
  log(f"compare: {len(plan)} runs ({len(arms)} arms x {len(seeds)} seeds), {num_steps:,} steps "
      f"each, eval {config.eval.mode}, in {workdir}")

  runs, timings = [], {}
  for i, (arm, seed) in enumerate(plan):
    run_dir = os.path.join(workdir, "runs", run_name(arm, seed))
    run = run_config(config, arm, seed)
    tag = f"[{i + 1}/{len(plan)} {run_name(arm, seed)}]"
    log(f"{tag} starting: {len(plan) - i} runs left, elapsed {elapsed()}")
    t = time.perf_counter()
    step = _train(run, run_dir, tag, log)
    seconds = {"train": time.perf_counter() - t}
    t = time.perf_counter()
    ev = _evaluate(config, run, run_dir, step, tag, log)
    seconds["eval"] = time.perf_counter() - t
    timings[run_name(arm, seed)] = seconds
    runs.append(_collect(arm, seed, run_dir, step, ev, seconds, int(config.base.log_every)))
    # Check the data as soon as a pair exists, so a mismatch does not wait for the last run.
    first = next(r for r in runs if r["seed"] == seed)
    if first is not runs[-1]:
      check = check_batches({(r["arm"], seed): batch_hashes(r["metrics"])
                             for r in (first, runs[-1])}, [first["arm"], arm], [seed], num_steps)
      if not check["ok"]:
        _loud(log, ["DATA MISMATCH: " + p for p in check["problems"]])
    final = runs[-1]["final_metrics"]
    log(f"{tag} done: train loss {final.get('train/loss', float('nan')):.4f}, eval loss "
        f"{final.get('eval/loss', float('nan')):.4f}; {len(plan) - i - 1} runs left, elapsed "
        f"{elapsed()}")

  hashes = {(r["arm"], r["seed"]): batch_hashes(r["metrics"]) for r in runs}
  data_check = check_batches(hashes, arms, seeds, num_steps)
  timings["total"] = time.perf_counter() - t0
  results = write_outputs(config, workdir, runs, data_check, timings)
  if data_check["ok"]:
    log(f"data check: all arms saw identical batches for seeds {list(seeds)}" +
        ("" if data_check["distinct_across_seeds"] else
         " (but the seeds did not change the data order)"))
  else:
    _loud(log, ["DATA MISMATCH: the arms did not see the same batches.",
                *data_check["problems"], "The comparison is not matched."])
  log(f"compare: wrote {os.path.join(workdir, 'report.md')} and results.json in {elapsed()}")
  return results


def _enable_compile_cache(workdir: str) -> None:
  """Points JAX's persistent compilation cache into the workdir unless the user chose one."""
  import jax  # pylint: disable=import-outside-toplevel
  if not jax.config.jax_compilation_cache_dir:  # JAX_COMPILATION_CACHE_DIR wins
    jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "compile_cache"))


def main(argv: Sequence[str] | None = None) -> int:
  from absl import flags, logging  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  argv = list(sys.argv if argv is None else argv)
  # Own flag registry: importing this module (e.g. in tests) registers no global flags.
  fv = flags.FlagValues()
  config_flag = config_flags.DEFINE_config_file("config", None, "Path to a configs/compare/*.py "
                                                "file.", flag_values=fv, lock_config=True,
                                                sys_argv=argv)
  workdir_flag = flags.DEFINE_string("workdir", None, "Directory for the runs and the report.",
                                     flag_values=fv)
  usage = ("usage: python -m diffjax.compare --config=configs/compare/<file>.py --workdir=<dir> "
           "[--config.<key>=<value> ...]")
  try:
    rest = fv(argv)
  except Exception as e:  # absl and ml_collections raise several types for bad flags
    detail = str(e).strip('"')
    if isinstance(e, (KeyError, AttributeError)):
      detail = f"unknown config key {detail}"
    if "config key" in detail or "flag 'config." in detail:
      detail += " (--config.<key>=<value> can only set keys the config file defines)"
    print(f"error: invalid command line: {detail}", file=sys.stderr)
    return 2
  try:
    config = config_flag.value
    _ = config is not None and "arms" in config  # loading errors surface on first access
  except Exception as e:  # a config file that is missing or fails to import
    detail = str(e).splitlines()[-1].strip() if str(e).strip() else type(e).__name__
    print(f"error: cannot load --config: {detail}", file=sys.stderr)
    return 2
  if len(rest) > 1 or workdir_flag.value is None or config is None:
    print(f"error: {usage}" + (f" (unexpected arguments {rest[1:]})" if len(rest) > 1 else ""),
          file=sys.stderr)
    return 2
  logging.set_verbosity(logging.WARNING)
  _enable_compile_cache(workdir_flag.value)
  from diffjax.cli import run_guarded  # pylint: disable=import-outside-toplevel
  outcome = {}

  def go():
    outcome["results"] = run_comparison(config, workdir_flag.value)

  try:
    code = run_guarded(go)
  except (ComparisonStopped, KeyboardInterrupt) as e:
    print(f"stopped: {e or 'interrupted'}; rerun the same command to continue.", file=sys.stderr)
    return 130
  if code == 0 and not outcome["results"]["data_check"]["ok"]:
    print("error: the arms did not see the same batches; see the warning in report.md.",
          file=sys.stderr)
    return 1
  return code


if __name__ == "__main__":
  sys.exit(main())
