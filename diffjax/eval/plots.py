"""PNG plots of eval results over arms x seeds, for the report: the loss curves, then each
registered section's own plot (`Section.plot`), in section order.

The bands and the files: docs/evaluation.md#the-report.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from diffjax.eval import display, sections


def _curve(rows, key) -> dict[int, float]:
  """{step: value} of ``key`` over the metrics rows that have a finite one."""
  return {int(r["step"]): float(r[key]) for r in rows if key in r and _finite(r[key])}


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

  colors = display.colors(groups)
  made = []
  for fn in (_plot_loss, *(s.plot for s in sections.registered() if s.plot is not None)):
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
  mean, lo, hi = display.band(np.asarray([[c[s] for s in steps] for c in curves]))
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
  display.label_axes(
    ax,
    "step",
    "loss (nats/token)",
    "Loss over training: mean over seeds, band = 95% t interval (range at n=2)",
  )
  return display.save(
    fig,
    out_dir,
    "loss_curves.png",
    "Training and validation loss per arm (mean over seeds with band).",
  )
