"""Aggregate eval results over arms x seeds into report.md and PNG plots.

    python -m diffjax.eval.report runs/transformer_s0 runs/diff_v1_s0 ... --out=report/

Each positional argument is a run directory (holding eval.json from `python -m diffjax.eval`
and, optionally, the trainer's metrics.jsonl) or an eval JSON file.

Input structure (`load_results` builds it; `write_report` takes it), a list of runs:

    [{"arm": "transformer",             # from eval["meta"]["arm"]
      "seed": 0,                        # from eval["meta"]["seed"]; runs of different arms
                                        # with the same seed are paired
      "name": "runs/transformer_s0",    # shown in the run list
      "eval": {... eval JSON, schema "diffjax.eval/1" ...},      # optional
      "curve": [{"step": 50, "train/loss": 3.1, "eval/loss": 3.2}, ...]},   # optional
     ...]

Outputs in `out_dir`: report.md; loss_curves.png (mean over seeds, band = t interval, or the
seeds' range when only two), retrieval_heatmap.png, allocation.png, lambda.png, lowbit.png
(each only when some run has the data).

Statistics (`diffjax.eval.stats`): each arm's scalar is reported as mean ± half-width of the
two-sided 95% t interval over seeds (n shown; no interval with one seed); each non-baseline arm
is compared with the baseline by paired differences over the seeds both have, with a paired
t-test. The summary sentences come from `stats.verdict`: "better/worse" only with p < 0.05 and a
metric whose direction is known, "no significant difference" otherwise, and the seed count
always.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from diffjax.eval import stats

BASELINE = "transformer"
ARM_ORDER = ("transformer", "diff_v1", "diff_v2")

# Metrics the summary states first, in this order.
HEADLINE = ("val/loss", "retrieval/mean", "heatmap/mean", "mqar/accuracy",
            "allocation/answer_signed_share", "allocation/context_signed_share",
            "outliers/attention_logits_top1", "outliers/hidden_top1")


def direction(metric: str) -> bool | None:
  """True if higher is better, False if lower is better, None for descriptive metrics."""
  if metric.startswith(("val/", "lowbit/")) and metric.endswith(("loss", "perplexity")):
    return False
  if metric.endswith("accuracy") or metric.startswith(("retrieval/", "heatmap/")):
    return True
  return None


# ----------------------------------------------------------------------------------------------
# Loading.


def read_metrics_jsonl(path: str) -> list[dict[str, float]]:
  """Rows of a trainer metrics.jsonl (one JSON object per line; bad lines are skipped)."""
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(row, dict) and "step" in row:
        rows.append(row)
  return rows


def load_results(paths: Sequence[str]) -> list[dict[str, Any]]:
  """Runs from run directories (eval.json + metrics.jsonl) or eval JSON files."""
  runs = []
  for path in paths:
    if os.path.isdir(path):
      eval_path = os.path.join(path, "eval.json")
      metrics_path = os.path.join(path, "metrics.jsonl")
      ev = _read_json(eval_path) if os.path.isfile(eval_path) else None
      curve = read_metrics_jsonl(metrics_path) if os.path.isfile(metrics_path) else None
      if ev is None and curve is None:
        raise FileNotFoundError(f"{path!r} has neither eval.json nor metrics.jsonl; run "
                                "`python -m diffjax.eval --workdir=...` on it first.")
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
      raise ValueError(f"Cannot tell the arm of {path!r}: no meta.arm in eval.json and no "
                       "model_config.json.")
    runs.append({"arm": arm, "seed": meta.get("seed"), "name": path, "eval": ev, "curve": curve})
  return runs


def _read_json(path: str) -> dict:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _by_arm(runs: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
  groups: dict[str, list] = {}
  for r in runs:
    groups.setdefault(r["arm"], []).append(r)
  order = [a for a in ARM_ORDER if a in groups] + sorted(a for a in groups if a not in ARM_ORDER)
  return {a: sorted(groups[a], key=lambda r: (r.get("seed") is None, r.get("seed") or 0))
          for a in order}


def _seed_key(run, index):
  return run.get("seed") if run.get("seed") is not None else f"#{index}"


# ----------------------------------------------------------------------------------------------
# Aggregation.


def aggregate(runs: Sequence[Mapping[str, Any]], baseline: str = BASELINE,
              confidence: float = 0.95) -> dict[str, Any]:
  """Per-arm mean/CI of every scalar and paired differences against `baseline`.

  Returns {"arms": [..], "metrics": [..], "per_arm": {arm: {metric: mean_ci}},
  "paired": {arm: {metric: paired_difference}}}, pairing runs by seed.
  """
  groups = _by_arm(runs)
  metrics: list[str] = []
  for arm_runs in groups.values():
    for r in arm_runs:
      for k in ((r.get("eval") or {}).get("scalars") or {}):
        if k not in metrics:
          metrics.append(k)
  values = {arm: {m: {_seed_key(r, i): _num((r.get("eval") or {}).get("scalars", {}).get(m))
                      for i, r in enumerate(arm_runs)} for m in metrics}
            for arm, arm_runs in groups.items()}
  per_arm = {arm: {m: stats.mean_ci(list(v.values()), confidence) for m, v in vals.items()}
             for arm, vals in values.items()}
  paired = {}
  if baseline in values:
    for arm in values:
      if arm == baseline:
        continue
      paired[arm] = {}
      for m in metrics:
        a, b = values[arm][m], values[baseline][m]
        seeds = [s for s in a if s in b and not str(s).startswith("#")]
        paired[arm][m] = stats.paired_difference([a[s] for s in seeds], [b[s] for s in seeds],
                                                 confidence)
  return {"arms": list(groups), "metrics": metrics, "per_arm": per_arm, "paired": paired,
          "baseline": baseline, "confidence": confidence}


def _num(x) -> float:
  try:
    return float(x)
  except (TypeError, ValueError):
    return float("nan")


def _fmt(x: float, digits: int = 4) -> str:
  if x is None or not math.isfinite(x):
    return "n/a"
  return f"{x:.{digits}g}"


def _fmt_ci(c: Mapping[str, float]) -> str:
  if c["n"] == 0:
    return "–"
  if c["n"] < 2:
    return f"{_fmt(c['mean'])} (n=1)"
  return f"{_fmt(c['mean'])} ± {_fmt(c['half_width'], 2)} (n={c['n']})"


def _fmt_diff(d: Mapping[str, float]) -> str:
  if d["n"] == 0:
    return "–"
  if d["n"] < 2:
    return f"{d['mean']:+.3g} (n=1, no test)"
  return f"{d['mean']:+.3g} [{d['lo']:+.3g}, {d['hi']:+.3g}] p={_fmt(d['p'], 2)} (n={d['n']})"


# ----------------------------------------------------------------------------------------------
# Report.


def summary_lines(agg: Mapping[str, Any], alpha: float = 0.05) -> list[str]:
  """Plain-language verdicts for the headline metrics (only those some run has)."""
  lines = []
  if not agg["paired"]:
    base = agg["baseline"]
    lines.append(f"No {base} runs, so no paired comparisons; the tables give each arm alone.")
    return lines
  for arm, diffs in agg["paired"].items():
    for m in HEADLINE:
      if m in diffs:
        lines.append(stats.verdict(diffs[m], m, arm, agg["baseline"], direction(m), alpha))
  n_sig = sum(1 for diffs in agg["paired"].values() for m, d in diffs.items()
              if d.get("p", float("nan")) < alpha)
  n_all = sum(1 for diffs in agg["paired"].values() for d in diffs.values() if d["n"] >= 2)
  if n_all:
    lines.append(f"Across all {n_all} paired comparisons with at least two seeds, {n_sig} have "
                 f"p < {alpha}; with this many tests about {alpha * n_all:.1f} would by chance "
                 "alone, so read single significant rows with care.")
  return lines


def write_report(runs: Sequence[Mapping[str, Any]], out_dir: str, baseline: str = BASELINE,
                 confidence: float = 0.95, title: str = "diffjax evaluation report") -> str:
  """Writes report.md and the PNG plots into `out_dir`; returns the report's path."""
  os.makedirs(out_dir, exist_ok=True)
  agg = aggregate(runs, baseline, confidence)
  figures = make_plots(runs, out_dir)
  arms = agg["arms"]
  groups = _by_arm(runs)
  md = [f"# {title}", ""]
  md += ["## Runs", "", "| arm | seeds | runs |", "|---|---|---|"]
  for arm in arms:
    seeds = ", ".join(str(r.get("seed")) for r in groups[arm])
    md.append(f"| {arm} | {seeds} | {len(groups[arm])} |")
  md.append("")
  md += ["## Summary", ""]
  md += [f"- {line}" for line in summary_lines(agg)] or ["- No scalar results."]
  md.append("")
  pct = f"{confidence:.0%}"
  if agg["metrics"]:
    md += ["## Results per arm", "",
           f"Mean over seeds ± half-width of the two-sided {pct} t interval (n seeds).", ""]
    md.append("| metric | " + " | ".join(arms) + " |")
    md.append("|---" * (len(arms) + 1) + "|")
    for m in agg["metrics"]:
      md.append(f"| {m} | " + " | ".join(_fmt_ci(agg["per_arm"][a][m]) for a in arms) + " |")
    md.append("")
  if agg["paired"]:
    others = list(agg["paired"])
    md += [f"## Paired differences against {baseline}", "",
           f"Arm minus {baseline} at matched seeds: mean [{pct} t interval], two-sided paired "
           "t-test p-value.", ""]
    md.append("| metric | " + " | ".join(others) + " |")
    md.append("|---" * (len(others) + 1) + "|")
    for m in agg["metrics"]:
      md.append(f"| {m} | " + " | ".join(_fmt_diff(agg["paired"][a][m]) for a in others) + " |")
    md.append("")
  table = _needle_table_md(runs)
  if table:
    md += table
  if figures:
    md += ["## Figures", ""]
    for name, caption in figures:
      md += [f"![{caption}]({name})", "", f"*{caption}*", ""]
  md += ["## How to read this", "",
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
         "Transformer, of query heads 2i and 2i+1, as a control).", ""]
  path = os.path.join(out_dir, "report.md")
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(md))
  return path


