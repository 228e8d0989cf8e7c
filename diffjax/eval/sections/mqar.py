"""The "mqar" section: associative recall (key-value pairs, queried keys with near-duplicate
distractors), teacher-forced exact match of each queried value."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffjax.data.tasks import AssociativeRecallTask
from diffjax.eval.registry import HIGHER_IS_BETTER, Section
from diffjax.eval.runner import LogitsFn
from diffjax.eval.scoring import retrieval_accuracy
from diffjax.eval.sections.context import Context


def associative_recall(
  fn: LogitsFn, num_examples: int = 64, seed: int = 0, batch_size: int = 8, **task_kwargs
) -> dict[str, Any]:
  """MQAR accuracy (teacher-forced exact match of each queried value).

  Returns `scoring.retrieval_accuracy`'s dict with "sequence_len" and "task" (its name).
  """
  task = AssociativeRecallTask(num_examples=num_examples, seed=seed, **task_kwargs)
  out = retrieval_accuracy(fn, task, batch_size=batch_size)
  out["sequence_len"] = int(task.example(0).tokens.size)
  out["task"] = task.name
  return out


def run(context: Context) -> dict[str, Any]:
  cfg = context.config
  return associative_recall(
    context.logits_fn, cfg.mqar_examples, cfg.seed + 3, cfg.batch_size, **dict(cfg.mqar)
  )


def scalars(result: Mapping[str, Any]) -> dict[str, float]:
  return {"mqar/accuracy": result["accuracy"]}


SECTION = Section(
  name="mqar",
  run=run,
  scalars=scalars,
  directions={"mqar/accuracy": HIGHER_IS_BETTER},
  headline=("mqar/accuracy",),
  enabled=lambda cfg: cfg.mqar is not None,
)
