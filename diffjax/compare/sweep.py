"""The sweep report: one comparison per value of a swept key (e.g. the peak learning rate).

Each point's own comparison lives in ``sweep/<key>=<value>/``; this module writes report.md,
sweep_loss.png and results.json across the points. What the report holds and its definitions
(diverged, skipped, spike): docs/evaluation.md, "Learning-rate stability".
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from diffjax.compare.config import ComparisonConfig, format_value, sweep_points
from diffjax.compare.datacheck import mismatch_warning
from diffjax.compare.outputs import clean_json
from diffjax.compare.sections import ComparisonReport
from diffjax.eval import display, stats
from diffjax.train.config import RunConfig
from diffjax.train.records import write_json

SCHEMA = "diffjax.compare.sweep/1"
# Mechanism scalars of the eval suite shown by value: (scalar, what it is).
MECHANISM_ROWS = (
  ("mechanisms/sink_combined", "attention-sink mass, the map that weights the values"),
  ("mechanisms/sink_a1", "attention-sink mass of A1 (DIFF)"),
  ("mechanisms/sink_a2", "attention-sink mass of A2 (DIFF)"),
  ("mechanisms/context_rms_median", "context RMS, median"),
  ("mechanisms/relative_context_rms_max", "context RMS / RMS of the visible values, max"),
  (
    "mechanisms/bounded_context_rms_max",
    "context RMS / largest RMS among the visible values, max (Transformer ≤ 1, V2 < 2)",
  ),
  (
    "mechanisms/above_sqrt2",
    "fraction of token-heads whose context RMS exceeds √2 x the largest visible value RMS",
  ),
  ("mechanisms/norm_magnification_median", "DIFF V1 norm magnification 1/RMS, median"),
  ("mechanisms/norm_magnification_max", "DIFF V1 norm magnification 1/RMS, max"),
  ("mechanisms/gradient_magnification_median", "DIFF V1 gradient magnification, median"),
  ("mechanisms/gradient_magnification_max", "DIFF V1 gradient magnification, max"),
  (
    "lambda/largest_abs",
    "largest |λ| over layers at the end of training (DIFF V1: each "
    "layer's λ; DIFF V2: each layer's mean λ over a batch)",
  ),
)


def spike_steps(metrics: Sequence[Mapping[str, float]], factor: float, window: int) -> list[int]:
  """Steps whose ``train/grad_norm`` exceeds ``factor`` x the median of the previous
  ``window`` logged grad norms (the first ``window`` steps are never spikes)."""
  norms = [
    (int(m["step"]), float(m["train/grad_norm"]))
    for m in metrics
    if "train/grad_norm" in m and math.isfinite(float(m["train/grad_norm"]))
  ]
  out = []
  for k in range(window, len(norms)):
    ref = float(np.median([g for _, g in norms[k - window : k]]))
    if norms[k][1] > factor * ref:
      out.append(norms[k][0])
  return out


def divergence(
  run: Mapping[str, Any], unigram: float, warmup_steps: int, window: int
) -> str | None:
  """Why ``run`` (a comparison run record) counts as diverged, or None if it trained."""
  if run.get("diverged"):
    return f"stopped on non-finite updates at step {run['diverged']['step']}"
  loss = run["eval"]["scalars"].get("val/final_eval_loss", float("nan"))
  if not math.isfinite(loss):
    return "final loss not finite"
  if math.isfinite(unigram) and loss > unigram:
    return f"final loss {loss:.3f} above the unigram baseline {unigram:.3f}"
  if math.isfinite(unigram):
    losses = [
      (int(m["step"]), float(m["train/loss"]))
      for m in run["metrics"]
      if "train/loss" in m and int(m["step"]) > warmup_steps
    ]
    below = False
    for k in range(window, len(losses) + 1):
      mean = sum(l for _, l in losses[k - window : k]) / window
      if mean < unigram:
        below = True
      elif below:
        return (
          f"train loss over {window} steps back above the unigram baseline {unigram:.3f} "
          f"({mean:.3f} at step {losses[k - 1][0]}) after it had been below it"
        )
  return None


def _fmt(x: float, digits: int = 4) -> str:
  return f"{x:.{digits}g}" if math.isfinite(x) else "–"


@dataclasses.dataclass(frozen=True)
class _Sweep:
  """The settings every table of the sweep report is built from."""

  key: str
  arms: list[str]
  values: list[Any]
  baseline: str
  factor: float  # report.spike_factor
  spike_window: int
  div_window: int  # report.divergence_window
  warmup: tuple[int, ...]  # optim.warmup_steps at each value (a sweep may set it), in order
  unigram: float  # NaN: only non-finite runs count as diverged

  def warmup_at(self, value: Any) -> int:
    """The warm-up steps of the runs at ``value``."""
    return self.warmup[self.values.index(value)]


def point_bases(config: ComparisonConfig) -> list[RunConfig]:
  """The base run at each value of the sweep, in order: the steps, batch or schedule the swept
  key (or a scaled one) sets are each point's own."""
  return [point.base_run for _, _, point in sweep_points(config)]


