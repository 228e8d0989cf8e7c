"""lm-evaluation-harness scores for diffjax models, all three arms, offline.

    python -m diffjax.eval.harness --workdir=runs/default \\
        --include_path=tests/fixtures/harness --tasks=diffjax_fixture_choice [--limit=N]

:class:`DiffjaxLM` (``lm_eval.api.model.TemplateLM``, registered as ``"diffjax"`` in the
harness's model registry when :mod:`diffjax.eval.harness.model` is imported) scores
log-likelihoods through :class:`TokenScorer` (length buckets, one compiled forward each),
rolling perplexity windows the harness's way, and generates with
:func:`diffjax.generation.generate`. :func:`run_tasks` runs tasks; :func:`harness_scalars`
flattens their results for comparison reports. The model and the task runner need the
``[harness]`` extra (lm-eval, without torch); they load on first use, so the scorer and
``--help`` do not.
"""

import importlib

from diffjax.eval.harness.scorer import TokenScorer, length_bucket

_LAZY = {
  "DiffjaxLM": "model",
  "cut_at_stops": "model",
  "run_tasks": "tasks",
  "harness_scalars": "tasks",
  "check_tasks": "tasks",
  "task_manager": "tasks",
}


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
  "DiffjaxLM",
  "TokenScorer",
  "check_tasks",
  "cut_at_stops",
  "harness_scalars",
  "length_bucket",
  "run_tasks",
  "task_manager",
]
