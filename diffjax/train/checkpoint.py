"""Orbax checkpoints holding the train state, the data iterator and the run's configs.

A step holds ``state``, ``data`` (the iterator) and ``meta`` (the configs and the integrity
record); ``save`` refuses a state that is not finite, and ``restore_newest_good`` resumes from
the newest step that verifies. The items and the resume order: docs/training.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from diffjax.errors import require_filesystem
from diffjax.model import ModelConfig, layout
from diffjax.train import integrity
from diffjax.train.digest import all_processes_agree, named_leaves
from diffjax.train.integrity import CheckpointError, CorruptCheckpointError

__all__ = [
  "CheckpointError",
  "CorruptCheckpointError",
  "abstract_like",
  "check_model_config",
  "make_manager",
  "newest_finished_step",
  "quarantine",
  "read_meta",
  "restore",
  "restore_newest_good",
  "restore_params",
  "resume_line",
  "save",
]


def make_manager(directory: str, *, keep: int, async_save: bool) -> ocp.CheckpointManager:
  require_filesystem(directory, "the checkpoint directory")
  options = ocp.CheckpointManagerOptions(
    max_to_keep=keep,
    enable_async_checkpointing=async_save,
    create=True,
    cleanup_tmp_directories=True,
  )
  return ocp.CheckpointManager(
    os.path.abspath(directory) if "://" not in directory else directory,
    options=options,
    item_names=("state", "data", "meta"),
  )


def newest_finished_step(directory) -> int:
  """The newest step under ``directory`` whose save finished, as Orbax judges it (on every
  file system: a renamed directory locally, its commit marker on GCS); -1 when there is none
  or the directory cannot be read."""
  try:
    return max(ocp.path.step.checkpoint_steps(directory), default=-1)
  except (OSError, ValueError):
    return -1


# --- save ----------------------------------------------------------------------------------------


def save(
  manager: ocp.CheckpointManager,
  step: int,
  state: Any,
  data_iter,
  meta: dict,
  *,
  force: bool = False,
) -> bool:
  """Saves ``state``, the iterator and ``meta`` (plus their digests) as ``step``.

  Raises ``CheckpointError`` without writing anything if a floating leaf of ``state``
  is not finite. Returns what ``manager.save`` returns (whether a save started).
  """
  record = integrity.make_record(
    manager.directory, manager.latest_step(), step, state, data_iter, meta
  )
  args = {"state": ocp.args.StandardSave(state)}
  if data_iter is not None:
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
    abandoned = (
      "Task exception was never retrieved" in text or "Task was destroyed but it is pending" in text
    )
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


def _restore_items(
  manager: ocp.CheckpointManager, step: int, items: dict[str, Any], *, pass_interrupts: bool = False
) -> dict[str, Any]:
  """``manager.restore`` of ``step``'s ``items`` (item name: restore args); a step that cannot be
  read raises ``CorruptCheckpointError``. With ``pass_interrupts``, a failure a signal's
  KeyboardInterrupt is behind propagates as it is: not the checkpoint's fault."""
  try:
    return manager.restore(step, args=ocp.args.Composite(**items))
  except Exception as e:  # orbax and tensorstore raise several types for damaged files
    if pass_interrupts and _interrupted(e):
      raise
    raise CorruptCheckpointError(manager.directory, step, _reason(e), _brief(e)) from None


def _read_meta_and_record(manager: ocp.CheckpointManager, step: int) -> tuple[dict, dict]:
  """The step's meta (without the integrity record) and the record."""
  raw = _restore_items(manager, step, {"meta": ocp.args.JsonRestore()})["meta"]
  return integrity.split_meta(manager.directory, step, raw)


def read_meta(manager: ocp.CheckpointManager, step: int) -> dict:
  """The ``meta`` item of ``step`` as given to ``save``.

  Raises ``CorruptCheckpointError`` if it cannot be read or its digest differs, and
  ``CheckpointError`` if the step holds no integrity record.
  """
  return _read_meta_and_record(manager, step)[0]


