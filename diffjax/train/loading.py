"""Loading trained models from a ``train.py`` workdir for evaluation and analysis."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from etils import epath
from flax import nnx

from diffjax import arms
from diffjax.model import DecoderLM, ModelConfig
from diffjax.train import checkpoint as ckpt
from diffjax.train.steps import create_model


def _stderr_line(text: str) -> None:
  print(text, file=sys.stderr)


@dataclasses.dataclass
class LoadedRun:
  """A trained model with what its run was: ``config`` is the run config (a dict) the run was
  launched with (its data, sequence length, seed, tokenizer), as saved in the checkpoint;
  ``meta`` is the step's whole ``meta`` item (the configs, and what an imported workdir kept of
  its source)."""

  model: DecoderLM
  model_config: ModelConfig
  config: dict[str, Any]
  step: int
  meta: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)


@contextlib.contextmanager
def _checkpoints(directory: str, no_directory: str) -> Iterator[tuple[Any, Sequence[int]]]:
  """``(manager, steps)`` of the checkpoints in ``directory``, the manager closed on the way out.

  Raises ``FileNotFoundError``: ``no_directory`` when ``directory`` is not one, and a line of its
  own when it holds no finished step.
  """
  if not epath.Path(directory).is_dir():  # local paths and gs:// alike
    raise FileNotFoundError(no_directory)
  manager = ckpt.make_manager(directory, keep=1_000_000, async_save=False)
  try:
    steps = manager.all_steps()
    if not steps:
      raise FileNotFoundError(f"{directory!r} holds no complete checkpoint.")
    yield manager, steps
  finally:
    manager.close()


def _load_step(manager, step: int, model_overrides: dict) -> tuple[DecoderLM, ModelConfig, dict]:
  """The verified model of one step and its meta; ``CorruptCheckpointError`` if unusable."""
  meta = ckpt.read_meta(manager, step)
  # An arm of the user's own is registered by the module the run recorded.
  arms.get(meta["model_config"].get("attention", ""), module=meta.get("arm_module"))
  # Analysis reads blocks one by one: load unscanned unless asked (the layout converts).
  cfg = ModelConfig.from_dict({**meta["model_config"], "scan_layers": False, **model_overrides})
  with nnx.use_eager_sharding(False):
    abstract = nnx.eval_shape(lambda: create_model(cfg, 0))
  graphdef, abstract_state = nnx.split(abstract)
  params = ckpt.restore_params(manager, step, nnx.to_pure_dict(abstract_state))
  state = nnx.State(abstract_state)
  nnx.replace_by_pure_dict(state, params)
  model = nnx.merge(graphdef, state)
  if cfg.v2_mix_steps and step < cfg.v2_mix_steps:
    # A retrofit inside its ramp computes what the trainer computed at this step (the
    # subtraction scaled by step / v2_mix_steps, in float32 as the train and eval steps do).
    model.v2_mix_at = float(np.float32(step) / np.float32(cfg.v2_mix_steps))
  return model, cfg, meta


def load_model(
  workdir: str,
  step: int | None = None,
  *,
  message: Callable[[str], None] | None = None,
  **model_overrides,
) -> tuple[DecoderLM, ModelConfig, int]:
  """Returns ``(model, model_config, step)`` from the checkpoints of ``workdir``.

  The parameters are checked against the digests saved with them. ``step`` defaults
  to the newest checkpoint that reads and verifies; each newer unusable one is skipped
  with one line to ``message`` (default: stderr) and left where it is, since a run may
  still be writing to the workdir. An explicit ``step`` that is unusable raises
  ``CheckpointError``. ``model_overrides`` change settings that do not alter
  parameters (e.g. ``implementation="xla"``).
  """
  run = load_run(workdir, step, message=message, **model_overrides)
  return run.model, run.model_config, run.step


def load_run(
  workdir: str,
  step: int | None = None,
  *,
  message: Callable[[str], None] | None = None,
  **model_overrides,
) -> LoadedRun:
  """:func:`load_model`, with the run config the checkpoint was saved with."""
  message = message or _stderr_line
  directory = os.path.join(workdir, "checkpoints")
  no_directory = f"No checkpoints in {directory!r}: pass the --workdir of a train.py run."
  with _checkpoints(directory, no_directory) as (manager, steps):
    if step is not None and step not in steps:
      raise ValueError(
        f"step={step} is not among the checkpoints of {directory!r}: {sorted(steps)}."
      )
    skipped = []
    for candidate in [step] if step is not None else sorted(steps, reverse=True):
      try:
        model, cfg, meta = _load_step(manager, candidate, model_overrides)
      except ckpt.CorruptCheckpointError as e:
        if step is not None:
          raise
        skipped.append(f"step {candidate} ({e.reason})")
        message(f"{e}; skipping it.")
        continue
      return LoadedRun(model, cfg, dict(meta.get("config") or {}), candidate, meta)
    raise ckpt.CheckpointError(f"No usable checkpoint in {directory!r}: {', '.join(skipped)}.")


# The model settings that fix the parameters' shapes; a run may start from the weights of
# another only when they agree on these.
SHAPE_FIELDS = (
  "attention",
  "vocab_size",
  "d_model",
  "num_layers",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "mlp_dim",
  "mlp_activation",
  "tie_embeddings",
)


# The model settings that change what the same parameters compute: a run started from another's
# weights must agree on these too, unless its checkpoint.init_changes names them (e.g. a
# long-context run with another rope_theta).
FUNCTION_FIELDS = (
  "rope_style",
  "rope_theta",
  "norm_eps",
  "diff_norm_eps",
  "diff_use_norm",
  "diff_fixed_lambda",
  "v2_pairing",
  "v2_lambda",
)


def _function_change(
  workdir: str, saved: dict, now: dict, allowed: Sequence[str]
) -> ckpt.CheckpointError | None:
  """The refusal of the first function setting that differs from the init_from run's."""
  for k in FUNCTION_FIELDS:
    if k in allowed or k not in saved or saved[k] == now.get(k):
      continue
    return ckpt.CheckpointError(
      f"checkpoint.init_from={workdir!r} was trained with model.{k}={saved[k]!r} but this run "
      f"has model.{k}={now.get(k)!r}, which changes what its weights compute: set "
      f"--config.model.{k}={saved[k]!r}, or allow the change with "
      f"--config.checkpoint.init_changes=\"('{k}',)\"."
    )
  return None


