"""From a `DataConfig` to checkpointable training batches and fixed validation batches.

Batch b of the run (a "global batch") holds the global examples b*B .. b*B + B - 1, where B is
`global_batch_size` and example g is defined by `Packer` from g alone. Process p of P yields rows
[p*B/P, (p+1)*B/P) of every global batch, so the union over processes is the single-process
batch and no process ever reads another's rows. Because a batch is a function of its index, the
iterator's state is one integer (`{"next_index": b}`); it is saved with
`grain.checkpoint.CheckpointSave(iterator)` and restored with `CheckpointRestore`. It is the
same number on every process and means the same batch under any process count.

Batch format: a dict of numpy arrays with leading dim b = global_batch_size // process_count:
  inputs (b, T) int32, targets (b, T) int32, segment_ids (b, T) int32, positions (b, T) int32,
  loss_mask (b, T) float32. See `diffjax.data.packing` for the meaning of each.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Sequence

import grain
import numpy as np

from diffjax.data.config import DataConfig, check_batch_split
from diffjax.data.packing import Packer, PackedCorpus, split_documents, unigram_cross_entropy_nats
from diffjax.data.stream_datasets import build_prepared_datasets
from diffjax.data.sources import ArrayRecordSource, DocumentSource, TextFileSource, read_documents, stdlib_corpus
from diffjax.data.tokenizers import Tokenizer, load_tokenizer


class PackedBatchDataset(grain.MapDataset):
  """grain MapDataset whose element b is this process's rows of global batch b.

  Args:
    packer: builds examples from global example indices.
    global_batch_size: B, rows of a global batch over all processes.
    process_index, process_count: this process's slot; B must be divisible by process_count.
    num_batches: length; None for an endless stream (epochs follow one another).
  """

  def __init__(self, packer: Packer, global_batch_size: int, process_index: int = 0,
               process_count: int = 1, num_batches: int | None = None):
    super().__init__()
    check_batch_split(global_batch_size, process_index, process_count)
    self.packer = packer
    self.global_batch_size = global_batch_size
    self.per_process_batch_size = global_batch_size // process_count
    self._row_start = process_index * self.per_process_batch_size
    self._num_batches = num_batches

  def __len__(self) -> int:
    return sys.maxsize if self._num_batches is None else self._num_batches

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    if index < 0 or (self._num_batches is not None and index >= self._num_batches):
      raise IndexError(f"batch index {index} out of range for {len(self)} batches")
    return self.batch_at(index)

  def batch_at(self, index: int) -> dict[str, np.ndarray]:
    """This process's rows of global batch `index`, ignoring `num_batches` (wraps epochs)."""
    rows_b = np.arange(self._row_start, self._row_start + self.per_process_batch_size)
    return self.packer.examples(int(index) * self.global_batch_size + rows_b)

  def __str__(self) -> str:
    return (f"PackedBatchDataset(seq_len={self.packer.seq_len}, global_batch_size="
            f"{self.global_batch_size}, rows={self._row_start}:"
            f"{self._row_start + self.per_process_batch_size})")


@dataclasses.dataclass
class Datasets:
  """Everything the trainer needs from the data side.

  Attributes:
    train: the endless `PackedBatchDataset`; `train[step]` is the batch of that step.
    train_iter: a checkpointable grain iterator over `train` (state: `{"next_index": step}`).
    val: the finite validation dataset (`num_val_batches` batches, corpus order).
    tokenizer: the tokenizer the corpus was encoded with (vocab_size, eos_id, pad_id).
    num_train_tokens / num_val_tokens: stream tokens per epoch (documents plus one eos each).
    num_train_documents / num_val_documents: documents in each split; no document is in both.
    windows_per_epoch: training examples per epoch; `batches_per_epoch` = that / B (float).
    unigram_entropy_nats / unigram_entropy_bits: cross-entropy per token on validation of an
      add-one unigram model fit on train; nan without validation data.
  """

  train: PackedBatchDataset
  train_iter: grain.DatasetIterator
  val: PackedBatchDataset | None
  tokenizer: Tokenizer
  seq_len: int
  global_batch_size: int
  per_process_batch_size: int
  num_train_tokens: int
  num_val_tokens: int
  num_train_documents: int
  num_val_documents: int
  windows_per_epoch: int
  unigram_entropy_nats: float
  unigram_entropy_bits: float
  read_options: grain.ReadOptions

  @property
  def batches_per_epoch(self) -> float:
    return self.windows_per_epoch / self.global_batch_size

  @property
  def num_val_batches(self) -> int:
    """Validation batches that use each validation window at most once (at least 1 batch)."""
    return 0 if self.val is None else len(self.val)

  def epoch_at_step(self, step: int) -> float:
    """Fractional epoch reached after `step` training batches."""
    return step / self.batches_per_epoch

  def new_train_iter(self) -> grain.DatasetIterator:
    """A fresh iterator from step 0 (restore a saved state into it with `set_state`)."""
    return iter(self.train.to_iter_dataset(self.read_options))

  def val_batches(self, num_batches: int | None = None) -> list[dict[str, np.ndarray]]:
    """The first `num_batches` validation batches (default: `num_val_batches`, all windows once).

    Always the same batches for the same data and split, whatever the training seed. Asking for
    more than `num_val_batches` cycles through the validation windows again (so does a
    validation split with fewer windows than one global batch).
    """
    if self.val is None:
      raise ValueError("No validation data: val_fraction is 0. Set DataConfig(val_fraction=0.01).")
    num_batches = self.num_val_batches if num_batches is None else num_batches
    if num_batches < 0:
      raise ValueError(f"num_batches={num_batches} must be >= 0.")
    return [self.val.batch_at(b) for b in range(num_batches)]