def check_model_config(saved: dict, current: dict, directory) -> None:
  """Refuses to resume when the model changed (parameters would not fit). A key the saved
  config lacks (a field added since it was written) counts as that field's default."""
  defaults = {
    f.name: f.default
    for f in dataclasses.fields(ModelConfig)
    if f.default is not dataclasses.MISSING
  }
  saved = {**{k: v for k, v in defaults.items() if k in current and k not in saved}, **saved}
  diffs = {
    k: (saved.get(k), current.get(k))
    for k in sorted(set(saved) | set(current))
    if saved.get(k) != current.get(k)
  }
  # Settings that do not change parameters may differ between runs.
  # scan_layers changes the tree's layout only; restore converts it.
  for k in ("implementation", "block_sizes", "interpret", "remat", "dtype", "scan_layers"):
    diffs.pop(k, None)
  if diffs:
    desc = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in diffs.items())
    raise CheckpointError(
      f"The model config differs from the checkpoint in {directory}: {desc}. Use a new "
      "--workdir for a different model, or restore the original settings."
    )


# Run settings that decide which tokens each step reads and which of them it scores: a saved
# data position means nothing under other values, and a run resumed under another loss mask
# (task_mix.loss) or other task examples would be half one run, half another. Not here:
# ``data.paths``, which may move with the corpus unchanged (`check_corpus` compares what they
# hold, whatever the path), and ``data.streams_per_row``, which the data iterator checks (it
# may be lowered for a small split); how batches are fetched (``data.prefetch_batches``) does
# not change them.
DATA_ORDER_KEYS = (
  "seed",
  "seq_len",
  *(
    f"data.{k}"
    for k in (
      "kind",
      "tokenizer",
      "val_fraction",
      "split_seed",
      "max_documents",
      "max_tokens",
      "shuffle",
      "shards_per_group",
    )
  ),
  *(
    f"task_mix.{k}"
    for k in (
      "task",
      "fraction",
      "context_len",
      "num_needles",
      "num_queries",
      "num_pairs",
      "distractors_per_query",
      "key_len",
      "value_len",
      "separator",
      "grid",
      "num_examples",
      "loss",
    )
  ),
)


def setting_differences(
  saved: dict, current: dict, keys, ignore: tuple[str, ...] = ()
) -> list[str]:
  """``"key: saved X vs now Y"`` for each of ``keys`` (``"name"`` or ``"section.name"``; one
  naming a dict is compared key by key) whose value differs between two run configs as JSON. A
  key the saved config lacks is not compared, nor one in ``ignore``."""

  def flat(config: dict) -> dict:
    out = {}
    for key in keys:
      section, _, name = key.rpartition(".")
      holder = (config.get(section) or {}) if section else config
      if name in holder:
        value = holder[name]
        out.update(
          {f"{key}.{k}": v for k, v in value.items()} if isinstance(value, dict) else {key: value}
        )
    return {k: v for k, v in out.items() if k not in ignore}

  old, new = flat(saved), flat(current)
  return [f"{k}: saved {v!r} vs now {new.get(k)!r}" for k, v in old.items() if v != new.get(k)]


def check_data_order(saved: dict, current: dict, directory) -> None:
  """Refuses to resume when a setting of :data:`DATA_ORDER_KEYS` changed (``saved`` and
  ``current``: run configs as JSON); a key the saved config lacks is not compared."""
  diffs = setting_differences(saved, current, DATA_ORDER_KEYS)
  if diffs:
    raise CheckpointError(
      f"The data settings differ from the checkpoint in {directory}: {', '.join(diffs)}. The "
      "saved data position is only valid with the settings that saved it: restore them, or "
      "start a new --workdir (checkpoint.init_from naming this run takes its weights)."
    )


