"""A task as training data scored on its answers only."""

from __future__ import annotations

import numpy as np

from diffjax.data.tasks.common import TaskBase


class AnswersOnly:
  """A task as training data scored on its answers only.

  A `DocumentSource` (the task's token sequences) with `read_weighted()`: the training
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

  def read_weighted(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every example's tokens and answer weights, each example generated once."""
    examples = [self.task.example(i) for i in range(len(self.task))]
    return ([ex.tokens for ex in examples],
            [(ex.answer_segments >= 0).astype(np.uint8) for ex in examples])
