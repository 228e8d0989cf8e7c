"""The report's heatmap stays legible: with several arms and many context lengths no tick label
overlaps another one or a neighbouring panel."""

from __future__ import annotations

import itertools

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from diffjax.eval.sections import heatmap  # noqa: E402

DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]


def _groups(arms, lengths):
  rng = np.random.default_rng(0)
  result = lambda: {
    "lengths": list(lengths),
    "depths": DEPTHS,
    "accuracy": rng.uniform(size=(len(DEPTHS), len(lengths))).tolist(),
    "needles": [4, 1],
  }
  return {a: [{"eval": {"sections": {"heatmap": result()}}} for _ in range(2)] for a in arms}


def _drawn(monkeypatch, groups, out_dir):
  """The figure the heatmap's plot saves, drawn as saved."""
  drawn = []
  save = Figure.savefig
  monkeypatch.setattr(
    Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k))
  )
  assert heatmap.plot(plt, groups, {}, str(out_dir))[0] == "retrieval_heatmap.png"
  (fig,) = drawn
  fig.canvas.draw()
  return fig


def _overlap(a, b) -> bool:
  return a.x0 < b.x1 - 1 and b.x0 < a.x1 - 1 and a.y0 < b.y1 - 1 and b.y0 < a.y1 - 1


@pytest.mark.parametrize(
  "arms,lengths",
  [
    (("transformer", "diff_v1", "diff_v2"), (256, 512)),
    (("transformer", "diff_v1", "diff_v2"), tuple(256 * 2**k for k in range(8))),
    (("transformer", "diff_v2"), tuple(range(128, 128 * 17, 128))),
  ],
)
def test_the_heatmap_tick_labels_overlap_nothing(monkeypatch, tmp_path, arms, lengths):
  fig = _drawn(monkeypatch, _groups(arms, lengths), tmp_path)
  renderer = fig.canvas.get_renderer()
  panels = [ax for ax in fig.axes if ax.images]
  assert len(panels) == len(arms)
  labels = []  # (panel index, window extent) of every visible tick label
  for k, ax in enumerate(panels):
    ticks = ax.get_xticklabels() + ax.get_yticklabels()
    labels += [
      (k, t.get_window_extent(renderer)) for t in ticks if t.get_visible() and t.get_text()
    ]
    # Every length and depth can still be read off: the labelled ticks are at most two apart.
    shown = [t.get_text() for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
    assert len(shown) >= (len(lengths) + 1) // 2, shown
  assert labels
  for (_, a), (_, b) in itertools.combinations(labels, 2):
    assert not _overlap(a, b), (a, b)
  for k, box in labels:
    for j, ax in enumerate(panels):
      if j != k:
        assert not _overlap(box, ax.get_window_extent(renderer)), (k, j, box)
  plt.close(fig)
