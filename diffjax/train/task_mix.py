"""Mixing synthetic retrieval tasks into language-model training data.

The run's ``task_mix`` section names a task of :mod:`diffjax.data.tasks` and the share of
training tokens that come from it; its examples join the corpus as documents (docs/training.md,
"Retrieval tasks in training").
"""

from __future__ import annotations

import math

import numpy as np

from diffjax.data import DataConfig, DocumentSource, load_tokenizer, open_corpus
from diffjax.train.sections import TASKS, TaskMixConfig

__all__ = [
  "TASKS",
  "TRAIN_SEED_OFFSET",
  "InterleavedSource",
  "mixed_source",
  "run_source",
  "task_only",
]
# Evaluation examples use small seeds; training examples start here.
TRAIN_SEED_OFFSET = 1_000_003


class InterleavedSource:
  """The documents of two sources spread evenly through each other.

  Even spreading keeps the mix's proportion when a document cap
  (``data.max_documents`` / ``max_tokens``) keeps only a prefix of the documents.
  """

  def __init__(self, first: DocumentSource, second: DocumentSource):
    self.first, self.second = first, second
    self.name = f"{getattr(first, 'name', 'source')}+{getattr(second, 'name', 'task')}"
    n1, n2 = len(first), len(second)
    total = n1 + n2
    steps = np.floor(np.arange(total + 1) * (n2 / max(total, 1)))
    self._is_second = np.diff(steps) > 0
    self._rank = np.where(
      self._is_second, np.cumsum(self._is_second) - 1, np.cumsum(~self._is_second) - 1
    )

  def __len__(self) -> int:
    return int(self._is_second.size)

  def __getitem__(self, index: int) -> np.ndarray:
    if not 0 <= index < len(self):
      raise IndexError(f"document {index} out of range for {len(self)} documents")
    src = self.second if self._is_second[index] else self.first
    return src[int(self._rank[index])]


def task_only(mix: TaskMixConfig) -> bool:
  """True when ``mix`` trains on task examples alone (fraction 1), so no corpus is needed.
  (A mapping of the section's keys is resolved first.)"""
  return TaskMixConfig.from_config(mix).task_only


def run_source(
  mix: TaskMixConfig, data_cfg: DataConfig, seed: int
) -> tuple[DocumentSource | None, object | None]:
  """The documents and tokenizer a run trains on when it mixes in a task, else (None, None)
  (the data config alone then says what to read). The trainer and every later evaluation of the
  run build their data through this, so a run scored afterwards sees the held-out split of the
  very documents it was trained on."""
  if mix.task == "none":
    return None, None
  tokenizer = load_tokenizer(data_cfg.tokenizer)
  corpus = None if mix.task_only else open_corpus(data_cfg, tokenizer)
  return mixed_source(corpus, mix, tokenizer, seed), tokenizer


def mixed_source(
  corpus: DocumentSource | None, mix: TaskMixConfig, tokenizer, seed: int
) -> DocumentSource:
  """``corpus`` plus enough task examples to make ``mix.fraction`` of the tokens; with
  fraction 1, ``mix.num_examples`` task examples alone (``corpus`` may then be None). A mapping
  of the section's keys is resolved (and checked) first."""
  mix = TaskMixConfig.from_config(mix)
  if mix.task == "none" or mix.fraction == 0.0:
    return corpus
  from diffjax.data import tasks  # pylint: disable=import-outside-toplevel

  seed = TRAIN_SEED_OFFSET + int(seed)
  if mix.task == "multi_needle":
    make = lambda n: tasks.MultiNeedleTask(
      mix.context_len,
      mix.num_needles,
      mix.num_queries,
      num_examples=n,
      seed=seed,
      filler=corpus,
      tokenizer=tokenizer,
    )
  else:
    lengths = dict(key_len=mix.key_len, value_len=mix.value_len, separator=mix.separator)
    if mix.grid:
      make = lambda n: tasks.AssociativeRecallMix(
        list(mix.grid), mix.num_queries, num_examples=n, seed=seed, tokenizer=tokenizer, **lengths
      )
    else:
      make = lambda n: tasks.AssociativeRecallTask(
        mix.num_pairs,
        mix.num_queries,
        mix.distractors_per_query,
        num_examples=n,
        seed=seed,
        tokenizer=tokenizer,
        **lengths,
      )
  if mix.task_only:
    n = mix.num_examples
    return tasks.AnswersOnly(make(n)) if mix.loss == "answers" else make(n)
  corpus_tokens = sum(int(np.size(corpus[i])) for i in range(len(corpus)))
  per_example = max(int(np.size(make(1)[0])), 1)
  n = max(1, math.ceil(mix.fraction / (1.0 - mix.fraction) * corpus_tokens / per_example))
  return InterleavedSource(corpus, make(n))