def load_source(cfg: DataConfig, tokenizer: Tokenizer) -> DocumentSource:
  """The `DocumentSource` named by `cfg` (stdlib sources are cached in memory)."""
  if cfg.kind == "prepared":
    raise ValueError("data.kind='prepared' streams its shards and cannot be mixed with another "
                     "source (task_mix); use task_mix.task='none' or an in-memory data.kind.")
  if cfg.kind == "stdlib":
    return stdlib_corpus(cfg.tokenizer)
  if cfg.kind == "text":
    return TextFileSource(cfg.paths, tokenizer)
  return ArrayRecordSource(cfg.paths)


def _capped_documents(docs: Sequence[np.ndarray], weights: Sequence[np.ndarray] | None,
                      cfg: DataConfig) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
  """The documents `cfg.max_documents` / `cfg.max_tokens` keep, without empty ones; per-token
  `weights`, if given, are cut the same way."""
  keep_w = weights is not None
  pairs = list(zip(docs, weights if keep_w else [None] * len(docs)))
  pairs = pairs[:cfg.max_documents] if cfg.max_documents is not None else pairs
  if cfg.max_tokens is not None:
    ends = np.cumsum([d.size for d, _ in pairs])
    keep = int(np.searchsorted(ends, cfg.max_tokens, side="left")) + 1
    pairs = pairs[:keep]
    if pairs and ends[len(pairs) - 1] > cfg.max_tokens:
      d, w = pairs[-1]
      n = d.size - (ends[len(pairs) - 1] - cfg.max_tokens)
      pairs[-1] = (d[:n], None if w is None else w[:n])
  pairs = [(d, w) for d, w in pairs if d.size]  # An empty document would add a lone eos.
  return [d for d, _ in pairs], ([np.asarray(w) for _, w in pairs] if keep_w else None)


def _read_weighted(source: DocumentSource) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
  """Every document of `source` and, when it has them (`read_weighted()`), their per-token
  loss weights, read in one pass."""
  read_weighted = getattr(source, "read_weighted", None)
  if read_weighted is None:
    return read_documents(source), None
  docs, weights = read_weighted()
  return ([np.asarray(d, np.int32).reshape(-1) for d in docs],
          [np.asarray(w).reshape(-1) for w in weights])


