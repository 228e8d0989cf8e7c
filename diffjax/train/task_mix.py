"""Mixing synthetic retrieval tasks into language-model training data.

``config.task_mix.task`` names a task of :mod:`diffjax.data.tasks` ("multi_needle" or
"associative_recall"); ``config.task_mix.fraction`` is the share of training tokens
that come from it. Task examples join the corpus as documents, so they are packed,
shuffled and split exactly like text. Training examples are drawn from a seed range
the evaluation suite never uses, so no evaluation example is trained on.

``fraction = 1.0`` trains on task examples alone: the corpus is not read and
``task_mix.num_examples`` examples are made (it must then be > 0). With task examples
alone, ``task_mix.loss = "answers"`` scores only the answer tokens (``"all"``, the default,
scores every token, as for text).

Keys of ``config.task_mix`` (``diffjax.presets.base_config`` has them all):
  multi_needle: context_len, num_needles, num_queries.
  associative_recall: num_pairs, num_queries, distractors_per_query, key_len, value_len,
    separator;
    ``grid``, a list of (num_pairs, distractors_per_query) pairs, mixes those settings in
    equal shares instead (``AssociativeRecallMix``).
"""

from __future__ import annotations

import math

import numpy as np

from diffjax.data import DocumentSource, load_tokenizer, open_corpus

TASKS = ("none", "multi_needle", "associative_recall")
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


def task_only(mix) -> bool:
  """True when ``mix`` trains on task examples alone (fraction 1), so no corpus is needed."""
  return mix.get("task", "none") != "none" and float(mix.get("fraction", 0.0)) == 1.0


def run_source(config, data_cfg) -> tuple[DocumentSource | None, object | None]:
  """The documents and tokenizer a run config trains on when it mixes in a task, else
  (None, None) (the data config alone then says what to read). The trainer and every
  later evaluation of the run build their data through this, so a run scored afterwards
  sees the held-out split of the very documents it was trained on."""
  mix = config.get("task_mix") if "task_mix" in config else None
  if mix is None or mix.get("task", "none") == "none":
    return None, None
  tokenizer = load_tokenizer(data_cfg.tokenizer)
  corpus = None if task_only(mix) else open_corpus(data_cfg, tokenizer)
  return mixed_source(corpus, mix, tokenizer, config.seed), tokenizer


def mixed_source(corpus: DocumentSource | None, mix, tokenizer, seed: int) -> DocumentSource:
  """``corpus`` plus enough task examples to make ``mix.fraction`` of the tokens; with
  fraction 1, ``mix.num_examples`` task examples alone (``corpus`` may then be None)."""
  task = mix.get("task", "none")
  if task not in TASKS:
    raise ValueError(f"task_mix.task={task!r} is not one of {TASKS}.")
  fraction = float(mix.get("fraction", 0.0))
  if task == "none" or fraction == 0.0:
    return corpus
  if not 0.0 < fraction <= 1.0:
    raise ValueError(f"task_mix.fraction={fraction} must be in (0, 1].")
  loss = mix.get("loss", "all")
  if loss not in ("all", "answers"):
    raise ValueError(f"task_mix.loss={loss!r} must be 'all' or 'answers'.")
  if loss == "answers" and fraction != 1.0:
    raise ValueError(
      f"task_mix.loss='answers' scores task answers only, so it needs task "
      f"examples alone (task_mix.fraction=1); got fraction={fraction}."
    )
  if task == "multi_needle" and corpus is None:
    raise ValueError(
      "task_mix.task='multi_needle' hides its needles in corpus text; it cannot "
      "train on task examples alone (fraction=1). Use a fraction below 1."
    )
  from diffjax.data import tasks  # pylint: disable=import-outside-toplevel

  seed = TRAIN_SEED_OFFSET + int(seed)
  if task == "multi_needle":
    make = lambda n: tasks.MultiNeedleTask(
      int(mix.context_len),
      int(mix.num_needles),
      int(mix.num_queries),
      num_examples=n,
      seed=seed,
      filler=corpus,
      tokenizer=tokenizer,
    )
  else:
    lengths = dict(
      key_len=int(mix.get("key_len", 3)),
      value_len=int(mix.get("value_len", 3)),
      separator=str(mix.get("separator", ":")),
    )
    grid = mix.get("grid") or ()
    if grid:
      make = lambda n: tasks.AssociativeRecallMix(
        [tuple(g) for g in grid],
        int(mix.num_queries),
        num_examples=n,
        seed=seed,
        tokenizer=tokenizer,
        **lengths,
      )
    else:
      make = lambda n: tasks.AssociativeRecallTask(
        int(mix.num_pairs),
        int(mix.num_queries),
        int(mix.get("distractors_per_query", 1)),
        num_examples=n,
        seed=seed,
        tokenizer=tokenizer,
        **lengths,
      )
  if fraction == 1.0:
    n = int(mix.get("num_examples", 0) or 0)
    if n <= 0:
      raise ValueError(
        f"task_mix.fraction=1 trains on task examples alone; set "
        f"task_mix.num_examples to how many (> 0), got {n}."
      )
    return tasks.AnswersOnly(make(n)) if loss == "answers" else make(n)
  corpus_tokens = sum(int(np.size(corpus[i])) for i in range(len(corpus)))
  per_example = max(int(np.size(make(1)[0])), 1)
  n = max(1, math.ceil(fraction / (1.0 - fraction) * corpus_tokens / per_example))
  return InterleavedSource(corpus, make(n))
