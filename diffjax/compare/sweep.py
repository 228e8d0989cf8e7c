"""The sweep report: one comparison per value of a swept key (e.g. the peak learning rate).

Each point's own comparison (report.md, results.json, paired statistics) lives in
``sweep/<key>=<value>/``; this module writes the report across points in the workdir:

  * per arm and value: the final validation loss over seeds (mean, min, max), how many seeds
    diverged, updates the trainer skipped as non-finite, and gradient-norm spikes;
  * per arm: the largest value at which every seed trained, and the value with the lowest mean
    loss;
  * the paired difference of each arm to the baseline at each value (from the point's own
    statistics), and the mechanism measures of the eval suite (attention sinks, context RMS,
    DIFF V1's norm magnification) by value;
  * a plot of final loss against the value, one line per arm, with the seed spread.

Definitions (stated in the report):
  diverged: the trainer stopped on non-finite updates (more than ``max_skipped_updates``),
    the final loss is not finite or above the unigram baseline (the loss of predicting every
    token by its frequency), or after warm-up the train loss averaged over
    ``report.divergence_window`` consecutive steps went below the unigram baseline and later
    back above it (a run that trained, then blew up); ``report.divergence_above_unigram=False``
    keeps only the non-finite criteria (for runs too short to get below the baseline);
  gradient-norm spike: a step whose global gradient norm (before clipping) exceeds
    ``report.spike_factor`` times the median of the previous ``report.spike_window`` steps'.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np

from diffjax.compare.config import arm_names, format_value, sweep_key
from diffjax.compare.outputs import clean_json
from diffjax.eval import stats
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


def _value(v: Any) -> str:
  return format_value(v)


def write_sweep_outputs(
  config: ml_collections.ConfigDict,
  workdir: str,
  point_results: Sequence[tuple[str, Any, Mapping[str, Any]]],
  point_runs: Sequence[tuple[str, Any, Sequence[Mapping[str, Any]]]],
) -> dict[str, Any]:
  """report.md, sweep_loss.png and results.json across the sweep's points; returns the
  results."""
  key = sweep_key(config)
  arms = list(arm_names(config.arms))
  baseline = config.report.baseline
  factor = float(config.report.get("spike_factor", 3.0))
  spike_window = int(config.report.get("spike_window", 50))
  div_window = int(config.report.get("divergence_window", 20))
  warmup = RunConfig.from_config(config.base).optim.warmup_steps
  unigrams = [
    float(r["final_metrics"]["unigram/loss"])
    for _, _, runs in point_runs
    for r in runs
    if "unigram/loss" in (r["final_metrics"] or {})
  ]
  unigram = unigrams[0] if unigrams else float("nan")
  if not config.report.get("divergence_above_unigram", True):
    unigram = float("nan")  # only non-finite runs count as diverged
  values = [v for _, v, _ in point_runs]

  records, cells = [], {arm: {} for arm in arms}
  for name, value, runs in point_runs:
    for r in runs:
      why = divergence(r, unigram, warmup, div_window)
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
        "spikes": spike_steps(r["metrics"], factor, spike_window),
        "mechanisms": {
          k: v for k, v in r["eval"]["scalars"].items() if k.startswith("mechanisms/")
        },
      }
      lams = [
        abs(float(v))
        for k, v in (r["final_metrics"] or {}).items()
        if k.startswith(("lambda/", "lambda_mean/"))
      ]
      if lams:
        rec["mechanisms"]["lambda/largest_abs"] = max(lams)
      records.append(rec)
      cells[r["arm"]].setdefault(_value(value), []).append(rec)

  def cell_stats(recs):
    trained = [r["final_eval_loss"] for r in recs if not r["diverged"]]
    return {
      "n": len(recs),
      "diverged": sum(r["diverged"] for r in recs),
      "mean": float(np.mean(trained)) if trained else float("nan"),
      "min": float(np.min(trained)) if trained else float("nan"),
      "max": float(np.max(trained)) if trained else float("nan"),
      "skipped_updates": sum(r["skipped_updates"] for r in recs),
      "spikes_per_run": float(np.mean([len(r["spikes"]) for r in recs])) if recs else 0.0,
    }

  table = {
    arm: {_value(v): cell_stats(cells[arm].get(_value(v), [])) for v in values} for arm in arms
  }
  verdict = {}
  for arm in arms:
    stable = [
      v for v in values if table[arm][_value(v)]["n"] and table[arm][_value(v)]["diverged"] == 0
    ]
    means = {
      v: table[arm][_value(v)]["mean"]
      for v in values
      if math.isfinite(table[arm][_value(v)]["mean"]) and table[arm][_value(v)]["diverged"] == 0
    }
    verdict[arm] = {
      "largest_stable": max(stable) if stable else None,
      "best": min(means, key=means.get) if means else None,
      "best_loss": min(means.values()) if means else None,
    }

  confidence = float(config.report.confidence)
  references = [baseline] + [
    a for a in (config.report.get("also_against", ()) or ()) if a in arms and a != baseline
  ]
  paired = {}
  for ref in references:
    for arm in arms:
      if arm == ref or (ref != baseline and arm == baseline):
        continue  # the baseline's own table already pairs it with every arm
      for v in values:
        mine = {r["seed"]: r for r in cells[arm].get(_value(v), [])}
        theirs = {r["seed"]: r for r in cells[ref].get(_value(v), [])}
        seeds = sorted(set(mine) & set(theirs))
        loss = lambda r: (
          r["final_eval_loss"]
          if r["final_eval_loss"] is not None and not r["diverged"]
          else float("nan")
        )
        paired.setdefault(ref, {}).setdefault(arm, {})[_value(v)] = stats.paired_difference(
          [loss(mine[s]) for s in seeds], [loss(theirs[s]) for s in seeds], confidence
        )

  mech = {}
  for k, _ in MECHANISM_ROWS:
    for arm in arms:
      for v in values:
        recs = [r for r in cells[arm].get(_value(v), []) if k in r["mechanisms"]]
        if recs:
          mech.setdefault(k, {}).setdefault(arm, {})[_value(v)] = float(
            np.median([r["mechanisms"][k] for r in recs])
          )

  plot = _plot(workdir, key, arms, values, table, unigram)
  lines = _report(
    config,
    key,
    arms,
    values,
    table,
    verdict,
    paired,
    mech,
    unigram,
    factor,
    spike_window,
    div_window,
    warmup,
    point_runs,
    plot,
  )
  checks = [(n, res.get("data_check") or {}) for n, _, res in point_results]
  data_check = {
    "ok": all(c.get("ok", False) for _, c in checks),
    "problems": [f"{n}: {p}" for n, c in checks for p in c.get("problems", [])],
  }
  if not data_check["ok"]:
    lines[1:1] = (
      ["", "## WARNING: the arms did not see the same data", ""]
      + [f"- {p}" for p in data_check["problems"]]
      + [""]
    )
  with open(os.path.join(workdir, "report.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  results = {
    "schema": SCHEMA,
    "workdir": workdir,
    "key": key,
    "values": values,
    "arms": arms,
    "data_check": data_check,
    "seeds": list(config.seeds),
    "baseline": baseline,
    "unigram_loss": unigram,
    "definitions": {
      "spike_factor": factor,
      "spike_window": spike_window,
      "divergence_window": div_window,
      "warmup_steps": warmup,
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


def _report(
  config,
  key,
  arms,
  values,
  table,
  verdict,
  paired,
  mech,
  unigram,
  factor,
  spike_window,
  div_window,
  warmup,
  point_runs,
  plot,
) -> list[str]:
  base = RunConfig.from_config(config.base)
  seeds = list(config.seeds)
  tokens = base.num_steps * base.tokens_per_step
  head = " | ".join(f"{key.split('.')[-1]}={_value(v)}" for v in values)
  lines = [
    f"# {config.report.title}",
    "",
    f"{len(arms)} arms x {len(seeds)} seeds {seeds} x {len(values)} values of `{key}`; "
    f"each run {base.num_steps:,} steps x {base.global_batch_size} x "
    f"{base.seq_len} tokens = {tokens:,} tokens, warm-up {warmup} steps. Each "
    f"value's full comparison (paired statistics, data check, per-run evaluation) is in "
    f"`sweep/<{key.split('.')[-1]}=value>/report.md`.",
    "",
    "Definitions. **Diverged**: the trainer stopped on non-finite updates (more than "
    f"`max_skipped_updates={base.max_skipped_updates}` skipped), the "
    f"final loss is not finite or above the unigram baseline ({_fmt(unigram)} nats), or after "
    f"warm-up the train loss averaged over {div_window} consecutive steps went below the "
    "unigram baseline and later back above it. "
    f"**Skipped**: updates the trainer refused as non-finite (all seeds). **Spike**: a "
    f"step whose gradient norm before clipping exceeds {factor:g}x the median of the "
    f"previous {spike_window} steps' (mean count per run).",
    "",
    "## Final validation loss",
    "",
    "Mean over the seeds that trained [min, max]; diverged seeds are left out of the "
    "mean and counted.",
    "",
    f"| arm | {head} |",
    "|---" * (len(values) + 1) + "|",
  ]
  for arm in arms:
    row = []
    for v in values:
      c = table[arm][_value(v)]
      txt = (
        f"{_fmt(c['mean'])} [{_fmt(c['min'])}, {_fmt(c['max'])}]"
        if math.isfinite(c["mean"])
        else "–"
      )
      if c["diverged"]:
        txt += f" **{c['diverged']}/{c['n']} diverged**"
      row.append(txt)
    lines.append(f"| {arm} | " + " | ".join(row) + " |")
  lines += [
    "",
    "## Stability",
    "",
    f"| arm | largest {key} where every seed trained | "
    f"{key} with the lowest mean loss | that loss |",
    "|---|---|---|---|",
  ]
  for arm in arms:
    v = verdict[arm]
    lines.append(
      f"| {arm} | {_value(v['largest_stable']) if v['largest_stable'] is not None else 'none'}"
      f" | {_value(v['best']) if v['best'] is not None else '–'} | "
      f"{_fmt(v['best_loss']) if v['best_loss'] is not None else '–'} |"
    )
  lines += [
    "",
    "Diverged seeds / skipped updates / gradient-norm spikes per run:",
    "",
    f"| arm | {head} |",
    "|---" * (len(values) + 1) + "|",
  ]
  for arm in arms:
    cells = [
      f"{c['diverged']}/{c['n']} · {c['skipped_updates']} · {c['spikes_per_run']:.1f}"
      for c in (table[arm][_value(v)] for v in values)
    ]
    lines.append(f"| {arm} | " + " | ".join(cells) + " |")
  if plot:
    lines += ["", f"![final loss against {key}]({plot})"]
  tests = sum(len(by_arm) for by_arm in paired.values()) * len(values)
  for ref, by_arm in paired.items():
    lines += [
      "",
      f"## Paired difference to {ref}",
      "",
      f"Final eval loss, arm minus {ref} at matched seeds (seeds where both trained): "
      f"mean [{float(config.report.confidence):.0%} interval] and the paired t-test's p. "
      f"The report makes {tests} such tests; about {0.05 * tests:.1f} would pass "
      "p < 0.05 by chance, so read a single small p value with that in mind.",
      "",
      f"| arm | {head} |",
      "|---" * (len(values) + 1) + "|",
    ]
    for arm, by_value in by_arm.items():
      cells = []
      for v in values:
        d = by_value.get(_value(v)) or {}
        if d.get("n", 0) >= 2 and math.isfinite(d.get("p", float("nan"))):
          cells.append(f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] p={d['p']:.2g}")
        elif d.get("n", 0) >= 1:
          cells.append(f"{d['mean']:+.3f} (n={d['n']})")
        else:
          cells.append("–")
      lines.append(f"| {arm} | " + " | ".join(cells) + " |")
  if mech:
    lines += [
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
      lines += [f"**{what}** (`{k}`)", "", f"| arm | {head} |", "|---" * (len(values) + 1) + "|"]
      for arm in arms:
        if arm in mech[k]:
          lines.append(
            f"| {arm} | "
            + " | ".join(_fmt(mech[k][arm].get(_value(v), float("nan")), 3) for v in values)
            + " |"
          )
      lines.append("")
  notes = [
    f"- {r['arm']} seed {r['seed']} at {n}: {why}"
    for n, _, runs in point_runs
    for r in runs
    for why in [divergence(r, unigram, warmup, div_window)]
    if why
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
) -> str | None:
  """sweep_loss.png: final loss against the swept value (log scale), one line per arm."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  from diffjax.eval.display import colors as _colors  # pylint: disable=import-outside-toplevel

  colors = _colors(arms)
  fig, ax = plt.subplots(figsize=(7, 4.5))
  xs = np.asarray([float(v) for v in values])
  for arm in arms:
    c = [table[arm][_value(v)] for v in values]
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
    gone = [x for x, cc in zip(xs, c) if cc["diverged"]]
    if gone and math.isfinite(unigram):
      ax.scatter(gone, [unigram] * len(gone), marker="x", s=60, color=colors[arm])
  if math.isfinite(unigram):
    ax.axhline(unigram, color="black", lw=0.8, ls="--", label="unigram baseline (x: diverged)")
  ax.set_xscale("log")
  ax.set_xlabel(key)
  ax.set_ylabel("final validation loss (nats)")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "sweep_loss.png"), dpi=120)
  plt.close(fig)
  return "sweep_loss.png"
