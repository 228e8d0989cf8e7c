"""Orbax checkpoints holding the train state, the data iterator and the run's configs.

One checkpoint step directory holds three items:
  * ``state``: params, optimizer state, step and RNG (``StandardSave``);
  * ``data``: the grain iterator state, so a resumed run continues with exactly the
    next batch;
  * ``meta``: the model config and the full run config as JSON, plus an ``integrity``
    record: per state leaf its shape, dtype and a 64-bit content digest, a SHA-256 of the
    iterator state of every process, and a SHA-256 of the rest of ``meta``.
Orbax writes each step into a temporary directory and renames it when complete, so
a process killed mid-save leaves the previous complete step as the latest one.

``save`` refuses a state whose floating leaves are not all finite: such a checkpoint
would only make every resume fail again. The leaf digests (:mod:`diffjax.train.digest`)
come from one jitted pass over
the state on its devices; a digest is a sum over elements of a mix of the element's bits
and its index in the whole array, so it does not depend on how the array is sharded (a
checkpoint restored onto another mesh still verifies) and any change to one element
changes it.

Resume order (``restore_newest_good``), newest step first: read ``meta`` and check its
digest, let the caller compare model configs, compare the saved leaf names and shapes
with the target (a changed model or optimizer is the user's to fix: refused, nothing
moved), restore ``state`` into the abstract (optionally sharded) target and the
iterator, then recompute and compare the digests. A step that cannot be read or does not
verify is moved to ``<checkpoints>_quarantine/<step>-<reason>`` beside the checkpoint
directory, where the manager does not look, and the previous step is tried.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any, Callable

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from diffjax.errors import UserError
from diffjax.model import layout
from diffjax.train.digest import (all_processes_agree, dtype_name, named_leaves, per_process, scan,
                                  sha256)

_FORMAT = 1


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


def make_manager(directory: str, *, keep: int, async_save: bool) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
      cleanup_tmp_directories=True)
  return ocp.CheckpointManager(os.path.abspath(directory) if "://" not in directory
                               else directory, options=options,
                               item_names=("state", "data", "meta"))


# --- save ----------------------------------------------------------------------------------------

def save(manager: ocp.CheckpointManager, step: int, state: Any, data_iter, meta: dict,
         *, force: bool = False) -> bool:
  """Saves ``state``, the iterator and ``meta`` (plus their digests) as ``step``.

  Raises ``CheckpointError`` without writing anything if a floating leaf of ``state``
  is not finite. Returns what ``manager.save`` returns (whether a save started).
  """
  names, leaves = named_leaves(state)
  digests, finite = scan(leaves)
  bad = [n for n, ok in zip(names, finite) if not ok]
  if bad:
    latest = manager.latest_step()
    kept = (f"the newest checkpoint, step {latest} in {manager.directory}, is kept"
            if latest is not None else f"{manager.directory} holds no checkpoint yet")
    what = "Parameters" if bad[0].startswith("params") else "The optimizer state"
    verb = "are" if what == "Parameters" else "is"
    more = f" and {len(bad) - 1} more leaves" if len(bad) > 1 else ""
    raise CheckpointError(
        f"{what} at step {step} {verb} not finite ({bad[0]}{more}); not saved; {kept}. "
        "Lower optim.lr or check the data.")
  record = {"format": _FORMAT, "meta": sha256(meta),
            "leaves": {n: [list(np.shape(x)), dtype_name(x), d]
                       for n, x, d in zip(names, leaves, digests)}}
  args = {"state": ocp.args.StandardSave(state)}
  if data_iter is not None:
    record["data"] = per_process(sha256(data_iter.get_state()))
    args["data"] = grain.checkpoint.CheckpointSave(data_iter)
  args["meta"] = ocp.args.JsonSave({**meta, "integrity": record})
  return manager.save(step, args=ocp.args.Composite(**args), force=force)


# --- restore -------------------------------------------------------------------------------------

def _is_abandoned_read_noise(unraisable) -> bool:
  """Reports left behind by a restore that failed part-way (see ``_quiet_abandoned_reads``)."""
  exc = unraisable.exc_value
  if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
    return True
  code = getattr(unraisable.object, "cr_code", None)
  return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


class _AbandonedTaskFilter(logging.Filter):
  """Drops asyncio's reports of Orbax read tasks that a failed restore left behind."""

  def filter(self, record: logging.LogRecord) -> bool:
    text = record.getMessage()
    abandoned = ("Task exception was never retrieved" in text
                 or "Task was destroyed but it is pending" in text)
    return not (abandoned and f"{os.sep}orbax{os.sep}" in text)