def _settings(
  config: ComparisonConfig, point_runs: Sequence[tuple[str, Any, Sequence[Mapping]]]
) -> _Sweep:
  unigrams = [
    float(r["final_metrics"]["unigram/loss"])
    for _, _, runs in point_runs
    for r in runs
    if "unigram/loss" in (r["final_metrics"] or {})
  ]
  unigram = unigrams[0] if unigrams else float("nan")
  report = config.report
  if not report.divergence_above_unigram:
    unigram = float("nan")  # only non-finite runs count as diverged
  return _Sweep(
    key=config.sweep.key,
    arms=list(config.arms),
    values=[v for _, v, _ in point_runs],
    baseline=report.baseline,
    factor=report.spike_factor,
    spike_window=report.spike_window,
    div_window=report.divergence_window,
    warmup=tuple(run.optim.warmup_steps for run in point_bases(config)),
    unigram=unigram,
  )


def _record(s: _Sweep, name: str, value: Any, r: Mapping[str, Any]) -> dict[str, Any]:
  """One run's row of results.json: its loss, divergence, skips, spikes and mechanisms."""
  why = divergence(r, s.unigram, s.warmup_at(value), s.div_window)
  loss = float(r["eval"]["scalars"].get("val/final_eval_loss", float("nan")))
  rec = {
    "point": name,
    "value": value,
    "arm": r["arm"],
    "seed": r["seed"],
    "step": r["step"],
    "final_eval_loss": loss if math.isfinite(loss) else None,
    "diverged": why is not None,
    "why": why,
    "skipped_updates": int(r["eval"]["scalars"].get("train/skipped_updates", 0)),
    "spikes": spike_steps(r["metrics"], s.factor, s.spike_window),
    "mechanisms": {k: v for k, v in r["eval"]["scalars"].items() if k.startswith("mechanisms/")},
  }
  lams = [
    abs(float(v))
    for k, v in (r["final_metrics"] or {}).items()
    if k.startswith(("lambda/", "lambda_mean/"))
  ]
  if lams:
    rec["mechanisms"]["lambda/largest_abs"] = max(lams)
  return rec


