"""`build_prepared_datasets`: the streaming counterpart of `pipeline.build_datasets` for
`DataConfig(kind="prepared")`. Reads only the manifest before the first batch."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from diffjax.data.config import DataConfig, check_batch_split
from diffjax.data.manifest import Manifest, read_manifest
from diffjax.data.streaming import (EpochOrder, Lane, ShardReader, StreamingBatchIterator, doc_hashes,
                                    doc_is_val)
from diffjax.data.tokenizers import Tokenizer, load_tokenizer

_SCAN_BLOCK = 1 << 16


class ValidationDocs:
  """Validation document ids in corpus order, found by hashing ids block by block on demand.

  As in the in-memory split, val_fraction > 0 holds out at least one document: if no id hashes
  below it (only in small corpora, since the scan stops at the first hit otherwise), the id with
  the smallest hash is held out (`forced`)."""

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


@dataclasses.dataclass
class PreparedDatasets:
  """What the trainer needs from a prepared corpus (same members as `pipeline.Datasets`).

  Token and document counts come from the manifest; the split is drawn per document, so the
  training / validation counts are expectations (`val_fraction` of the corpus), marked `~`.
  """

  manifest: Manifest
  tokenizer: Tokenizer
  seq_len: int
  global_batch_size: int
  per_process_batch_size: int
  process_index: int
  cfg: DataConfig
  seed: int
  train_iter: StreamingBatchIterator = None

  def __post_init__(self):
    self._order = EpochOrder([s.num_documents for s in self.manifest.shards], self.seed,
                             self.cfg.shuffle, self.cfg.shards_per_group)
    self._val_docs = ValidationDocs(self._order.total, self.cfg.val_fraction, self.cfg.split_seed)
    self.train_iter = self.new_train_iter()

  @property
  def rows(self) -> tuple[int, int]:
    start = self.process_index * self.per_process_batch_size
    return start, start + self.per_process_batch_size

  @property
  def num_train_tokens(self) -> int:
    """Expected stream tokens of the training split per epoch (documents plus one eos each)."""
    m = self.manifest
    return int((m.num_tokens + m.num_documents) * (1.0 - self.cfg.val_fraction))

  @property
  def windows_per_epoch(self) -> int:
    return self.num_train_tokens // self.seq_len

  @property
  def batches_per_epoch(self) -> float:
    return self.windows_per_epoch / self.global_batch_size

  def epoch_at_step(self, step: int) -> float:
    return step / self.batches_per_epoch

  unigram_entropy_nats: float = math.nan
  unigram_entropy_bits: float = math.nan

  def _train_slot(self, epoch: int, k: int) -> int | None:
    doc = self._order.doc_at(epoch, k)
    if doc is None or self.cfg.val_fraction == 0:
      return doc
    if doc == self._val_docs.forced:
      return -1
    return -1 if doc_is_val(np.array([doc]), self.cfg.val_fraction, self.cfg.split_seed)[0] else doc

  def _val_slot(self, epoch: int, k: int) -> int | None:
    del epoch  # a split with fewer documents than rows cycles through them, as in memory
    doc = self._val_docs.get(k)
    return doc if doc is not None else self._val_docs.ids[k % len(self._val_docs.ids)]

  def _lanes(self, slot_fn, reader) -> list[Lane]:
    return [Lane(r, self.global_batch_size, slot_fn, reader, self.tokenizer.eos_id, self.seq_len)
            for r in range(*self.rows)]

  def new_train_iter(self) -> StreamingBatchIterator:
    """A fresh iterator from step 0 (restore a saved state into it with `set_state`)."""
    reader = ShardReader(self.manifest, max_open=2 * self.cfg.shards_per_group + 2)
    return StreamingBatchIterator(lambda: self._lanes(self._train_slot, reader), self.rows,
                                  self.cfg.prefetch_batches)

  def val_batches(self, num_batches: int) -> list[dict[str, np.ndarray]]:
    """The first `num_batches` validation batches: validation documents in corpus order, lane
    r taking documents r, r + B, ... (cycling when the split has fewer); the same for every
    training seed."""
    if self.cfg.val_fraction == 0:
      raise ValueError("No validation data: val_fraction is 0. Set data.val_fraction=0.01.")
    if self._val_docs.get(0) is None:
      raise ValueError(f"No document of {self.manifest.directory!r} fell into the validation split "
                       f"(val_fraction={self.cfg.val_fraction}); raise val_fraction or add data.")
    reader = ShardReader(self.manifest, max_open=4)
    it = StreamingBatchIterator(lambda: self._lanes(self._val_slot, reader), self.rows, 0)
    return [next(it) for _ in range(num_batches)]


def build_prepared_datasets(cfg: DataConfig, seq_len: int, global_batch_size: int, seed: int,
                            process_index: int = 0, process_count: int = 1,
                            tokenizer: Tokenizer | None = None) -> PreparedDatasets:
  """Opens a prepared corpus (`cfg.paths[0]`: its directory or manifest.json) for streaming.

  Raises:
    FileNotFoundError: no manifest there.
    ValueError: the manifest's tokenizer is not `cfg.tokenizer`; fewer documents than rows.
  """
  check_batch_split(global_batch_size, process_index, process_count)
  if len(cfg.paths) != 1:
    raise ValueError(f"data.kind='prepared' takes one path (a prepared directory or its "
                     f"manifest.json), got data.paths={cfg.paths}.")
  manifest = read_manifest(cfg.paths[0])
  tokenizer = tokenizer or load_tokenizer(cfg.tokenizer)
  manifest.check_tokenizer(tokenizer, cfg.tokenizer)
  if manifest.num_documents < global_batch_size:
    raise ValueError(
        f"Prepared corpus {manifest.directory!r} has {manifest.num_documents} documents, fewer than "
        f"global_batch_size={global_batch_size} rows (each row streams its own documents); use a "
        "smaller batch or more data.")
  return PreparedDatasets(manifest, tokenizer, seq_len, global_batch_size,
                          global_batch_size // process_count, process_index, cfg, seed)
