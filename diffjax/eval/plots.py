"""PNG plots of eval results over arms x seeds, for the report.

Every plot shows each arm's mean over seeds with a band or error bars: the two-sided t interval
when there are three or more seeds, the seeds' range with two (an interval from two points is
too wide to read), nothing with one. Each plot is written only when some run has its data:

  loss_curves.png        train loss (and eval loss points) over steps
  retrieval_heatmap.png  multi-needle accuracy by answer depth x context length, one panel per arm
  mqar_grid.png          associative-recall accuracy against the number of pairs, one panel per
                         number of distractors per queried key
  allocation.png         attention allocation by region (signed and absolute shares)
  lambda.png             DIFF V1 lambda per layer; DIFF V2 sigmoid(lambda) per layer
  lowbit.png             validation loss with only the attention logits quantized
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from diffjax.eval import stats


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


def make_plots(
  groups: Mapping[str, Sequence[Mapping[str, Any]]], out_dir: str
) -> list[tuple[str, str]]:
  """Writes every plot the data allows into ``out_dir``; returns [(file name, caption)].

  ``groups`` maps each arm to its runs (the structure `diffjax.eval.report` documents), in the
  order the plots show them; `diffjax.eval.aggregate.by_arm` builds it.
  """
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")  # files only: no display needed
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  colors = _colors(groups)
  made = []
  for fn in (
    _plot_loss,
    _plot_heatmap,
    _plot_mqar_grid,
    _plot_allocation,
    _plot_lambda,
    _plot_lowbit,
  ):
    res = fn(plt, groups, colors, out_dir)
    if res:
      made.append(res)
    plt.close("all")
  return made


def _seed_band(runs, key: str):
  """(steps, mean, lo, hi, seeds) of ``key`` over the steps every run logged, or None."""
  curves = [c for c in (_curve(r["curve"], key) for r in runs if r.get("curve")) if c]
  if not curves:
    return None
  steps = sorted(set.intersection(*(set(c) for c in curves)))
  if not steps:
    return None
  mean, lo, hi = _band(np.asarray([[c[s] for s in steps] for c in curves]))
  return steps, mean, lo, hi, len(curves)


def _plot_loss(plt, groups, colors, out_dir):
  if not any(r.get("curve") for rs in groups.values() for r in rs):
    return None
  fig, ax = plt.subplots(figsize=(7, 4.2))
  for arm, rs in groups.items():
    band = _seed_band(rs, "train/loss")
    if band is not None:
      steps, mean, lo, hi, n = band
      ax.plot(steps, mean, color=colors[arm], label=f"{arm} train (n={n})")
      if lo is not None:
        ax.fill_between(steps, lo, hi, color=colors[arm], alpha=0.2)
    band = _seed_band(rs, "eval/loss")
    if band is not None:
      steps, mean, lo, hi, _ = band
      yerr = None if lo is None else np.vstack([mean - lo, hi - mean])
      ax.errorbar(
        steps, mean, yerr=yerr, color=colors[arm], marker="o", ls="--", ms=4, label=f"{arm} eval"
      )
  _label(
    ax,
    "step",
    "loss (nats/token)",
    "Loss over training: mean over seeds, band = 95% t interval (range at n=2)",
  )
  return _save(
    fig,
    out_dir,
    "loss_curves.png",
    "Training and validation loss per arm (mean over seeds with band).",
  )


def _sections(r, name):
  return (((r.get("eval") or {}).get("sections")) or {}).get(name)


def _plot_heatmap(plt, groups, colors, out_dir):
  data = {}
  for arm, rs in groups.items():
    maps = [_sections(r, "heatmap") for r in rs if _sections(r, "heatmap")]
    if maps:
      ref = maps[0]
      same = [m for m in maps if m["lengths"] == ref["lengths"] and m["depths"] == ref["depths"]]
      data[arm] = (
        np.mean([np.asarray(m["accuracy"], float) for m in same], axis=0),
        ref,
        len(same),
      )
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
  return (
    "retrieval_heatmap.png",
    "Multi-needle retrieval accuracy by depth and context length (mean over seeds).",
  )


def _plot_mqar_grid(plt, groups, colors, out_dir):
  # {arm: {(pairs, distractors): [accuracy per seed]}}
  data: dict[str, dict[tuple[int, int], list[float]]] = {}
  for arm, rs in groups.items():
    for r in rs:
      g = _sections(r, "mqar_grid")
      for name in (g or {}).get("order", []):
        kw = g["cells"][name]["settings"]
        key = (int(kw["num_pairs"]), int(kw.get("distractors_per_query", 1)))
        data.setdefault(arm, {}).setdefault(key, []).append(float(g["cells"][name]["accuracy"]))
  if not data:
    return None
  dis = sorted({d for cells in data.values() for _, d in cells})
  fig, axes = plt.subplots(1, len(dis), figsize=(3.6 * len(dis), 3.4), squeeze=False, sharey=True)
  for ax, d in zip(axes[0], dis):
    for arm, cells in data.items():
      pairs = sorted(p for p, dd in cells if dd == d)
      if not pairs:
        continue
      n = min(len(cells[(p, d)]) for p in pairs)
      vals = np.asarray([cells[(p, d)][:n] for p in pairs], float).T  # [seeds, points]
      mean, lo, hi = _band(vals)
      ax.plot(pairs, mean, "o-", color=colors[arm], label=f"{arm} (n={n})")
      if lo is not None:
        ax.fill_between(pairs, lo, hi, color=colors[arm], alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("key-value pairs in the context")
    ax.set_title(f"{d} near-duplicate distractor{'s' if d != 1 else ''} per query", fontsize=9)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel("exact-match accuracy")
  axes[0][0].legend(fontsize=8)
  return _save(
    fig,
    out_dir,
    "mqar_grid.png",
    "Associative recall accuracy by difficulty, mean over seeds (band: "
    "95% t interval with 3 or more seeds, the range with 2).",
  )


def _label(ax, xlabel: str, ylabel: str, title: str) -> None:
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)


def _save(fig, out_dir: str, name: str, caption: str) -> tuple[str, str]:
  """Writes ``fig`` to ``out_dir/name``; returns (name, caption) for the report."""
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, name), dpi=120)
  return name, caption


def _plot_allocation(plt, groups, colors, out_dir):
  rows = {}
  for arm, rs in groups.items():
    al = [_sections(r, "allocation") for r in rs if _sections(r, "allocation")]
    if al:
      names = al[0]["regions"]
      rows[arm] = {
        k: np.asarray([a["summary"][k] for a in al], float) for k in ("signed_share", "abs_share")
      }
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
      ax.bar(
        x,
        mean,
        width,
        yerr=yerr,
        color=colors[arm],
        label=f"{arm} (n={d[key].shape[0]})",
        capsize=3,
      )
    ax.set_xticks(range(len(d["names"])), d["names"])
    ax.axhline(0, color="black", lw=0.6)
    ax.set_title("signed share (sums to 1)" if key == "signed_share" else "absolute share")
    ax.grid(axis="y", alpha=0.3)
  axes[0].set_ylabel("attention of answer-predicting rows")
  axes[0].legend(fontsize=8)
  return _save(
    fig,
    out_dir,
    "allocation.png",
    "Attention allocation by region, mean over layers and seeds "
    "(error bars: 95% t interval; range at n=2).",
  )


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
  return _save(
    fig,
    out_dir,
    "lambda.png",
    "DIFF V1 lambda per layer (thin lines: seeds) and DIFF V2 sigmoid(lambda) on evaluation text.",
  )


def _plot_lowbit(plt, groups, colors, out_dir):
  series = {}
  for arm, rs in groups.items():
    lbs = [_sections(r, "lowbit") for r in rs if _sections(r, "lowbit")]
    if not lbs:
      continue
    bits = sorted({int(k[len("logits") :]) for k in lbs[0] if k.startswith("logits")}, reverse=True)
    if bits:
      vals = np.asarray(
        [[lb.get(f"logits{b}", {}).get("loss", np.nan) for b in bits] for lb in lbs]
      )
      base = np.asarray([lb["float"]["loss"] for lb in lbs])
      series[arm] = (bits, vals, base)
  if not series:
    return None
  fig, ax = plt.subplots(figsize=(6, 3.8))
  for arm, (bits, vals, base) in series.items():
    mean, lo, hi = _band(vals)
    yerr = None if lo is None else np.vstack([mean - lo, hi - mean])
    ax.errorbar(
      [str(b) for b in bits],
      mean,
      yerr=yerr,
      color=colors[arm],
      marker="o",
      capsize=3,
      label=f"{arm} (float {np.mean(base):.3f}, n={len(vals)})",
    )
  _label(
    ax,
    "attention-logit bits (absmax)",
    "validation loss",
    "Loss with only the attention logits quantized",
  )
  return _save(
    fig,
    out_dir,
    "lowbit.png",
    "Validation loss when only attention logits are quantized (mean over seeds).",
  )
