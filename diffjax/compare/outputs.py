"""The comparison's outputs: report.md and its PNGs, and results.json with every number."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from etils import epath

from diffjax.compare.config import ComparisonConfig
from diffjax.compare.summary import diverged_note, loss_curve, summary_section
from diffjax.train.records import write_json

SCHEMA = "diffjax.compare/1"


def clean_json(x: Any) -> Any:
  """NaN and infinities become null so results.json is strict JSON."""
  if isinstance(x, float):
    return x if math.isfinite(x) else None
  if isinstance(x, Mapping):
    return {str(k): clean_json(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [clean_json(v) for v in x]
  return x


def write_outputs(
  config: ComparisonConfig,
  workdir: str,
  runs: Sequence[dict[str, Any]],
  data_check: Mapping[str, Any],
  timings: Mapping[str, float],
) -> dict[str, Any]:
  """report.md and PNGs (via `diffjax.eval.report`, the comparison summary first), then
  results.json; returns the results."""
  from diffjax.eval import aggregate, report  # pylint: disable=import-outside-toplevel

  arms = list(config.arms)
  baseline, confidence = config.report.baseline, config.report.confidence
  log_every = config.base_run.log_every
  curves = {r["name"]: loss_curve(r["metrics"], log_every) for r in runs}
  report_runs = [
    {
      "arm": r["arm"],
      "seed": r["seed"],
      "name": f"runs/{r['name']}",
      "eval": r["eval"],
      "curve": curves[r["name"]],
    }
    for r in runs
  ]
  # The report and plots are written with local file calls; a cloud workdir gets copies.
  remote = "://" in workdir
  out_dir = tempfile.mkdtemp(prefix="diffjax_compare_") if remote else workdir
  title = (
    f"{config.report.title}: {', '.join(arms)} x seeds {', '.join(str(s) for s in config.seeds)}"
  )
  preamble, table = summary_section(config, runs, arms, data_check)
  report.write_report(report_runs, out_dir, baseline, confidence, title=title, preamble=preamble)

  results = {
    "schema": SCHEMA,
    "workdir": workdir,
    "arms": arms,
    "seeds": list(config.seeds),
    "config": json.loads(config.to_json()),
    "data_check": data_check,
    "summary": table,
    "aggregate": aggregate.aggregate(report_runs, baseline, confidence),
    "this_invocation_s": dict(timings),  # seconds spent by this command (0 for skipped work)
    "runs": [
      {
        "arm": r["arm"],
        "seed": r["seed"],
        "name": r["name"],
        "workdir": r["workdir"],
        "step": r["step"],
        # Stopped on non-finite updates (allow_divergence): no final eval, left out of means.
        "diverged": diverged_note(r) is not None,
        "why": diverged_note(r),
        "params": r["params"],
        "train_seconds": r["train_seconds"],
        "eval_seconds": r["eval_seconds"],
        "final_metrics": r["final_metrics"],
        "scalars": (r["eval"] or {}).get("scalars", {}),
        "eval": r["eval_file"],
        "curve": curves[r["name"]],
      }
      for r in runs
    ],
  }
  write_json(os.path.join(out_dir, "results.json"), clean_json(results))
  if remote:
    for name in os.listdir(out_dir):
      epath.Path(workdir, name).write_bytes(epath.Path(out_dir, name).read_bytes())
  return results
