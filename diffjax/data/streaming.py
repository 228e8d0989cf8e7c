"""Streaming batches from a prepared corpus (`diffjax.data.prepare`): memory bounded by
buffers, start-up independent of corpus size, exact resume, the same global batch for any
number of processes.

Design. Row r of every global batch (B rows) is fed by its own *lane*: a packed token stream
of the documents at epoch positions r, r + B, r + 2B, ... . Epoch e visits every document once
in a seeded order built without materialising a permutation of the corpus:

  1. the shards are permuted with numpy's generator seeded (seed, e) (S numbers: small);
  2. consecutive permuted shards form groups of `shards_per_group`; inside a group the documents
     of all its shards are permuted lazily with grain's `index_shuffle` (O(1) memory, any size),
     so a batch mixes the documents of several shards, and only that many shards are open.

Each lane appends eos after each document and cuts windows of T + 1 tokens, consecutive windows
sharing one token, with segment ids and per-document positions exactly as `packing.Packer`.
A lane whose documents run out starts its next epoch; lanes are independent of each other and of
the process count, so process p (rows [p*b, (p+1)*b)) reads only the documents of its own lanes
and the union of the processes' rows is the single-process batch.

Validation documents are chosen by a keyed hash of the global document id (`doc_is_val`), so
neither split reads anything to decide; training lanes skip them, validation lanes read them in
corpus order, scanning ids only as far as needed.

Iterator state: per lane (epoch, slot, offset) plus the rows it covers; a resume must use the
same process count (the rows are checked). Why not grain's `ConcatThenSplitIterDataset` /
`FirstFitPackIterDataset`: they pack whatever a process reads, so the global batch would depend
on the process count and the per-lane position could not be written as three integers.
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import Callable

import grain
import numpy as np
from grain.experimental import index_shuffle

from diffjax.data.manifest import Manifest
from diffjax.data.packing import BATCH_KEYS
from diffjax.data.shards import TokenShard
from diffjax.data.sources import _decode_record

_U64 = np.uint64
_MASK = (1 << 64) - 1


def _splitmix64(x_N: np.ndarray) -> np.ndarray:
  """A bijective 64-bit mixer (uint64 in, uint64 out)."""
  with np.errstate(over="ignore"):
    z_N = x_N + _U64(0x9E3779B97F4A7C15)
    z_N = (z_N ^ (z_N >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z_N = (z_N ^ (z_N >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z_N ^ (z_N >> _U64(31))


def doc_hashes(doc_ids_N: np.ndarray, split_seed: int) -> np.ndarray:
  """(N,) float64 uniform in [0, 1) from a keyed hash of global document ids."""
  key = _splitmix64(np.array([int(split_seed) & _MASK], _U64))[0]
  h_N = _splitmix64(np.asarray(doc_ids_N, np.int64).astype(_U64) ^ key)
  return (h_N >> _U64(11)).astype(np.float64) * 2.0**-53


def doc_is_val(doc_ids_N: np.ndarray, val_fraction: float, split_seed: int) -> np.ndarray:
  """(N,) bool: which global document ids belong to the validation split."""
  return doc_hashes(doc_ids_N, split_seed) < val_fraction


def _seed32(*values: int) -> int:
  x = np.array([0], _U64)
  for v in values:
    x = _splitmix64(x ^ _U64(int(v) & _MASK))
  return int(x[0] >> _U64(33))


class EpochOrder:
  """Maps (epoch, position) to a global document id: the seeded visiting order of an epoch."""

  def __init__(self, counts_S: np.ndarray, seed: int, shuffle: bool, shards_per_group: int):
    self.counts_S = np.asarray(counts_S, np.int64)
    self.offsets_Sp1 = np.concatenate([[0], np.cumsum(self.counts_S)])
    self.total = int(self.offsets_Sp1[-1])
    self.seed, self.shuffle = int(seed), bool(shuffle)
    self.group = max(1, int(shards_per_group))
    self._layouts: collections.OrderedDict = collections.OrderedDict()

  def _layout(self, epoch: int):
    if epoch in self._layouts:
      return self._layouts[epoch]
    perm_S = np.random.default_rng([self.seed, epoch]).permutation(self.counts_S.size)
    groups = [perm_S[i:i + self.group] for i in range(0, perm_S.size, self.group)]
    inner = [np.concatenate([[0], np.cumsum(self.counts_S[g])]) for g in groups]
    starts_Gp1 = np.concatenate([[0], np.cumsum([o[-1] for o in inner])])
    layout = (groups, inner, starts_Gp1)
    self._layouts[epoch] = layout
    while len(self._layouts) > 2:  # lanes are at most one epoch apart
      self._layouts.popitem(last=False)
    return layout

  def doc_at(self, epoch: int, k: int) -> int | None:
    """Global id of the k-th document of `epoch`, None past the epoch's end."""
    if k >= self.total:
      return None
    if not self.shuffle:
      return k
    groups, inner, starts_Gp1 = self._layout(epoch)
    g = int(np.searchsorted(starts_Gp1, k, side="right")) - 1
    n = int(inner[g][-1])
    j = index_shuffle(int(k - starts_Gp1[g]), n - 1, _seed32(self.seed, epoch, g), 4) if n > 1 else 0
    s = int(np.searchsorted(inner[g], j, side="right")) - 1
    shard = int(groups[g][s])
    return int(self.offsets_Sp1[shard] + j - inner[g][s])


