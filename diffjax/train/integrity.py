"""The integrity record of a checkpoint step, its checks on restore, and the quarantine.

A step that cannot be read or does not verify raises :class:`CorruptCheckpointError`; the
caller moves it to ``<checkpoints>_quarantine/<step>-<reason>`` (:func:`quarantine`), where
the manager does not look. What the record holds and the order of the checks: docs/training.md.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from etils import epath

from diffjax.errors import UserError
from diffjax.train.digest import dtype_name, named_leaves, per_process, scan, sha256

__all__ = [
  "FORMAT",
  "CheckpointError",
  "CorruptCheckpointError",
  "check_structure",
  "make_record",
  "quarantine",
  "saved_processes",
  "split_meta",
  "verify",
  "verify_data_states",
]

FORMAT = 1


class CheckpointError(UserError, RuntimeError):
  """A checkpoint cannot be used for this run."""


class CorruptCheckpointError(CheckpointError):
  """A checkpoint step cannot be read, or its content differs from what was saved.

  ``step`` is the step, ``reason`` a short tag (``missing``, ``unreadable``,
  ``digest-mismatch``, ``not-finite``) and ``detail`` one line saying what was seen.
  """

  def __init__(self, directory, step: int, reason: str, detail: str):
    super().__init__(f"Checkpoint step {step} in {directory} is unusable ({detail})")
    self.step, self.reason, self.detail = step, reason, detail


def make_record(
  directory, latest: int | None, step: int, state: Any, data_iter, meta: dict
) -> dict:
  """The integrity record of ``state``, the iterator (or None) and ``meta``.

  Raises ``CheckpointError`` if a floating leaf of ``state`` is not finite: such a
  checkpoint would only make every resume fail again. ``latest`` is the newest step
  already in ``directory`` (None if none), which the message says is kept.
  """
  names, leaves = named_leaves(state)
  digests, finite = scan(leaves)
  bad = [n for n, ok in zip(names, finite) if not ok]
  if bad:
    kept = (
      f"the newest checkpoint, step {latest} in {directory}, is kept"
      if latest is not None
      else f"{directory} holds no checkpoint yet"
    )
    what = "Parameters" if bad[0].startswith("params") else "The optimizer state"
    verb = "are" if what == "Parameters" else "is"
    more = f" and {len(bad) - 1} more leaves" if len(bad) > 1 else ""
    raise CheckpointError(
      f"{what} at step {step} {verb} not finite ({bad[0]}{more}); not saved; {kept}. "
      "Lower optim.lr or check the data."
    )
  record = {
    "format": FORMAT,
    "meta": sha256(meta),
    "leaves": {n: [list(np.shape(x)), dtype_name(x), d] for n, x, d in zip(names, leaves, digests)},
  }
  if data_iter is not None:
    record["data"] = per_process(sha256(data_iter.get_state()))
  return record


def split_meta(directory, step: int, raw: Any) -> tuple[dict, dict]:
  """The step's ``meta`` as given to ``save`` and its integrity record, from the stored item.

  Raises ``CorruptCheckpointError`` if the item is not a JSON object or its digest differs,
  and ``CheckpointError`` if it holds no record of this format.
  """
  if not isinstance(raw, dict):
    raise CorruptCheckpointError(
      directory, step, "unreadable", f"meta holds {type(raw).__name__}, not a JSON object"
    )
  meta = {k: v for k, v in raw.items() if k != "integrity"}
  record = raw.get("integrity")
  seen = record.get("format") if isinstance(record, dict) else None
  if seen != FORMAT:
    found = "no integrity record" if record is None else f"integrity record format {seen!r}"
    raise CheckpointError(
      f"Checkpoint step {step} in {directory} has {found}; diffjax saves format {FORMAT} "
      "and restores only steps it can verify. Move the step out of that directory to resume "
      "from the one before it, or use a new --workdir."
    )
  if record.get("meta") != sha256(meta):
    raise CorruptCheckpointError(
      directory, step, "digest-mismatch", "content digest mismatch in meta"
    )
  return meta, record


def check_structure(
  directory, step: int, record: dict, names: list[str], leaves: list[Any], prefix: str = ""
) -> None:
  """Refuses a target whose leaves differ from the saved ones (not a corruption)."""
  saved = {n: v for n, v in record["leaves"].items() if n.startswith(prefix)}
  target = dict(zip(names, leaves))
  only_saved = [n for n in saved if n not in target]
  only_now = [n for n in target if n not in saved]
  reshaped = [
    f"{n} {tuple(saved[n][0])} vs {tuple(np.shape(x))}"
    for n, x in target.items()
    if n in saved and tuple(saved[n][0]) != tuple(np.shape(x))
  ]
  if only_saved or only_now or reshaped:
    parts = [
      f"{label}: {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}"
      for label, items in (
        ("only in the checkpoint", only_saved),
        ("only in this run", only_now),
        ("shape", reshaped),
      )
      if items
    ]
    raise CheckpointError(
      f"Checkpoint step {step} in {directory} holds a different model or optimizer "
      f"state ({'; '.join(parts)}), e.g. optim.clip_norm switched on or off. Restore the "
      "original settings, or use a new --workdir."
    )


def verify(
  directory, step: int, record: dict, names: list[str], leaves: list[Any], data_iter
) -> None:
  """Raises ``CorruptCheckpointError`` unless the restored leaves and iterator match."""
  digests, finite = scan(leaves)
  saved = record["leaves"]
  # A leaf restored into another dtype was cast, so its bits cannot match: skip it.
  wrong = [
    n
    for n, x, d in zip(names, leaves, digests)
    if saved[n][1] == dtype_name(x) and saved[n][2] != d
  ]
  if wrong:
    more = f" and {len(wrong) - 1} more leaves" if len(wrong) > 1 else ""
    raise CorruptCheckpointError(
      directory, step, "digest-mismatch", f"content digest mismatch in {wrong[0]}{more}"
    )
  # ``data_iter`` was restored from this process's own state (as many processes as saved the
  # step); a position assembled from every process's state is checked by verify_data_states.
  if data_iter is not None:
    expected = record.get("data", {}).get(str(jax.process_index()))
    if expected is None:
      raise CorruptCheckpointError(
        directory, step, "digest-mismatch", "no digest of this process's data iterator state"
      )
    if sha256(data_iter.get_state()) != expected:
      raise CorruptCheckpointError(
        directory, step, "digest-mismatch", "content digest mismatch in the data iterator state"
      )
  bad = [n for n, ok in zip(names, finite) if not ok]
  if bad:
    raise CorruptCheckpointError(directory, step, "not-finite", f"{bad[0]} holds non-finite values")


def saved_processes(record: dict) -> int:
  """How many processes saved the step's data iterator states (0: none saved)."""
  return len(record.get("data", {}))


