"""The "mqar_grid" section: associative recall over a difficulty grid (pairs in the context x
near-duplicate distractor keys per query), one accuracy per cell; the report's table of the
cells with paired differences and its plot of accuracy against difficulty."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from diffjax.eval import display
from diffjax.eval.registry import HIGHER_IS_BETTER, Section
from diffjax.eval.runner import LogitsFn
from diffjax.eval.sections.context import Context
from diffjax.eval.sections.mqar import associative_recall


def mqar_cell_name(cell: Mapping[str, Any]) -> str:
  """The scalar name of an associative-recall grid cell: P{pairs}_D{distractors}[_Q{q}]."""
  name = f"P{int(cell['num_pairs'])}_D{int(cell.get('distractors_per_query', 1))}"
  return name + (f"_Q{int(cell['num_queries'])}" if "num_queries" in cell else "")


def associative_recall_grid(
  fn: LogitsFn,
  grid: Sequence[Mapping[str, Any]],
  num_examples: int = 64,
  seed: int = 0,
  batch_size: int = 8,
  **common,
) -> dict[str, Any]:
  """MQAR accuracy on every cell of a difficulty grid (each a dict of `AssociativeRecallTask`
  arguments over `common`); cell c draws its examples from seed `seed + c`.

  Returns {"cells": {name: {"accuracy", "all_correct", "sequence_len", "settings"}},
  "order": [names in grid order], "num_examples"}.
  """
  cells, order = {}, []
  for c, cell in enumerate(grid):
    kw = {**common, **dict(cell)}
    kw.setdefault("num_queries", min(4, int(kw["num_pairs"])))
    r = associative_recall(fn, num_examples, seed + c, batch_size, **kw)
    name = mqar_cell_name(cell)
    if name in cells:
      raise ValueError(f"mqar_grid has two cells named {name!r}; give each cell distinct settings.")
    order.append(name)
    cells[name] = {
      "accuracy": r["accuracy"],
      "all_correct": r["all_correct"],
      "sequence_len": r["sequence_len"],
      "settings": kw,
    }
  return {"cells": cells, "order": order, "num_examples": int(num_examples)}


def run(context: Context) -> dict[str, Any]:
  cfg = context.config
  # The cells set the pairs, queries and distractors; the rest of `mqar` applies to every cell.
  common = {
    k: v
    for k, v in dict(cfg.mqar or {}).items()
    if k not in ("num_pairs", "num_queries", "distractors_per_query")
  }
  return associative_recall_grid(
    context.logits_fn, cfg.mqar_grid, cfg.mqar_examples, cfg.seed + 100, cfg.batch_size, **common
  )


def scalars(result: Mapping[str, Any]) -> dict[str, float]:
  out = {f"mqar_grid/{name}": result["cells"][name]["accuracy"] for name in result["order"]}
  out["mqar_grid/mean"] = float(np.mean([result["cells"][n]["accuracy"] for n in result["order"]]))
  return out


def table(groups: Mapping[str, Sequence[Mapping[str, Any]]], agg: Mapping[str, Any]) -> list[str]:
  """The associative-recall grid: per cell each arm's mean ± interval and the paired
  differences against the baseline."""
  del groups  # the aggregate has every number
  cells = [m for m in agg["metrics"] if m.startswith("mqar_grid/") and m != "mqar_grid/mean"]
  if not cells:
    return []
  pct = f"{agg['confidence']:.0%}"
  arms, others = agg["arms"], list(agg["paired"])
  head = ["cell", *arms, *(f"{a} − {agg['baseline']}" for a in others)]
  rows = []
  for m in cells + ["mqar_grid/mean"]:
    row = [m.split("/", 1)[1]]
    row += [display.fmt_ci(agg["per_arm"][a][m]) for a in arms]
    row += [display.fmt_diff(agg["paired"][a][m]) for a in others]
    rows.append(row)
  return [
    "## Associative recall by difficulty",
    "",
    f"Exact-match accuracy per cell (P: key-value pairs, D: near-duplicate distractor pairs "
    f"per queried key): mean ± half-width of the {pct} t interval over seeds, then each "
    f"arm minus {agg['baseline']} at matched seeds [{pct} interval], paired t-test p.",
    "",
    *display.md_table(head, rows),
    "",
  ]


def plot(plt, groups, colors, out_dir):
  """mqar_grid.png: accuracy against the number of pairs, one panel per distractor count."""
  # {arm: {(pairs, distractors): [accuracy per seed]}}
  data: dict[str, dict[tuple[int, int], list[float]]] = {}
  for arm, rs in groups.items():
    for r in rs:
      g = display.section_result(r, "mqar_grid")
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
      vals_NxP = np.asarray([cells[(p, d)][:n] for p in pairs], float).T  # [seeds, points]
      mean, lo, hi = display.band(vals_NxP)
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
  return display.save(
    fig,
    out_dir,
    "mqar_grid.png",
    "Associative recall accuracy by difficulty, mean over seeds (band: "
    "95% t interval with 3 or more seeds, the range with 2).",
  )


SECTION = Section(
  name="mqar_grid",
  run=run,
  scalars=scalars,
  directions={"mqar_grid/*": HIGHER_IS_BETTER},
  headline=("mqar_grid/mean",),
  enabled=lambda cfg: bool(cfg.mqar_grid),
  plot=plot,
  table=table,
)