def _quiet_abandoned_reads() -> None:
  """Drops the background noise of a failed restore, keeping every other report.

  Orbax runs a restore on a fresh event loop and closes it as soon as one array read
  fails. TensorStore then completes the other reads on its own threads and calls back
  into the closed loop ("RuntimeError: Event loop is closed"); the abandoned read
  coroutines and tasks are collected with their exceptions unretrieved. Python reports
  these through ``sys.unraisablehook`` and the ``asyncio`` logger, possibly much later
  (even at exit), each with a traceback or a whole TensorStore spec, so the filters
  stay installed; they match only those reports.
  """
  asyncio_logger = logging.getLogger("asyncio")
  if not any(isinstance(f, _AbandonedTaskFilter) for f in asyncio_logger.filters):
    asyncio_logger.addFilter(_AbandonedTaskFilter())
  previous = sys.unraisablehook
  if getattr(previous, "_drops_abandoned_reads", False):
    return

  def hook(unraisable):
    if not _is_abandoned_read_noise(unraisable):
      previous(unraisable)

  hook._drops_abandoned_reads = True
  sys.unraisablehook = hook


def _brief(e: BaseException) -> str:
  """One line saying why a read failed, without the TensorStore spec Orbax embeds."""
  chain, c = [], e
  while c is not None and len(chain) < 8:
    chain.append(c)
    c = c.__cause__ or c.__context__
  text = ""
  for c in chain:
    text = str(c).strip().strip("'\"")
    if text and "TensorStore details" not in text:
      break
  text = text.split(" [tensorstore_spec")[0].splitlines()[0] if text else type(e).__name__
  text = re.sub(r' in OCDBT database at local file "[^"]*"', "", text)
  return text if len(text) <= 200 else text[:197] + "..."


def _reason(e: BaseException) -> str:
  text = " ".join(str(c) for c in (e, e.__cause__, e.__context__) if c is not None)
  missing = isinstance(e, (FileNotFoundError, KeyError)) or "NOT_FOUND" in text
  return "missing" if missing else "unreadable"


def _read_meta_and_record(manager: ocp.CheckpointManager, step: int) -> tuple[dict, dict | None]:
  """The step's meta (without the integrity record) and the record (None if absent)."""
  try:
    raw = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  except Exception as e:  # orbax raises several types for unreadable steps
    raise CorruptCheckpointError(manager.directory, step, _reason(e), _brief(e)) from None
  if not isinstance(raw, dict):
    raise CorruptCheckpointError(manager.directory, step, "unreadable",
                                 f"meta holds {type(raw).__name__}, not a JSON object")
  meta = {k: v for k, v in raw.items() if k != "integrity"}
  record = raw.get("integrity")
  if not isinstance(record, dict) or record.get("format") != _FORMAT:
    return meta, None
  if record.get("meta") != sha256(meta):
    raise CorruptCheckpointError(manager.directory, step, "digest-mismatch",
                                 "content digest mismatch in meta")
  return meta, record


def read_meta(manager: ocp.CheckpointManager, step: int) -> dict:
  """The ``meta`` item of ``step`` as given to ``save``; ``CorruptCheckpointError`` if unusable."""
  return _read_meta_and_record(manager, step)[0]


def check_model_config(saved: dict, current: dict, directory) -> None:
  """Refuses to resume when the model changed (parameters would not fit)."""
  diffs = {k: (saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current))
           if saved.get(k) != current.get(k)}
  # Settings that do not change parameters may differ between runs.
  # scan_layers changes the tree's layout only; restore converts it.
  for k in ("implementation", "block_sizes", "interpret", "remat", "dtype", "scan_layers"):
    diffs.pop(k, None)
  if diffs:
    desc = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in diffs.items())
    raise CheckpointError(
        f"The model config differs from the checkpoint in {directory}: {desc}. Use a new "
        "--workdir for a different model, or restore the original settings.")


def _check_structure(manager, step: int, record: dict | None, names: list[str],
                     leaves: list[Any], prefix: str = "") -> None:
  """Refuses a target whose leaves differ from the saved ones (not a corruption)."""
  if record is None:
    return
  saved = {n: v for n, v in record["leaves"].items() if n.startswith(prefix)}
  target = dict(zip(names, leaves))
  only_saved = [n for n in saved if n not in target]
  only_now = [n for n in target if n not in saved]
  reshaped = [f"{n} {tuple(saved[n][0])} vs {tuple(np.shape(x))}" for n, x in target.items()
              if n in saved and tuple(saved[n][0]) != tuple(np.shape(x))]
  if only_saved or only_now or reshaped:
    parts = [f"{label}: {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}"
             for label, items in (("only in the checkpoint", only_saved),
                                  ("only in this run", only_now), ("shape", reshaped)) if items]
    raise CheckpointError(
        f"Checkpoint step {step} in {manager.directory} holds a different model or optimizer "
        f"state ({'; '.join(parts)}), e.g. optim.clip_norm switched on or off. Restore the "
        "original settings, or use a new --workdir.")


