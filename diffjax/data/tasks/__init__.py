"""Synthetic retrieval tasks: multi-needle retrieval in real text, and associative recall.

One file per task (`multi_needle`, `associative_recall`, `answers_only`); what they share is
in `common`. Each is a training source and an evaluation set: docs/data.md.
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