def build_datasets(cfg: DataConfig, seq_len: int, global_batch_size: int, seed: int,
                   process_index: int = 0, process_count: int = 1, *,
                   source: DocumentSource | None = None,
                   tokenizer: Tokenizer | None = None) -> Datasets:
  """Reads, splits and packs the corpus; returns training and validation batches.

  `cfg.kind == "prepared"` streams instead (see `diffjax.data.streaming`) and returns a
  `PreparedDatasets` with the same members the trainer uses.

  Args:
    cfg: the data configuration.
    seq_len: T, tokens per example.
    global_batch_size: B, examples per step over all processes.
    seed: orders documents and windows (epoch e uses (seed, e)); does not affect the split.
    process_index, process_count: this host's slot (`jax.process_index()`, `jax.process_count()`).
    source: any `DocumentSource` to use instead of the one `cfg.kind` / `cfg.paths` names
      (e.g. a synthetic task); its ids must come from `tokenizer`. A source with a
      `read_weighted()` method (every document and its (N_i,) 0/1 per-token loss weights) is
      scored only where the weight is 1.
    tokenizer: overrides `cfg.tokenizer`.

  Raises:
    ValueError: B not divisible by process_count; an empty corpus; seq_len + 1 longer than the
      training or validation split; ids outside the tokenizer's vocabulary.
    FileNotFoundError: a path or glob of `cfg.paths` matches nothing.
  """
  check_batch_split(global_batch_size, process_index, process_count)
  if cfg.kind == "prepared":
    if source is not None:
      raise ValueError("data.kind='prepared' streams its shards and cannot be mixed with another "
                       "source (task_mix); use task_mix.task='none' or an in-memory data.kind.")
    return build_prepared_datasets(cfg, seq_len, global_batch_size, seed, process_index,
                                   process_count, tokenizer)
  tokenizer = tokenizer or load_tokenizer(cfg.tokenizer)
  source = source if source is not None else load_source(cfg, tokenizer)
  name = getattr(source, "name", type(source).__name__)
  docs, weights = _capped_documents(*_read_weighted(source), cfg)
  corpus = PackedCorpus.from_documents(docs, tokenizer.eos_id, weights)
  if corpus.tokens_N.size == 0:
    raise ValueError(
        f"Corpus {name!r} has no tokens ({len(source)} documents, all empty after max_documents="
        f"{cfg.max_documents}, max_tokens={cfg.max_tokens}); point DataConfig.paths at non-empty data."
    )
  lo, hi = int(corpus.tokens_N.min()), int(corpus.tokens_N.max())
  if lo < 0 or hi >= tokenizer.vocab_size:
    raise ValueError(
        f"Corpus {name!r} has token ids in [{lo}, {hi}], outside [0, vocab_size={tokenizer.vocab_size}) "
        f"of {tokenizer!r}; use the tokenizer that produced the data."
    )

  _check_room_for_validation(corpus, cfg.val_fraction, seq_len, name)
  train_ids, val_ids = split_documents(corpus, cfg.val_fraction, cfg.split_seed)
  train_corpus, val_corpus = corpus.subset(train_ids), corpus.subset(val_ids)
  packer = _packer_or_error(train_corpus, seq_len, seed, cfg.shuffle, "training", name)
  train = PackedBatchDataset(packer, global_batch_size, process_index, process_count)
  read_options = grain.ReadOptions(num_threads=cfg.num_threads, prefetch_buffer_size=cfg.prefetch_batches)

  val, entropy_nats = None, math.nan
  if val_corpus.num_documents:
    val_packer = _packer_or_error(val_corpus, seq_len, 0, False, "validation", name)
    num_val = max(1, val_packer.windows_per_epoch // global_batch_size)
    val = PackedBatchDataset(val_packer, global_batch_size, process_index, process_count, num_val)
    entropy_nats = unigram_cross_entropy_nats(train_corpus, val_corpus, tokenizer.vocab_size)

  return Datasets(
      train=train, train_iter=iter(train.to_iter_dataset(read_options)), val=val,
      tokenizer=tokenizer, seq_len=seq_len, global_batch_size=global_batch_size,
      per_process_batch_size=train.per_process_batch_size,
      num_train_tokens=train_corpus.stream_length, num_val_tokens=val_corpus.stream_length,
      num_train_documents=train_corpus.num_documents, num_val_documents=val_corpus.num_documents,
      windows_per_epoch=packer.windows_per_epoch, unigram_entropy_nats=entropy_nats,
      unigram_entropy_bits=entropy_nats / math.log(2), read_options=read_options,
  )


def _check_room_for_validation(corpus: PackedCorpus, val_fraction: float, seq_len: int,
                               name: str) -> None:
  """The validation split holds out whole documents: a corpus needs at least two, and
  seq_len + 1 tokens on each side of the split."""
  if val_fraction > 0 and corpus.num_documents < 2:
    raise ValueError(
        f"Corpus {name!r} is too small: {corpus.num_documents} document "
        f"({corpus.stream_length} tokens), but the validation split holds out whole documents "
        f"(val_fraction={val_fraction}), so it needs at least 2 documents, with at least "
        f"2 x {seq_len + 1} = {2 * (seq_len + 1)} tokens (seq_len + 1 on each side). Add "
        "documents (kind='text' reads one document per file), e.g. split the file in several."
    )


def _packer_or_error(corpus: PackedCorpus, seq_len: int, seed: int, shuffle: bool,
                     split: str, name: str) -> Packer:
  if corpus.stream_length < seq_len + 1:
    hint = " or a larger val_fraction" if split == "validation" else ""
    raise ValueError(
        f"seq_len + 1 = {seq_len + 1} tokens is longer than the {split} split of {name!r}: "
        f"{corpus.stream_length} tokens ({corpus.num_documents} documents, one eos each). "
        f"The corpus is too small: each split needs at least {seq_len + 1} tokens. Use a "
        f"shorter seq_len, more data{hint}."
    )
  return Packer(corpus, seq_len, seed=seed, shuffle=shuffle)
