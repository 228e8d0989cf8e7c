"""Multi-needle retrieval in real text (the paper's Section 3.3 setup).

N needle sentences hidden in filler text from a real corpus, R of them asked for at the end; the
answer needle sits at a chosen depth, the others at random depths (docs/data.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from diffjax.data.corpus import stdlib_corpus
from diffjax.data.sources import DocumentSource
from diffjax.data.tasks.common import (
  ANSWER,
  CONTEXT,
  QUERY,
  SINK,
  Builder,
  RetrievalExample,
  TaskBase,
  digits,
  draws,
)
from diffjax.data.tokenizers import ByteTokenizer, Tokenizer

# The paper's (num_needles, num_queries) grid at a fixed context length (Table 2).
NEEDLE_GRID = ((1, 1), (2, 2), (4, 2), (6, 2))
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)

# Needle keys: place names written for this module. Short ASCII words so every key is a few bytes.
_KEYS = (
  "Oslo",
  "Lima",
  "Cairo",
  "Quito",
  "Dakar",
  "Hanoi",
  "Perth",
  "Turin",
  "Seville",
  "Nagoya",
  "Lagos",
  "Bergen",
  "Tromso",
  "Kyoto",
  "Porto",
  "Zagreb",
  "Tbilisi",
  "Malmo",
  "Lyon",
  "Graz",
  "Leeds",
  "Cork",
  "Accra",
  "Davao",
  "Cusco",
  "Tunis",
  "Sendai",
  "Izmir",
  "Gdansk",
  "Brno",
  "Riga",
  "Tartu",
  "Aarhus",
  "Ghent",
  "Bremen",
  "Basel",
  "Padua",
  "Split",
  "Varna",
  "Kazan",
  "Omsk",
  "Recife",
  "Natal",
  "Salta",
  "Osaka",
  "Busan",
  "Daegu",
  "Pune",
  "Surat",
  "Nagpur",
  "Kochi",
  "Medan",
  "Cebu",
  "Hobart",
  "Darwin",
  "Nelson",
  "Regina",
  "Halifax",
  "Tucson",
  "Boise",
)


class ContextTooShort(ValueError):
  """The requested context length cannot hold the needles, question and answers."""


class _Filler:
  """Cuts filler token runs out of a DocumentSource, joining documents with a separator."""

  def __init__(self, source: DocumentSource, separator: np.ndarray):
    self.source = source
    self.separator = separator
    if len(source) == 0:
      raise ValueError(f"Filler source {getattr(source, 'name', source)!r} has no documents.")

  def take(self, rng: np.random.Generator, length: int) -> np.ndarray:
    if length <= 0:
      return np.zeros(0, np.int32)
    n = len(self.source)
    doc = int(rng.integers(n))
    first = np.asarray(self.source[doc], np.int32)
    offset = int(rng.integers(max(first.size, 1)))
    parts, have = [first[offset:]], first.size - offset
    empty_run = 0
    while have < length:
      doc = (doc + 1) % n
      nxt = np.asarray(self.source[doc], np.int32)
      empty_run = empty_run + 1 if nxt.size == 0 else 0
      if empty_run > n:
        raise ValueError(
          f"Filler source {getattr(self.source, 'name', self.source)!r} has only empty documents."
        )
      parts += [self.separator, nxt]
      have += self.separator.size + nxt.size
    return np.concatenate(parts)[:length]


class MultiNeedleTask(TaskBase):
  """Multi-needle retrieval in real filler text.

  Args:
    context_len: total tokens per example (context, question and answers).
    num_needles: N, needles hidden in the context (N <= 60 distinct keys).
    num_queries: R <= N, needles asked for at the end.
    depths: depth of the answer needle; example i uses depths[i % len(depths)].
    num_examples: length of the task as a source.
    seed: examples are a function of (seed, index).
    num_digits: digits per secret number.
    filler: DocumentSource in the same tokenizer (default: `stdlib_corpus()`).
    tokenizer: encodes needles and questions (default `ByteTokenizer`).
    bos: prepend `tokenizer.eos_id` as a start token. Off by default because the training
      pipeline masks attention across documents, so a trained model never sees one.

  Raises:
    ValueError: N, R or depths out of range, or a context too short for the needles and question.
  """

  def __init__(
    self,
    context_len: int,
    num_needles: int = 1,
    num_queries: int = 1,
    depths: Sequence[float] = DEPTHS,
    num_examples: int = 50,
    seed: int = 0,
    *,
    num_digits: int = 7,
    filler: DocumentSource | None = None,
    tokenizer: Tokenizer | None = None,
    bos: bool = False,
  ):
    if not 1 <= num_queries <= num_needles <= len(_KEYS):
      raise ValueError(
        f"Need 1 <= num_queries <= num_needles <= {len(_KEYS)}; got {num_needles=}, {num_queries=}."
      )
    depths = tuple(float(d) for d in depths)
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
      raise ValueError(f"depths must be a non-empty list of values in [0, 1]; got {depths}.")
    if num_digits < 1:
      raise ValueError(f"{num_digits=} must be at least 1.")
    self.context_len = int(context_len)
    self.num_needles, self.num_queries = int(num_needles), int(num_queries)
    self.depths, self.num_examples, self.seed = depths, int(num_examples), int(seed)
    self.num_digits, self.bos = int(num_digits), bool(bos)
    self.tokenizer = tokenizer or ByteTokenizer()
    self._filler = _Filler(
      filler if filler is not None else stdlib_corpus(), self.tokenizer.encode("\n")
    )
    self.name = (
      f"multi_needle(len={self.context_len},N={self.num_needles},R={self.num_queries},"
      f"seed={self.seed})"
    )
    # Fail now, not at the first example, when the context cannot hold needles and question.
    self.example(0)

  def _enc(self, text: str) -> np.ndarray:
    return self.tokenizer.encode(text)

  def example(self, index: int) -> RetrievalExample:
    rng = draws(self.seed, index, 1)
    depth = self.depths[index % len(self.depths)]
    key_ids = rng.choice(len(_KEYS), self.num_needles, replace=False)
    keys = [_KEYS[k] for k in key_ids]
    values = [digits(rng, self.num_digits) for _ in keys]
    # Needle j (j < R) is queried; needle 0 is the answer needle placed at `depth`.
    needles = [
      (self._enc(f"\nThe secret number for {k} is "), self._enc(v), self._enc(".\n"))
      for k, v in zip(keys, values)
    ]
    query_order = rng.permutation(self.num_queries)
    asked = [keys[j] for j in query_order]
    question = self._enc("\n\nWhat are the secret numbers for " + ", ".join(asked) + "?\n")
    answer_parts = [
      (self._enc(f"The secret number for {keys[j]} is "), self._enc(values[j]), self._enc(". "))
      for j in query_order
    ]
    fixed = (
      int(self.bos)
      + sum(sum(p.size for p in n) for n in needles)
      + question.size
      + sum(sum(p.size for p in a) for a in answer_parts)
    )
    filler_len = self.context_len - fixed
    if filler_len < 0:
      raise ContextTooShort(
        f"context_len={self.context_len} is too short for {self.num_needles} needles and "
        f"{self.num_queries} queries ({fixed} tokens without filler); use a longer context "
        "or fewer needles."
      )
    filler = self._filler.take(draws(self.seed, index, 2), filler_len)
    cuts = [int(round(depth * filler_len))] + [
      int(c) for c in rng.integers(0, filler_len + 1, self.num_needles - 1)
    ]
    order = sorted(range(self.num_needles), key=lambda j: (cuts[j], j))

    b = Builder()
    if self.bos:
      b.add(np.asarray([self.tokenizer.eos_id]), SINK)
    needle_span, value_span, needle_depth = {}, {}, {}
    prev = 0
    for j in order:
      b.add(filler[prev : cuts[j]], CONTEXT)
      prev = cuts[j]
      region = ANSWER if j < self.num_queries else CONTEXT
      needle_depth[j] = cuts[j] / max(filler_len, 1)
      s0, _ = b.add(needles[j][0], region)
      value_span[j] = b.add(needles[j][1], region)
      _, e1 = b.add(needles[j][2], region)
      needle_span[j] = (s0, e1)
    b.add(filler[prev:], CONTEXT)
    b.add(question, QUERY)
    answer_spans = []
    for prefix, value, suffix in answer_parts:
      b.add(prefix, QUERY)
      answer_spans.append(b.add(value, QUERY))
      b.add(suffix, QUERY)
    ex = b.example(
      answer_spans,
      needle_spans=tuple(needle_span[int(j)] for j in query_order),
      value_spans=tuple(value_span[int(j)] for j in query_order),
      distractor_spans=tuple(needle_span[j] for j in range(self.num_queries, self.num_needles)),
      depth=depth,
      depth_query=int(np.flatnonzero(query_order == 0)[0]),
      needle_depths=tuple(needle_depth[int(j)] for j in query_order),
      keys=tuple(asked),
      values=tuple(values[int(j)] for j in query_order),
    )
    assert ex.tokens.size == self.context_len, (ex.tokens.size, self.context_len)
    return ex
