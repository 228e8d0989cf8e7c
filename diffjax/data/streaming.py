"""Streaming batches from a corpus (`diffjax.data.corpus`): memory bounded by buffers, start-up
independent of corpus size, exact resume, the same global batch for any number of processes.

Rows, streams and the validation rule: docs/data.md#how-batches-are-made.
"""

from __future__ import annotations

import atexit
import collections
import queue
import threading
import weakref
from collections.abc import Callable

import grain
import numpy as np
from grain.experimental import index_shuffle

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")

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
    groups = [perm_S[i : i + self.group] for i in range(0, perm_S.size, self.group)]
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
    j = (
      index_shuffle(int(k - starts_Gp1[g]), n - 1, _seed32(self.seed, epoch, g), 4) if n > 1 else 0
    )
    s = int(np.searchsorted(inner[g], j, side="right")) - 1
    shard = int(groups[g][s])
    return int(self.offsets_Sp1[shard] + j - inner[g][s])


# Consecutive epochs without a training document after which a lane gives up.
EMPTY_EPOCHS = 8
# A slot function maps (epoch, k) to a document id, -1 to skip the slot, or None at the end.
SlotFn = Callable[[int, int], "int | None"]


class Lane:
  """One packed token stream. State: (epoch, slot, offset) of the next window's first token.

  The lane takes the documents at epoch positions ``start``, ``start + stride``, ... (through
  ``slot_fn``), appends eos after each and cuts windows of T + 1 tokens, consecutive windows
  sharing one token.
  """

  def __init__(self, start: int, stride: int, slot_fn: SlotFn, corpus, eos_id: int, seq_len: int):
    self.start, self.stride, self.slot_fn, self.corpus = start, stride, slot_fn, corpus
    self.eos_id, self.seq_len = eos_id, seq_len
    self.set_state((0, -1, 0))

  def state(self) -> list[int]:
    return [self.epoch, self.slot, self.offset]

  def set_state(self, state) -> None:
    self.epoch, self.slot, self.offset = (int(v) for v in state)
    self.doc = self.doc_weights = None
    if self.slot >= 0:
      self._load(self.slot_fn(self.epoch, self.start + self.slot * self.stride))
    else:
      self._advance()

  def _load(self, doc_id: int) -> bool:
    tokens_N = self.corpus.tokens(doc_id)
    if not tokens_N.size:
      return False
    self.doc = np.append(tokens_N, np.int32(self.eos_id)).astype(np.int32)
    w = self.corpus.weights(doc_id)
    # An eos target is scored with the document it closes unless the corpus weighs tokens.
    self.doc_weights = None if w is None else np.append(np.asarray(w) != 0, False)
    return True

  def _advance(self) -> None:
    """Moves to the next usable document of the lane (next epoch at the end of one).

    In a small corpus every position of a lane in one epoch may hold a validation document;
    the lane then takes its documents from the next epoch's order (another shuffle)."""
    empty_epochs = 0
    found = False
    while True:
      self.slot += 1
      doc_id = self.slot_fn(self.epoch, self.start + self.slot * self.stride)
      if doc_id is None:
        empty_epochs = 0 if found else empty_epochs + 1
        if empty_epochs > EMPTY_EPOCHS:
          raise ValueError(
            f"Data stream {self.start} received no training document in {EMPTY_EPOCHS} "
            f"epochs: the split has too few usable documents for its {self.stride} streams "
            "(global_batch_size x data.streams_per_row); use a smaller batch, "
            "data.streams_per_row=1 or more data."
          )
        self.epoch, self.slot, found = self.epoch + 1, -1, False
        continue
      found = found or doc_id >= 0
      if doc_id >= 0 and self._load(doc_id):
        self.offset = 0
        return

  def window(self) -> dict[str, np.ndarray]:
    """The next (T,) window of every BATCH_KEYS array; advances the lane by T tokens."""
    need = self.seq_len + 1
    pieces = []
    while True:
      piece = self.doc[self.offset : self.offset + need]
      scored = (
        None if self.doc_weights is None else self.doc_weights[self.offset : self.offset + need]
      )
      pieces.append((piece, self.offset + piece.size == self.doc.size, scored))
      need -= piece.size
      if need == 0:
        self.offset += piece.size - 1  # the window's last token starts the next window
        break
      self._advance()
    tokens_T1 = np.concatenate([p for p, _, _ in pieces])
    segment_T1 = np.concatenate(
      [np.full(p.size, i + 1, np.int32) for i, (p, _, _) in enumerate(pieces)]
    )
    positions_T1 = np.concatenate([np.arange(p.size, dtype=np.int32) for p, _, _ in pieces])
    eos_T1 = np.zeros(tokens_T1.size, bool)
    ends = np.cumsum([p.size for p, _, _ in pieces]) - 1
    eos_T1[[e for e, (_, closed, _) in zip(ends, pieces) if closed]] = True
    t = self.seq_len
    loss_mask_T = ~eos_T1[:t]
    if any(w is not None for _, _, w in pieces):
      scored_T1 = np.concatenate([np.ones(p.size, bool) if w is None else w for p, _, w in pieces])
      loss_mask_T &= scored_T1[1:]
    return {
      "inputs": tokens_T1[:t],
      "targets": tokens_T1[1:],
      "segment_ids": segment_T1[:t],
      "positions": positions_T1[:t],
      "loss_mask": loss_mask_T.astype(np.float32),
    }


