"""report.md and PNG plots from the eval results of arms x seeds.

    python -m diffjax.eval.report runs/transformer_s0 runs/diff_v1_s0 ... --out=report/

Each argument is a run directory (eval.json from `python -m diffjax.eval` and, optionally, the
trainer's metrics.jsonl) or an eval JSON file. Arms get means with t intervals over seeds, paired
t-tests against the baseline and verdicts only at p < 0.05: docs/evaluation.md#the-report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from diffjax import cli
from diffjax.errors import run_guarded
from diffjax.eval import display, plots, sections
from diffjax.eval.aggregate import BASELINE, aggregate, by_arm, summary_lines
from diffjax.train.records import METRICS_FILE, read_metrics

__all__ = ["BASELINE", "aggregate", "load_results", "write_report"]


# ----------------------------------------------------------------------------------------------
# Loading.


def load_results(paths: Sequence[str]) -> list[dict[str, Any]]:
  """Runs from run directories (eval.json + metrics.jsonl) or eval JSON files.

  A run's "curve" is its metrics.jsonl, one row per step (`diffjax.train.records.read_metrics`),
  or None without one.
  """
  runs = []
  for path in paths:
    if os.path.isdir(path):
      eval_path = os.path.join(path, "eval.json")
      ev = _read_json(eval_path) if os.path.isfile(eval_path) else None
      curve = read_metrics(path) if os.path.isfile(os.path.join(path, METRICS_FILE)) else None
      if ev is None and curve is None:
        raise FileNotFoundError(
          f"{path!r} has neither eval.json nor metrics.jsonl; run "
          "`python -m diffjax.eval --workdir=...` on it first."
        )
    elif os.path.isfile(path):
      ev, curve = _read_json(path), None
    else:
      raise FileNotFoundError(f"{path!r} is neither a run directory nor an eval JSON file.")
    meta = (ev or {}).get("meta", {})
    arm = meta.get("arm")
    if arm is None:
      cfg_path = os.path.join(path, "model_config.json") if os.path.isdir(path) else None
      arm = _read_json(cfg_path).get("attention") if cfg_path and os.path.isfile(cfg_path) else None
    if arm is None:
      raise ValueError(
        f"Cannot tell the arm of {path!r}: no meta.arm in eval.json and no model_config.json."
      )
    runs.append({"arm": arm, "seed": meta.get("seed"), "name": path, "eval": ev, "curve": curve})
  return runs


def _read_json(path: str) -> dict:
  with open(path, encoding="utf-8") as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path!r} is not whole JSON ({e}); evaluate the run again.") from None


# ----------------------------------------------------------------------------------------------
# Markdown.


# The report's last section: what the measures mean.
_HOW_TO_READ = [
  "## How to read this",
  "",
  "- Retrieval accuracy is teacher-forced exact match of every answer token, which equals "
  "greedy-decoding exact match; the table cells average the answer depths.",
  "- Attention allocation: rows that predict an answer token; `signed_share` divides "
  "each region's signed sum of A1 - lambda A2 by the rows' signed total (regions sum to "
  "1, the paper's Figure 1 normalisation); `abs_share` uses |weights| and is in [0, 1]. "
  "For the Transformer both are the same.",
  "- Outliers: k-th largest |value| over causally valid attention scores (both maps for "
  "DIFF) and over every block's output; medians may be estimated from a sample.",
  "- Low-bit: absmax round-to-nearest; logits-only settings quantize just the attention "
  "scores; w/a/kv settings quantize projection weights per output channel, their inputs "
  "per token, and keys/values per token and head.",
  "- Probes: clamp = loss change when negative attention weights are set to zero; map "
  "correlation = Pearson correlation of A1 and A2 over non-salient keys (for the "
  "Transformer, of query heads 2i and 2i+1, as a control).",
  "",
]


def _results_tables(agg: Mapping[str, Any]) -> list[str]:
  """Every scalar per arm (mean ± interval), then the paired differences against the
  baseline."""
  pct, baseline = f"{agg['confidence']:.0%}", agg["baseline"]
  # (heading, what the cells are, {column: {metric: result}}, the cell's format)
  tables = []
  if agg["metrics"]:
    tables.append(
      (
        "## Results per arm",
        f"Mean over seeds ± half-width of the two-sided {pct} t interval (n seeds).",
        agg["per_arm"],
        display.fmt_ci,
      )
    )
  if agg["paired"]:
    tables.append(
      (
        f"## Paired differences against {baseline}",
        f"Arm minus {baseline} at matched seeds: mean [{pct} t interval], two-sided paired "
        "t-test p-value.",
        agg["paired"],
        display.fmt_diff,
      )
    )
  md = []
  for heading, text, by_column, fmt in tables:
    rows = [[m, *(fmt(by_column[c][m]) for c in by_column)] for m in agg["metrics"]]
    md += [heading, "", text, "", *display.md_table(["metric", *by_column], rows), ""]
  return md


def write_report(
  runs: Sequence[Mapping[str, Any]],
  out_dir: str,
  baseline: str = BASELINE,
  confidence: float = 0.95,
  title: str = "diffjax evaluation report",
  preamble: Sequence[str] = (),
) -> str:
  """Writes report.md and the PNG plots into `out_dir`; returns the report's path.

  Args:
    runs: [{"arm", "seed", "name", "eval" (eval JSON or None), "curve" (metrics rows or
      None)}], as `load_results` returns them.
    out_dir: created if missing.
    baseline: the arm the others are paired against.
    confidence: of the t intervals.
    title: the report's first heading.
    preamble: markdown lines placed after the title, before the run list.
  """
  os.makedirs(out_dir, exist_ok=True)
  agg = aggregate(runs, baseline, confidence)
  groups = by_arm(runs)
  figures = plots.make_plots(groups, out_dir)
  arms = agg["arms"]
  md = [f"# {title}", ""]
  if preamble:
    md += [*preamble] + ([""] if preamble[-1] else [])
  rows = [
    [arm, ", ".join(str(r.get("seed")) for r in groups[arm]), str(len(groups[arm]))] for arm in arms
  ]
  md += ["## Runs", "", *display.md_table(["arm", "seeds", "runs"], rows), ""]
  md += ["## Summary", ""]
  md += [f"- {line}" for line in summary_lines(agg)] or ["- No scalar results."]
  md.append("")
  md += _results_tables(agg)
  for section in sections.registered():
    if section.table is not None:
      md += section.table(groups, agg)
  if figures:
    md += ["## Figures", ""]
    for name, caption in figures:
      md += [f"![{caption}]({name})", "", f"*{caption}*", ""]
  md += _HOW_TO_READ
  path = os.path.join(out_dir, "report.md")
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(md))
  return path


def main(argv: Sequence[str] | None = None) -> int:
  p = cli.ArgumentParser(
    prog="python -m diffjax.eval.report",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("runs", nargs="+", help="run directories or eval JSON files")
  p.add_argument("--out", required=True, help="output directory for report.md and PNGs")
  p.add_argument("--baseline", default=BASELINE, help="arm the others are paired against")
  p.add_argument("--confidence", type=float, default=0.95)
  args = p.parse_args(argv)
  if os.path.exists(args.out) and not os.path.isdir(args.out):
    print(f"error: --out={args.out!r} is a file; name a directory for the report.", file=sys.stderr)
    return 2
  paths = []
  status = run_guarded(
    lambda: paths.append(
      write_report(load_results(args.runs), args.out, args.baseline, args.confidence)
    )
  )
  if status:
    return status
  print(f"wrote {paths[0]}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
