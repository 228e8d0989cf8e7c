"""From a `DataConfig` to checkpointable training batches and fixed validation batches.

Every corpus (`diffjax.data.corpus`) is streamed by `diffjax.data.streaming` with one
validation rule; the batch format: docs/data.md, "How batches are made".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import numpy as np

from diffjax.data.config import DataConfig, check_batch_split
from diffjax.data.corpus import Corpus, ShardCorpus, SourceCorpus, cached_corpus, capped
from diffjax.data.manifest import read_manifest
from diffjax.data.raw import CHUNK_BYTES, is_single_text_file
from diffjax.data.sources import DocumentSource, resolve_paths, stdlib_files
from diffjax.data.streaming import EpochOrder, Lane, StreamingBatchIterator, doc_hashes, doc_is_val
from diffjax.data.tokenizers import Tokenizer, load_tokenizer

_SCAN_BLOCK = 1 << 16
# Start-up work that grows with the corpus is done for small corpora only: the unigram baseline
# (reads every document once) up to this many tokens, and the exact count of the validation
# split (hashes every document id) up to this many documents; larger corpora report nan and
# the split's expected size.
UNIGRAM_MAX_TOKENS = 64_000_000
EXACT_COUNT_DOCUMENTS = 1 << 20
# ... and their validation documents' tokens counted when there are up to this many.
EXACT_COUNT_VAL_DOCUMENTS = 1 << 16


class ValidationDocs:
  """Validation document ids in corpus order, found by hashing ids block by block on demand.

  With val_fraction > 0 at least one document is held out: if no id hashes below it (only in
  small corpora, since the scan stops at the first hit otherwise), the id with the smallest hash
  is held out (`forced`)."""

  def __init__(self, total: int, val_fraction: float, split_seed: int):
    self.total, self.fraction, self.split_seed = total, val_fraction, split_seed
    self.ids: list[int] = []
    self._scanned = 0
    self.forced: int | None = None
    if val_fraction > 0 and self.get(0) is None and total:
      self.forced = int(np.argmin(doc_hashes(np.arange(total), split_seed)))
      self.ids = [self.forced]

  def get(self, k: int) -> int | None:
    """The k-th validation id, None if the corpus has fewer (after a full scan)."""
    while k >= len(self.ids) and self._scanned < self.total:
      ids_N = np.arange(self._scanned, min(self.total, self._scanned + _SCAN_BLOCK))
      self.ids.extend(ids_N[doc_is_val(ids_N, self.fraction, self.split_seed)].tolist())
      self._scanned += ids_N.size
    return self.ids[k] if k < len(self.ids) else None

  def all(self) -> list[int]:
    self.get(self.total)
    return self.ids


@dataclasses.dataclass
class Datasets:
  """Everything the trainer needs from the data side.

  Attributes:
    corpus: what is streamed (documents by global id).
    tokenizer: the tokenizer the corpus was encoded with (vocab_size, eos_id, pad_id).
    train_iter: a checkpointable iterator over this process's rows of the training batches.
    num_train_documents / num_val_documents: documents in each split (no document is in both;
      above EXACT_COUNT_DOCUMENTS documents, the split's expected size).
    num_train_tokens: training-split tokens per epoch (documents plus one eos each; exact when
      the validation documents were counted, see the property).
    unigram_entropy_nats / unigram_entropy_bits: cross-entropy per token on validation of an
      add-one unigram model fit on train (corpora up to UNIGRAM_MAX_TOKENS; nan above, or
      without validation data).
  """

  corpus: Corpus
  tokenizer: Tokenizer
  cfg: DataConfig
  seq_len: int
  global_batch_size: int
  per_process_batch_size: int
  process_index: int
  seed: int
  train_iter: StreamingBatchIterator = None
  unigram_entropy_nats: float = math.nan

  def __post_init__(self):
    self._streams = None
    self._order = EpochOrder(
      list(self.corpus.groups), self.seed, self.cfg.shuffle, self.cfg.shards_per_group
    )
    self._val_docs = ValidationDocs(self._order.total, self.cfg.val_fraction, self.cfg.split_seed)
    n = self.corpus.num_documents
    self._val_tokens = None  # counted: the validation documents' tokens, one eos each
    if self.cfg.val_fraction == 0:
      n_val, self._val_tokens = 0, 0
    elif n <= EXACT_COUNT_DOCUMENTS:
      ids = self._val_docs.all()
      n_val = len(ids)
      if n_val <= EXACT_COUNT_VAL_DOCUMENTS:
        self._val_tokens = sum(len(self.corpus.tokens(d)) + 1 for d in ids)
    else:  # a large corpus is not scanned at start-up: the split's expected size
      n_val = max(1, round(n * self.cfg.val_fraction))
    self.num_val_documents = n_val
    self.num_train_documents = n - n_val
    if self.num_train_tokens < self.seq_len + 1:
      raise ValueError(
        f"seq_len + 1 = {self.seq_len + 1} tokens is longer than the training split of "
        f"{self.corpus.name!r}: {self.num_train_tokens} tokens ({self.num_train_documents} "
        "documents, one eos each). Use a shorter seq_len or more data."
      )
    if self.num_train_documents < self.global_batch_size:
      raise ValueError(
        f"Corpus {self.corpus.name!r} has {self.num_train_documents} training documents, fewer "
        f"than global_batch_size={self.global_batch_size} rows (each row streams its own "
        "documents); use a smaller batch or more data."
      )
    self.train_iter = self.new_train_iter()
    if (
      math.isnan(self.unigram_entropy_nats)
      and n_val
      and n <= EXACT_COUNT_DOCUMENTS
      and self.corpus.num_tokens <= UNIGRAM_MAX_TOKENS
    ):
      self.unigram_entropy_nats = self._unigram()

  @property
  def unigram_entropy_bits(self) -> float:
    return self.unigram_entropy_nats / math.log(2)

  def identity(self) -> dict[str, int | str]:
    """What a saved data position means in the corpus itself, whatever its path: its documents,
    tokens and groups, and a digest of them and of eight documents' ids (the first, the last and
    six spread between); for a corpus read from shards whose digests prepare recorded, also
    ``content``, a digest of every token. A resume on a corpus with another identity is
    refused."""
    c = self.corpus
    h = hashlib.sha256(json.dumps([c.num_documents, c.num_tokens, list(c.groups)]).encode())
    for doc in sorted({round(i * (c.num_documents - 1) / 7) for i in range(8)}):
      h.update(np.asarray(c.tokens(doc), np.int32).tobytes())
    out = {"documents": c.num_documents, "tokens": c.num_tokens, "sha256": h.hexdigest()[:16]}
    digests = getattr(c, "shard_digests", lambda: None)()
    if digests is not None:
      out["content"] = hashlib.sha256("".join(digests).encode()).hexdigest()[:16]
    return out

  @property
  def rows(self) -> tuple[int, int]:
    start = self.process_index * self.per_process_batch_size
    return start, start + self.per_process_batch_size

  @property
  def num_train_tokens(self) -> int:
    """Training-split stream tokens per epoch (documents plus one eos each): exact when the
    validation documents were counted (up to EXACT_COUNT_DOCUMENTS documents, of which up to
    EXACT_COUNT_VAL_DOCUMENTS held out), else from the share of documents held out."""
    total = self.corpus.num_tokens + self.corpus.num_documents
    if self._val_tokens is not None:
      return total - self._val_tokens
    return int(total * self.num_train_documents / max(self.corpus.num_documents, 1))

  @property
  def windows_per_epoch(self) -> int:
    return self.num_train_tokens // self.seq_len

  @property
  def batches_per_epoch(self) -> float:
    return self.windows_per_epoch / self.global_batch_size

  def _train_slot(self, epoch: int, k: int) -> int | None:
    doc = self._order.doc_at(epoch, k)
    if doc is None or self.cfg.val_fraction == 0:
      return doc
    if doc == self._val_docs.forced:
      return -1
    return -1 if doc_is_val(np.array([doc]), self.cfg.val_fraction, self.cfg.split_seed)[0] else doc

  def _val_slot(self, epoch: int, k: int) -> int | None:
    del epoch  # a split with fewer documents than rows cycles through them
    doc = self._val_docs.get(k)
    return doc if doc is not None else self._val_docs.ids[k % len(self._val_docs.ids)]

  def _lanes(self, slot_fn, streams: int) -> list[Lane]:
    b = self.global_batch_size
    return [
      Lane(r + b * s, b * streams, slot_fn, self.corpus, self.tokenizer.eos_id, self.seq_len)
      for r in range(*self.rows)
      for s in range(streams)
    ]

  @property
  def streams_per_row(self) -> int:
    """``data.streams_per_row``, lowered (in a small corpus) until every stream of every row
    finds a training document in the first epoch."""
    if self._streams is None:
      b = self.global_batch_size
      s = max(1, min(self.cfg.streams_per_row, self.num_train_documents // b))
      while s > 1 and not all(self._lane_has_a_document(k, b * s) for k in range(b * s)):
        s -= 1
      self._streams = s
    return self._streams

  def _lane_has_a_document(self, start: int, stride: int) -> bool:
    for k in range(start, self._order.total, stride):
      if self._train_slot(0, k) is not None and self._train_slot(0, k) >= 0:
        return True
    return False

  def new_train_iter(self) -> StreamingBatchIterator:
    """A fresh iterator from step 0 (restore a saved state into it with `set_state`)."""
    streams = self.streams_per_row
    return StreamingBatchIterator(
      self._lanes(self._train_slot, streams),
      self.rows,
      self.cfg.prefetch_batches,
      streams,
      global_rows=self.global_batch_size,
    )

  def val_batches(self, num_batches: int) -> list[dict[str, np.ndarray]]:
    """The first `num_batches` validation batches: validation documents in corpus order, row r
    taking documents r, r + B, ... (cycling when the split has fewer); the same for every
    training seed and every `streams_per_row`."""
    if self.cfg.val_fraction == 0:
      raise ValueError("No validation data: val_fraction is 0. Set data.val_fraction=0.01.")
    if num_batches < 0:
      raise ValueError(f"num_batches={num_batches} must be >= 0.")
    if self._val_docs.get(0) is None:
      raise ValueError(
        f"No document of {self.corpus.name!r} fell into the validation split "
        f"(val_fraction={self.cfg.val_fraction}); raise val_fraction or add data."
      )
    it = StreamingBatchIterator(self._lanes(self._val_slot, 1), self.rows, 0, 1)
    return [next(it) for _ in range(num_batches)]

  def _unigram(self) -> float:
    """Cross-entropy (nats/token) on the validation documents of an add-one unigram model fit
    on the training documents; both count one eos per document. The loss a model with no
    context would reach: the baseline to beat."""
    vocab = self.tokenizer.vocab_size
    val = set(self._val_docs.ids)
    counts = {True: np.zeros(vocab, np.float64), False: np.zeros(vocab, np.float64)}
    for d in range(self.corpus.num_documents):
      ids = self.corpus.tokens(d)
      c = counts[d in val]
      c += np.bincount(ids, minlength=vocab)[:vocab]
      c[self.tokenizer.eos_id] += 1
    train, held = counts[False], counts[True]
    logp_V = np.log(train + 1.0) - np.log(train.sum() + vocab)
    return float(-(held * logp_V).sum() / max(held.sum(), 1.0))


def open_corpus(cfg: DataConfig, tokenizer: Tokenizer, *, progress: bool = True) -> Corpus:
  """The corpus ``cfg`` names, capped by ``max_documents`` / ``max_tokens``.

  "stdlib" and "text" are prepared into the data cache on first use (`corpus.cached_corpus`);
  "prepared" reads its directory, whose tokenizer must be ``tokenizer``.
  """
  if cfg.kind == "prepared":
    if len(cfg.paths) != 1:
      raise ValueError(
        f"data.kind='prepared' takes one path (a prepared directory or its "
        f"manifest.json), got data.paths={cfg.paths}."
      )
    manifest = read_manifest(cfg.paths[0])
    manifest.check_tokenizer(tokenizer, cfg.tokenizer)
    corpus = ShardCorpus(manifest, max_open=2 * cfg.shards_per_group + 2)
  else:
    files = stdlib_files() if cfg.kind == "stdlib" else resolve_paths(cfg.paths)
    if not files:
      raise FileNotFoundError(
        "No standard-library .py files found: use data.kind='text' with "
        "data.paths=... to train on your own files."
      )
    # A single text file is split into documents (diffjax.data.raw.split_text): its own name,
    # so that no copy prepared as one document is reused.
    name = cfg.kind + ("-split" if is_single_text_file(files) else "")
    corpus = cached_corpus(files, tokenizer, cfg.tokenizer, name, progress=progress)
    corpus.name = ", ".join(cfg.paths) if cfg.kind == "text" else cfg.kind  # what errors name
  return capped(corpus, cfg.max_documents, cfg.max_tokens)


def build_datasets(
  cfg: DataConfig,
  seq_len: int,
  global_batch_size: int,
  seed: int,
  process_index: int = 0,
  process_count: int = 1,
  *,
  source: DocumentSource | Corpus | None = None,
  tokenizer: Tokenizer | None = None,
) -> Datasets:
  """Opens the corpus and returns the training stream and the validation batches.

  Args:
    cfg: the data configuration.
    seq_len: T, tokens per example.
    global_batch_size: B, examples per step over all processes.
    seed: orders documents (epoch e uses (seed, e)); does not affect the split.
    process_index, process_count: this host's slot of the batch rows.
    source: documents to stream instead of the corpus ``cfg`` names (e.g. a synthetic task or
      a task mixed into a corpus); a `DocumentSource` (``len``, ``source[i]``, optionally
      ``weighted(i)`` giving per-token 0/1 loss weights) or a `Corpus`; its ids must come
      from ``tokenizer``.
    tokenizer: overrides ``cfg.tokenizer``.

  Raises:
    ValueError: B not divisible by process_count; an empty corpus; fewer usable documents than
      streams; ids outside the tokenizer's vocabulary; a prepared corpus of another tokenizer.
    FileNotFoundError: a path or glob of ``cfg.paths`` matches nothing, or no manifest.
  """
  check_batch_split(global_batch_size, process_index, process_count)
  tokenizer = tokenizer or load_tokenizer(cfg.tokenizer)
  if source is None:
    corpus = open_corpus(cfg, tokenizer)
  elif hasattr(source, "tokens") and hasattr(source, "groups"):
    corpus = capped(source, cfg.max_documents, cfg.max_tokens)
  else:
    corpus = capped(SourceCorpus(source), cfg.max_documents, cfg.max_tokens)
  if corpus.num_documents == 0:
    raise ValueError(
      f"Corpus {corpus.name!r} has no documents (max_documents="
      f"{cfg.max_documents}, max_tokens={cfg.max_tokens}); point data.paths at "
      "non-empty data."
    )
  if cfg.val_fraction > 0 and corpus.num_documents < 2:
    # The user's paths, not the cache directory they were prepared into.
    label = ", ".join(cfg.paths) if source is None and cfg.paths else corpus.name
    raise ValueError(
      f"Corpus {label!r} is too small: {corpus.num_documents} document, but the "
      f"validation split holds out whole documents (val_fraction={cfg.val_fraction}), so it "
      "needs at least 2; add documents (kind='text' reads one document per file; a single "
      f"file is split at blank lines, else into chunks of {CHUNK_BYTES // 1024} KiB of lines)."
    )
  _check_ids(corpus, tokenizer)
  return Datasets(
    corpus,
    tokenizer,
    cfg,
    seq_len,
    global_batch_size,
    global_batch_size // process_count,
    process_index,
    seed,
  )


def _check_ids(corpus: Corpus, tokenizer: Tokenizer, sample: int = 64) -> None:
  """Ids of the first documents inside the tokenizer's vocabulary (a wrong tokenizer is caught
  before training; the whole corpus is checked when it is prepared)."""
  for d in range(min(sample, corpus.num_documents)):
    ids = corpus.tokens(d)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= tokenizer.vocab_size):
      raise ValueError(
        f"Corpus {corpus.name!r} has token ids in [{int(ids.min())}, {int(ids.max())}] "
        f"(document {d}), outside [0, vocab_size={tokenizer.vocab_size}) of {tokenizer!r}; use "
        "the tokenizer that produced the data."
      )