def _copy_state(state: dict) -> dict:
  return {
    "rows": [int(r) for r in state["rows"]],
    "batches": int(state["batches"]),
    "lanes": [[int(v) for v in s] for s in state["lanes"]],
  }


class DataPositionError(ValueError):
  """Saved per-process data positions that do not make one global position for this run."""


def _plural(n: int, word: str) -> str:
  return f"{n} {word}" if n == 1 else f"{n} {word}es"


def global_position(states: dict[int, dict], count: int) -> dict:
  """The global data position from the iterator states that ``count`` processes saved.

  ``states`` maps each saving process's index to its state (``StreamingBatchIterator``'s
  format). Every row's lanes are global (they depend on the row and the global batch, not
  on the process that read them), so the rows of all states together give the position of
  the whole batch: ``{"rows": [0, B], "batches": n, "lanes": [...]}``, the state a
  single-process iterator would have after the same batches. Processes that read the same
  rows (a context group) must have saved the same lanes for them.

  Raises ``DataPositionError`` when a process's state is missing or the states disagree
  (batch counts, streams per row, lanes of a shared row, rows not covering ``[0, B)``).
  """
  missing = [i for i in range(count) if i not in states]
  if missing:
    which = ", ".join(str(i) for i in missing)
    raise DataPositionError(
      f"The data position of process {which} of the {_plural(count, 'process')} that saved "
      "the step is missing; every process's state is needed to resume on another number "
      "of processes."
    )
  lanes_by_row: dict[int, list[int]] = {}
  batches, streams = set(), set()
  for i in sorted(states):
    state = _copy_state(states[i])
    start, stop = state["rows"]
    if stop <= start or len(state["lanes"]) % (stop - start):
      raise DataPositionError(
        f"Process {i}'s saved data position has {len(state['lanes'])} lanes for rows "
        f"[{start}, {stop})."
      )
    k = len(state["lanes"]) // (stop - start)
    batches.add(state["batches"])
    streams.add(k)
    for r in range(start, stop):
      lanes = state["lanes"][(r - start) * k : (r - start + 1) * k]
      if lanes_by_row.setdefault(r, lanes) != lanes:
        raise DataPositionError(
          f"Two saved data positions disagree on row {r}: {lanes_by_row[r]} vs {lanes}."
        )
  if len(batches) > 1 or len(streams) > 1:
    raise DataPositionError(
      f"The saved data positions disagree: batches {sorted(batches)}, streams per row "
      f"{sorted(streams)}."
    )
  rows = max(lanes_by_row) + 1
  gaps = [r for r in range(rows) if r not in lanes_by_row]
  if gaps:
    raise DataPositionError(f"No saved data position holds rows {gaps} of the {rows}-row batch.")
  return {
    "rows": [0, rows],
    "batches": batches.pop(),
    "lanes": [lane for r in range(rows) for lane in lanes_by_row[r]],
  }


def take_rows(position: dict, rows: tuple[int, int]) -> dict:
  """The state of the iterator that reads ``rows`` (a block of the global batch) at
  ``position`` (a :func:`global_position`)."""
  start, stop = (int(r) for r in rows)
  total = int(position["rows"][1]) - int(position["rows"][0])
  if not 0 <= start < stop <= total:
    raise DataPositionError(
      f"Rows [{start}, {stop}) are not in the saved {total}-row batch: resume with "
      f"global_batch_size={total}."
    )
  k = len(position["lanes"]) // total
  return _copy_state(
    {
      "rows": [start, stop],
      "batches": position["batches"],
      "lanes": position["lanes"][start * k : stop * k],
    }
  )


def split_position(position: dict, count: int) -> list[dict]:
  """The states of ``count`` processes reading equal row blocks of ``position``, in order.

  Raises ``DataPositionError`` when ``count`` does not divide the global batch."""
  total = int(position["rows"][1]) - int(position["rows"][0])
  if count < 1 or total % count:
    raise DataPositionError(
      f"The saved data position has a global batch of {total} rows, which "
      f"{_plural(count, 'process')} cannot split into equal blocks; resume on a number of "
      f"processes that divides {total}."
    )
  per = total // count
  return [take_rows(position, (i * per, (i + 1) * per)) for i in range(count)]