def _legacy_structure_error(manager, step: int, e: BaseException) -> CheckpointError | None:
  """For steps without a record: Orbax's refusal of a changed structure, as one line."""
  text = str(e)
  if "tree structures do not match" in text or "is not compatible with the stored shape" in text:
    return CheckpointError(
        f"Checkpoint step {step} in {manager.directory} holds a different model or optimizer "
        f"state ({_brief(e)}), e.g. optim.clip_norm switched on or off. Restore the original "
        "settings, or use a new --workdir.")
  return None


def _verify(manager, step: int, record: dict | None, names: list[str], leaves: list[Any],
            data_iter) -> None:
  """Raises ``CorruptCheckpointError`` unless the restored leaves and iterator match."""
  digests, finite = scan(leaves)
  if record is not None:
    saved = record["leaves"]
    # A leaf restored into another dtype was cast, so its bits cannot match: skip it.
    wrong = [n for n, x, d in zip(names, leaves, digests)
             if saved[n][1] == dtype_name(x) and saved[n][2] != d]
    if wrong:
      more = f" and {len(wrong) - 1} more leaves" if len(wrong) > 1 else ""
      raise CorruptCheckpointError(manager.directory, step, "digest-mismatch",
                                   f"content digest mismatch in {wrong[0]}{more}")
    expected = record.get("data", {}).get(str(jax.process_index()))
    if data_iter is not None and expected is not None and \
        sha256(data_iter.get_state()) != expected:
      raise CorruptCheckpointError(manager.directory, step, "digest-mismatch",
                                   "content digest mismatch in the data iterator state")
  bad = [n for n, ok in zip(names, finite) if not ok]
  if bad:
    raise CorruptCheckpointError(manager.directory, step, "not-finite",
                                 f"{bad[0]} holds non-finite values")


def _sds_stack(xs: list[Any]) -> jax.ShapeDtypeStruct:
  x = xs[0]
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding):
    sharding = jax.sharding.NamedSharding(sharding.mesh,
                                          jax.sharding.PartitionSpec(None, *sharding.spec))
  return jax.ShapeDtypeStruct((len(xs), *x.shape), x.dtype, sharding=sharding)


def _sds_take(x: Any, i: int) -> jax.ShapeDtypeStruct:
  del i
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding):
    sharding = jax.sharding.NamedSharding(sharding.mesh,
                                          jax.sharding.PartitionSpec(*sharding.spec[1:]))
  return jax.ShapeDtypeStruct(tuple(x.shape[1:]), x.dtype, sharding=sharding)


def _saved_layout_target(record: dict | None, target: Any, meta: dict | None = None
                         ) -> tuple[Any, Callable[[Any], Any]]:
  """The restore target in the layer layout the checkpoint was saved in, and the function
  that brings a tree restored in it back to ``target``'s layout.

  A scanned run (stacked ``layers``) and an unscanned one (per-layer ``blocks``) save
  different trees; a checkpoint of either restores into both (see
  :mod:`diffjax.model.layout`).
  """
  want = layout.tree_layout(target)
  if record is not None:
    saved = layout.names_layout(record["leaves"])
  else:  # a step saved before the integrity record: its model config says
    saved = (layout.SCANNED if (meta or {}).get("model_config", {}).get("scan_layers")
             else layout.UNSCANNED)
  if want is None or saved is None or saved == want:
    return target, lambda tree: tree
  n = layout.num_layers_of(target)
  read = layout.convert_layout(target, saved, n, stack=_sds_stack, take=_sds_take)
  shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves(target)]

  def back(tree: Any) -> Any:
    fn = lambda t: layout.convert_layout(t, want, n)
    if all(isinstance(s, jax.sharding.Sharding) for s in shardings):
      out = jax.tree.map(lambda x: x.sharding, target)
      return jax.jit(fn, out_shardings=out)(tree)
    return jax.jit(fn)(tree)

  return read, back