def _needle_table_md(runs) -> list[str]:
  """The (N, R) retrieval table with one row per arm (means over seeds)."""
  groups = _by_arm(runs)
  cells: list[str] = []
  for rs in groups.values():
    for r in rs:
      for c in (((r.get("eval") or {}).get("sections") or {}).get("retrieval") or {}).get("cells", {}):
        if c not in cells:
          cells.append(c)
  if not cells:
    return []
  md = ["## Multi-needle retrieval (mean accuracy over seeds)", "",
        "| arm | " + " | ".join(c.replace("_", ", ") for c in cells) + " |",
        "|---" * (len(cells) + 1) + "|"]
  for arm, rs in groups.items():
    row = []
    for c in cells:
      vals = [_num((((r.get("eval") or {}).get("sections") or {}).get("retrieval") or {})
                   .get("cells", {}).get(c)) for r in rs]
      ci = stats.mean_ci(vals)
      row.append(_fmt(ci["mean"], 3))
    md.append(f"| {arm} | " + " | ".join(row) + " |")
  return md + [""]


# ----------------------------------------------------------------------------------------------
# Plots.


def _colors(arms: Iterable[str]) -> dict[str, str]:
  palette = {"transformer": "tab:gray", "diff_v1": "tab:blue", "diff_v2": "tab:orange"}
  extra = iter(["tab:green", "tab:red", "tab:purple", "tab:brown"])
  return {a: palette.get(a) or next(extra, "black") for a in arms}


