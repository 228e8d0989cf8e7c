"""The comparison's own summary: a per-arm table of the trainer's losses, the data check, and the
loss curves handed to the report.

`summary_section` returns markdown lines that `diffjax.eval.report.write_report` places right
after the report's title (its ``preamble``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from diffjax.compare.config import ComparisonConfig
from diffjax.compare.datacheck import mismatch_warning
from diffjax.eval import display, stats
from diffjax.model import count_params, resolve_model
from diffjax.train.config import RunConfig


def loss_curve(metrics: Sequence[Mapping[str, float]], every: int) -> list[dict[str, float]]:
  """Rows {step, train/loss, eval/loss} from metrics rows sorted by step: the train loss averaged
  over each window of ``every`` steps (per-step losses are too noisy to compare arms by eye),
  eval losses where measured."""
  rows, window = [], []
  last = metrics[-1]["step"] if metrics else 0
  for m in metrics:
    step = int(m["step"])
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


def _fmt(ci: Mapping[str, float], digits: int = 4) -> str:
  if ci["n"] == 0:
    return "–"
  if ci["n"] == 1:
    return f"{ci['mean']:.{digits}g}"
  return f"{ci['mean']:.{digits}g} ± {ci['half_width']:.2g}"


def _paired_cell(d: Mapping[str, float]) -> str:
  if d["n"] >= 2 and math.isfinite(d.get("p", float("nan"))):
    return f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}] p={d['p']:.2g}"
  if d["n"] >= 1:
    return f"{d['mean']:+.4f} (n={d['n']}, no test)"
  return "–"


def diverged_note(run: Mapping[str, Any]) -> str | None:
  """Why a run of the comparison counts as diverged (its DIVERGED marker: the trainer stopped
  it on non-finite updates), or None if it trained to the end."""
  marker = run.get("diverged")
  return f"stopped on non-finite updates at step {marker['step']}" if marker else None


def summary_table(
  runs: Sequence[Mapping[str, Any]],
  arms: Sequence[str],
  baseline: str,
  confidence: float,
  log_every: int,
) -> tuple[list[str], dict[str, Any]]:
  """The per-arm summary (markdown lines, and the same numbers as a dict by arm). A diverged
  run (:func:`diverged_note`) is counted in a "diverged" column, shown only when some run
  diverged, and left out of the losses' means and paired differences."""
  cols = [
    (f"train loss (last {log_every} steps)", "train/final_loss"),
    ("final eval loss", "val/final_eval_loss"),
    ("retrieval/mean", "retrieval/mean"),
    ("mqar/accuracy", "mqar/accuracy"),
  ]
  present = [
    (title, key)
    for title, key in cols
    if any(key in (r["eval"] or {}).get("scalars", {}) for r in runs)
  ]
  nan = float("nan")
  by_seed = {
    (r["arm"], r["seed"]): {k: nan for k, _ in cols}
    if diverged_note(r)
    else (r["eval"] or {}).get("scalars", {})
    for r in runs
  }
  any_diverged = any(diverged_note(r) for r in runs)
  table: dict[str, Any] = {}
  head = ["arm", "params", "seeds", *(["diverged"] if any_diverged else [])]
  head += [t for t, _ in present]
  head += [f"final eval loss − {baseline} (paired)", "train time / run"]
  cells = []
  for arm in arms:
    mine = [r for r in runs if r["arm"] == arm]
    row = {
      "params": mine[0]["params"] if mine else None,
      "seeds": [r["seed"] for r in mine],
      "diverged": [r["seed"] for r in mine if diverged_note(r)],
    }
    for _, key in present:
      row[key] = stats.mean_ci(
        [by_seed[(arm, r["seed"])].get(key, float("nan")) for r in mine], confidence
      )
    seeds = [r["seed"] for r in mine if (baseline, r["seed"]) in by_seed]
    key = "val/final_eval_loss"
    row["paired_eval_loss"] = stats.paired_difference(
      [by_seed[(arm, s)].get(key, float("nan")) for s in seeds],
      [by_seed[(baseline, s)].get(key, float("nan")) for s in seeds],
      confidence,
    )
    row["train_seconds"] = stats.mean_ci([r["train_seconds"] for r in mine], confidence)
    table[arm] = row
    paired = "(baseline)" if arm == baseline else _paired_cell(row["paired_eval_loss"])
    secs = row["train_seconds"]["mean"]
    gone = [f"{len(row['diverged'])}/{len(mine)}"] if any_diverged else []
    cells.append(
      [arm, f"{row['params']:,}", str(len(mine)), *gone, *(_fmt(row[k]) for _, k in present)]
      + [paired, f"{secs:.0f} s"]
    )
  return display.md_table(head, cells), table


def perf_table(runs: Sequence[Mapping[str, Any]], arms: Sequence[str], baseline: str) -> list[str]:
  """Step time, tokens/s and MFU per arm (medians of the trainer's log intervals, from each
  run's final_metrics.json, averaged over seeds); empty when the runs logged none. MFU only
  where the device has a peak (a TPU or GPU kind, or ``peak_flops`` in the config)."""

  def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None

  rows = {}
  for arm in arms:
    finals = [r.get("final_metrics") or {} for r in runs if r["arm"] == arm]
    rows[arm] = {
      k: mean([f.get(f"perf/{k}") for f in finals])
      for k in ("step_time_s", "tokens_per_s_per_device", "mfu", "model_flops_per_token")
    }
  if not any(r["step_time_s"] for r in rows.values()):
    return []
  base = rows.get(baseline, {}).get("step_time_s")
  head = ["arm", "step time", f"vs {baseline}", "tokens/s per device", "model GFLOP/token", "MFU"]
  cells = []
  for arm, r in rows.items():
    if r["step_time_s"] is None:
      continue
    ratio = f"{r['step_time_s'] / base:.3f}x" if base else "-"
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "- (no peak for this device)"
    flops = f"{r['model_flops_per_token'] / 1e9:.4f}" if r["model_flops_per_token"] else "-"
    step = f"{r['step_time_s'] * 1e3:.1f} ms"
    cells.append([arm, step, ratio, f"{r['tokens_per_s_per_device']:,.0f}", flops, mfu])
  return display.md_table(head, cells)