class _ArrayRecordShard:
  """A shard of a corpus prepared as ArrayRecord files by earlier versions of `prepare`."""

  def __init__(self, path: str):
    from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
    self.path = path
    self._reader = array_record_module.ArrayRecordReader(
        path, options="readahead_buffer_size:0", file_reader_buffer_size=32768)

  def __len__(self) -> int:
    return self._reader.num_records()

  def __getitem__(self, i: int) -> np.ndarray:
    return _decode_record(self._reader.read([int(i)])[0], i, self.path)

  def close(self) -> None:
    self._reader.close()


class ShardReader:
  """Reads documents by global id, keeping at most `max_open` shards open (least recently used
  closed first). Opening a `.tokens` shard reads its 32-byte header, so touching a whole group of
  shards for the first batch costs about as much as touching one."""

  def __init__(self, manifest: Manifest, max_open: int):
    self.manifest = manifest
    self.offsets_Sp1 = manifest.doc_offsets_Sp1
    self.max_open = max(1, max_open)
    self._open: collections.OrderedDict = collections.OrderedDict()

  def _shard_of(self, doc: int) -> int:
    return int(np.searchsorted(self.offsets_Sp1, doc, side="right")) - 1

  def _reader(self, s: int):
    shard = self.manifest.shards[s]
    reader = (_ArrayRecordShard(shard.path) if shard.path.endswith(".array_record")
              else TokenShard(shard.path))
    if len(reader) != shard.num_documents:
      n = len(reader)
      reader.close()
      raise ValueError(f"Shard {shard.path} holds {n} documents but the manifest says "
                       f"{shard.num_documents}: the prepared directory is inconsistent; prepare again.")
    return reader

  def _source(self, s: int):
    reader = self._open.get(s)
    if reader is None:
      reader = self._open[s] = self._reader(s)
      while len(self._open) > self.max_open:
        self._open.popitem(last=False)[1].close()
    else:
      self._open.move_to_end(s)
    return reader

  def __getitem__(self, doc: int) -> np.ndarray:
    s = self._shard_of(doc)
    return self._source(s)[int(doc - self.offsets_Sp1[s])]


# A slot function maps (epoch, k) to a document id, -1 to skip the slot, or None at the end.
SlotFn = Callable[[int, int], "int | None"]


class Lane:
  """One row's packed token stream. State: (epoch, slot, offset) of the window's first token."""

  def __init__(self, row: int, stride: int, slot_fn: SlotFn, reader, eos_id: int, seq_len: int):
    self.row, self.stride, self.slot_fn, self.reader = row, stride, slot_fn, reader
    self.eos_id, self.seq_len = eos_id, seq_len
    self.set_state((0, -1, 0))

  def state(self) -> list[int]:
    return [self.epoch, self.slot, self.offset]

  def set_state(self, state) -> None:
    self.epoch, self.slot, self.offset = (int(v) for v in state)
    self.doc = None
    if self.slot >= 0:
      doc_id = self.slot_fn(self.epoch, self.row + self.slot * self.stride)
      self.doc = self._with_eos(self.reader[doc_id])
    else:
      self._advance()

  def _with_eos(self, tokens_N: np.ndarray) -> np.ndarray:
    return np.append(tokens_N, np.int32(self.eos_id)).astype(np.int32)

  def _advance(self) -> None:
    """Moves to the next training document of the lane (next epoch at the end of one)."""
    epoch_start = (self.epoch, self.slot)
    while True:
      self.slot += 1
      doc_id = self.slot_fn(self.epoch, self.row + self.slot * self.stride)
      if doc_id is None:
        if epoch_start == (self.epoch, -1):
          raise ValueError(
              f"Batch row {self.row} received no document in a whole epoch: the split has fewer "
              f"usable documents than global_batch_size={self.stride} rows; use a smaller batch "
              "or more data.")
        self.epoch, self.slot = self.epoch + 1, -1
        epoch_start = (self.epoch, -1)
        continue
      if doc_id < 0:
        continue
      tokens_N = self.reader[doc_id]
      if tokens_N.size:
        self.doc, self.offset = self._with_eos(tokens_N), 0
        return

  def window(self) -> dict[str, np.ndarray]:
    """The next (T,) window of every BATCH_KEYS array; advances the lane by T tokens."""
    need = self.seq_len + 1
    pieces = []
    while True:
      piece = self.doc[self.offset:self.offset + need]
      pieces.append((piece, self.offset + piece.size == self.doc.size))
      need -= piece.size
      if need == 0:
        self.offset += piece.size - 1  # the window's last token starts the next window
        break
      self._advance()
    tokens_T1 = np.concatenate([p for p, _ in pieces])
    segment_T1 = np.concatenate([np.full(p.size, i + 1, np.int32) for i, (p, _) in enumerate(pieces)])
    positions_T1 = np.concatenate([np.arange(p.size, dtype=np.int32) for p, _ in pieces])
    eos_T1 = np.zeros(tokens_T1.size, bool)
    ends = np.cumsum([p.size for p, _ in pieces]) - 1
    eos_T1[[e for e, (_, closed) in zip(ends, pieces) if closed]] = True
    t = self.seq_len
    return {"inputs": tokens_T1[:t], "targets": tokens_T1[1:], "segment_ids": segment_T1[:t],
            "positions": positions_T1[:t], "loss_mask": (~eos_T1[:t]).astype(np.float32)}