def _restore_checked(manager, step: int, abstract_state: Any, data_iter,
                     check_meta: Callable[[dict], None]) -> tuple[Any, bool]:
  """Restores and verifies one step; returns (state, verified)."""
  meta, record = _read_meta_and_record(manager, step)
  check_meta(meta)
  abstract_state, to_target_layout = _saved_layout_target(record, abstract_state, meta)
  names, abstract_leaves = named_leaves(abstract_state)
  _check_structure(manager, step, record, names, abstract_leaves)
  if data_iter is not None and record is not None and "data" not in record:
    raise CheckpointError(f"Checkpoint step {step} in {manager.directory} was saved without "
                          "a data-iterator state, so the run cannot continue its data from it.")
  args = {"state": ocp.args.StandardRestore(abstract_state)}
  if data_iter is not None:
    args["data"] = grain.checkpoint.CheckpointRestore(data_iter)
  _quiet_abandoned_reads()
  try:
    state = manager.restore(step, args=ocp.args.Composite(**args))["state"]
  except Exception as e:  # orbax and tensorstore raise several types for damaged files
    legacy = _legacy_structure_error(manager, step, e) if record is None else None
    if legacy is not None:
      raise legacy from None
    raise CorruptCheckpointError(manager.directory, step, _reason(e), _brief(e)) from None
  _verify(manager, step, record, names, named_leaves(state)[1], data_iter)
  return to_target_layout(state), record is not None


def restore(manager: ocp.CheckpointManager, step: int, abstract_state: Any, data_iter) -> Any:
  """Restores and verifies ``step`` into ``abstract_state``; ``data_iter`` is set in place.

  Raises ``CorruptCheckpointError`` if the step cannot be read or does not verify, and
  ``CheckpointError`` if its state has other leaves than the target.
  """
  return _restore_checked(manager, step, abstract_state, data_iter, lambda meta: None)[0]


def quarantine(manager: ocp.CheckpointManager, step: int, reason: str) -> epath.Path:
  """Moves step directory ``step`` out of the manager's sight; returns where it went."""
  directory = epath.Path(manager.directory)
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
  manager.reload()
  return dest


def restore_newest_good(manager: ocp.CheckpointManager, abstract_state: Any, data_iter, *,
                        check_meta: Callable[[dict], None],
                        message: Callable[[str], None]) -> tuple[int | None, Any]:
  """Restores the newest step that reads and verifies, moving unusable newer ones aside.

  ``check_meta(meta)`` runs first for each candidate; a ``CheckpointError`` it raises
  (e.g. a changed model config) propagates and nothing is moved, as does a target whose
  leaves differ from the saved ones. ``data_iter`` (or None) is restored in place.
  ``message`` receives one line per moved step, and one for a step saved without digests.
  Returns ``(None, None)`` if the manager holds no step, else ``(step, state)``; raises
  ``CheckpointError`` if no step is usable (all of them moved aside).
  """
  moved = []
  for step in sorted(manager.all_steps(), reverse=True):
    failure = None
    try:
      state, verified = _restore_checked(manager, step, abstract_state, data_iter, check_meta)
    except CorruptCheckpointError as e:
      failure = e
    if not all_processes_agree(failure is None):
      failure = failure or CorruptCheckpointError(
          manager.directory, step, "unreadable", "another process could not read it")
      dest = quarantine(manager, step, failure.reason)
      moved.append(f"step {step} to {dest} ({failure.reason})")
      message(f"{failure}; moved it to {dest} and trying the previous step.")
      continue
    if not verified:
      message(f"Checkpoint step {step} has no content digest (saved by an older diffjax): "
              "restored unverified.")
    return step, state
  if moved:
    raise CheckpointError(
        f"No usable checkpoint in {manager.directory}: moved {', '.join(moved)}. Rerun to "
        "start from scratch, or move a step back to inspect it.")
  return None, None


def restore_params(manager: ocp.CheckpointManager, step: int, params_target: Any,
                   shardings: Any = None) -> Any:
  """Restores and verifies only the parameters of a step (for evaluation, or to start a
  run from another run's weights).

  ``shardings`` (a tree of shardings like ``params_target``) places them as a sharded
  train state would be; by default they land on the first device. Raises
  ``CorruptCheckpointError`` if they cannot be read or do not verify.
  """
  meta, record = _read_meta_and_record(manager, step)
  if shardings is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: one, params_target)
  placed = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
                        params_target, shardings)
  target, to_target_layout = _saved_layout_target(record, {"params": placed}, meta)
  params_target = target["params"]
  names, leaves = named_leaves({"params": params_target})
  _check_structure(manager, step, record, names, leaves, prefix="params/")
  abstract = params_target
  _quiet_abandoned_reads()
  try:
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
            item={"params": abstract},
            restore_args={"params": jax.tree.map(
                lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), abstract)},
            partial_restore=True)))
  except Exception as e:  # orbax and tensorstore raise several types for damaged files
    legacy = _legacy_structure_error(manager, step, e) if record is None else None
    if legacy is not None:
      raise legacy from None
    raise CorruptCheckpointError(manager.directory, step, _reason(e), _brief(e)) from None
  params = restored["state"]["params"]
  _verify(manager, step, record, names, named_leaves({"params": params})[1], None)
  return to_target_layout({"params": params})["params"]


def abstract_like(state: Any, shardings: Any = None) -> Any:
  if shardings is None:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state, shardings)
