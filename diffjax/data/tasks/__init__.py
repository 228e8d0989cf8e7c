"""Synthetic retrieval tasks: multi-needle retrieval in real text, and associative recall.

Each task is a deterministic function of (seed, example index) and serves two purposes:

  * training data: a task is a `diffjax.data.DocumentSource`, so it can be mixed into the
    training pipeline like any corpus (`AnswersOnly` scores only its answers);
  * evaluation: `task.example(i)` returns a `RetrievalExample` that also knows where the answers
    are (which tokens are scored, where the answer needle sits in the context, which tokens are
    the question), and `task.batch(indices)` stacks examples into arrays for a model.

One file per task: `multi_needle` (`MultiNeedleTask`, the paper's Section 3.3 setup),
`associative_recall` (`AssociativeRecallTask`, MQAR with near-miss distractors, and
`AssociativeRecallMix` over several settings), `answers_only` (`AnswersOnly`); what they share
(region labels, `RetrievalExample`, `collate`) is in `common`.
"""

from diffjax.data.tasks.answers_only import AnswersOnly
from diffjax.data.tasks.associative_recall import AssociativeRecallMix, AssociativeRecallTask
from diffjax.data.tasks.common import (
  ANSWER,
  CONTEXT,
  QUERY,
  REGION_NAMES,
  SINK,
  RetrievalExample,
  collate,
)
from diffjax.data.tasks.multi_needle import DEPTHS, NEEDLE_GRID, ContextTooShort, MultiNeedleTask

__all__ = [
  "ANSWER",
  "CONTEXT",
  "DEPTHS",
  "NEEDLE_GRID",
  "QUERY",
  "REGION_NAMES",
  "SINK",
  "AnswersOnly",
  "AssociativeRecallMix",
  "AssociativeRecallTask",
  "ContextTooShort",
  "MultiNeedleTask",
  "RetrievalExample",
  "collate",
]
