"""Eval results pooled over seeds: per-arm means with t intervals, paired differences against a
baseline arm, and plain-language verdicts.

Runs (`diffjax.eval.report.load_results`) and how they pair: docs/evaluation.md#the-report.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

from diffjax import arms
from diffjax.eval import sections, stats
from diffjax.eval.display import as_number

BASELINE = arms.BASELINE

# Scalars that no evaluation section produces, with their directions and the ones the summary
# states first (after the sections' headline scalars). `diffjax.compare` adds these to each
# run's eval scalars (`diffjax.compare.runs.collect_run`).
COMPARISON_METRICS: dict[str, sections.Direction] = {
  "train/final_loss": sections.DESCRIPTIVE,
  "val/final_eval_loss": sections.LOWER_IS_BETTER,
  "train/steps_to_learn": sections.LOWER_IS_BETTER,
  "train/learned": sections.HIGHER_IS_BETTER,
  "train/skipped_updates": sections.DESCRIPTIVE,
}
COMPARISON_HEADLINE = ("train/steps_to_learn", "train/learned")

# Tables of such scalars: `register_metrics` adds one.
_METRIC_TABLES: list[tuple[Mapping[str, sections.Direction], tuple[str, ...]]] = [
  (COMPARISON_METRICS, COMPARISON_HEADLINE)
]


def register_metrics(
  directions: Mapping[str, sections.Direction], headline: Sequence[str] = ()
) -> None:
  """Declares scalars that no section produces (added to the eval JSON's scalars by your own
  code): their directions ({fnmatch pattern: HIGHER_IS_BETTER, LOWER_IS_BETTER or
  DESCRIPTIVE}) and the ones the summary states first, after those already declared."""
  _METRIC_TABLES.append((dict(directions), tuple(headline)))


def direction(metric: str) -> sections.Direction:
  """True if higher is better, False if lower is better, None for descriptive metrics: as the
  section that reports `metric` says (`Section.directions`), or a table of `register_metrics`;
  None for a metric neither names."""
  for section in sections.registered():
    matched, d = section.direction(metric)
    if matched:
      return d
  for directions, _ in _METRIC_TABLES:
    for pattern, d in directions.items():
      if fnmatch.fnmatchcase(metric, pattern):
        return d
  return None


def headline() -> tuple[str, ...]:
  """The metrics the summary states first, in order: the registered sections' headline
  scalars, in section order, then those of `register_metrics`."""
  names = [m for section in sections.registered() for m in section.headline]
  names += [m for _, table_headline in _METRIC_TABLES for m in table_headline]
  return tuple(names)


def __getattr__(name: str):
  # HEADLINE reads the registry when asked, so sections registered later count.
  if name == "HEADLINE":
    return headline()
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def by_arm(runs: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
  """Runs grouped by arm: the registered arms first (in `diffjax.arms.names()` order), then others by name; each arm's
  runs sorted by seed, seedless runs last."""
  groups: dict[str, list] = {}
  for r in runs:
    groups.setdefault(r["arm"], []).append(r)
  known = arms.names()
  order = [a for a in known if a in groups] + sorted(a for a in groups if a not in known)
  return {
    a: sorted(groups[a], key=lambda r: (r.get("seed") is None, r.get("seed") or 0)) for a in order
  }


def _seed_key(run: Mapping[str, Any], index: int) -> Any:
  """The key that pairs a run across arms: its seed; seedless runs get a key that never pairs."""
  return run.get("seed") if run.get("seed") is not None else f"#{index}"


def check_one_run_per_seed(groups: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
  """Raises ValueError naming two runs of one arm that record the same seed: runs are keyed
  (and paired across arms) by seed, so each arm may have one run per seed."""
  for arm, arm_runs in groups.items():
    seen: dict[Any, Mapping[str, Any]] = {}
    for r in arm_runs:
      seed = r.get("seed")
      if seed is None:
        continue
      if seed in seen:
        raise ValueError(
          f"{seen[seed].get('name')!r} and {r.get('name')!r} are both {arm} runs with seed "
          f"{seed}; the report pairs runs by seed, so give it one run per arm and seed (leave "
          "one out, or evaluate it again with another --seed)."
        )
      seen[seed] = r


def aggregate(
  runs: Sequence[Mapping[str, Any]], baseline: str = BASELINE, confidence: float = 0.95
) -> dict[str, Any]:
  """Per-arm mean/CI of every scalar and paired differences against `baseline`.

  Returns {"arms": [..], "metrics": [..], "per_arm": {arm: {metric: mean_ci}},
  "paired": {arm: {metric: paired_difference}}, "baseline", "confidence"}, pairing runs by
  seed; "paired" is empty when no run is of the baseline arm. Two runs of one arm with the same
  seed are refused (`check_one_run_per_seed`); runs without a seed are averaged, never paired.
  """
  groups = by_arm(runs)
  check_one_run_per_seed(groups)
  metrics: list[str] = []
  for arm_runs in groups.values():
    for r in arm_runs:
      for k in (r.get("eval") or {}).get("scalars") or {}:
        if k not in metrics:
          metrics.append(k)
  values = {
    arm: {
      m: {
        _seed_key(r, i): as_number((r.get("eval") or {}).get("scalars", {}).get(m))
        for i, r in enumerate(arm_runs)
      }
      for m in metrics
    }
    for arm, arm_runs in groups.items()
  }
  per_arm = {
    arm: {m: stats.mean_ci(list(v.values()), confidence) for m, v in vals.items()}
    for arm, vals in values.items()
  }
  paired = {}
  if baseline in values:
    for arm in values:
      if arm == baseline:
        continue
      paired[arm] = {}
      for m in metrics:
        a, b = values[arm][m], values[baseline][m]
        seeds = [s for s in a if s in b and not str(s).startswith("#")]
        paired[arm][m] = stats.paired_difference(
          [a[s] for s in seeds], [b[s] for s in seeds], confidence
        )
  return {
    "arms": list(groups),
    "metrics": metrics,
    "per_arm": per_arm,
    "paired": paired,
    "baseline": baseline,
    "confidence": confidence,
  }


def summary_lines(agg: Mapping[str, Any], alpha: float = 0.05) -> list[str]:
  """Plain-language verdicts for the headline metrics (only those some run has)."""
  lines = []
  if not agg["paired"]:
    base = agg["baseline"]
    lines.append(f"No {base} runs, so no paired comparisons; the tables give each arm alone.")
    return lines
  for arm, diffs in agg["paired"].items():
    for m in headline():
      if m in diffs:
        lines.append(stats.verdict(diffs[m], m, arm, agg["baseline"], direction(m), alpha))
  n_sig = sum(
    1
    for diffs in agg["paired"].values()
    for m, d in diffs.items()
    if d.get("p", float("nan")) < alpha
  )
  n_all = sum(1 for diffs in agg["paired"].values() for d in diffs.values() if d["n"] >= 2)
  if n_all:
    lines.append(
      f"Across all {n_all} paired comparisons with at least two seeds, {n_sig} have "
      f"p < {alpha}; with this many tests about {alpha * n_all:.1f} would by chance "
      "alone, so read single significant rows with care."
    )
  return lines