def verify_data_states(directory, step: int, record: dict, states: dict[int, Any]) -> None:
  """Raises ``CorruptCheckpointError`` unless ``states`` holds the iterator state of every
  process that saved the step, each matching its digest in the record."""
  digests = record.get("data", {})
  missing = [i for i in range(len(digests)) if i not in states]
  if missing:
    raise CorruptCheckpointError(
      directory, step, "missing", f"no data iterator state of process {missing[0]}"
    )
  for i in sorted(states):
    if digests.get(str(i)) != sha256(states[i]):
      raise CorruptCheckpointError(
        directory,
        step,
        "digest-mismatch",
        f"content digest mismatch in the data iterator state of process {i}",
      )


def quarantine(directory, step: int, reason: str) -> epath.Path:
  """Moves step directory ``step`` of ``directory`` beside it, out of a manager's sight (the
  caller reloads its manager); returns where it went."""
  directory = epath.Path(directory)
  root = directory.parent / f"{directory.name}_quarantine"
  dest, n = root / f"{step}-{reason}", 1
  while dest.exists():
    dest, n = root / f"{step}-{reason}-{n}", n + 1
  if jax.process_index() == 0:
    root.mkdir(parents=True, exist_ok=True)
    (directory / str(step)).rename(dest)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    multihost_utils.sync_global_devices(f"diffjax_quarantine_{step}")
  return dest
