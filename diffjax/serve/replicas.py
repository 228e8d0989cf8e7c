"""Several engines over one model, each with its own slots, KV cache and thread.

:class:`Replicas` sends each job to the replica with the fewest jobs; they share the parameters
and compiled programs (docs/serving.md#continuous-batching; figures: docs/results/serving.md).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from diffjax.model import DecoderLM
from diffjax.serve.engine import Engine, Job, QueueFull


class Replicas:
  """``replicas`` :class:`Engine` s over ``model``, with the interface of one.

  Args:
    model: any DecoderLM.
    replicas: engines, each decoding on its own thread (at least 1).
    slots: rows decoded at once in all, at least ``replicas``; each replica gets
      ``ceil(slots / replicas)``.
    max_waiting: jobs held beyond the slots in all, split the same way.
    **options: the other :class:`Engine` options (``context``, ``decode_chunk``,
      ``max_prefill``, ``pad_id``, ``cache_layout``); a mesh is refused, since sharded
      decoding already uses every device.
  """

  def __init__(
    self, model: DecoderLM, *, replicas: int = 2, slots: int = 8, max_waiting: int = 256, **options
  ):
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
      raise ValueError(f"replicas={replicas!r} must be an integer of at least 1.")
    if options.get("mesh") is not None:
      raise ValueError(
        "replicas decode on one device each; with a mesh, decoding is sharded over its "
        "devices instead: drop the mesh or the replicas."
      )
    if slots < 1 or max_waiting < 0:
      raise ValueError(
        f"slots={slots} must be at least 1 and max_waiting={max_waiting} at least 0."
      )
    if replicas > slots:
      raise ValueError(
        f"replicas={replicas} with slots={slots}: each replica decodes at least one slot; "
        f"give at least {replicas} slots or at most {slots} replicas."
      )
    per_slots, per_waiting = -(-slots // replicas), -(-max_waiting // replicas)
    self.engines = [
      Engine(model, slots=per_slots, max_waiting=per_waiting, **options) for _ in range(replicas)
    ]
    first = self.engines[0]
    for engine in self.engines[1:]:
      engine._programs = first._programs  # pylint: disable=protected-access
    self.context, self.vocab_size = first.context, first.vocab_size
    self.cache_layout, self.decode_chunk = first.cache_layout, first.decode_chunk
    self.slots, self.max_waiting = per_slots * replicas, per_waiting * replicas

  def program_names(self) -> list[tuple]:
    """Every program the replicas run (they share them)."""
    return self.engines[0].program_names()

  def warm_up(self, progress: Callable[[str], None] | None = None) -> float:
    """Compiles every program once for all replicas; returns the seconds it took."""
    return self.engines[0].warm_up(progress)

  @property
  def compiles(self) -> int:
    return sum(e.compiles for e in self.engines)

  @property
  def counts(self) -> collections.Counter:
    """The engines' counts, added up."""
    return sum((e.counts for e in self.engines), collections.Counter())

  @property
  def error(self) -> str | None:
    return next((e.error for e in self.engines if e.error), None)

  def check(self, job: Job) -> None:
    self.engines[0].check(job)

  def submit(self, job: Job) -> None:
    """Queues ``job`` on the replica with the fewest jobs running and waiting (the next one
    when that one's queue is full); raises as :meth:`Engine.submit` does."""
    full = None
    for engine in sorted(self.engines, key=_jobs):
      try:
        engine.submit(job)
        return
      except QueueFull as e:
        full = e
    raise full

  def load(self) -> dict[str, int]:
    """The engines' loads, added up."""
    total = collections.Counter()
    for engine in self.engines:
      total.update(engine.load())
    return dict(total)

  def start(self) -> Replicas:
    for engine in self.engines:
      engine.start()
    return self

  def stop(self, *, cancel: bool = False, timeout: float | None = None) -> None:
    """As :meth:`Engine.stop`, for every replica (all stop taking jobs first; ``timeout`` is
    for them all)."""
    for engine in self.engines:
      engine.stop(cancel=cancel, timeout=0)
    end = None if timeout is None else time.monotonic() + timeout
    for engine in self.engines:
      left = None if end is None else max(0.0, end - time.monotonic())
      engine.stop(cancel=cancel, timeout=left)


def _jobs(engine: Engine) -> int:
  """Jobs running and waiting on ``engine``."""
  load = engine.load()
  return load["running"] + load["waiting"]
