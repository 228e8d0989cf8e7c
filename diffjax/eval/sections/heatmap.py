"""The "heatmap" section: multi-needle retrieval accuracy by answer depth x context length
(paper Figure 5), lengths beyond training included, and the report's heatmap per arm."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from diffjax.data.tasks import DEPTHS, ContextTooShort, MultiNeedleTask
from diffjax.eval import display
from diffjax.eval.registry import HIGHER_IS_BETTER, Section
from diffjax.eval.runner import LogitsFn
from diffjax.eval.scoring import retrieval_accuracy
from diffjax.eval.sections.context import Context


def _lengths_that_fit(lengths, num_needles, num_queries, seed, filler) -> list[int]:
  """The lengths of `lengths` that hold `num_needles` needles and `num_queries` questions."""
  fits = []
  for length in lengths:
    try:
      MultiNeedleTask(
        int(length),
        num_needles,
        num_queries,
        depths=(0.0,),
        num_examples=1,
        seed=seed,
        filler=filler,
      )
      fits.append(int(length))
    except ContextTooShort:
      pass
  return fits


def retrieval_heatmap(
  fn: LogitsFn,
  lengths: Sequence[int],
  depths: Sequence[float] = DEPTHS,
  num_needles: int = 4,
  num_queries: int = 1,
  samples_per_cell: int = 10,
  seed: int = 0,
  batch_size: int = 8,
  filler=None,
) -> dict[str, Any]:
  """Accuracy per (depth, context length) cell (paper Figure 5).

  Returns {"lengths": [...], "depths": [...], "accuracy": [[depth-major rows]],
  "mean_by_length": [...], "mean": float, "needles": [N, R]}. Lengths too short for the
  needles are dropped (listed under "skipped_lengths").
  """
  fits = _lengths_that_fit(lengths, num_needles, num_queries, seed, filler)
  skipped = [int(x) for x in lengths if int(x) not in fits]
  lengths = fits
  if not lengths:
    raise ContextTooShort(
      f"No heatmap length in {skipped} fits {num_needles} needles and {num_queries} queries."
    )
  acc = np.zeros((len(depths), len(lengths)))
  for j, length in enumerate(lengths):
    for i, depth in enumerate(depths):
      task = MultiNeedleTask(
        int(length),
        num_needles,
        num_queries,
        depths=(depth,),
        num_examples=samples_per_cell,
        seed=seed + 7919 * i,
        filler=filler,
      )
      acc[i, j] = retrieval_accuracy(fn, task, batch_size=batch_size)["accuracy"]
  return {
    "lengths": [int(x) for x in lengths],
    "depths": [float(d) for d in depths],
    "accuracy": acc.tolist(),
    "mean_by_length": acc.mean(axis=0).tolist(),
    "mean": float(acc.mean()),
    "needles": [int(num_needles), int(num_queries)],
    "skipped_lengths": skipped,
  }


def run(context: Context) -> dict[str, Any]:
  cfg = context.config
  return retrieval_heatmap(
    context.logits_fn,
    cfg.heatmap_lengths,
    cfg.depths,
    *cfg.heatmap_needles,
    samples_per_cell=cfg.heatmap_samples or cfg.samples_per_depth,
    seed=cfg.seed + 2,
    batch_size=cfg.batch_size,
    filler=context.filler,
  )


def scalars(result: Mapping[str, Any]) -> dict[str, float]:
  out = {
    f"heatmap/len{length}": acc for length, acc in zip(result["lengths"], result["mean_by_length"])
  }
  out["heatmap/mean"] = result["mean"]
  return out


def _length_label(length: int) -> str:
  """A context length as a tick label: 256, 1K, 32K."""
  return f"{length // 1024}K" if length >= 1024 and length % 1024 == 0 else str(length)


# Panel sizes (inches): each length's column gets _COLUMN_IN up to a panel of _PANEL_MAX_IN; past
# that every second (third, ...) length is labelled, and cells too narrow for a number get none.
_COLUMN_IN, _PANEL_MIN_IN, _PANEL_MAX_IN, _NUMBER_MIN_IN = 0.5, 3.2, 6.5, 0.32


def plot(plt, groups, colors, out_dir):
  """retrieval_heatmap.png: accuracy by depth x length, one panel per arm (mean over seeds)."""
  del colors  # one colour map for every arm
  data = {}
  for arm, rs in groups.items():
    maps = [display.section_result(r, "heatmap") for r in rs]
    maps = [m for m in maps if m]
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
  columns = max(len(ref["lengths"]) for _, ref, _ in data.values())
  panel_in = min(max(_COLUMN_IN * columns + 0.8, _PANEL_MIN_IN), _PANEL_MAX_IN)
  column_in = (panel_in - 0.8) / columns
  every = math.ceil(_COLUMN_IN / column_in - 1e-9)  # label every this many lengths
  # The layout engine keeps each panel's tick labels clear of its neighbours.
  fig, axes = plt.subplots(
    1, len(data), figsize=(panel_in * len(data) + 1.0, 3.6), squeeze=False, layout="constrained"
  )
  first_depths = next(iter(data.values()))[1]["depths"]
  for k, (ax, (arm, (acc, ref, n))) in enumerate(zip(axes[0], data.items())):
    im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    lengths = ref["lengths"]
    ax.set_xticks(
      range(len(lengths)),
      [_length_label(x) if j % every == 0 else "" for j, x in enumerate(lengths)],
      fontsize=8,
    )
    # Panels with the first panel's depths share its depth labels.
    shared = k > 0 and ref["depths"] == first_depths
    ax.set_yticks(range(len(ref["depths"])), [f"{d:.0%}" for d in ref["depths"]])
    ax.tick_params(axis="y", labelleft=not shared)
    if column_in >= _NUMBER_MIN_IN:
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


SECTION = Section(
  name="heatmap",
  run=run,
  scalars=scalars,
  directions={"heatmap/*": HIGHER_IS_BETTER},
  headline=("heatmap/mean",),
  enabled=lambda cfg: bool(cfg.heatmap_lengths),
  plot=plot,
)
