"""Several runs of a comparison at once, each in its own process (``workers`` > 1, CPU only).

A small model does not keep two CPU cores busy: XLA runs its step on about one core, so runs
side by side finish sooner than one after the other (on a 2-core machine two or three "micro"
runs at once train 1.3-1.4x more tokens per second in total than one). Each run is exactly
what the serial loop trains: the same config, data order and step function, in a process of
its own. A child writes its trainer and
eval output to ``runs/<arm>_seed<k>/output.log``; the parent prints when runs start and finish
and, every minute, the step each running run has reached.

Signals: SIGTERM or SIGINT to the parent is passed on to the children as SIGTERM; runs in
training save a checkpoint and stop (rerunning the command resumes them), queued runs are not
started, and the parent raises `ComparisonStopped`.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections

from diffjax.compare.config import run_name
from diffjax.compare.runs import ComparisonStopped, RunResult, last_step, train_and_evaluate_run
from diffjax.errors import UserError

PROGRESS_SECONDS = 60.0
LOG_NAME = "output.log"


def _stop_outside_training(signum: int, frame: Any) -> None:
  del frame
  raise ComparisonStopped(
    f"signal {signum} stopped a run outside its training loop (nothing new to save)"
  )


def _child_init(cache_dir: str | None) -> None:
  # Ctrl-C reaches the whole process group; the parent decides what it means. The trainer
  # installs its own SIGINT/SIGTERM handlers (save, then stop) while it trains; outside that
  # loop (start-up, evaluation) SIGTERM ends the run with an exception and the worker process
  # lives on, so the pool never breaks under a run that is still saving.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, _stop_outside_training)
  from absl import logging  # pylint: disable=import-outside-toplevel

  logging.set_verbosity(logging.WARNING)
  import jax  # pylint: disable=import-outside-toplevel

  if cache_dir:
    jax.config.update("jax_compilation_cache_dir", cache_dir)


def _child_run(
  config: ml_collections.ConfigDict, workdir: str, arm: str, seed: int, tag: str
) -> RunResult:
  """One run in a worker process, its output appended to the run's output.log."""
  import jax  # pylint: disable=import-outside-toplevel

  run_dir = os.path.join(workdir, "runs", run_name(arm, seed))
  os.makedirs(run_dir, exist_ok=True)
  sys.stdout.flush()
  sys.stderr.flush()
  saved = os.dup(1), os.dup(2)
  with open(os.path.join(run_dir, LOG_NAME), "a", encoding="utf-8") as f:
    os.dup2(f.fileno(), 1)
    os.dup2(f.fileno(), 2)
    try:
      if jax.default_backend() != "cpu" or jax.process_count() > 1:
        raise UserError(
          f"workers={config.workers} trains several runs on one machine at "
          f"once, which only a CPU backend allows (this one is "
          f"{jax.default_backend()!r}); set --config.workers=1."
        )
      return train_and_evaluate_run(
        config, workdir, arm, seed, tag, lambda msg: print(msg, flush=True)
      )
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os.dup2(saved[0], 1)
      os.dup2(saved[1], 2)
      os.close(saved[0])
      os.close(saved[1])


Job = tuple[ml_collections.ConfigDict, str, str, int]


def run_parallel(
  jobs: Sequence[Job],
  labels: Sequence[str],
  workers: int,
  log: Callable[[str], None],
  on_done: Callable[[int, RunResult], None],
) -> None:
  """Runs ``jobs`` ((comparison config, workdir, arm, seed), named by ``labels``) in
  ``workers`` processes; calls ``on_done(index, result)`` in this process as each run
  finishes, in finishing order.

  Raises `ComparisonStopped` when a signal stopped the runs, and a run's own error (after
  stopping the other runs, which save checkpoints) when one failed.
  """
  import jax  # pylint: disable=import-outside-toplevel

  cache_dir = jax.config.jax_compilation_cache_dir or None
  tags = [f"[{i + 1}/{len(jobs)} {labels[i]}]" for i in range(len(jobs))]
  logs = [os.path.join(wd, "runs", run_name(arm, seed), LOG_NAME) for _, wd, arm, seed in jobs]
  pool = cf.ProcessPoolExecutor(
    max_workers=workers,
    mp_context=multiprocessing.get_context("spawn"),
    initializer=_child_init,
    initargs=(cache_dir,),
  )
  futures: dict[cf.Future, int] = {}
  # Runs are submitted only when a worker is free: none waits in the pool's own queue, where
  # a stop could not reach it.
  queue = list(range(len(jobs)))
  pending: set[cf.Future] = set()
  stop: dict[str, Any] = {"signum": None}

  def stop_children(signum: int = signal.SIGTERM, frame: Any = None) -> None:
    del frame
    stop["signum"] = stop["signum"] or signum
    queue.clear()  # queued runs never start
    for p in list((getattr(pool, "_processes", None) or {}).values()):
      try:
        os.kill(p.pid, signal.SIGTERM)
      except OSError:
        pass

  def submit_next() -> None:
    if queue:
      i = queue.pop(0)
      f = pool.submit(_child_run, *jobs[i], tags[i])
      futures[f] = i
      pending.add(f)
      log(f"{tags[i]} started in a worker process")

  old = {s: signal.signal(s, stop_children) for s in (signal.SIGTERM, signal.SIGINT)}
  stopped: list[str] = []
  error: BaseException | None = None
  try:
    log(
      f"compare: {workers} runs at a time, each in its own process; a run's trainer and eval "
      f"output goes to runs/<arm>_seed<k>/{LOG_NAME}"
    )
    for _ in range(workers):
      submit_next()
    while pending:
      done, still = cf.wait(pending, timeout=PROGRESS_SECONDS, return_when=cf.FIRST_COMPLETED)
      pending.difference_update(done)
      for f in sorted(done, key=futures.get):
        i = futures[f]
        try:
          result = f.result()
        except ComparisonStopped as e:
          stopped.append(str(e))
          continue
        except cf.process.BrokenProcessPool as e:
          if stop["signum"] is None and error is None:
            error = RuntimeError(
              f"{tags[i]} a worker process died ({e}); see {logs[i]}. "
              "Rerun the command to continue from the saved checkpoints."
            )
            stop_children()
          continue
        except Exception as e:  # pylint: disable=broad-except
          if error is None:
            error = e
            log(f"{tags[i]} failed: {e}; stopping the other runs (see {logs[i]})")
            stop_children()
          continue
        on_done(i, result)
        submit_next()
      if not done and stop["signum"] is None:
        steps = []
        for i in sorted(futures[f] for f in still):
          step = last_step(os.path.dirname(logs[i]))
          steps.append(f"{labels[i]} " + (f"step {step:,}" if step is not None else "starting"))
        log(f"compare: running {', '.join(steps)}")
  finally:
    for s, h in old.items():
      signal.signal(s, h)
    pool.shutdown(wait=True, cancel_futures=True)
  if error is not None:
    raise error
  if stopped or stop["signum"] is not None:
    raise ComparisonStopped(
      "; ".join(stopped) or f"signal {stop['signum']} stopped the comparison before a run started"
    )
