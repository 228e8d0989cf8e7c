"""`Context`: what `evaluate_model` hands every section's `run`, built once per evaluation."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from diffjax.data.tasks import AssociativeRecallTask, MultiNeedleTask
from diffjax.eval.config import EvalConfig
from diffjax.eval.runner import LogitsFn, ModelRunner


@dataclasses.dataclass(frozen=True)
class Context:
  """The model and the data of one evaluation.

  Attributes:
    runner: the model's jitted passes (`ModelRunner`); `runner.model` and `runner.config` are
      the model and its `ModelConfig`.
    logits_fn: tokens -> logits on the model's normal path (`runner.logits_fn()`).
    config: the `EvalConfig`.
    val_batches: the first `config.val_batches` validation batches (pipeline dicts or (B, T+1)
      token arrays); may be empty (sections with `needs_validation` are then skipped).
    capture_batches: the same rows split into batches of at most `config.capture_batch_size`,
      for passes that capture attention maps.
    make_standard_task: builds the task of attention allocation, low-bit accuracy and the clamp
      probe (`config.probe_task`: multi-needle retrieval or associative recall); read it as
      `standard_task`, which builds it on first use, so an evaluation whose sections never read
      it neither builds it nor needs a context long enough for its needles.
    standard_examples: how many of its examples those sections score.
    filler: the documents needles are hidden in (None: the standard-library corpus).
  """

  runner: ModelRunner
  logits_fn: LogitsFn
  config: EvalConfig
  val_batches: Sequence[Any]
  capture_batches: Sequence[Any]
  make_standard_task: Callable[[], MultiNeedleTask | AssociativeRecallTask]
  standard_examples: int
  filler: Any = None

  @functools.cached_property
  def standard_task(self) -> MultiNeedleTask | AssociativeRecallTask:
    """The standard task, built on first use (`ContextTooShort` when the context cannot hold
    one needle and its question)."""
    return self.make_standard_task()

  def options(self, section: str) -> dict[str, Any]:
    """The settings ``config.options`` gives the section called ``section`` ({} if none)."""
    return dict(self.config.options.get(section, {}))