def _cell_stats(recs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """One arm at one value over its seeds; diverged seeds are counted, not averaged."""
  trained = [r["final_eval_loss"] for r in recs if not r["diverged"]]

  def over_trained(reduce) -> float:
    return float(reduce(trained)) if trained else float("nan")

  return {
    "n": len(recs),
    "diverged": sum(r["diverged"] for r in recs),
    "mean": over_trained(np.mean),
    "min": over_trained(np.min),
    "max": over_trained(np.max),
    "skipped_updates": sum(r["skipped_updates"] for r in recs),
    "spikes_per_run": float(np.mean([len(r["spikes"]) for r in recs])) if recs else 0.0,
  }


def _verdicts(s: _Sweep, table: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
  """Per arm: the largest value at which every seed trained and the value of lowest mean loss."""
  verdict = {}
  for arm in s.arms:
    cells = {v: table[arm][format_value(v)] for v in s.values}
    stable = [v for v, c in cells.items() if c["n"] and c["diverged"] == 0]
    means = {
      v: c["mean"] for v, c in cells.items() if math.isfinite(c["mean"]) and c["diverged"] == 0
    }
    verdict[arm] = {
      "largest_stable": max(stable) if stable else None,
      "best": min(means, key=means.get) if means else None,
      "best_loss": min(means.values()) if means else None,
    }
  return verdict


def _paired(
  report: ComparisonReport, s: _Sweep, cells: Mapping[str, Mapping[str, list]]
) -> dict[str, Any]:
  """{reference: {arm: {value: paired difference of final loss over matched seeds}}}."""
  confidence = report.confidence
  # Only arms the sweep trained: the baseline may not be one of them (as also_against's).
  references = [a for a in dict.fromkeys([s.baseline, *report.also_against]) if a in s.arms]
  loss = lambda r: (
    r["final_eval_loss"] if r["final_eval_loss"] is not None and not r["diverged"] else float("nan")
  )
  paired = {}
  for ref in references:
    for arm in s.arms:
      if arm == ref or (ref != s.baseline and arm == s.baseline):
        continue  # the baseline's own table already pairs it with every arm
      for v in s.values:
        mine = {r["seed"]: r for r in cells[arm].get(format_value(v), [])}
        theirs = {r["seed"]: r for r in cells[ref].get(format_value(v), [])}
        seeds = sorted(set(mine) & set(theirs))
        paired.setdefault(ref, {}).setdefault(arm, {})[format_value(v)] = stats.paired_difference(
          [loss(mine[k]) for k in seeds], [loss(theirs[k]) for k in seeds], confidence
        )
  return paired


def _mechanisms(s: _Sweep, cells: Mapping[str, Mapping[str, list]]) -> dict[str, Any]:
  """{scalar: {arm: {value: median over seeds}}} of the `MECHANISM_ROWS` some run has."""
  mech = {}
  for k, _ in MECHANISM_ROWS:
    for arm in s.arms:
      for v in s.values:
        recs = [r for r in cells[arm].get(format_value(v), []) if k in r["mechanisms"]]
        if recs:
          mech.setdefault(k, {}).setdefault(arm, {})[format_value(v)] = float(
            np.median([r["mechanisms"][k] for r in recs])
          )
  return mech


def _data_check(point_results: Sequence[tuple[str, Any, Mapping[str, Any]]]) -> dict[str, Any]:
  """The points' data checks as one: ok only if every point's is."""
  checks = [(n, res.get("data_check") or {}) for n, _, res in point_results]
  return {
    "ok": all(c.get("ok", False) for _, c in checks),
    "problems": [f"{n}: {p}" for n, c in checks for p in c.get("problems", [])],
  }


def write_sweep_outputs(
  config: ComparisonConfig,
  workdir: str,
  point_results: Sequence[tuple[str, Any, Mapping[str, Any]]],
  point_runs: Sequence[tuple[str, Any, Sequence[Mapping[str, Any]]]],
) -> dict[str, Any]:
  """report.md, sweep_loss.png and results.json across the sweep's points; returns the
  results."""
  s = _settings(config, point_runs)
  records, cells = [], {arm: {} for arm in s.arms}
  for name, value, runs in point_runs:
    for r in runs:
      records.append(_record(s, name, value, r))
      cells[r["arm"]].setdefault(format_value(value), []).append(records[-1])
  table = {
    arm: {format_value(v): _cell_stats(cells[arm].get(format_value(v), [])) for v in s.values}
    for arm in s.arms
  }
  verdict = _verdicts(s, table)
  paired = _paired(config.report, s, cells)
  mech = _mechanisms(s, cells)
  figure = _plot(workdir, s.key, s.arms, s.values, table, s.unigram)
  lines = _report(config, s, table, verdict, paired, mech, records, figure)
  data_check = _data_check(point_results)
  if not data_check["ok"]:
    lines[1:1] = ["", *mismatch_warning(data_check), ""]
  with open(os.path.join(workdir, "report.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  results = {
    "schema": SCHEMA,
    "workdir": workdir,
    "key": s.key,
    "values": s.values,
    "arms": s.arms,
    "data_check": data_check,
    "seeds": list(config.seeds),
    "baseline": s.baseline,
    "unigram_loss": s.unigram,
    "definitions": {
      "spike_factor": s.factor,
      "spike_window": s.spike_window,
      "divergence_window": s.div_window,
      # One number, or {value: steps} when the sweep sets them per value.
      "warmup_steps": _per_value(s, s.warmup),
    },
    "table": table,
    "verdict": verdict,
    "paired": paired,
    "mechanisms": mech,
    "runs": records,
    "points": [
      {"name": n, "value": v, "workdir": os.path.join(workdir, "sweep", n)}
      for n, v, _ in point_results
    ],
  }
  write_json(os.path.join(workdir, "results.json"), clean_json(results))
  return results


def _columns(s: _Sweep) -> list[str]:
  """A table's columns: the arm, then one per swept value."""
  return ["arm", *(f"{s.key.split('.')[-1]}={format_value(v)}" for v in s.values)]


def _per_value(s: _Sweep, numbers: Sequence[Any]) -> Any:
  """``numbers`` (one per value of the sweep): the number when they are all one, else
  {value: number}."""
  if len(set(numbers)) == 1:
    return numbers[0]
  return {format_value(v): n for v, n in zip(s.values, numbers)}


def _numbers(numbers: Sequence[int]) -> str:
  """``numbers`` (one per value of the sweep) as the introduction says them: one number, or
  each value's ("3 / 8 (by value)")."""
  if len(set(numbers)) == 1:
    return f"{numbers[0]:,}"
  return " / ".join(f"{n:,}" for n in numbers) + " (by value)"


def _introduction(config: ComparisonConfig, s: _Sweep) -> list[str]:
  """The title, what was run, and the report's definitions. A number the swept key (or a
  scaled one) sets is given at each value."""
  runs = point_bases(config)
  seeds = list(config.seeds)
  short = s.key.split(".")[-1]
  each = lambda get: _numbers([get(run) for run in runs])
  return [
    f"# {config.report.title}",
    "",
    f"{len(s.arms)} arms x {len(seeds)} seeds {seeds} x {len(s.values)} values of `{s.key}`; "
    f"each run {each(lambda r: r.num_steps)} steps x {each(lambda r: r.global_batch_size)} x "
    f"{each(lambda r: r.seq_len)} tokens = {each(lambda r: r.num_steps * r.tokens_per_step)} "
    f"tokens, warm-up {_numbers(s.warmup)} steps. Each "
    f"value's full comparison (paired statistics, data check, per-run evaluation) is in "
    f"`sweep/<{short}=value>/report.md`.",
    "",
    "Definitions. **Diverged**: the trainer stopped on non-finite updates (more than "
    f"`max_skipped_updates={each(lambda r: r.max_skipped_updates)}` skipped), the final loss is "
    "not finite"
    + (
      f" or above the unigram baseline ({_fmt(s.unigram)} nats), or after warm-up the train "
      f"loss averaged over {s.div_window} consecutive steps went below the unigram baseline "
      "and later back above it. "
      if math.isfinite(s.unigram)
      else " (`report.divergence_above_unigram` is off, or no unigram baseline was measured). "
    )
    + f"**Skipped**: updates the trainer refused as non-finite (all seeds). **Spike**: a "
    f"step whose gradient norm before clipping exceeds {s.factor:g}x the median of the "
    f"previous {s.spike_window} steps' (mean count per run).",
    "",
  ]


def _loss_cell(c: Mapping[str, Any]) -> str:
  """One arm at one value (`_cell_stats`): the mean loss [min, max], and how many diverged."""
  txt = (
    f"{_fmt(c['mean'])} [{_fmt(c['min'])}, {_fmt(c['max'])}]" if math.isfinite(c["mean"]) else "–"
  )
  if c["diverged"]:
    txt += f" **{c['diverged']}/{c['n']} diverged**"
  return txt


def _loss_table(s: _Sweep, table: Mapping[str, Any]) -> list[str]:
  rows = [[arm, *(_loss_cell(table[arm][format_value(v)]) for v in s.values)] for arm in s.arms]
  return [
    "## Final validation loss",
    "",
    "Mean over the seeds that trained [min, max]; diverged seeds are left out of the "
    "mean and counted.",
    "",
    *display.md_table(_columns(s), rows),
  ]


def _counts_cell(c: Mapping[str, Any]) -> str:
  """One arm at one value (`_cell_stats`): diverged seeds / skipped updates / spikes per run."""
  return f"{c['diverged']}/{c['n']} · {c['skipped_updates']} · {c['spikes_per_run']:.1f}"


def _stability_tables(
  s: _Sweep, table: Mapping[str, Any], verdict: Mapping[str, Any], figure: tuple[str, str]
) -> list[str]:
  head = [
    "arm",
    f"largest {s.key} where every seed trained",
    f"{s.key} with the lowest mean loss",
    "that loss",
  ]
  verdicts = []
  for arm in s.arms:
    v = verdict[arm]
    verdicts.append(
      [
        arm,
        format_value(v["largest_stable"]) if v["largest_stable"] is not None else "none",
        format_value(v["best"]) if v["best"] is not None else "–",
        _fmt(v["best_loss"]) if v["best_loss"] is not None else "–",
      ]
    )
  counts = [[arm, *(_counts_cell(table[arm][format_value(v)]) for v in s.values)] for arm in s.arms]
  name, caption = figure
  return [
    "",
    "## Stability",
    "",
    *display.md_table(head, verdicts),
    "",
    "Diverged seeds / skipped updates / gradient-norm spikes per run:",
    "",
    *display.md_table(_columns(s), counts),
    "",
    f"![{caption}]({name})",
  ]


def _paired_cell(d: Mapping[str, float]) -> str:
  """A paired difference (`stats.paired_difference`; {} for none) as "mean [lo, hi] p=...", or
  the mean alone with one seed."""
  if d.get("n", 0) >= 2 and math.isfinite(d.get("p", float("nan"))):
    return f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] p={d['p']:.2g}"
  if d.get("n", 0) >= 1:
    return f"{d['mean']:+.3f} (n={d['n']})"
  return "–"


def _paired_tables(report: ComparisonReport, s: _Sweep, paired: Mapping) -> list[str]:
  lines = []
  tests = sum(len(by_arm) for by_arm in paired.values()) * len(s.values)
  for ref, by_arm in paired.items():
    lines += [
      "",
      f"## Paired difference to {ref}",
      "",
      f"Final eval loss, arm minus {ref} at matched seeds (seeds where both trained): "
      f"mean [{report.confidence:.0%} interval] and the paired t-test's p. "
      f"The report makes {tests} such tests; about {0.05 * tests:.1f} would pass "
      "p < 0.05 by chance, so read a single small p value with that in mind.",
      "",
    ]
    rows = [
      [arm, *(_paired_cell(by_value.get(format_value(v)) or {}) for v in s.values)]
      for arm, by_value in by_arm.items()
    ]
    lines += display.md_table(_columns(s), rows)
  return lines


def _mechanism_tables(s: _Sweep, mech: Mapping[str, Any]) -> list[str]:
  if not mech:
    return []
  lines = [
    "",
    "## Mechanisms",
    "",
    "The eval suite's `mechanisms` section on each trained model, and λ from the "
    "trainer's final metrics: the median over seeds (diverged seeds included, so a "
    "blown-up run shows), definitions in docs/evaluation.md.",
    "",
  ]
  for k, what in MECHANISM_ROWS:
    if k not in mech:
      continue
    rows = [
      [arm, *(_fmt(mech[k][arm].get(format_value(v), float("nan")), 3) for v in s.values)]
      for arm in s.arms
      if arm in mech[k]
    ]
    lines += [f"**{what}** (`{k}`)", "", *display.md_table(_columns(s), rows), ""]
  return lines


def _report(
  config: ComparisonConfig,
  s: _Sweep,
  table: Mapping[str, Any],
  verdict: Mapping[str, Any],
  paired: Mapping[str, Any],
  mech: Mapping[str, Any],
  records: Sequence[Mapping[str, Any]],
  figure: tuple[str, str],
) -> list[str]:
  """The sweep's report.md, as lines."""
  lines = _introduction(config, s) + _loss_table(s, table)
  lines += _stability_tables(s, table, verdict, figure)
  lines += _paired_tables(config.report, s, paired) + _mechanism_tables(s, mech)
  notes = [
    f"- {r['arm']} seed {r['seed']} at {r['point']}: {r['why']}" for r in records if r["why"]
  ]
  if notes:
    lines += ["## Diverged runs", ""] + notes + [""]
  return lines


def _plot(
  workdir: str,
  key: str,
  arms: Sequence[str],
  values: Sequence[Any],
  table: Mapping[str, Any],
  unigram: float,
) -> tuple[str, str]:
  """sweep_loss.png: final loss against the swept value (a log scale when every value is
  positive, else linear, so that a value of 0 is drawn), one line per arm, under a strip with
  one row per arm that marks each value where seeds of that arm diverged (x, with the count of
  diverged seeds), so arms that diverged at the same value stay apart. Returns (file name,
  caption)."""
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  colors = display.colors(arms)
  xs = np.asarray([float(v) for v in values])
  cells = {arm: [table[arm][format_value(v)] for v in values] for arm in arms}
  gone = [a for a in arms if any(c["diverged"] for c in cells[a])]
  if gone:
    fig, (strip, ax) = plt.subplots(
      2,
      1,
      sharex=True,
      figsize=(7, 4.5 + 0.2 * len(gone)),
      gridspec_kw={"height_ratios": [0.45 + 0.25 * len(gone), 4.0]},
    )
  else:
    fig, ax = plt.subplots(figsize=(7, 4.5))
  for arm in arms:
    c = cells[arm]
    mean = np.asarray([x["mean"] for x in c])
    lo = np.asarray([x["min"] for x in c])
    hi = np.asarray([x["max"] for x in c])
    ok = np.isfinite(mean)
    ax.errorbar(
      xs[ok],
      mean[ok],
      yerr=[mean[ok] - lo[ok], hi[ok] - mean[ok]],
      marker="o",
      capsize=3,
      label=arm,
      color=colors[arm],
    )
  if math.isfinite(unigram):
    ax.axhline(unigram, color="black", lw=0.8, ls="--", label="unigram baseline")
  if all(x > 0 for x in xs):
    ax.set_xscale("log")
  display.label_axes(ax, key, "final validation loss (nats)", title="")
  if gone:
    # One row per arm that diverged anywhere, top to bottom in the legend's order.
    for row, arm in enumerate(gone):
      y = len(gone) - 1 - row
      at = [(x, cc) for x, cc in zip(xs, cells[arm]) if cc["diverged"]]
      strip.scatter([x for x, _ in at], [y] * len(at), marker="x", s=40, color=colors[arm])
      for x, cc in at:
        strip.annotate(
          f"{cc['diverged']}/{cc['n']}",
          (x, y),
          xytext=(6, 0),
          textcoords="offset points",
          va="center",
          fontsize=7,
          color=colors[arm],
        )
    strip.set_ylim(-0.6, len(gone) - 0.4)
    strip.set_yticks(range(len(gone)), list(reversed(gone)), fontsize=7)
    for tick, arm in zip(strip.get_yticklabels(), reversed(gone)):
      tick.set_color(colors[arm])
    strip.set_title("x: seeds diverged (diverged/all), one row per arm", fontsize=8)
    strip.grid(alpha=0.3, axis="x")
    strip.tick_params(axis="x", which="both", labelbottom=False)
  figure = display.save(fig, workdir, "sweep_loss.png", f"final loss against {key}")
  plt.close(fig)
  return figure