def check_corpus(saved: dict | None, current: dict, directory) -> None:
  """Refuses to resume on a corpus other than the one the saved data position belongs to
  (``saved``, ``current``: :meth:`diffjax.data.Datasets.identity`, compared on the keys both
  have; a checkpoint saved without one is not compared): its files were changed, added or
  removed since."""
  if not saved or all(saved[k] == current[k] for k in saved.keys() & current.keys()):
    return

  def described(ident: dict) -> str:
    digests = ", ".join(f"{k} {ident[k]}" for k in ("sha256", "content") if k in ident)
    return f"{ident['documents']:,} documents of {ident['tokens']:,} tokens (digests {digests})"

  raise CheckpointError(
    f"The corpus is not the one the checkpoint in {directory} was trained on: saved "
    f"{described(saved)}, now {described(current)}; its files changed since. The saved data "
    "position would read other tokens: restore the files, or start a new --workdir "
    "(checkpoint.init_from naming this run takes its weights)."
  )


def _sds_reshaped(
  x: Any, shape: tuple[int, ...], spec: Callable[[Any], tuple]
) -> jax.ShapeDtypeStruct:
  """A ``ShapeDtypeStruct`` of ``x``'s dtype and sharding with ``shape``; a named sharding keeps
  its mesh and gets the partition spec ``spec(x's spec)``."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding):
    sharding = jax.sharding.NamedSharding(
      sharding.mesh, jax.sharding.PartitionSpec(*spec(sharding.spec))
    )
  return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)


def _sds_stack(xs: list[Any]) -> jax.ShapeDtypeStruct:
  x = xs[0]
  return _sds_reshaped(x, (len(xs), *x.shape), lambda spec: (None, *spec))


def _sds_take(x: Any, i: int) -> jax.ShapeDtypeStruct:
  del i
  return _sds_reshaped(x, tuple(x.shape[1:]), lambda spec: spec[1:])


def _saved_layout_target(record: dict, target: Any) -> tuple[Any, Callable[[Any], Any]]:
  """The restore target in the layer layout the checkpoint was saved in, and the function
  that brings a tree restored in it back to ``target``'s layout.

  A scanned run (stacked ``layers``) and an unscanned one (per-layer ``blocks``) save
  different trees; a checkpoint of either restores into both (see
  :mod:`diffjax.model.layout`).
  """
  want = layout.tree_layout(target)
  saved = layout.names_layout(record["leaves"])
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


def _data_state_path(manager: ocp.CheckpointManager, step: int, index: int, count: int):
  """Where process ``index`` of the ``count`` that saved ``step`` wrote its iterator state (the
  file name grain's checkpoint handler gives it)."""
  step_dir = ocp.path.step.find_step_path(
    manager.directory, ocp.path.step.standard_name_format(), step=step
  )
  return step_dir / "data" / f"process_{index}-of-{count}.json"


def _read_data_states(manager: ocp.CheckpointManager, step: int, count: int) -> dict[int, Any]:
  """The iterator states that the ``count`` processes which saved ``step`` wrote, by process
  index (a missing file is left out: the integrity check names it)."""
  states = {}
  for i in range(count):
    path = _data_state_path(manager, step, i, count)
    try:
      text = path.read_text()
    except FileNotFoundError:
      continue
    try:
      states[i] = json.loads(text)
    except ValueError as e:
      raise CorruptCheckpointError(
        manager.directory, step, "unreadable", f"{path.name}: {e}"
      ) from None
  return states


def _reads_saved_rows(manager, step: int, count: int, data_iter) -> bool:
  """Whether this process's saved iterator state is of the rows ``data_iter`` reads, with as
  many streams per row (True for an iterator without rows, or a state that cannot be read:
  restoring it says why). Otherwise the step takes the global path, which refuses another
  global batch or another number of streams in one line."""
  rows = getattr(data_iter, "rows", None)
  if rows is None or not hasattr(data_iter, "set_position"):
    return True
  try:
    saved = json.loads(_data_state_path(manager, step, jax.process_index(), count).read_text())
    same_rows = [int(r) for r in saved["rows"]] == list(rows)
    return same_rows and len(saved["lanes"]) == getattr(data_iter, "num_lanes", len(saved["lanes"]))
  except Exception:  # missing or damaged: the restore reports it
    return True


def _restore_global_position(manager, step: int, record: dict, data_iter, saved: int) -> None:
  """Sets ``data_iter`` from the data position of every process that saved ``step`` (a run on
  another number of processes): each saved state is verified against the record, the states
  give the position of the whole batch, and the iterator takes its rows from it."""
  # Loaded here: reading a model's checkpoint needs no data package.
  from diffjax.data.streaming import DataPositionError, global_position  # pylint: disable=import-outside-toplevel

  now = jax.process_count()
  set_position = getattr(data_iter, "set_position", None)
  if set_position is None:
    raise CheckpointError(
      f"Checkpoint step {step} in {manager.directory} was written by "
      f"{_processes(saved)}, and this run's data iterator resumes only on as many (its "
      f"position is per process); run {_processes(saved)}, not {now}."
    )
  states = _read_data_states(manager, step, saved)
  integrity.verify_data_states(manager.directory, step, record, states)
  try:
    set_position(global_position(states, saved))
  except DataPositionError as e:
    raise CheckpointError(
      f"Checkpoint step {step} in {manager.directory} cannot continue its data on "
      f"{_processes(now)}: {e}"
    ) from None


def _processes(n: int) -> str:
  return f"{n} process" if n == 1 else f"{n} processes"


def resume_line(step: int, saved: int, now: int) -> str:
  """The line a run prints that resumed ``step`` from the global data position: on another
  number of processes than saved it, or on as many reading other rows (another mesh)."""
  where = f"on {_processes(now)}" if saved != now else "on as many reading other rows of the batch"
  return (
    f"Resuming step {step} written by {_processes(saved)} {where}: the data position is "
    "global, each process takes its rows from it."
  )


def _restore_checked(
  manager, step: int, abstract_state: Any, data_iter, check_meta: Callable[[dict], None]
) -> tuple[Any, str | None]:
  """Restores and verifies one step; returns the state and, when the iterator continues from
  the global data position, the line that says so."""
  meta, record = _read_meta_and_record(manager, step)
  check_meta(meta)
  abstract_state, to_target_layout = _saved_layout_target(record, abstract_state)
  names, abstract_leaves = named_leaves(abstract_state)
  integrity.check_structure(manager.directory, step, record, names, abstract_leaves)
  if data_iter is not None and "data" not in record:
    raise CheckpointError(
      f"Checkpoint step {step} in {manager.directory} was saved without a data-iterator "
      "state, so a run cannot continue its data from it; start a new --workdir with "
      "checkpoint.init_from naming it to take its weights."
    )
  saved = integrity.saved_processes(record)
  # As many processes as saved the step, each reading the rows it saved: each restores its own
  # iterator state, as grain saved it. Another number of processes (or rows): each reads every
  # process's state after the arrays (global_position).
  own = data_iter if data_iter is not None and saved == jax.process_count() else None
  if own is not None and not _reads_saved_rows(manager, step, saved, own):
    own = None
  args = {"state": ocp.args.StandardRestore(abstract_state)}
  if own is not None:
    args["data"] = grain.checkpoint.CheckpointRestore(own)
  _quiet_abandoned_reads()
  state = _restore_items(manager, step, args, pass_interrupts=True)["state"]
  integrity.verify(manager.directory, step, record, names, named_leaves(state)[1], own)
  line = None
  if data_iter is not None and own is None:
    _restore_global_position(manager, step, record, data_iter, saved)
    line = resume_line(step, saved, jax.process_count())
  return to_target_layout(state), line


def _interrupted(e: BaseException | None) -> bool:
  """Whether a KeyboardInterrupt is behind ``e`` (its causes and contexts)."""
  seen = set()
  while e is not None and id(e) not in seen:
    if isinstance(e, KeyboardInterrupt):
      return True
    seen.add(id(e))
    e = e.__cause__ or e.__context__
  return False


def restore(manager: ocp.CheckpointManager, step: int, abstract_state: Any, data_iter) -> Any:
  """Restores and verifies ``step`` into ``abstract_state``; ``data_iter`` is set in place.

  Raises ``CorruptCheckpointError`` if the step cannot be read or does not verify, and
  ``CheckpointError`` if its state has other leaves than the target.
  """
  return _restore_checked(manager, step, abstract_state, data_iter, lambda meta: None)[0]


def quarantine(manager: ocp.CheckpointManager, step: int, reason: str) -> epath.Path:
  """Moves step directory ``step`` out of the manager's sight; returns where it went."""
  dest = integrity.quarantine(manager.directory, step, reason)
  manager.reload()
  return dest


def restore_newest_good(
  manager: ocp.CheckpointManager,
  abstract_state: Any,
  data_iter,
  *,
  check_meta: Callable[[dict], None],
  message: Callable[[str], None],
) -> tuple[int | None, Any]:
  """Restores the newest step that reads and verifies, moving unusable newer ones aside.

  ``check_meta(meta)`` runs first for each candidate; a ``CheckpointError`` it raises
  (e.g. a changed model config) propagates and nothing is moved, as does a target whose
  leaves differ from the saved ones. ``data_iter`` (or None) is restored in place.
  ``message`` receives one line per moved step, and one saying so when the iterator continues
  from the global data position (a step saved by another number of processes, or by as many
  reading other rows). A step without an integrity record is refused (``CheckpointError``),
  nothing moved.
  Returns ``(None, None)`` if the manager holds no step, else ``(step, state)``; raises
  ``CheckpointError`` if no step is usable (all of them moved aside).
  """
  moved = []
  for step in sorted(manager.all_steps(), reverse=True):
    failure = None
    line = None
    try:
      state, line = _restore_checked(manager, step, abstract_state, data_iter, check_meta)
    except CorruptCheckpointError as e:
      failure = e
    if not all_processes_agree(failure is None):
      failure = failure or CorruptCheckpointError(
        manager.directory, step, "unreadable", "another process could not read it"
      )
      dest = quarantine(manager, step, failure.reason)
      moved.append(f"step {step} to {dest} ({failure.reason})")
      message(f"{failure}; moved it to {dest} and trying the previous step.")
      continue
    if line is not None:
      message(line)
    return step, state
  if moved:
    raise CheckpointError(
      f"No usable checkpoint in {manager.directory}: moved {', '.join(moved)}. Rerun to "
      "start from scratch, or move a step back to inspect it."
    )
  return None, None


def restore_params(
  manager: ocp.CheckpointManager, step: int, params_target: Any, shardings: Any = None
) -> Any:
  """Restores and verifies only the parameters of a step (for evaluation, or to start a
  run from another run's weights).

  ``shardings`` (a tree of shardings like ``params_target``) places them as a sharded
  train state would be; by default they land on the first device. Raises
  ``CorruptCheckpointError`` if they cannot be read or do not verify.
  """
  _, record = _read_meta_and_record(manager, step)
  if shardings is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: one, params_target)
  placed = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), params_target, shardings
  )
  target, to_target_layout = _saved_layout_target(record, {"params": placed})
  params_target = target["params"]
  names, leaves = named_leaves({"params": params_target})
  integrity.check_structure(manager.directory, step, record, names, leaves, prefix="params/")
  restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), params_target)
  state_args = ocp.args.PyTreeRestore(
    item={"params": params_target}, restore_args={"params": restore_args}, partial_restore=True
  )
  _quiet_abandoned_reads()
  params = _restore_items(manager, step, {"state": state_args})["state"]["params"]
  integrity.verify(
    manager.directory, step, record, names, named_leaves({"params": params})[1], None
  )
  return to_target_layout({"params": params})["params"]


def abstract_like(state: Any, shardings: Any = None) -> Any:
  if shardings is None:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
  )
