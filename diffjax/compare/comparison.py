"""`run_comparison`: every arm x seed trained, evaluated and checked, then the outputs written."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from etils import epath

from diffjax.compare.config import ComparisonConfig, run_config, run_name, sweep_points
from diffjax.compare.datacheck import batch_hashes, check_batches
from diffjax.compare.outputs import write_outputs
from diffjax.compare.parallel import run_parallel
from diffjax.compare.runs import RunResult, check_trained_as, collect_run, train_and_evaluate_run
from diffjax.train.config import RunConfig
from diffjax.train.progress import format_duration
from diffjax.train.records import write_json


def _loud(log: Callable[[str], None], lines: Sequence[str]) -> None:
  bar = "!" * 78
  log("\n".join([bar, *lines, bar]))


class _Point:
  """One comparison (the whole one, or one sweep point): its config, its own base run (a sweep
  may set its steps or logging), workdir and runs."""

  def __init__(self, name: str, value: Any, config: ComparisonConfig, workdir: str):
    self.name, self.value, self.config, self.workdir = name, value, config, workdir
    self.base: RunConfig = config.base_run
    self.runs: list[dict[str, Any]] = []
    self.timings: dict[str, Any] = {}
    self.results: dict[str, Any] = {}

  def add_run(self, arm: str, seed: int, result: RunResult, log) -> dict:
    """Adds a finished run's record and returns it; checks its batches against the seed's
    first run as soon as that pair exists, so a mismatch does not wait for the last run."""
    base = self.base
    step, ev, seconds = result
    self.timings[run_name(arm, seed)] = seconds
    run_dir = os.path.join(self.workdir, "runs", run_name(arm, seed))
    report = self.config.report
    learned = report.learned_below, report.learned_window
    runs = self.runs
    runs.append(collect_run(arm, seed, run_dir, step, ev, seconds, base.log_every, *learned))
    first = next(r for r in runs if r["seed"] == seed)
    if first is not runs[-1]:
      check = check_batches(
        {(r["arm"], seed): batch_hashes(r["metrics"]) for r in (first, runs[-1])},
        [first["arm"], arm],
        [seed],
        _checked_steps([first, runs[-1]], base.num_steps),
      )
      if not check["ok"]:
        _loud(log, ["DATA MISMATCH: " + p for p in check["problems"]])
    return runs[-1]

  def write(self, arms: Sequence[str], seeds: Sequence[int], t0: float, log):
    """Checks the data over all the runs and writes the report and results.json."""
    order = {run_name(a, s): k for k, (a, s) in enumerate((a, s) for s in seeds for a in arms)}
    self.runs.sort(key=lambda r: order[r["name"]])
    hashes = {(r["arm"], r["seed"]): batch_hashes(r["metrics"]) for r in self.runs}
    data_check = check_batches(hashes, arms, seeds, _checked_steps(self.runs, self.base.num_steps))
    self.timings["total"] = time.perf_counter() - t0
    self.results = write_outputs(self.config, self.workdir, self.runs, data_check, self.timings)
    where = f" at {self.name}" if self.name else ""
    if data_check["ok"]:
      log(
        f"data check{where}: all arms saw identical batches for seeds {list(seeds)}"
        + (
          ""
          if data_check["distinct_across_seeds"]
          else " (but the seeds did not change the data order)"
        )
      )
    else:
      _loud(
        log,
        [
          f"DATA MISMATCH{where}: the arms did not see the same batches.",
          *data_check["problems"],
          "The comparison is not matched.",
        ],
      )


def run_comparison(
  config: ComparisonConfig | Any, workdir: str, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
  """Trains, evaluates and reports every arm x seed of ``config`` (a ComparisonConfig, or the
  ConfigDict of a comparison config file, resolved first) in ``workdir``.

  With a sweep (``sweep.key``), every point's comparison is run in ``workdir/sweep/<point>``
  (all points' runs share the workers) and the sweep report is written in ``workdir``.
  Returns the results written to results.json (``data_check["ok"]`` says whether the arms saw
  the same batches; a sweep's results hold each point's). Raises ValueError for a bad config and
  ``CheckpointError`` for a run directory trained as another run than ``config`` describes, both
  before anything is written, and `ComparisonStopped` when a signal stopped a run.
  """
  log = log or (lambda msg: print(msg, flush=True))
  config = ComparisonConfig.from_config(config)
  arms, seeds = config.arms, config.seeds
  points = [
    _Point(name, value, cfg, os.path.join(workdir, "sweep", name) if name else workdir)
    for name, value, cfg in sweep_points(config)
  ]
  # Point-major, then seed-major order: an interrupted comparison has complete arm pairs for
  # its first seeds.
  plan = [(p, arm, seed) for p in points for seed in seeds for arm in arms]
  t0 = time.perf_counter()
  elapsed = lambda: format_duration(time.perf_counter() - t0)
  # Every run directory the workdir already holds, before anything is written or trained.
  _check_run_dirs(plan)
  _write_configs(config, workdir, points)
  swept = f" x {len(points)} values of {config.sweep.key}" if config.sweep.key else ""
  steps = sorted({p.base.num_steps for p in points})
  log(
    f"compare: {len(plan)} runs ({len(arms)} arms x {len(seeds)} seeds{swept}), "
    f"{' or '.join(f'{n:,}' for n in steps)} steps each, eval {config.eval.mode}, in {workdir}"
  )
  _train_all(config, plan, elapsed, log)
  for p in points:
    p.write(arms, seeds, t0, log)
  results = points[0].results
  if len(points) > 1:
    from diffjax.compare.sweep import write_sweep_outputs  # pylint: disable=import-outside-toplevel

    results = write_sweep_outputs(
      config,
      workdir,
      [(p.name, p.value, p.results) for p in points],
      [(p.name, p.value, p.runs) for p in points],
    )
  log(f"compare: wrote {os.path.join(workdir, 'report.md')} and results.json in {elapsed()}")
  return results


Plan = Sequence[tuple[_Point, str, int]]


def _check_run_dirs(plan: Plan) -> None:
  """Refuses a run directory of ``plan`` trained as another run than the comparison now
  describes (:func:`~diffjax.compare.runs.check_trained_as`): all of them before the first
  run trains, so that a refusal does not come after hours of training the others."""
  for p, arm, seed in plan:
    run_dir = os.path.join(p.workdir, "runs", run_name(arm, seed))
    check_trained_as(RunConfig.from_config(run_config(p.config, arm, seed)), run_dir)


def _write_configs(config: ComparisonConfig, workdir: str, points: list[_Point]) -> None:
  """Each point's runs/ and compare_config.json, and a sweep's own config in ``workdir``."""
  for p in points:
    epath.Path(p.workdir, "runs").mkdir(parents=True, exist_ok=True)
    write_json(epath.Path(p.workdir, "compare_config.json"), json.loads(p.config.to_json()))
  if len(points) > 1:
    write_json(epath.Path(workdir, "compare_config.json"), json.loads(config.to_json()))


def _train_all(
  config: ComparisonConfig, plan: Plan, elapsed: Callable[[], str], log: Callable[[str], None]
) -> None:
  """Trains and evaluates every run of ``plan``, in worker processes when ``workers`` > 1,
  adding each finished run to its point."""
  label = lambda i: (f"{plan[i][0].name}/" if plan[i][0].name else "") + run_name(*plan[i][1:])
  done = [0]

  def finish(i: int, result: RunResult) -> None:
    point, arm, seed = plan[i]
    run = point.add_run(arm, seed, result, log)
    done[0] += 1
    left = len(plan) - done[0]
    final = run["final_metrics"]
    state = (
      ("DIVERGED at step " + str(result[0]))
      if run["diverged"]
      else (
        f"train loss {final.get('train/loss', float('nan')):.4f}, eval loss "
        f"{final.get('eval/loss', float('nan')):.4f}"
      )
    )
    log(
      f"[{i + 1}/{len(plan)} {label(i)}] done: {state}; {left} run{'' if left == 1 else 's'} "
      f"left, elapsed {elapsed()}"
    )

  workers = config.workers
  jobs = [(p.config, p.workdir, arm, seed) for p, arm, seed in plan]
  if workers > 1 and len(plan) > 1:
    run_parallel(jobs, [label(i) for i in range(len(plan))], min(workers, len(plan)), log, finish)
  else:
    for i, (cfg, wd, arm, seed) in enumerate(jobs):
      tag = f"[{i + 1}/{len(plan)} {label(i)}]"
      left = len(plan) - i
      log(f"{tag} starting: {left} run{'' if left == 1 else 's'} left, elapsed {elapsed()}")
      finish(i, train_and_evaluate_run(cfg, wd, arm, seed, tag, log))


def _checked_steps(runs: Sequence[dict[str, Any]], num_steps: int) -> int:
  """Steps the data check compares: all of them, or up to the earliest divergence."""
  reached = [int(r["step"]) for r in runs if r.get("diverged")]
  return min([num_steps, *reached])
