"""The "retrieval" section: multi-needle retrieval in real text at one context length, accuracy
per (N needles, R queried) cell (paper Table 2), and the report's table of the cells."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from diffjax.data.tasks import DEPTHS, NEEDLE_GRID, ContextTooShort, MultiNeedleTask
from diffjax.eval import display, stats
from diffjax.eval.registry import HIGHER_IS_BETTER, Section
from diffjax.eval.runner import LogitsFn
from diffjax.eval.scoring import retrieval_accuracy
from diffjax.eval.sections.context import Context


def needle_table(
  fn: LogitsFn,
  context_len: int,
  grid: Sequence[tuple[int, int]] = NEEDLE_GRID,
  samples_per_depth: int = 10,
  depths: Sequence[float] = DEPTHS,
  seed: int = 0,
  batch_size: int = 8,
  filler=None,
) -> dict[str, Any]:
  """Accuracy per (N, R) cell at one context length, averaged over depths (paper Table 2).

  Returns {"context_len", "cells": {"N{n}_R{r}": accuracy}, "by_depth": {cell: {depth: acc}},
  "mean": mean over cells, "skipped": {cell: reason}} (cells whose needles and question do not
  fit in `context_len` are skipped, not failed).
  """
  cells, by_depth, skipped = {}, {}, {}
  for n, r in grid:
    try:
      task = MultiNeedleTask(
        context_len,
        n,
        r,
        depths=depths,
        num_examples=samples_per_depth * len(depths),
        seed=seed,
        filler=filler,
      )
    except ContextTooShort as e:
      skipped[f"N{n}_R{r}"] = str(e)
      continue
    res = retrieval_accuracy(fn, task, batch_size=batch_size)
    cells[f"N{n}_R{r}"] = res["accuracy"]
    by_depth[f"N{n}_R{r}"] = res["by_depth"]
  return {
    "context_len": int(context_len),
    "cells": cells,
    "by_depth": by_depth,
    "mean": float(np.mean(list(cells.values()))) if cells else float("nan"),
    "skipped": skipped,
  }


def run(context: Context) -> dict[str, Any]:
  cfg = context.config
  return needle_table(
    context.logits_fn,
    cfg.context_len,
    cfg.needle_grid,
    cfg.samples_per_depth,
    cfg.depths,
    cfg.seed,
    cfg.batch_size,
    context.filler,
  )


def scalars(result: Mapping[str, Any]) -> dict[str, float]:
  out = {f"retrieval/{cell}": acc for cell, acc in result["cells"].items()}
  out["retrieval/mean"] = result["mean"]
  return out


def table(groups: Mapping[str, Sequence[Mapping[str, Any]]], agg: Mapping[str, Any]) -> list[str]:
  """The (N, R) retrieval table with one row per arm (means over seeds)."""
  del agg  # the cells' means come from the runs, every run counted
  cells: list[str] = []
  for rs in groups.values():
    for r in rs:
      for c in (display.section_result(r, "retrieval") or {}).get("cells", {}):
        if c not in cells:
          cells.append(c)
  if not cells:
    return []
  rows = []
  for arm, rs in groups.items():
    row = [arm]
    for c in cells:
      vals = [
        display.as_number((display.section_result(r, "retrieval") or {}).get("cells", {}).get(c))
        for r in rs
      ]
      row.append(display.fmt(stats.mean_ci(vals)["mean"], 3))
    rows.append(row)
  head = ["arm", *(c.replace("_", ", ") for c in cells)]
  return [
    "## Multi-needle retrieval (mean accuracy over seeds)",
    "",
    *display.md_table(head, rows),
    "",
  ]


SECTION = Section(
  name="retrieval",
  run=run,
  scalars=scalars,
  directions={"retrieval/*": HIGHER_IS_BETTER},
  headline=("retrieval/mean",),
  table=table,
)
