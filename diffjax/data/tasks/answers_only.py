"""A task as training data scored on its answers only."""

from __future__ import annotations

import numpy as np

from diffjax.data.tasks.common import TaskBase


class AnswersOnly:
  """A task as training data scored on its answers only.

  A `DocumentSource` (the task's token sequences) with `weighted(i)`: the training
  pipeline then counts only the predictions of answer tokens in the loss, the usual way of
  training a model on associative recall (the keys and values are random, so predicting
  them teaches nothing but adds noise to every update).
  """

  def __init__(self, task: TaskBase):
    self.task = task
    self.name = f"{task.name}[answers]"

  def __len__(self) -> int:
    return len(self.task)

  def __getitem__(self, index: int) -> np.ndarray:
    return self.task[index]

  def weighted(self, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Example ``index``'s tokens and per-token weights: 1 on answer tokens, 0 elsewhere."""
    ex = self.task.example(index)
    return ex.tokens, (ex.answer_segments >= 0).astype(np.uint8)
