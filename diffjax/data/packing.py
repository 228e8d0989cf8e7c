"""Packing documents into fixed-length training windows: arrays in, arrays out.

The token stream of an epoch is the documents in a seeded order, each followed by eos:

    doc_a eos doc_b eos doc_c eos ...

Window k covers stream positions [k*T, k*T + T] (T + 1 tokens, consecutive windows share one
token), so every stream token except the first is a target exactly once per epoch; the tail that
does not fill a window is dropped (a different tail each epoch, since the order changes).
With `shuffle`, the windows of an epoch are also visited in a seeded random order, so one long
document does not fill a whole batch.

Per window (all (T,) int32 unless said otherwise):
  inputs       stream[s : s+T]
  targets      stream[s+1 : s+T+1]  (next token)
  segment_ids  1, 2, 3, ... : which document of the window each input belongs to; an eos belongs
               to the document it closes. Attention must stay within a segment.
  positions    index of the input inside its document, restarting at 0 at each document start.
               A document already running when the window starts counts from 0 at the window's
               first token, so positions stay below T (what the model sees is the same: attention
               cannot reach the part before the window, and RoPE depends only on differences).
  loss_mask    (T,) float32: 0 where the input is an eos, because its target is the first token of
               the next, unrelated document; 1 elsewhere. Predicting eos itself is trained.
               A corpus with per-token loss weights (`PackedCorpus.weights_N`, e.g. a retrieval
               task scored on its answers only) also zeroes the positions whose target has
               weight 0; an eos target then has weight 0 too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import threading
from typing import Sequence

import numpy as np

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


@dataclasses.dataclass(frozen=True)
class PackedCorpus:
  """Documents as one flat token array.

  Attributes:
    tokens_N: (N,) int32, all documents concatenated (no eos).
    offsets_Dp1: (D + 1,) int64; document d is tokens_N[offsets_Dp1[d]:offsets_Dp1[d + 1]].
    eos_id: id placed after every document in the stream.
    weights_N: None (every target is scored), or (N,) uint8 per token: 1 where predicting that
      token is scored, 0 where it is not (see `loss_mask` above).
  """

  tokens_N: np.ndarray
  offsets_Dp1: np.ndarray
  eos_id: int
  weights_N: np.ndarray | None = None

  @classmethod
  def from_documents(cls, docs: Sequence[np.ndarray], eos_id: int,
                     weights: Sequence[np.ndarray] | None = None) -> "PackedCorpus":
    """Concatenates `docs` (each (N_i,) int); documents are kept in the given order.

    `weights`, if given, holds one (N_i,) array of 0/1 per document (its tokens' loss weights).
    """
    docs = [np.asarray(d, dtype=np.int32).reshape(-1) for d in docs]
    lengths_D = np.fromiter((d.size for d in docs), dtype=np.int64, count=len(docs))
    offsets_Dp1 = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths_D, out=offsets_Dp1[1:])
    tokens_N = np.concatenate(docs).astype(np.int32, copy=False) if docs else np.zeros(0, np.int32)
    weights_N = None
    if weights is not None:
      weights = [np.asarray(w).reshape(-1) for w in weights]
      if len(weights) != len(docs) or any(w.size != d.size for w, d in zip(weights, docs)):
        raise ValueError("Loss weights must match the documents one to one, token for token; got "
                         f"{len(weights)} weight arrays for {len(docs)} documents.")
      bad = [i for i, w in enumerate(weights) if w.size and not np.isin(w, (0, 1)).all()]
      if bad:
        raise ValueError(f"Loss weights must be 0 or 1; document {bad[0]} has other values.")
      weights_N = (np.concatenate(weights).astype(np.uint8) if weights
                   else np.zeros(0, np.uint8))
    return cls(tokens_N, offsets_Dp1, int(eos_id), weights_N)

  @property
  def num_documents(self) -> int:
    return self.offsets_Dp1.size - 1

  @property
  def lengths_D(self) -> np.ndarray:
    """(D,) int64 document lengths, without eos."""
    return np.diff(self.offsets_Dp1)

  @property
  def stream_length(self) -> int:
    """Tokens in one epoch's stream: every document plus its eos."""
    return int(self.tokens_N.size) + self.num_documents

  def document(self, d: int) -> np.ndarray:
    return self.tokens_N[self.offsets_Dp1[d]:self.offsets_Dp1[d + 1]]

  def document_weights(self, d: int) -> np.ndarray | None:
    if self.weights_N is None:
      return None
    return self.weights_N[self.offsets_Dp1[d]:self.offsets_Dp1[d + 1]]

  def subset(self, doc_ids_K: np.ndarray) -> "PackedCorpus":
    """A corpus of the documents `doc_ids_K`, in that order (weights kept)."""
    weights = (None if self.weights_N is None else
               [self.document_weights(int(d)) for d in doc_ids_K])
    return PackedCorpus.from_documents([self.document(int(d)) for d in doc_ids_K], self.eos_id,
                                       weights)

  def stream_tokens(self) -> np.ndarray:
    """The (stream_length,) int32 stream in document order (for statistics, not training)."""
    ends_D = self.offsets_Dp1[1:]
    return np.insert(self.tokens_N, ends_D, self.eos_id).astype(np.int32)


def document_hashes(corpus: PackedCorpus, split_seed: int) -> np.ndarray:
  """(D,) uniform floats in [0, 1) from a keyed hash of each document's tokens.

  Depends only on a document's content and `split_seed`: not on its index, the corpus order or
  the training seed. Identical documents get identical values, so they land on the same side.
  """
  key = int(split_seed).to_bytes(8, "little", signed=True)
  out_D = np.empty(corpus.num_documents, dtype=np.float64)
  for d in range(corpus.num_documents):
    digest = hashlib.blake2b(corpus.document(d).astype("<i4").tobytes(), digest_size=8, key=key).digest()
    out_D[d] = int.from_bytes(digest, "little") / 2.0**64
  return out_D


def _docs_for_a_train_split(val_fraction: float) -> int:
  """Documents needed so that all land in validation with probability below 1%."""
  return max(2, math.ceil(math.log(0.01) / math.log(val_fraction)))


def split_documents(corpus: PackedCorpus, val_fraction: float,
                    split_seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Splits document ids into (train_ids, val_ids), each sorted, by `document_hashes`.

  A document goes to validation when its hash is below `val_fraction`. With val_fraction > 0 at
  least one document (with all its duplicates) is held out; with 0, none is.
  """
  if not 0.0 <= val_fraction < 1.0:
    raise ValueError(f"val_fraction={val_fraction} must be in [0, 1); e.g. 0.01 holds out 1% of documents.")
  ids_D = np.arange(corpus.num_documents)
  if val_fraction == 0.0:
    return ids_D, ids_D[:0]
  h_D = document_hashes(corpus, split_seed)
  is_val_D = h_D < val_fraction
  if not is_val_D.any():
    is_val_D = h_D == h_D.min()
  if is_val_D.all():
    raise ValueError(
        f"All {corpus.num_documents} documents fell into the validation split (val_fraction="
        f"{val_fraction}): the corpus is too small for this fraction. Each document lands "
        f"there with probability {val_fraction}, so with {_docs_for_a_train_split(val_fraction)}"
        " or more documents this happens less than once in 100 seeds; add documents or lower "
        "val_fraction (0 disables validation)."
    )
  return ids_D[~is_val_D], ids_D[is_val_D]


def unigram_cross_entropy_nats(train: PackedCorpus, val: PackedCorpus, vocab_size: int) -> float:
  """Cross-entropy (nats/token) on val's stream of a unigram model fit on train's stream.

  The model is add-one smoothed counts over all `vocab_size` ids; both streams include the eos
  after each document. This is the loss a model with no context would reach: the baseline to beat.
  """
  counts_V = np.bincount(train.tokens_N, minlength=vocab_size).astype(np.float64)
  counts_V[train.eos_id] += train.num_documents
  if counts_V.size > vocab_size:
    raise ValueError(f"Training tokens reach id {counts_V.size - 1}, outside vocab_size={vocab_size}.")
  logp_V = np.log(counts_V + 1.0) - np.log(counts_V.sum() + vocab_size)
  val_counts_V = np.bincount(val.tokens_N, minlength=vocab_size).astype(np.float64)
  if val_counts_V.size > vocab_size:
    raise ValueError(f"Validation tokens reach id {val_counts_V.size - 1}, outside vocab_size={vocab_size}.")
  val_counts_V[val.eos_id] += val.num_documents
  return float(-(val_counts_V * logp_V).sum() / val_counts_V.sum())


@dataclasses.dataclass(frozen=True)
class EpochLayout:
  """Where every document and window of one epoch lies in the stream.

  Attributes:
    order_D: document ids in stream order.
    starts_D: (D,) int64 stream position of each document in `order_D`.
    window_order_W: window ids in the order the epoch visits them.
  """

  order_D: np.ndarray
  starts_D: np.ndarray
  window_order_W: np.ndarray


class Packer:
  """Gathers training windows of a `PackedCorpus` by global example index.

  Example g is window `window_order_W[g % W]` of epoch `g // W` (W = windows per epoch), so any
  example can be rebuilt from its index alone: this is what makes resuming exact and cheap.
  Epoch e shuffles with the seed sequence (seed, e); without `shuffle`, every epoch is the
  corpus order. Thread-safe.
  """

  def __init__(self, corpus: PackedCorpus, seq_len: int, *, seed: int, shuffle: bool):
    if seq_len < 1:
      raise ValueError(f"seq_len={seq_len} must be at least 1.")
    self.corpus = corpus
    self.seq_len = int(seq_len)
    self.seed = int(seed)
    self.shuffle = bool(shuffle)
    self.windows_per_epoch = (corpus.stream_length - 1) // self.seq_len
    if self.windows_per_epoch < 1:
      raise ValueError(
          f"seq_len + 1 = {self.seq_len + 1} tokens is longer than the whole corpus split "
          f"({corpus.stream_length} tokens including one eos per document, "
          f"{corpus.num_documents} documents); use a shorter seq_len or more data."
      )
    self._lengths_D = corpus.lengths_D
    self._layouts: dict[int, EpochLayout] = {}
    self._lock = threading.Lock()

  def layout(self, epoch: int) -> EpochLayout:
    """The (cached) layout of `epoch`."""
    epoch = epoch if self.shuffle else 0
    with self._lock:
      cached = self._layouts.get(epoch)
    if cached is not None:
      return cached
    d, w = self.corpus.num_documents, self.windows_per_epoch
    if self.shuffle:
      rng = np.random.default_rng([self.seed, epoch])
      order_D, window_order_W = rng.permutation(d), rng.permutation(w)
    else:
      order_D, window_order_W = np.arange(d), np.arange(w)
    starts_D = np.zeros(d, dtype=np.int64)
    np.cumsum(self._lengths_D[order_D][:-1] + 1, out=starts_D[1:])
    layout = EpochLayout(order_D, starts_D, window_order_W)
    with self._lock:
      if len(self._layouts) >= 4:  # Iterators move forward: old epochs are not needed again.
        self._layouts.pop(min(self._layouts))
      self._layouts[epoch] = layout
    return layout

  def examples(self, indices_B: np.ndarray) -> dict[str, np.ndarray]:
    """Returns the batch of examples `indices_B` (global example indices), each value (B, T)."""
    indices_B = np.asarray(indices_B, dtype=np.int64)
    out = {k: np.empty((indices_B.size, self.seq_len), np.float32 if k == "loss_mask" else np.int32)
           for k in BATCH_KEYS}
    epochs_B = indices_B // self.windows_per_epoch
    for epoch in np.unique(epochs_B):
      rows = np.nonzero(epochs_B == epoch)[0]
      layout = self.layout(int(epoch))
      windows = layout.window_order_W[indices_B[rows] % self.windows_per_epoch]
      for key, value in self._gather(layout, windows).items():
        out[key][rows] = value
    return out

  def _gather(self, layout: EpochLayout, windows_B: np.ndarray) -> dict[str, np.ndarray]:
    t = self.seq_len
    pos_BxT1 = windows_B[:, None] * t + np.arange(t + 1)[None, :]
    slot_BxT1 = np.searchsorted(layout.starts_D, pos_BxT1, side="right") - 1
    doc_BxT1 = layout.order_D[slot_BxT1]
    offset_BxT1 = pos_BxT1 - layout.starts_D[slot_BxT1]
    is_eos_BxT1 = offset_BxT1 == self._lengths_D[doc_BxT1]
    flat_BxT1 = np.minimum(self.corpus.offsets_Dp1[doc_BxT1] + offset_BxT1, self.corpus.tokens_N.size - 1)
    tokens_BxT1 = np.where(is_eos_BxT1, self.corpus.eos_id,
                           self.corpus.tokens_N[np.maximum(flat_BxT1, 0)]).astype(np.int32)
    slot_BxT = slot_BxT1[:, :t]
    segment_ids_BxT = slot_BxT - slot_BxT[:, :1] + 1
    offset_BxT = offset_BxT1[:, :t]
    positions_BxT = np.where(segment_ids_BxT == 1, offset_BxT - offset_BxT[:, :1], offset_BxT)
    loss_mask_BxT = ~is_eos_BxT1[:, :t]
    if self.corpus.weights_N is not None:
      scored_BxT = self.corpus.weights_N[np.maximum(flat_BxT1[:, 1:], 0)].astype(bool)
      loss_mask_BxT &= scored_BxT & ~is_eos_BxT1[:, 1:]
    return {
        "inputs": tokens_BxT1[:, :t],
        "targets": tokens_BxT1[:, 1:],
        "segment_ids": segment_ids_BxT.astype(np.int32),
        "positions": positions_BxT.astype(np.int32),
        "loss_mask": loss_mask_BxT.astype(np.float32),
    }
