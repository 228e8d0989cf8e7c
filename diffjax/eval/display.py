"""Shared pieces of the report's figures and tables: arm colours, bands over seeds, numbers read
from results, markdown tables and the formats of their cells. `diffjax.eval.plots`,
`diffjax.eval.report`, the sections' own plots and tables and `diffjax.compare`'s reports use
them."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from diffjax import arms as arms_registry
from diffjax.eval import stats

# ----------------------------------------------------------------------------------------------
# Reading results.


def as_number(x: Any) -> float:
  """float(x), or NaN for a missing or non-numeric value (a metric some run lacks)."""
  try:
    return float(x)
  except (TypeError, ValueError):
    return float("nan")


def section_result(run: Mapping[str, Any], name: str) -> Any:
  """The result of section ``name`` in a run's eval JSON, or None without one."""
  return (((run.get("eval") or {}).get("sections")) or {}).get(name)


# ----------------------------------------------------------------------------------------------
# Figures.


def colors(arms: Iterable[str]) -> dict[str, str]:
  """A matplotlib colour per arm: the registered arms' own, then others in turn."""
  palette = {a.name: a.color for a in arms_registry.all_arms()}
  extra = iter(["tab:green", "tab:red", "tab:purple", "tab:brown"])
  return {a: palette.get(a) or next(extra, "black") for a in arms}


def band(values_NxK: np.ndarray, confidence: float = 0.95):
  """Mean and band over seeds (axis 0): t interval when n >= 3, min-max at n = 2, none at 1.

  Returns (mean_K, lo_K, hi_K); lo and hi are None with one seed.
  """
  mean = np.nanmean(values_NxK, axis=0)
  n = values_NxK.shape[0]
  if n < 2:
    return mean, None, None
  if n == 2:
    return mean, np.nanmin(values_NxK, axis=0), np.nanmax(values_NxK, axis=0)
  sem = np.nanstd(values_NxK, axis=0, ddof=1) / math.sqrt(n)
  half = stats.t_ppf(0.5 + confidence / 2, n - 1) * sem
  return mean, mean - half, mean + half


def label_axes(ax, xlabel: str, ylabel: str, title: str) -> None:
  """Axis labels, a title, a legend and a light grid."""
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)


def save(fig, out_dir: str, name: str, caption: str) -> tuple[str, str]:
  """Writes ``fig`` to ``out_dir/name``; returns (name, caption) for the report."""
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, name), dpi=120)
  return name, caption


# ----------------------------------------------------------------------------------------------
# Tables.


def md_table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
  """A markdown table's lines: the header ``head``, its separator, then one line per row."""
  lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
  lines += ["| " + " | ".join(row) + " |" for row in rows]
  return lines


# ----------------------------------------------------------------------------------------------
# Table cells.


def fmt(x: float, digits: int = 4) -> str:
  """``x`` to ``digits`` significant digits; "n/a" for None or a non-finite value."""
  if x is None or not math.isfinite(x):
    return "n/a"
  return f"{x:.{digits}g}"


def _by_count(x: Mapping[str, float], one: Callable[[], str], more: Callable[[], str]) -> str:
  """ "–" without values, ``one()`` with a single value, ``more()`` with two or more."""
  return "–" if x["n"] == 0 else one() if x["n"] < 2 else more()


def fmt_ci(c: Mapping[str, float]) -> str:
  """A `stats.mean_ci` result as "mean ± half-width (n=...)"."""
  return _by_count(
    c,
    lambda: f"{fmt(c['mean'])} (n=1)",
    lambda: f"{fmt(c['mean'])} ± {fmt(c['half_width'], 2)} (n={c['n']})",
  )


def fmt_diff(d: Mapping[str, float]) -> str:
  """A `stats.paired_difference` result as "mean [lo, hi] p=... (n=...)"."""
  return _by_count(
    d,
    lambda: f"{d['mean']:+.3g} (n=1, no test)",
    lambda: f"{d['mean']:+.3g} [{d['lo']:+.3g}, {d['hi']:+.3g}] p={fmt(d['p'], 2)} (n={d['n']})",
  )