def _band(values_NxK: np.ndarray, confidence: float = 0.95):
  """Mean and band over seeds (axis 0): t interval when n >= 3, min-max at n = 2."""
  mean = np.nanmean(values_NxK, axis=0)
  n = values_NxK.shape[0]
  if n < 2:
    return mean, None, None
  if n == 2:
    return mean, np.nanmin(values_NxK, axis=0), np.nanmax(values_NxK, axis=0)
  sem = np.nanstd(values_NxK, axis=0, ddof=1) / math.sqrt(n)
  half = stats.t_ppf(0.5 + confidence / 2, n - 1) * sem
  return mean, mean - half, mean + half


def _curve(rows, key):
  pts = {int(r["step"]): float(r[key]) for r in rows if key in r and _finite(r[key])}
  return pts


def _finite(x) -> bool:
  try:
    return math.isfinite(float(x))
  except (TypeError, ValueError):
    return False


def make_plots(runs: Sequence[Mapping[str, Any]], out_dir: str) -> list[tuple[str, str]]:
  """Writes every plot the data allows; returns [(file name, caption)]."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  groups = _by_arm(runs)
  colors = _colors(groups)
  made = []
  for fn in (_plot_loss, _plot_heatmap, _plot_allocation, _plot_lambda, _plot_lowbit):
    res = fn(plt, groups, colors, out_dir)
    if res:
      made.append(res)
    plt.close("all")
  return made


def _plot_loss(plt, groups, colors, out_dir):
  if not any(r.get("curve") for rs in groups.values() for r in rs):
    return None
  fig, ax = plt.subplots(figsize=(7, 4.2))
  for arm, rs in groups.items():
    curves = [_curve(r["curve"], "train/loss") for r in rs if r.get("curve")]
    curves = [c for c in curves if c]
    if curves:
      steps = sorted(set.intersection(*(set(c) for c in curves)))
      if steps:
        vals = np.asarray([[c[s] for s in steps] for c in curves])
        mean, lo, hi = _band(vals)
        ax.plot(steps, mean, color=colors[arm], label=f"{arm} train (n={len(curves)})")
        if lo is not None:
          ax.fill_between(steps, lo, hi, color=colors[arm], alpha=0.2)
    evals = [_curve(r["curve"], "eval/loss") for r in rs if r.get("curve")]
    evals = [c for c in evals if c]
    if evals:
      steps = sorted(set.intersection(*(set(c) for c in evals)))
      if steps:
        vals = np.asarray([[c[s] for s in steps] for c in evals])
        mean, lo, hi = _band(vals)
        yerr = None if lo is None else np.vstack([mean - lo, hi - mean])
        ax.errorbar(steps, mean, yerr=yerr, color=colors[arm], marker="o", ls="--", ms=4,
                    label=f"{arm} eval")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats/token)")
  ax.set_title("Loss over training: mean over seeds, band = 95% t interval (range at n=2)")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "loss_curves.png"), dpi=120)
  return "loss_curves.png", "Training and validation loss per arm (mean over seeds with band)."


def _sections(r, name):
  return (((r.get("eval") or {}).get("sections")) or {}).get(name)


def _plot_heatmap(plt, groups, colors, out_dir):
  data = {}
  for arm, rs in groups.items():
    maps = [_sections(r, "heatmap") for r in rs if _sections(r, "heatmap")]
    if maps:
      ref = maps[0]
      same = [m for m in maps if m["lengths"] == ref["lengths"] and m["depths"] == ref["depths"]]
      data[arm] = (np.mean([np.asarray(m["accuracy"], float) for m in same], axis=0), ref, len(same))
  if not data:
    return None
  fig, axes = plt.subplots(1, len(data), figsize=(4.2 * len(data), 3.6), squeeze=False)
  for k, (ax, (arm, (acc, ref, n))) in enumerate(zip(axes[0], data.items())):
    im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(ref["lengths"])), [str(x) for x in ref["lengths"]])
    ax.set_yticks(range(len(ref["depths"])), [f"{d:.0%}" for d in ref["depths"]])
    for i in range(acc.shape[0]):
      for j in range(acc.shape[1]):
        ax.text(j, i, f"{acc[i, j]:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xlabel("context length (tokens)")
    if k == 0:
      ax.set_ylabel("answer depth")
    n_needles, n_q = ref.get("needles", ["?", "?"])
    ax.set_title(f"{arm} (N={n_needles}, R={n_q}, n={n})", fontsize=9)
  fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
  fig.savefig(os.path.join(out_dir, "retrieval_heatmap.png"), dpi=120, bbox_inches="tight")
  return ("retrieval_heatmap.png",
          "Multi-needle retrieval accuracy by depth and context length (mean over seeds).")


def _plot_allocation(plt, groups, colors, out_dir):
  rows = {}
  for arm, rs in groups.items():
    al = [_sections(r, "allocation") for r in rs if _sections(r, "allocation")]
    if al:
      names = al[0]["regions"]
      rows[arm] = {k: np.asarray([a["summary"][k] for a in al], float)
                   for k in ("signed_share", "abs_share")}
      rows[arm]["names"] = names
  if not rows:
    return None
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
  width = 0.8 / len(rows)
  for ax, key in zip(axes, ("signed_share", "abs_share")):
    for i, (arm, d) in enumerate(rows.items()):
      mean, lo, hi = _band(d[key])
      x = np.arange(len(d["names"])) + i * width - 0.4 + width / 2
      yerr = None if lo is None else np.vstack([mean - lo, hi - mean])
      ax.bar(x, mean, width, yerr=yerr, color=colors[arm], label=f"{arm} (n={d[key].shape[0]})",
             capsize=3)
    ax.set_xticks(range(len(d["names"])), d["names"])
    ax.axhline(0, color="black", lw=0.6)
    ax.set_title("signed share (sums to 1)" if key == "signed_share" else "absolute share")
    ax.grid(axis="y", alpha=0.3)
  axes[0].set_ylabel("attention of answer-predicting rows")
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "allocation.png"), dpi=120)
  return ("allocation.png", "Attention allocation by region, mean over layers and seeds "
          "(error bars: 95% t interval; range at n=2).")


def _plot_lambda(plt, groups, colors, out_dir):
  panels = []
  for arm, rs in groups.items():
    lams = [(_sections(r, "text") or {}).get("lambda") for r in rs]
    lams = [l for l in lams if l and l.get("kind") in ("scalar", "sigmoid")]
    if lams:
      panels.append((arm, lams))
  if not panels:
    return None
  fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
  for ax, (arm, lams) in zip(axes[0], panels):
    if lams[0]["kind"] == "scalar":
      vals = np.asarray([l["layers"] for l in lams], float)
      layers = np.arange(vals.shape[1])
      for v in vals:
        ax.plot(layers, v, color=colors[arm], alpha=0.35, marker=".")
      ax.plot(layers, vals.mean(0), color=colors[arm], marker="o", label=f"lambda (n={len(vals)})")
      ax.plot(layers, lams[0]["lambda_init"], color="black", ls="--", label="lambda_init")
      ax.set_ylabel("lambda")
    else:
      means = np.asarray([[x["mean"] for x in l["layers"]] for l in lams], float)
      q05 = np.asarray([[x["quantiles"]["0.05"] for x in l["layers"]] for l in lams], float).mean(0)
      q95 = np.asarray([[x["quantiles"]["0.95"] for x in l["layers"]] for l in lams], float).mean(0)
      layers = np.arange(means.shape[1])
      ax.plot(layers, means.mean(0), color=colors[arm], marker="o", label=f"mean (n={len(means)})")
      ax.fill_between(layers, q05, q95, color=colors[arm], alpha=0.2, label="5-95% of tokens")
      ax.set_ylim(0, 1)
      ax.set_ylabel("sigmoid(lambda)")
    ax.set_xlabel("layer")
    ax.set_xticks(layers)
    ax.set_title(arm)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "lambda.png"), dpi=120)
  return ("lambda.png", "DIFF V1 lambda per layer (thin lines: seeds) and DIFF V2 "
          "sigmoid(lambda) on evaluation text.")


def _plot_lowbit(plt, groups, colors, out_dir):
  series = {}
  for arm, rs in groups.items():
    lbs = [_sections(r, "lowbit") for r in rs if _sections(r, "lowbit")]
    if not lbs:
      continue
    bits = sorted({int(k[len("logits"):]) for k in lbs[0] if k.startswith("logits")}, reverse=True)
    if bits:
      vals = np.asarray([[lb.get(f"logits{b}", {}).get("loss", np.nan) for b in bits] for lb in lbs])
      base = np.asarray([lb["float"]["loss"] for lb in lbs])
      series[arm] = (bits, vals, base)
  if not series:
    return None
  fig, ax = plt.subplots(figsize=(6, 3.8))
  for arm, (bits, vals, base) in series.items():
    mean, lo, hi = _band(vals)
    yerr = None if lo is None else np.vstack([mean - lo, hi - mean])
    ax.errorbar([str(b) for b in bits], mean, yerr=yerr, color=colors[arm], marker="o",
                capsize=3, label=f"{arm} (float {np.mean(base):.3f}, n={len(vals)})")
  ax.set_xlabel("attention-logit bits (absmax)")
  ax.set_ylabel("validation loss")
  ax.set_title("Loss with only the attention logits quantized")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "lowbit.png"), dpi=120)
  return "lowbit.png", "Validation loss when only attention logits are quantized (mean over seeds)."


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m diffjax.eval.report", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("runs", nargs="+", help="run directories or eval JSON files")
  p.add_argument("--out", required=True, help="output directory for report.md and PNGs")
  p.add_argument("--baseline", default=BASELINE, help="arm the others are paired against")
  p.add_argument("--confidence", type=float, default=0.95)
  args = p.parse_args(argv)
  runs = load_results(args.runs)
  path = write_report(runs, args.out, args.baseline, args.confidence)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
