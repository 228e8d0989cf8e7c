"""Several runs of a comparison at once, each in its own process (``workers`` > 1, CPU only).

Each run is exactly what the serial loop trains, in a process of its own; its output goes to
``runs/<arm>_seed<k>/output.log``. SIGTERM or SIGINT to the parent reaches the children as
SIGTERM: training runs save and stop, queued runs never start. See docs/evaluation.md.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from diffjax.compare.config import ComparisonConfig, run_name
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


def _child_run(config: ComparisonConfig, workdir: str, arm: str, seed: int, tag: str) -> RunResult:
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


Job = tuple[ComparisonConfig, str, str, int]


class _Pool:
  """The worker processes, the runs not yet started, and what has stopped or failed so far."""

  def __init__(self, jobs: Sequence[Job], labels: Sequence[str], workers: int, log: Callable):
    import jax  # pylint: disable=import-outside-toplevel

    cache_dir = jax.config.jax_compilation_cache_dir or None
    self.jobs, self.labels, self.log = jobs, labels, log
    self.tags = [f"[{i + 1}/{len(jobs)} {labels[i]}]" for i in range(len(jobs))]
    self.logs = [
      os.path.join(wd, "runs", run_name(arm, seed), LOG_NAME) for _, wd, arm, seed in jobs
    ]
    self.pool = cf.ProcessPoolExecutor(
      max_workers=workers,
      mp_context=multiprocessing.get_context("spawn"),
      initializer=_child_init,
      initargs=(cache_dir,),
    )
    self.futures: dict[cf.Future, int] = {}
    # Runs are submitted only when a worker is free: none waits in the pool's own queue, where
    # a stop could not reach it.
    self.queue = list(range(len(jobs)))
    self.pending: set[cf.Future] = set()
    self.signum: int | None = None
    self.stopped: list[str] = []
    self.error: BaseException | None = None

  def stop_children(self, signum: int = signal.SIGTERM, frame: Any = None) -> None:
    del frame
    self.signum = self.signum or signum
    self.queue.clear()  # queued runs never start
    for p in list((getattr(self.pool, "_processes", None) or {}).values()):
      try:
        os.kill(p.pid, signal.SIGTERM)
      except OSError:
        pass

  def submit_next(self) -> None:
    if self.queue:
      i = self.queue.pop(0)
      f = self.pool.submit(_child_run, *self.jobs[i], self.tags[i])
      self.futures[f] = i
      self.pending.add(f)
      self.log(f"{self.tags[i]} started in a worker process")

  def result(self, f: cf.Future) -> RunResult | None:
    """The run's result, or None when it stopped or failed (recorded; the others are stopped)."""
    i = self.futures[f]
    try:
      return f.result()
    except ComparisonStopped as e:
      self.stopped.append(str(e))
    except cf.process.BrokenProcessPool as e:
      if self.signum is None and self.error is None:
        self.error = RuntimeError(
          f"{self.tags[i]} a worker process died ({e}); see {self.logs[i]}. "
          "Rerun the command to continue from the saved checkpoints."
        )
        self.stop_children()
    except Exception as e:  # pylint: disable=broad-except
      if self.error is None:
        self.error = e
        self.log(f"{self.tags[i]} failed: {e}; stopping the other runs (see {self.logs[i]})")
        self.stop_children()
    return None

  def log_progress(self, running: set[cf.Future]) -> None:
    steps = []
    for i in sorted(self.futures[f] for f in running):
      step = last_step(os.path.dirname(self.logs[i]))
      steps.append(f"{self.labels[i]} " + (f"step {step:,}" if step is not None else "starting"))
    self.log(f"compare: running {', '.join(steps)}")

  def raise_if_stopped(self) -> None:
    if self.error is not None:
      raise self.error
    if self.stopped or self.signum is not None:
      raise ComparisonStopped(
        "; ".join(self.stopped)
        or f"signal {self.signum} stopped the comparison before a run started"
      )


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
  pool = _Pool(jobs, labels, workers, log)
  old = {s: signal.signal(s, pool.stop_children) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    log(
      f"compare: {workers} runs at a time, each in its own process; a run's trainer and eval "
      f"output goes to runs/<arm>_seed<k>/{LOG_NAME}"
    )
    for _ in range(workers):
      pool.submit_next()
    while pool.pending:
      done, still = cf.wait(pool.pending, timeout=PROGRESS_SECONDS, return_when=cf.FIRST_COMPLETED)
      pool.pending.difference_update(done)
      for f in sorted(done, key=pool.futures.get):
        result = pool.result(f)
        if result is not None:
          on_done(pool.futures[f], result)
          pool.submit_next()
      if not done and pool.signum is None:
        pool.log_progress(still)
  finally:
    for s, h in old.items():
      signal.signal(s, h)
    pool.pool.shutdown(wait=True, cancel_futures=True)
  pool.raise_if_stopped()