def _stack(windows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  return {k: np.stack([w[k] for w in windows]) for k in BATCH_KEYS}


# The iterators whose prefetch thread runs. They are stopped before the interpreter shuts down:
# a daemon thread still inside a C++ call then (grain's index shuffle) aborts the process
# ("terminate called without an active exception", status 134) after a script's last line.
_PREFETCHING: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _halt_prefetching() -> None:
  for it in list(_PREFETCHING):
    it.close()


class StreamingBatchIterator(grain.DatasetIterator):
  """This process's rows of consecutive global batches, checkpointable with grain.

  State (JSON): {"rows": [start, stop], "batches": n, "lanes": [[epoch, slot, offset], ...]}.
  ``lanes`` lists each row's ``streams`` lanes, row after row; batch n takes stream n mod
  ``streams`` of every row. A background thread keeps up to `prefetch` batches ready; the state
  always describes the batches handed out, not the ones prefetched. ``global_rows`` is the
  global batch (default: ``rows``' stop); :meth:`set_position` takes this iterator's rows from a
  position of the whole batch.
  """

  def __init__(
    self,
    lanes: list[Lane],
    rows: tuple[int, int],
    prefetch: int,
    streams: int = 1,
    global_rows: int | None = None,
  ):
    super().__init__()
    self._rows, self._prefetch, self._streams = list(rows), int(prefetch), int(streams)
    self._global_rows = int(rows[1] if global_rows is None else global_rows)
    if len(lanes) != (rows[1] - rows[0]) * self._streams:
      raise ValueError(f"{len(lanes)} lanes for rows {rows} and {streams} streams per row.")
    self._lanes = lanes
    self._state = self._snapshot(0)
    self._thread = None
    self._queue = None
    self._stop = None

  def _snapshot(self, batches: int) -> dict:
    return {"rows": list(self._rows), "batches": batches, "lanes": [l.state() for l in self._lanes]}

  def _produce(self) -> tuple[dict[str, np.ndarray], dict]:
    stream = self._produced % self._streams
    batch = _stack([lane.window() for lane in self._lanes[stream :: self._streams]])
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
      self._thread = threading.Thread(
        target=self._worker, args=(self._stop, self._queue), daemon=True
      )
      self._thread.start()
      _PREFETCHING.add(self)

  def _halt(self) -> None:
    if self._thread is not None:
      self._stop.set()
      self._thread.join()
      self._thread = None
      _PREFETCHING.discard(self)

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
        f"{self._rows}: resume with the same number of processes as the run that saved it."
      )
    if len(state["lanes"]) != len(self._lanes):
      saved = len(state["lanes"]) // max(self._rows[1] - self._rows[0], 1)
      raise ValueError(
        f"The saved data position has {saved} streams per row, but this run reads "
        f"{self._streams}: resume with the data settings that saved it (data.streams_per_row)."
      )
    self._halt()
    for lane, s in zip(self._lanes, state["lanes"]):
      lane.set_state(s)
    self._state = _copy_state(state)
    self._produced = self._state["batches"]

  @property
  def rows(self) -> tuple[int, int]:
    """The rows ``[start, stop)`` of the global batch this iterator reads."""
    return self._rows[0], self._rows[1]

  @property
  def num_lanes(self) -> int:
    """How many lanes the state lists: the rows times the streams per row."""
    return len(self._lanes)

  def set_position(self, position: dict) -> None:
    """Continues from a global position (:func:`global_position`), taking this iterator's
    rows from it: how a run resumes on another number of processes than saved it.

    Raises ``DataPositionError`` if the position is of another global batch or another
    number of streams per row than this iterator's."""
    start, stop = (int(r) for r in position["rows"])
    if (start, stop) != (0, self._global_rows):
      raise DataPositionError(
        f"The saved data position covers a global batch of {stop - start} rows, but this run "
        f"has global_batch_size={self._global_rows}: resume with global_batch_size="
        f"{stop - start}."
      )
    if len(position["lanes"]) != self._global_rows * self._streams:
      saved = len(position["lanes"]) // max(self._global_rows, 1)
      raise DataPositionError(
        f"The saved data position has {saved} streams per row, but this run reads "
        f"{self._streams}: resume with the data settings that saved it (data.streams_per_row)."
      )
    self.set_state(take_rows(position, tuple(self._rows)))

  def close(self) -> None:
    self._halt()

  def __del__(self):
    try:
      self._halt()
    except Exception:  # interpreter shutdown
      pass
