"""The "probes" section: the clamp probe, the loss and retrieval accuracy change when the
negative entries of the combined map (A1 - lambda A2) are set to zero."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from diffjax.eval.registry import DESCRIPTIVE, Section
from diffjax.eval.runner import ModelRunner
from diffjax.eval.scoring import retrieval_accuracy, validation_loss
from diffjax.eval.sections.context import Context


def clamp_probe(
  runner: ModelRunner, val_batches: Sequence[Any], task, num_examples: int, batch_size: int = 8
) -> dict[str, Any]:
  """Clamp negative entries of the combined map to zero (the "signed weights" falsifier).

  Both runs use the reference path, so the deltas isolate the clamp. For the Transformer the
  map has no negative entries and the deltas are 0 (a sanity check).
  Returns {"loss", "loss_clamped", "loss_delta", "accuracy", "accuracy_clamped",
  "accuracy_delta"}.
  """
  base = runner.knob_fn()
  clamped = runner.knob_fn(knobs={"clamp": 1})
  l0, l1 = validation_loss(base, val_batches)["loss"], validation_loss(clamped, val_batches)["loss"]
  a0 = retrieval_accuracy(base, task, num_examples, batch_size)["accuracy"]
  a1 = retrieval_accuracy(clamped, task, num_examples, batch_size)["accuracy"]
  return {
    "loss": l0,
    "loss_clamped": l1,
    "loss_delta": l1 - l0,
    "accuracy": a0,
    "accuracy_clamped": a1,
    "accuracy_delta": a1 - a0,
  }


def run(context: Context) -> dict[str, Any]:
  return clamp_probe(
    context.runner,
    context.val_batches,
    context.standard_task,
    context.standard_examples,
    context.config.batch_size,
  )


def scalars(result: Mapping[str, Any]) -> dict[str, float]:
  return {
    "probe/clamp_loss_delta": result["loss_delta"],
    "probe/clamp_accuracy_delta": result["accuracy_delta"],
  }


SECTION = Section(
  name="probes",
  run=run,
  scalars=scalars,
  directions={"probe/clamp_*": DESCRIPTIVE},
  needs_validation=True,
)