def _copy_state(state: dict) -> dict:
  return {"rows": [int(r) for r in state["rows"]], "batches": int(state["batches"]),
          "lanes": [[int(v) for v in s] for s in state["lanes"]]}


def _stack(windows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  return {k: np.stack([w[k] for w in windows]) for k in BATCH_KEYS}


class StreamingBatchIterator(grain.DatasetIterator):
  """This process's rows of consecutive global batches, checkpointable with grain.

  State (JSON): {"rows": [start, stop], "batches": n, "lanes": [[epoch, slot, offset], ...]}.
  A background thread keeps up to `prefetch` batches ready; the state always describes the
  batches handed out, not the ones prefetched.
  """

  def __init__(self, make_lanes: Callable[[], list[Lane]], rows: tuple[int, int], prefetch: int):
    super().__init__()
    self._make_lanes, self._rows, self._prefetch = make_lanes, list(rows), int(prefetch)
    self._lanes = make_lanes()
    self._state = self._snapshot(0)
    self._thread = None
    self._queue = None
    self._stop = None

  def _snapshot(self, batches: int) -> dict:
    return {"rows": list(self._rows), "batches": batches, "lanes": [l.state() for l in self._lanes]}

  def _produce(self) -> tuple[dict[str, np.ndarray], dict]:
    batch = _stack([lane.window() for lane in self._lanes])
    return batch, self._snapshot(self._produced + 1)

  def _worker(self, stop: threading.Event, q: queue.Queue) -> None:
    while not stop.is_set():
      try:
        item = self._produce()
      except Exception as e:  # handed to the consumer, which raises it
        item = e
      self._produced += 1
      while not stop.is_set():
        try:
          q.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if isinstance(item, Exception):
        return

  def _start(self) -> None:
    self._produced = self._state["batches"]
    if self._prefetch > 0 and self._thread is None:
      self._stop, self._queue = threading.Event(), queue.Queue(self._prefetch)
      self._thread = threading.Thread(target=self._worker, args=(self._stop, self._queue), daemon=True)
      self._thread.start()

  def _halt(self) -> None:
    if self._thread is not None:
      self._stop.set()
      self._thread.join()
      self._thread = None

  def __next__(self) -> dict[str, np.ndarray]:
    if self._thread is None and self._prefetch > 0:
      self._start()
    if self._prefetch > 0:
      item = self._queue.get()
    else:
      self._produced = self._state["batches"]
      item = self._produce()
    if isinstance(item, Exception):
      raise item
    batch, self._state = item
    return batch

  def get_state(self) -> dict:
    return _copy_state(self._state)

  def set_state(self, state: dict) -> None:
    if list(state["rows"]) != self._rows:
      raise ValueError(
          f"The saved data position covers batch rows {state['rows']} but this process reads rows "
          f"{self._rows}: resume with the same number of processes as the run that saved it.")
    self._halt()
    for lane, s in zip(self._lanes, state["lanes"]):
      lane.set_state(s)
    self._state = _copy_state(state)
    self._produced = self._state["batches"]

  def close(self) -> None:
    self._halt()

  def __del__(self):
    try:
      self._halt()
    except Exception:  # interpreter shutdown
      pass
