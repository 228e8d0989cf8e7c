"""`run_comparison`: every arm x seed trained, evaluated and checked, then the outputs written."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Sequence

import ml_collections
from etils import epath

from diffjax.compare.config import arm_names, check_comparison_config, run_name
from diffjax.compare.datacheck import batch_hashes, check_batches
from diffjax.compare.outputs import write_outputs
from diffjax.compare.parallel import run_parallel
from diffjax.compare.runs import RunResult, collect_run, train_and_evaluate_run
from diffjax.train.records import write_json


def _clock(seconds: float) -> str:
  m, s = divmod(int(seconds), 60)
  h, m = divmod(m, 60)
  return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _loud(log: Callable[[str], None], lines: Sequence[str]) -> None:
  bar = "!" * 78
  log("\n".join([bar, *lines, bar]))


def run_comparison(config: ml_collections.ConfigDict, workdir: str,
                   log: Callable[[str], None] | None = None) -> dict[str, Any]:
  """Trains, evaluates and reports every arm x seed of ``config`` in ``workdir``.

  Returns the results written to results.json (``data_check["ok"]`` says whether the arms saw
  the same batches). Raises ValueError for a bad config before anything is written, and
  `ComparisonStopped` when a signal stopped a run.
  """
  log = log or (lambda msg: print(msg, flush=True))
  check_comparison_config(config)
  arms, seeds = arm_names(config.arms), tuple(config.seeds)
  num_steps = int(config.base.num_steps)
  # Seed-major order: an interrupted comparison has complete arm pairs for its first seeds.
  plan = [(arm, seed) for seed in seeds for arm in arms]
  t0 = time.perf_counter()
  elapsed = lambda: _clock(time.perf_counter() - t0)
  epath.Path(workdir, "runs").mkdir(parents=True, exist_ok=True)
  write_json(epath.Path(workdir, "compare_config.json"), json.loads(config.to_json_best_effort()))
  log(f"compare: {len(plan)} runs ({len(arms)} arms x {len(seeds)} seeds), {num_steps:,} steps "
      f"each, eval {config.eval.mode}, in {workdir}")

  runs, timings = [], {}

  def finish(i: int, result: RunResult) -> None:
    arm, seed = plan[i]
    step, ev, seconds = result
    timings[run_name(arm, seed)] = seconds
    run_dir = os.path.join(workdir, "runs", run_name(arm, seed))
    runs.append(collect_run(arm, seed, run_dir, step, ev, seconds, int(config.base.log_every),
                            float(config.report.get("learned_below", 0.0)),
                            int(config.report.get("learned_window", 25))))
    # Check the data as soon as a pair exists, so a mismatch does not wait for the last run.
    first = next(r for r in runs if r["seed"] == seed)
    if first is not runs[-1]:
      check = check_batches({(r["arm"], seed): batch_hashes(r["metrics"])
                             for r in (first, runs[-1])}, [first["arm"], arm], [seed], num_steps)
      if not check["ok"]:
        _loud(log, ["DATA MISMATCH: " + p for p in check["problems"]])
    final = runs[-1]["final_metrics"]
    left = len(plan) - len(runs)
    log(f"[{i + 1}/{len(plan)} {run_name(arm, seed)}] done: train loss "
        f"{final.get('train/loss', float('nan')):.4f}, eval loss "
        f"{final.get('eval/loss', float('nan')):.4f}; {left} run{'' if left == 1 else 's'} left, "
        f"elapsed {elapsed()}")

  workers = int(config.get("workers", 1))
  if workers > 1 and len(plan) > 1:
    run_parallel(config, workdir, plan, min(workers, len(plan)), log, finish)
  else:
    for i, (arm, seed) in enumerate(plan):
      tag = f"[{i + 1}/{len(plan)} {run_name(arm, seed)}]"
      left = len(plan) - i
      log(f"{tag} starting: {left} run{'' if left == 1 else 's'} left, elapsed {elapsed()}")
      finish(i, train_and_evaluate_run(config, workdir, arm, seed, tag, log))
  order = {name: k for k, name in enumerate(run_name(a, s) for a, s in plan)}
  runs.sort(key=lambda r: order[r["name"]])

  hashes = {(r["arm"], r["seed"]): batch_hashes(r["metrics"]) for r in runs}
  data_check = check_batches(hashes, arms, seeds, num_steps)
  timings["total"] = time.perf_counter() - t0
  results = write_outputs(config, workdir, runs, data_check, timings)
  if data_check["ok"]:
    log(f"data check: all arms saw identical batches for seeds {list(seeds)}" +
        ("" if data_check["distinct_across_seeds"] else
         " (but the seeds did not change the data order)"))
  else:
    _loud(log, ["DATA MISMATCH: the arms did not see the same batches.",
                *data_check["problems"], "The comparison is not matched."])
  log(f"compare: wrote {os.path.join(workdir, 'report.md')} and results.json in {elapsed()}")
  return results
