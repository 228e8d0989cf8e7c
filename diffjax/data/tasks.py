"""Synthetic retrieval tasks: multi-needle retrieval in real text, and associative recall.

Both tasks are deterministic functions of (seed, example index), so the same examples come back
on every machine that has the same filler corpus, and both serve two purposes:

  * training data: each task is a `diffjax.data.DocumentSource` (`name`, `__len__`,
    `__getitem__(i) -> (L,) int32`), so it can be mixed into the training pipeline like any corpus;
  * evaluation: `task.example(i)` returns a `RetrievalExample` that also knows where the answers
    are (which tokens are scored, where the answer needle sits in the context, which tokens are the
    question), and `task.batch(indices)` stacks examples into arrays for a model.

Sequences are built by concatenating separately tokenized pieces (filler, needle sentences,
question, answer digits), so every recorded span is exact in tokens for any tokenizer. With the
byte tokenizer one token is one byte and `context_len` is the length in bytes.

Multi-needle retrieval (`MultiNeedleTask`, the paper's Section 3.3 setup): N needle sentences
"The secret number for <key> is <digits>." are hidden in filler text cut from a real corpus (by
default the Python standard library's sources); R of them are asked for at the end. The first
queried needle (the "answer needle", asked for by query `depth_query`, a random one of the R
questions) is placed at a controlled depth of the context (0.0 = right after the start, 1.0 =
right before the question); every other needle, queried or not, sits at a uniformly random depth.
The answer to query r is the digits of the needle that query r names.

Associative recall with distractors (`AssociativeRecallTask`, MQAR): "key:value" pairs, then
queries "key:" whose answer is the value. For every queried key the context also holds
distractor pairs whose key differs from it in exactly one character, so a model that matches
keys only approximately retrieves the wrong value.

Region labels (`RetrievalExample.regions`, one per token) used for attention allocation:
  0 SINK     the first token of the sequence (the attention sink of a causal model);
  1 CONTEXT  filler text and every needle or pair that is not queried (the "noise");
  2 ANSWER   the queried needles (the whole sentence, or the whole "key:value" pair);
  3 QUERY    the question and the answer part at the end.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from diffjax.data.sources import DocumentSource, stdlib_corpus
from diffjax.data.tokenizers import ByteTokenizer, Tokenizer

SINK, CONTEXT, ANSWER, QUERY = 0, 1, 2, 3
REGION_NAMES = ("sink", "context", "answer", "query")

# The paper's (num_needles, num_queries) grid at a fixed context length (Table 2).
NEEDLE_GRID = ((1, 1), (2, 2), (4, 2), (6, 2))
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)

# Needle keys: place names written for this module. Short ASCII words so every key is a few bytes.
_KEYS = (
    "Oslo", "Lima", "Cairo", "Quito", "Dakar", "Hanoi", "Perth", "Turin", "Seville", "Nagoya",
    "Lagos", "Bergen", "Tromso", "Kyoto", "Porto", "Zagreb", "Tbilisi", "Malmo", "Lyon", "Graz",
    "Leeds", "Cork", "Accra", "Davao", "Cusco", "Tunis", "Sendai", "Izmir", "Gdansk", "Brno",
    "Riga", "Tartu", "Aarhus", "Ghent", "Bremen", "Basel", "Padua", "Split", "Varna", "Kazan",
    "Omsk", "Recife", "Natal", "Salta", "Osaka", "Busan", "Daegu", "Pune", "Surat", "Nagpur",
    "Kochi", "Medan", "Cebu", "Hobart", "Darwin", "Nelson", "Regina", "Halifax", "Tucson", "Boise",
)


class ContextTooShort(ValueError):
  """The requested context length cannot hold the needles, question and answers."""


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


class _Builder:
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


def _rng(seed: int, index: int, salt: int) -> np.random.Generator:
  return np.random.default_rng([int(seed), int(index), int(salt)])


class _TaskBase:
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
      raise IndexError(f"example index {index} out of range for {self.num_examples} examples "
                       f"of {self.name}")
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
  return dict(tokens=tokens, answer_segments=segs, regions=regions, valid=valid,
              prediction_rows=rows,
              num_queries=np.asarray([ex.num_queries for ex in examples], np.int32))


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
        raise ValueError(f"Filler source {getattr(self.source, 'name', self.source)!r} has "
                         "only empty documents.")
      parts += [self.separator, nxt]
      have += self.separator.size + nxt.size
    return np.concatenate(parts)[:length]


def _digits(rng: np.random.Generator, n: int) -> str:
  first = str(int(rng.integers(1, 10)))  # No leading zero, so the value reads as a number.
  return first + "".join(str(int(d)) for d in rng.integers(0, 10, n - 1))


class MultiNeedleTask(_TaskBase):
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

  def __init__(self, context_len: int, num_needles: int = 1, num_queries: int = 1,
               depths: Sequence[float] = DEPTHS, num_examples: int = 50, seed: int = 0, *,
               num_digits: int = 7, filler: DocumentSource | None = None,
               tokenizer: Tokenizer | None = None, bos: bool = False):
    if not 1 <= num_queries <= num_needles <= len(_KEYS):
      raise ValueError(f"Need 1 <= num_queries <= num_needles <= {len(_KEYS)}; got "
                       f"{num_needles=}, {num_queries=}.")
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
    self._filler = _Filler(filler if filler is not None else stdlib_corpus(),
                           self.tokenizer.encode("\n"))
    self.name = (f"multi_needle(len={self.context_len},N={self.num_needles},R={self.num_queries},"
                 f"seed={self.seed})")
    # Fail now, not at the first example, when the context cannot hold needles and question.
    self.example(0)

  def _enc(self, text: str) -> np.ndarray:
    return self.tokenizer.encode(text)

  def example(self, index: int) -> RetrievalExample:
    rng = _rng(self.seed, index, 1)
    depth = self.depths[index % len(self.depths)]
    key_ids = rng.choice(len(_KEYS), self.num_needles, replace=False)
    keys = [_KEYS[k] for k in key_ids]
    values = [_digits(rng, self.num_digits) for _ in keys]
    # Needle j (j < R) is queried; needle 0 is the answer needle placed at `depth`.
    needles = [(self._enc(f"\nThe secret number for {k} is "), self._enc(v), self._enc(".\n"))
               for k, v in zip(keys, values)]
    query_order = rng.permutation(self.num_queries)
    asked = [keys[j] for j in query_order]
    question = self._enc("\n\nWhat are the secret numbers for " + ", ".join(asked) + "?\n")
    answer_parts = [(self._enc(f"The secret number for {keys[j]} is "), self._enc(values[j]),
                     self._enc(". ")) for j in query_order]
    fixed = (int(self.bos) + sum(sum(p.size for p in n) for n in needles) + question.size
             + sum(sum(p.size for p in a) for a in answer_parts))
    filler_len = self.context_len - fixed
    if filler_len < 0:
      raise ContextTooShort(
          f"context_len={self.context_len} is too short for {self.num_needles} needles and "
          f"{self.num_queries} queries ({fixed} tokens without filler); use a longer context "
          "or fewer needles.")
    filler = self._filler.take(_rng(self.seed, index, 2), filler_len)
    cuts = [int(round(depth * filler_len))] + [int(c) for c in rng.integers(0, filler_len + 1,
                                                                             self.num_needles - 1)]
    order = sorted(range(self.num_needles), key=lambda j: (cuts[j], j))

    b = _Builder()
    if self.bos:
      b.add(np.asarray([self.tokenizer.eos_id]), SINK)
    needle_span, value_span, needle_depth = {}, {}, {}
    prev = 0
    for j in order:
      b.add(filler[prev:cuts[j]], CONTEXT)
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
    tokens, regions = b.finish()
    assert tokens.size == self.context_len, (tokens.size, self.context_len)
    segs = np.full(tokens.size, -1, np.int32)
    for r, (s, e) in enumerate(answer_spans):
      segs[s:e] = r
    return RetrievalExample(
        tokens=tokens, answer_segments=segs, regions=regions, prompt_len=answer_spans[0][0],
        answers=tuple(tokens[s:e].copy() for s, e in answer_spans),
        answer_spans=tuple(answer_spans),
        needle_spans=tuple(needle_span[int(j)] for j in query_order),
        value_spans=tuple(value_span[int(j)] for j in query_order),
        distractor_spans=tuple(needle_span[j] for j in range(self.num_queries, self.num_needles)),
        depth=depth, depth_query=int(np.flatnonzero(query_order == 0)[0]),
        needle_depths=tuple(needle_depth[int(j)] for j in query_order),
        keys=tuple(asked), values=tuple(values[int(j)] for j in query_order))


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


class AssociativeRecallTask(_TaskBase):
  """Multi-query associative recall (MQAR) with near-duplicate distractor keys.

  Sequence: "k1:v1 k2:v2 ... kP:vP\\n" then, for each of the Q queried keys in a random order,
  "k:v " where v is the answer. Keys are `key_len` lowercase letters, values `value_len` digits.
  For each queried key, `distractors_per_query` extra pairs use a key that differs from it in one
  letter and a different value; distractors are never queried. Pairs (real and distractor) appear
  in a random order.

  Args:
    num_pairs: P real pairs (the queried keys are among them).
    num_queries: Q <= P keys asked for.
    distractors_per_query: near-duplicate pairs per queried key.
    key_len, value_len: characters per key and per value.
    num_examples, seed, tokenizer, bos: as for `MultiNeedleTask`.
    stream: a further key of the random draws (0: the draws of earlier versions), so several
      tasks with one seed (the settings of `AssociativeRecallMix`) draw independent examples.
    separator: the text between a key and its value (":" by default; "" writes "k1v1"). With
      no separator the value follows the key's last letter directly, so the plain induction
      pattern (the token after an earlier copy of the current token) recalls a value unless a
      distractor shares that letter; the separator makes every key end in the same token,
      so even a plain recall must match letters one and two tokens back.
  """

  def __init__(self, num_pairs: int = 16, num_queries: int = 4, distractors_per_query: int = 1,
               num_examples: int = 64, seed: int = 0, *, key_len: int = 3, value_len: int = 3,
               tokenizer: Tokenizer | None = None, bos: bool = False, stream: int = 0,
               separator: str = ":"):
    if not 1 <= num_queries <= num_pairs:
      raise ValueError(f"Need 1 <= num_queries <= num_pairs; got {num_pairs=}, {num_queries=}.")
    if key_len < 2 or value_len < 1 or distractors_per_query < 0:
      raise ValueError(f"Need key_len >= 2, value_len >= 1, distractors_per_query >= 0; got "
                       f"{key_len=}, {value_len=}, {distractors_per_query=}.")
    total_keys = num_pairs + num_queries * distractors_per_query
    if total_keys > 26 ** key_len // 4:
      raise ValueError(f"{total_keys} keys do not fit comfortably in {key_len}-letter keys; "
                       "raise key_len.")
    if distractors_per_query > key_len * 25:
      raise ValueError(f"{distractors_per_query=} exceeds the {key_len * 25} one-letter "
                       "variants of a key.")
    self.num_pairs, self.num_queries = int(num_pairs), int(num_queries)
    self.distractors_per_query = int(distractors_per_query)
    self.key_len, self.value_len = int(key_len), int(value_len)
    self.num_examples, self.seed, self.bos = int(num_examples), int(seed), bool(bos)
    self.stream = int(stream)
    if not isinstance(separator, str) or any(ch.isalnum() or ch in " \n" for ch in separator):
      raise ValueError(f"separator={separator!r} must be a string without letters, digits, "
                       "spaces or newlines (they would run into keys, values and pairs).")
    self.separator = separator
    self.tokenizer = tokenizer or ByteTokenizer()
    self.name = (f"mqar(P={self.num_pairs},Q={self.num_queries},D={self.distractors_per_query},"
                 f"seed={self.seed}" + ("" if separator == ":" else f",sep={separator!r}") + ")")
    self.example(0)

  def _key(self, rng) -> str:
    return "".join(_LETTERS[i] for i in rng.integers(0, 26, self.key_len))

  def example(self, index: int) -> RetrievalExample:
    rng = (_rng(self.seed, index, 3) if self.stream == 0 else
           np.random.default_rng([self.seed, int(index), 3, self.stream]))
    used: set[str] = set()
    keys: list[str] = []
    while len(keys) < self.num_pairs:
      k = self._key(rng)
      if k not in used:
        used.add(k)
        keys.append(k)
    queried = [int(j) for j in rng.choice(self.num_pairs, self.num_queries, replace=False)]
    # Distractor keys: one letter of a queried key changed; a key may only appear once.
    pairs = [(k, _digits(rng, self.value_len), j) for j, k in enumerate(keys)]
    for j in queried:
      made = 0
      while made < self.distractors_per_query:
        pos = int(rng.integers(self.key_len))
        letter = _LETTERS[int(rng.integers(26))]
        k = keys[j][:pos] + letter + keys[j][pos + 1:]
        if k in used:
          continue
        used.add(k)
        v = _digits(rng, self.value_len)
        while v == pairs[j][1]:
          v = _digits(rng, self.value_len)
        pairs.append((k, v, -1))
        made += 1
    order = rng.permutation(len(pairs))

    b = _Builder()
    if self.bos:
      b.add(np.asarray([self.tokenizer.eos_id]), SINK)
    enc = self.tokenizer.encode
    needle_span, value_span, distractors = {}, {}, []
    pos_of: dict[int, int] = {}
    for n, p in enumerate(order):
      k, v, j = pairs[int(p)]
      region = ANSWER if j in queried else CONTEXT
      s0, _ = b.add(enc(k + self.separator), region)
      vs = b.add(enc(v), region)
      _, e1 = b.add(enc(" "), region)
      if j in queried:
        needle_span[j], value_span[j], pos_of[j] = (s0, e1), vs, n
      else:
        distractors.append((s0, e1))
    b.add(enc("\n"), QUERY)
    answer_spans = []
    for j in queried:
      b.add(enc(keys[j] + self.separator), QUERY)
      answer_spans.append(b.add(enc(pairs[j][1]), QUERY))
      b.add(enc(" "), QUERY)
    tokens, regions = b.finish()
    segs = np.full(tokens.size, -1, np.int32)
    for r, (s, e) in enumerate(answer_spans):
      segs[s:e] = r
    return RetrievalExample(
        tokens=tokens, answer_segments=segs, regions=regions, prompt_len=answer_spans[0][0],
        answers=tuple(tokens[s:e].copy() for s, e in answer_spans),
        answer_spans=tuple(answer_spans), needle_spans=tuple(needle_span[j] for j in queried),
        value_spans=tuple(value_span[j] for j in queried), distractor_spans=tuple(distractors),
        depth=None, depth_query=None,
        needle_depths=tuple(pos_of[j] / max(len(pairs) - 1, 1) for j in queried),
        keys=tuple(keys[j] for j in queried), values=tuple(pairs[j][1] for j in queried))


class AssociativeRecallMix(_TaskBase):
  """Associative recall over several difficulty settings, one after another.

  Example i is example i // K of setting i % K (K settings), so every prefix of the examples
  holds the settings in equal shares. Each setting is an `AssociativeRecallTask` with
  `num_pairs` and `distractors_per_query` from `settings` (queries: min(num_queries,
  num_pairs)); the settings draw independently of each other (their own `stream`).

  Args:
    settings: (num_pairs, distractors_per_query) per setting.
    num_queries, key_len, value_len, num_examples, seed, tokenizer, bos, separator: as for
      `AssociativeRecallTask`.
  """

  def __init__(self, settings: Sequence[tuple[int, int]], num_queries: int = 4,
               num_examples: int = 64, seed: int = 0, *, key_len: int = 3, value_len: int = 3,
               tokenizer: Tokenizer | None = None, bos: bool = False, separator: str = ":"):
    settings = [tuple(int(v) for v in s) for s in settings]
    if not settings or any(len(s) != 2 for s in settings):
      raise ValueError(f"settings={settings!r} must be a non-empty list of "
                       "(num_pairs, distractors_per_query) pairs.")
    self.tokenizer = tokenizer or ByteTokenizer()
    self.tasks = [AssociativeRecallTask(p, min(int(num_queries), p), d, 1, seed, key_len=key_len,
                                        value_len=value_len, tokenizer=self.tokenizer, bos=bos,
                                        stream=k + 1, separator=separator)
                  for k, (p, d) in enumerate(settings)]
    self.settings = settings
    self.num_queries = max(t.num_queries for t in self.tasks)
    self.num_examples, self.seed = int(num_examples), int(seed)
    grid = ",".join(f"{p}/{d}" for p, d in settings)
    sep = "" if separator == ":" else f",sep={separator!r}"
    self.name = f"mqar_mix(P/D={grid},Q={int(num_queries)},seed={self.seed}{sep})"

  def example(self, index: int) -> RetrievalExample:
    k = len(self.tasks)
    return self.tasks[index % k].example(index // k)


class AnswersOnly:
  """A task as training data scored on its answers only.

  A `DocumentSource` (the task's token sequences) with `read_weighted()`: the training
  pipeline then counts only the predictions of answer tokens in the loss, the usual way of
  training a model on associative recall (the keys and values are random, so predicting
  them teaches nothing but adds noise to every update).
  """

  def __init__(self, task: _TaskBase):
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
