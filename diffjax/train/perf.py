"""Where a run's time goes: step time, tokens/s, MFU, device memory and the goodput summary.

A :class:`Clock` accumulates wall time into named phases as the trainer enters them; between
log lines :class:`Throughput` turns the interval's steps and tokens into the ``perf/...``
metrics (docs/training.md, "Speed, MFU and where the time goes").
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import jax

from diffjax.train.sections import ProfileConfig

PHASES = ("setup", "restore", "compile", "data", "train", "eval", "checkpoint", "profile")


class Clock:
  """Wall time per phase since the clock started."""

  def __init__(self):
    self.t0 = time.perf_counter()
    self.seconds = {p: 0.0 for p in PHASES}
    self._started: dict[str, float] = {}

  @contextlib.contextmanager
  def phase(self, name: str) -> Iterator[None]:
    self.enter(name)
    try:
      yield
    finally:
      self.leave(name)

  def enter(self, name: str) -> None:
    """Starts timing ``name`` (for a phase that spans more than one block of code)."""
    self._started[name] = time.perf_counter()

  def leave(self, name: str) -> None:
    self.seconds[name] += time.perf_counter() - self._started.pop(name)

  def wall(self) -> float:
    return time.perf_counter() - self.t0


def device_memory() -> dict[str, int]:
  """Bytes in use and peak on the first local device, where its backend reports them
  (TPU and GPU do; a CPU may not)."""
  try:
    stats = jax.local_devices()[0].memory_stats() or {}
  except Exception:  # pylint: disable=broad-except  # backends without allocator statistics
    return {}
  out = {}
  if "bytes_in_use" in stats:
    out["memory_bytes_in_use"] = int(stats["bytes_in_use"])
  if "peak_bytes_in_use" in stats:
    out["memory_peak_bytes"] = int(stats["peak_bytes_in_use"])
  return out


class Throughput:
  """Per-interval ``perf/...`` metrics (the table in docs/training.md)."""

  def __init__(
    self,
    clock: Clock,
    *,
    tokens_per_step: int,
    model_flops_per_token: float,
    num_devices: int,
    peak_flops_per_device: float | None,
  ):
    self.clock = clock
    self.tokens_per_step = tokens_per_step
    self.flops_per_token = model_flops_per_token
    self.num_devices = num_devices
    self.peak = peak_flops_per_device
    self.step_times: list[float] = []
    self._mark(0)

  def _mark(self, step: int) -> None:
    self._step = step
    self._t = time.perf_counter()
    self._phases = dict(self.clock.seconds)

  def restart(self, step: int) -> None:
    """Starts a new interval at ``step`` (after compiling, restoring, ...)."""
    self._mark(step)

  def interval(self, step: int) -> dict[str, Any]:
    """The metrics of the steps since the last call (empty if none), and a new interval."""
    steps = step - self._step
    if steps <= 0:
      return {}
    now = time.perf_counter()
    elapsed = max(now - self._t, 1e-9)
    spent = {p: self.clock.seconds[p] - self._phases[p] for p in PHASES}
    step_time = (elapsed - spent["eval"] - spent["checkpoint"] - spent["profile"]) / steps
    self.step_times.append(step_time)
    tokens_per_s = self.tokens_per_step / step_time
    out = {
      "perf/step_time_s": step_time,
      "perf/tokens_per_s": tokens_per_s,
      "perf/tokens_per_s_per_device": tokens_per_s / self.num_devices,
      "perf/model_flops_per_token": self.flops_per_token,
      "perf/data_frac": spent["data"] / elapsed,
      "perf/checkpoint_frac": spent["checkpoint"] / elapsed,
      "perf/eval_frac": spent["eval"] / elapsed,
    }
    if self.peak:
      out["perf/mfu"] = self._mfu(tokens_per_s)
    out.update({f"perf/{k}": v for k, v in device_memory().items()})
    self._mark(step)
    return out

  def summary(self) -> dict[str, Any]:
    """Median step time, tokens/s and MFU over the run's intervals (for reports)."""
    if not self.step_times:
      return {}
    times = sorted(self.step_times)
    median = times[len(times) // 2]
    out = {
      "step_time_s": median,
      "tokens_per_s": self.tokens_per_step / median,
      "tokens_per_s_per_device": self.tokens_per_step / median / self.num_devices,
    }
    if self.peak:
      out["mfu"] = self._mfu(out["tokens_per_s"])
    return out

  def _mfu(self, tokens_per_s: float) -> float:
    return tokens_per_s * self.flops_per_token / (self.peak * self.num_devices)


def goodput(clock: Clock, *, steps_trained: int, steps_recomputed: int) -> dict[str, Any]:
  """Where the run's wall time went: each phase, the share spent training, and the steps
  trained again after a restart (those logged by an earlier attempt past its last checkpoint).
  The phases cover the run from its start; ``unaccounted_s`` is what falls between them."""
  wall = clock.wall()
  out = {"wall_s": wall, **{f"{p}_s": s for p, s in clock.seconds.items()}}
  out["unaccounted_s"] = wall - sum(clock.seconds.values())
  out["goodput"] = clock.seconds["train"] / wall if wall > 0 else float("nan")
  out["steps_trained"] = steps_trained
  out["steps_recomputed"] = steps_recomputed
  return out


def goodput_line(summary: dict[str, Any]) -> str:
  """The goodput summary as one line for the log."""
  parts = [f"{p} {summary[p + '_s']:.1f}s" for p in PHASES if summary[p + "_s"] >= 0.05]
  return (
    f"goodput: {summary['goodput']:.1%} of {summary['wall_s']:.1f}s training "
    f"({', '.join(parts)}); {summary['steps_trained']} steps trained, "
    f"{summary['steps_recomputed']} recomputed after a restart"
  )


class Profile:
  """``profile.steps=(a, b)``: a ``jax.profiler`` trace of steps a..b (1-based, inclusive) in
  ``<workdir>/profile`` (TensorBoard's profile plugin or XProf reads it); ``profile.dump_hlo``:
  the compiled train step's HLO in ``<workdir>/train_step.hlo.txt``. Process 0 only."""

  def __init__(
    self, section: ProfileConfig, workdir: str, *, enabled: bool, clock: Clock | None = None
  ):
    self.steps = section.steps if enabled else ()
    self.hlo = section.dump_hlo and enabled
    self.directory = os.path.join(workdir, "profile")
    self.workdir = workdir
    self._tracing = False
    self.clock = clock or Clock()

  def dump_hlo(self, compiled) -> None:
    if self.hlo:
      with open(os.path.join(self.workdir, "train_step.hlo.txt"), "w", encoding="utf-8") as f:
        f.write(compiled.as_text())

  def before(self, step: int) -> bool:
    """Called before ``step`` runs; True when a trace starts there."""
    if self.steps and step == self.steps[0] and not self._tracing:
      with self.clock.phase("profile"):
        jax.profiler.start_trace(self.directory)
      self._tracing = True
      return True
    return False

  def after(self, step: int, state) -> None:
    """Called after ``step`` was dispatched; waits for it when the trace ends there."""
    if self._tracing and step >= self.steps[1]:
      with self.clock.phase("train"):
        jax.block_until_ready(state)
      self.close()

  def close(self) -> None:
    if self._tracing:
      with self.clock.phase("profile"):
        jax.profiler.stop_trace()
      self._tracing = False