# An arm whose parameters differ from the Transformer's by more than this share is not matched
# by parameters (DIFF V2 matched by parameters is within it).
PARAMS_TOLERANCE = 0.005


def _transformer_params(config: ComparisonConfig, runs: Sequence[Mapping[str, Any]]) -> int | None:
  """The parameters of the Transformer every arm is matched to: base's model, at the runs'
  vocabulary; None when it does not resolve."""
  vocab = next((r["vocab_size"] for r in runs if r.get("vocab_size")), None)
  try:
    return count_params(resolve_model(config.base.model.to_dict(), vocab_size=vocab).baseline)
  except ValueError:
    return None


def _matching_line(config: ComparisonConfig, runs: Sequence[Mapping[str, Any]]) -> str:
  """Which matching made the arms, and their parameter counts; the arms whose count is more than
  :data:`PARAMS_TOLERANCE` away from the Transformer's are named as not matched by parameters."""
  params = {}
  for r in runs:
    params.setdefault(r["arm"], r["params"])
  counts = ", ".join(f"{arm} {n:,}" for arm, n in params.items() if n is not None)
  how = {
    "params": "by parameters (its SwiGLU width shrunk so its total is within 0.5 % of the "
    "Transformer's)",
    "heads": "by heads (the Transformer's widths, plus its extra query heads and W_λ)",
  }
  line = (
    f"Arms matched to one Transformer spec; DIFF V2 matched "
    f"{how.get(config.v2_match, config.v2_match)}. Parameters: {counts}."
  )
  ref = _transformer_params(config, runs)
  if not ref:
    return line
  off = {arm: n / ref - 1.0 for arm, n in params.items() if n is not None}
  off = {arm: d for arm, d in off.items() if abs(d) > PARAMS_TOLERANCE}
  if not off:
    return line
  listed = ", ".join(f"{arm} {d:+.1%}" for arm, d in off.items())
  return (
    f"{line} **Not matched by parameters**: {listed} against the Transformer's {ref:,} (more "
    f"than {PARAMS_TOLERANCE:.1%} apart)."
  )


def _data_phrase(base: RunConfig) -> str:
  """What the runs trained on, as the summary's first line says it."""
  mix = base.task_mix
  if mix.task == "none" or mix.fraction == 0.0:
    return f"`{base.data.kind}` data"
  scored = ", only the answer tokens scored" if mix.loss == "answers" else ""
  if mix.task_only:
    return (
      f"`{mix.task}` task examples alone ({mix.num_examples:,} examples{scored}; no corpus text)"
    )
  return f"`{base.data.kind}` data with {mix.fraction:.0%} of the tokens from `{mix.task}` examples"


def summary_section(
  config: ComparisonConfig,
  runs: Sequence[Mapping[str, Any]],
  arms: Sequence[str],
  data_check: Mapping[str, Any],
) -> tuple[list[str], dict[str, Any]]:
  """Markdown for the top of report.md, and the summary table's numbers by arm.

  The section says what was trained, gives the per-arm table and the data check's verdict; when
  the arms did not see the same batches a warning comes first, before anything else.
  """
  base = config.base_run
  baseline, confidence = config.report.baseline, config.report.confidence
  log_every = base.log_every
  lines, table = summary_table(runs, arms, baseline, confidence, log_every)
  tokens = base.num_steps * base.tokens_per_step
  head = (
    [
      "## Comparison summary",
      "",
      f"{len(runs)} runs; each trained {base.num_steps:,} steps x "
      f"{base.global_batch_size} x {base.seq_len} tokens = {tokens:,} tokens on "
      f"{_data_phrase(base)}, evaluation mode `{config.eval.mode}`. Mean over seeds ± "
      f"half-width of the {confidence:.0%} t interval; the paired column is arm minus "
      f"{baseline} at matched seeds. Losses are the trainer's: train averaged over the last "
      f"{log_every} steps, eval on its {base.eval_batches} validation batches "
      "at the last step (the eval suite's val/loss below uses its own `val_batches` of the "
      "same split).",
      "",
      _matching_line(config, runs),
      "",
    ]
    + lines
    + [""]
  )
  gone = [(r, diverged_note(r)) for r in runs if diverged_note(r)]
  if gone:
    head += [
      f"**{len(gone)} of {len(runs)} runs diverged** (`allow_divergence`): they are counted in "
      "the diverged column and left out of the losses' means and paired differences.",
      "",
      *(f"- {r['arm']} seed {r['seed']}: {why}" for r, why in gone),
      "",
    ]
  speed = perf_table(runs, arms, baseline)
  if speed:
    head += (
      [
        "Speed (median step time of each run's log intervals, evaluation and checkpoint "
        "waits excluded; mean over seeds):",
        "",
      ]
      + speed
      + [""]
    )
  if data_check["ok"]:
    verdict = (
      "Data check: for every seed all arms saw identical batches at every step "
      "(batch hashes from metrics.jsonl)"
    )
    if not data_check["distinct_across_seeds"]:
      verdict += "; note that the seeds did NOT vary the data order"
    head += [verdict + ".", ""]
  else:
    head = [
      *mismatch_warning(data_check),
      "",
      "The comparison is not matched; do not read the differences below as effects of the "
      "attention.",
      "",
      *head,
    ]
  return head, table
