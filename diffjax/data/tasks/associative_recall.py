"""Associative recall with distractors (MQAR), one setting or a mix of settings.

"key:value" pairs, then queries "key:" whose answer is the value. For every queried key the
context also holds distractor pairs whose key differs from it in exactly one character, so a
model that matches keys only approximately retrieves the wrong value.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


class AssociativeRecallTask(TaskBase):
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
    num_examples, seed, tokenizer, bos: as for
      `diffjax.data.tasks.MultiNeedleTask`.
    stream: which sequence of random draws the examples take: 0 for a task of its own; the
      settings of an `AssociativeRecallMix` take 1, 2, ..., so several tasks with one seed
      draw independent examples.
    separator: the text between a key and its value (":" by default; "" writes "k1v1"). With
      no separator the value follows the key's last letter directly, so the plain induction
      pattern (the token after an earlier copy of the current token) recalls a value unless a
      distractor shares that letter; the separator makes every key end in the same token,
      so even a plain recall must match letters one and two tokens back.
  """

  def __init__(
    self,
    num_pairs: int = 16,
    num_queries: int = 4,
    distractors_per_query: int = 1,
    num_examples: int = 64,
    seed: int = 0,
    *,
    key_len: int = 3,
    value_len: int = 3,
    tokenizer: Tokenizer | None = None,
    bos: bool = False,
    stream: int = 0,
    separator: str = ":",
  ):
    if not 1 <= num_queries <= num_pairs:
      raise ValueError(f"Need 1 <= num_queries <= num_pairs; got {num_pairs=}, {num_queries=}.")
    if key_len < 2 or value_len < 1 or distractors_per_query < 0:
      raise ValueError(
        f"Need key_len >= 2, value_len >= 1, distractors_per_query >= 0; got "
        f"{key_len=}, {value_len=}, {distractors_per_query=}."
      )
    total_keys = num_pairs + num_queries * distractors_per_query
    if total_keys > 26**key_len // 4:
      raise ValueError(
        f"{total_keys} keys do not fit comfortably in {key_len}-letter keys; raise key_len."
      )
    if distractors_per_query > key_len * 25:
      raise ValueError(
        f"{distractors_per_query=} exceeds the {key_len * 25} one-letter variants of a key."
      )
    self.num_pairs, self.num_queries = int(num_pairs), int(num_queries)
    self.distractors_per_query = int(distractors_per_query)
    self.key_len, self.value_len = int(key_len), int(value_len)
    self.num_examples, self.seed, self.bos = int(num_examples), int(seed), bool(bos)
    self.stream = int(stream)
    if not isinstance(separator, str) or any(ch.isalnum() or ch in " \n" for ch in separator):
      raise ValueError(
        f"separator={separator!r} must be a string without letters, digits, "
        "spaces or newlines (they would run into keys, values and pairs)."
      )
    self.separator = separator
    self.tokenizer = tokenizer or ByteTokenizer()
    self.name = (
      f"mqar(P={self.num_pairs},Q={self.num_queries},D={self.distractors_per_query},"
      f"seed={self.seed}" + ("" if separator == ":" else f",sep={separator!r}") + ")"
    )
    self.example(0)

  def _key(self, rng) -> str:
    return "".join(_LETTERS[i] for i in rng.integers(0, 26, self.key_len))

  def example(self, index: int) -> RetrievalExample:
    # A task of its own draws from (seed, index, 3); each setting of a mix adds its stream.
    rng = draws(self.seed, index, 3, *((self.stream,) if self.stream else ()))
    used: set[str] = set()
    keys: list[str] = []
    while len(keys) < self.num_pairs:
      k = self._key(rng)
      if k not in used:
        used.add(k)
        keys.append(k)
    queried = [int(j) for j in rng.choice(self.num_pairs, self.num_queries, replace=False)]
    # Distractor keys: one letter of a queried key changed; a key may only appear once.
    pairs = [(k, digits(rng, self.value_len), j) for j, k in enumerate(keys)]
    for j in queried:
      made = 0
      while made < self.distractors_per_query:
        pos = int(rng.integers(self.key_len))
        letter = _LETTERS[int(rng.integers(26))]
        k = keys[j][:pos] + letter + keys[j][pos + 1 :]
        if k in used:
          continue
        used.add(k)
        v = digits(rng, self.value_len)
        while v == pairs[j][1]:
          v = digits(rng, self.value_len)
        pairs.append((k, v, -1))
        made += 1
    order = rng.permutation(len(pairs))

    b = Builder()
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
    return b.example(
      answer_spans,
      needle_spans=tuple(needle_span[j] for j in queried),
      value_spans=tuple(value_span[j] for j in queried),
      distractor_spans=tuple(distractors),
      depth=None,
      depth_query=None,
      needle_depths=tuple(pos_of[j] / max(len(pairs) - 1, 1) for j in queried),
      keys=tuple(keys[j] for j in queried),
      values=tuple(pairs[j][1] for j in queried),
    )


class AssociativeRecallMix(TaskBase):
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

  def __init__(
    self,
    settings: Sequence[tuple[int, int]],
    num_queries: int = 4,
    num_examples: int = 64,
    seed: int = 0,
    *,
    key_len: int = 3,
    value_len: int = 3,
    tokenizer: Tokenizer | None = None,
    bos: bool = False,
    separator: str = ":",
  ):
    settings = [tuple(int(v) for v in s) for s in settings]
    if not settings or any(len(s) != 2 for s in settings):
      raise ValueError(
        f"settings={settings!r} must be a non-empty list of "
        "(num_pairs, distractors_per_query) pairs."
      )
    self.tokenizer = tokenizer or ByteTokenizer()
    self.tasks = [
      AssociativeRecallTask(
        p,
        min(int(num_queries), p),
        d,
        1,
        seed,
        key_len=key_len,
        value_len=value_len,
        tokenizer=self.tokenizer,
        bos=bos,
        stream=k + 1,
        separator=separator,
      )
      for k, (p, d) in enumerate(settings)
    ]
    self.settings = settings
    self.num_queries = max(t.num_queries for t in self.tasks)
    self.num_examples, self.seed = int(num_examples), int(seed)
    grid = ",".join(f"{p}/{d}" for p, d in settings)
    sep = "" if separator == ":" else f",sep={separator!r}"
    self.name = f"mqar_mix(P/D={grid},Q={int(num_queries)},seed={self.seed}{sep})"

  def example(self, index: int) -> RetrievalExample:
    k = len(self.tasks)
    return self.tasks[index % k].example(index // k)