def initial_params(
  workdir: str,
  model_cfg: ModelConfig,
  params_target,
  shardings,
  *,
  message: Callable[[str], None] | None = None,
  allowed_changes: Sequence[str] = (),
):
  """The newest verified parameters of the run in ``workdir``, to start another run from.

  Args:
    workdir: a ``train.py`` workdir (its ``checkpoints/``).
    model_cfg: the new run's model; it must agree with the saved one on
      :data:`SHAPE_FIELDS`, and on :data:`FUNCTION_FIELDS` but ``allowed_changes``
      (others, e.g. ``scan_layers``, may change).
    params_target: the new run's parameter tree (arrays or shape structs).
    shardings: the new run's parameter shardings (the parameters are read onto them,
      converting between scanned and unrolled layers if the runs differ).
  Returns:
    ``(params, step)``.
  Raises:
    FileNotFoundError: no checkpoints in ``workdir``.
    CheckpointError: a model of other shapes or of another function, or no step that reads
      and verifies.
  """
  message = message or _stderr_line
  directory = os.path.join(workdir, "checkpoints")
  no_directory = (
    f"checkpoint.init_from={workdir!r} has no checkpoints directory "
    f"{directory!r}; pass the --workdir of a train.py run."
  )
  with _checkpoints(directory, no_directory) as (manager, steps):
    for step in sorted(steps, reverse=True):
      try:
        saved = ckpt.read_meta(manager, step).get("model_config", {})
        now = model_cfg.to_dict()
        diffs = [
          f"{k}: saved {saved.get(k)!r} vs now {now[k]!r}"
          for k in SHAPE_FIELDS
          if saved.get(k, now[k]) != now[k]
        ]
        if diffs:
          fix = "start from a run of the same architecture"
          if saved.get("attention", now["attention"]) != now["attention"]:
            fix = (
              f"train the arm it holds, --config.model.arm={saved['attention']}, at the sizes it "
              "was made with (a workdir written by `python -m diffjax.convert retrofit`: the "
              "train.py command the retrofit printed)"
            )
          if saved.get("vocab_size", now["vocab_size"]) != now["vocab_size"]:
            fix = (
              f"set --config.model.vocab_size={saved['vocab_size']} and train with the tokenizer "
              "that run used (--config.data.tokenizer=<its spec or tokenizer.json>)"
              + (", and the same architecture" if len(diffs) > 1 else "")
            )
          raise ckpt.CheckpointError(
            f"checkpoint.init_from={workdir!r} holds a model of other shapes "
            f"({', '.join(diffs)}); {fix}."
          )
        changed = _function_change(workdir, saved, now, allowed_changes)
        if changed is not None:
          raise changed
        ramp = int(saved.get("v2_mix_steps", 0) or 0)
        if ramp != int(now.get("v2_mix_steps", 0) or 0):
          raise ckpt.CheckpointError(
            f"checkpoint.init_from={workdir!r} was written for v2_mix_steps={ramp} (a DIFF V2 "
            f"retrofit {'mixed in over that many steps' if ramp else 'without a ramp'}); this "
            f"run has v2_mix_steps={now.get('v2_mix_steps', 0)}. Set "
            f"--config.model.v2_mix_steps={ramp}, or the run starts from another function."
          )
        return ckpt.restore_params(manager, step, params_target, shardings), step
      except ckpt.CorruptCheckpointError as e:
        message(f"{e}; trying an older step.")
    raise ckpt.CheckpointError(f"No usable checkpoint in {directory!r} to start from.")
