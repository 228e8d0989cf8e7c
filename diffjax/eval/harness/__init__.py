"""lm-evaluation-harness scores for diffjax models, every arm, offline.

:class:`DiffjaxLM` (the harness's ``"diffjax"`` model) and :func:`run_tasks` need the
``[harness]`` extra and load on first use (docs/evaluation.md#lm-evaluation-harness-tasks).
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
