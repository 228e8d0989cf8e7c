"""Orbax checkpoints holding the train state, the data iterator and the run's configs.

One checkpoint step directory holds three items:
  * ``state``: params, optimizer state, step and RNG (``StandardSave``);
  * ``data``: the grain iterator state, so a resumed run continues with exactly the
    next batch;
  * ``meta``: the model config and the full run config as JSON.
Orbax writes each step into a temporary directory and renames it when complete, so
a process killed mid-save leaves the previous complete step as the latest one.
Resume order: read ``meta`` and compare model configs, then restore ``state`` into
the abstract (optionally sharded) target, then the iterator.
"""

from __future__ import annotations

import json
import os
from typing import Any

import grain
from etils import epath
import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
  """A checkpoint cannot be used for this run."""


def make_manager(directory: str, *, keep: int, async_save: bool) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
      cleanup_tmp_directories=True)
  return ocp.CheckpointManager(os.path.abspath(directory) if "://" not in directory
                               else directory, options=options,
                               item_names=("state", "data", "meta"))


def save(manager: ocp.CheckpointManager, step: int, state: Any, data_iter, meta: dict,
         *, force: bool = False) -> bool:
  args = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
  if data_iter is not None:
    args["data"] = grain.checkpoint.CheckpointSave(data_iter)
  return manager.save(step, args=ocp.args.Composite(**args), force=force)


def read_meta(manager: ocp.CheckpointManager, step: int) -> dict:
  try:
    restored = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
  except Exception as e:  # orbax raises several types for unreadable steps
    raise CheckpointError(
        f"Checkpoint step {step} in {manager.directory} cannot be read ({type(e).__name__}: "
        f"{e}). Move that step directory aside to resume from an earlier one.") from e
  return restored["meta"]


def check_model_config(saved: dict, current: dict, directory) -> None:
  """Refuses to resume when the model changed (parameters would not fit)."""
  diffs = {k: (saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current))
           if saved.get(k) != current.get(k)}
  # Settings that do not change parameters may differ between runs.
  for k in ("implementation", "block_sizes", "interpret", "remat", "dtype"):
    diffs.pop(k, None)
  if diffs:
    desc = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in diffs.items())
    raise CheckpointError(
        f"The model config differs from the checkpoint in {directory}: {desc}. Use a new "
        "--workdir for a different model, or restore the original settings.")


def restore(manager: ocp.CheckpointManager, step: int, abstract_state: Any, data_iter) -> Any:
  args = {"state": ocp.args.StandardRestore(abstract_state)}
  if data_iter is not None:
    args["data"] = grain.checkpoint.CheckpointRestore(data_iter)
  try:
    restored = manager.restore(step, args=ocp.args.Composite(**args))
  except Exception as e:
    raise CheckpointError(
        f"Restoring step {step} from {manager.directory} failed ({type(e).__name__}: {e}). "
        "The checkpoint may be corrupt, or written with a different model or optimizer "
        "structure (e.g. optim.clip_norm switched on or off); move that step directory aside "
        "to resume from an earlier one, or use a new --workdir.") from e
  return restored["state"]


def restore_params(manager: ocp.CheckpointManager, step: int, params_target: Any) -> Any:
  """Restores only the parameters of a step (for evaluation), as plain arrays."""
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, params_target)
  try:
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
            item={"params": abstract},
            restore_args={"params": jax.tree.map(lambda _: ocp.ArrayRestoreArgs(
                sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])), abstract)},
            partial_restore=True)))
  except Exception as e:
    raise CheckpointError(
        f"Reading the parameters of step {step} from {manager.directory} failed "
        f"({type(e).__name__}: {e}).") from e
  return restored["state"]["params"]


def abstract_like(state: Any, shardings: Any = None) -> Any:
  if shardings is None:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state, shardings)


def write_json(path: str, obj: dict) -> None:
  """Writes JSON to a local path or a cloud URI (gs://...)."""
  epath.Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
