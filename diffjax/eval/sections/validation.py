"""The "validation" section: next-token loss and perplexity on the run's validation batches."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffjax.eval.registry import LOWER_IS_BETTER, Section
from diffjax.eval.scoring import validation_loss
from diffjax.eval.sections.context import Context


def run(context: Context) -> dict[str, Any]:
  """{"loss", "perplexity", "tokens"} of `scoring.validation_loss`."""
  return validation_loss(context.logits_fn, context.val_batches)


def scalars(result: Mapping[str, Any]) -> dict[str, float]:
  return {"val/loss": result["loss"], "val/perplexity": result["perplexity"]}


SECTION = Section(
  name="validation",
  run=run,
  scalars=scalars,
  directions={"val/loss": LOWER_IS_BETTER, "val/perplexity": LOWER_IS_BETTER},
  headline=("val/loss",),
  needs_validation=True,
)
