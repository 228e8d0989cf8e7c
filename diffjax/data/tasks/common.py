"""What the retrieval tasks share: region labels, the example record, the token builder, the
seeded draws, the task base class and `collate`.

Sequences are built from separately tokenized pieces (`Builder`), so every recorded span is
exact in tokens for any tokenizer. The region labels: docs/data.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from diffjax.data.tokenizers import Tokenizer

SINK, CONTEXT, ANSWER, QUERY = 0, 1, 2, 3
REGION_NAMES = ("sink", "context", "answer", "query")


@dataclasses.dataclass(frozen=True)
class RetrievalExample:
  """One evaluation example; positions index `tokens`.

  Attributes:
    tokens: (L,) int32, the whole sequence (prompt and answers) for teacher forcing.
    answer_segments: (L,) int32; r >= 0 at the tokens of the answer to query r, -1 elsewhere.
      Teacher forcing scores position t from the logits at t - 1.
    regions: (L,) int32 region label per token (SINK, CONTEXT, ANSWER, QUERY).
    prompt_len: index of the first answer token; tokens[:prompt_len] is the prompt.
    answers: per query, the (n_r,) int32 answer tokens (equal to tokens at its answer span).
    answer_spans: per query, [start, end) of its answer in `tokens` (at the end of the sequence).
    needle_spans: per query, [start, end) of the queried needle (or pair) in the context.
    value_spans: per query, [start, end) of the value (digits) inside that needle.
    distractor_spans: [start, end) of every needle or pair in the context that is not queried.
    depth: requested depth of the answer needle in [0, 1] (None when the task has no depth).
    depth_query: which query asks for the needle placed at `depth` (None without depth).
    needle_depths: per query, the realised depth of its needle: the fraction of the filler text
      that precedes it (the scale of `depth`; equal to it for the answer needle up to rounding).
      For associative recall: the pair's index in the context divided by (pairs - 1).
    keys: per query, the key text; values: per query, the value text.
  """

  tokens: np.ndarray
  answer_segments: np.ndarray
  regions: np.ndarray
  prompt_len: int
  answers: tuple[np.ndarray, ...]
  answer_spans: tuple[tuple[int, int], ...]
  needle_spans: tuple[tuple[int, int], ...]
  value_spans: tuple[tuple[int, int], ...]
  distractor_spans: tuple[tuple[int, int], ...]
  depth: float | None
  depth_query: int | None
  needle_depths: tuple[float, ...]
  keys: tuple[str, ...]
  values: tuple[str, ...]

  @property
  def num_queries(self) -> int:
    return len(self.answers)


class Builder:
  """Appends tokenized pieces and records their spans."""

  def __init__(self):
    self.pieces: list[np.ndarray] = []
    self.regions: list[np.ndarray] = []
    self.length = 0

  def add(self, ids: np.ndarray, region: int) -> tuple[int, int]:
    ids = np.asarray(ids, dtype=np.int32).reshape(-1)
    start = self.length
    self.pieces.append(ids)
    self.regions.append(np.full(ids.size, region, np.int32))
    self.length += ids.size
    return start, self.length

  def finish(self) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.concatenate(self.pieces) if self.pieces else np.zeros(0, np.int32)
    regions = np.concatenate(self.regions) if self.regions else np.zeros(0, np.int32)
    if regions.size:
      regions[0] = SINK
    return tokens, regions

  def example(self, answer_spans: Sequence[tuple[int, int]], **fields) -> RetrievalExample:
    """The example of the pieces added so far; query r's answer is ``answer_spans[r]``
    (the prompt ends where the first answer starts). ``fields``: the other attributes."""
    tokens, regions = self.finish()
    segs = np.full(tokens.size, -1, np.int32)
    for r, (s, e) in enumerate(answer_spans):
      segs[s:e] = r
    return RetrievalExample(
      tokens=tokens,
      answer_segments=segs,
      regions=regions,
      prompt_len=answer_spans[0][0],
      answers=tuple(tokens[s:e].copy() for s, e in answer_spans),
      answer_spans=tuple(answer_spans),
      **fields,
    )


def draws(seed: int, index: int, *stream: int) -> np.random.Generator:
  """The random draws of example ``index``; ``stream`` keeps the draws of one task's parts (and
  of several tasks with one seed) apart."""
  return np.random.default_rng([int(seed), int(index), *(int(s) for s in stream)])


def digits(rng: np.random.Generator, n: int) -> str:
  """``n`` random decimal digits."""
  first = str(int(rng.integers(1, 10)))  # No leading zero, so the value reads as a number.
  return first + "".join(str(int(d)) for d in rng.integers(0, 10, n - 1))


class TaskBase:
  """Shared DocumentSource and batching behaviour; subclasses implement `example`."""

  name: str
  num_examples: int
  tokenizer: Tokenizer

  def example(self, index: int) -> RetrievalExample:
    raise NotImplementedError

  def __len__(self) -> int:
    return self.num_examples

  def __getitem__(self, index: int) -> np.ndarray:
    """Example `index` as a training document: its (L,) int32 tokens."""
    if not -self.num_examples <= index < self.num_examples:
      raise IndexError(
        f"example index {index} out of range for {self.num_examples} examples of {self.name}"
      )
    return self.example(index % self.num_examples).tokens

  def examples(self, indices: Sequence[int] | None = None) -> list[RetrievalExample]:
    indices = range(self.num_examples) if indices is None else indices
    return [self.example(int(i)) for i in indices]

  def batch(self, indices: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """Stacks examples `indices` (default: all) with `collate`."""
    return collate(self.examples(indices), pad_id=int(self.tokenizer.pad_id))


def collate(examples: Sequence[RetrievalExample], pad_id: int) -> dict[str, np.ndarray]:
  """Stacks examples into right-padded arrays.

  Returns a dict:
    tokens (B, L) int32 (padded with `pad_id`); answer_segments (B, L) int32 (-1 on padding);
    regions (B, L) int32 (-1 on padding); valid (B, L) bool; prediction_rows (B, L) bool:
    the positions whose next-token logits predict an answer token (t with answer_segments[t+1]
    >= 0), the natural "query" rows for attention allocation; num_queries (B,) int32.
  """
  if not examples:
    raise ValueError("collate needs at least one example.")
  length = max(ex.tokens.size for ex in examples)
  b = len(examples)
  tokens = np.full((b, length), pad_id, np.int32)
  segs = np.full((b, length), -1, np.int32)
  regions = np.full((b, length), -1, np.int32)
  valid = np.zeros((b, length), bool)
  for i, ex in enumerate(examples):
    n = ex.tokens.size
    tokens[i, :n] = ex.tokens
    segs[i, :n] = ex.answer_segments
    regions[i, :n] = ex.regions
    valid[i, :n] = True
  rows = np.zeros((b, length), bool)
  rows[:, :-1] = segs[:, 1:] >= 0
  return dict(
    tokens=tokens,
    answer_segments=segs,
    regions=regions,
    valid=valid,
    prediction_rows=rows,
    num_queries=np.asarray([ex.num_queries for ex in examples], np.int32),
  )
