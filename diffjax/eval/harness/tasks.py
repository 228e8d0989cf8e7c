"""Running lm-eval tasks on a :class:`~diffjax.eval.harness.model.DiffjaxLM`, offline.

Tasks are the harness's own (found in its task index) or YAML files and directories given
with ``include_path``. Nothing is downloaded here: a task whose data is not in the local
datasets cache fails with the datasets library's error. Set ``HF_DATASETS_OFFLINE=1`` (this
module sets it unless it is set) and point a task's ``dataset_path: json`` with
``dataset_kwargs.data_files`` at local files, as the fixture tasks in ``tests/fixtures/harness``
do.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The harness's bootstrap forks worker processes unless this is set; forking a process that
# runs JAX's threads can deadlock.
os.environ.setdefault("DISABLE_MULTIPROC", "1")

# pylint: disable=wrong-import-position
from lm_eval import evaluator
from lm_eval.tasks import TaskManager

from diffjax.eval.harness.model import DiffjaxLM


@functools.lru_cache(maxsize=8)
def _manager(paths: tuple[str, ...], defaults: bool) -> TaskManager:
  return TaskManager(include_path=list(paths) or None, include_defaults=defaults)


def task_manager(
  include_path: str | Sequence[str] | None = None, tasks: Sequence[str] = ()
) -> TaskManager:
  """The harness's task index with ``include_path`` added, built once per path.

  Indexing the harness's own thousands of task files takes seconds; when every one of
  ``tasks`` is defined under ``include_path``, only that path is indexed.
  """
  paths = (
    []
    if not include_path
    else ([include_path] if isinstance(include_path, str) else list(include_path))
  )
  missing = [p for p in paths if not os.path.exists(p)]
  if missing:
    raise FileNotFoundError(
      f"include_path {missing} does not exist: pass directories or YAML files of task definitions."
    )
  key = tuple(os.path.abspath(p) for p in paths)
  if key and tasks:
    own = _manager(key, False)
    if all(t in set(own.all_tasks) for t in tasks):
      return own
  return _manager(key, True)


def check_tasks(names: Sequence[str], manager: TaskManager) -> list[str]:
  """``names`` as a list; an unknown name (not a task, group or tag) is one clear error."""
  names = [n for n in names if n]
  if not names:
    raise ValueError("no tasks given: pass --tasks=NAME[,NAME...].")
  known = set(manager.all_tasks)
  unknown = [n for n in names if n not in known and not os.path.isfile(n)]
  if unknown:
    raise ValueError(
      f"unknown task(s) {unknown}: not in the harness's index or the "
      "include path; list them with `lm_eval ls tasks`, or pass "
      "--include_path=DIR with their YAML files."
    )
  return names


def _dataset_of(manager: TaskManager, name: str) -> str:
  """The dataset a task reads, as its YAML names it (``path`` or ``path/name``), if it can tell."""
  entry = manager.task_index.get(name)
  try:
    cfg = manager._factory._load_full_config(entry)  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except  # only for the message
    cfg = (entry.cfg if entry is not None else None) or {}
  path, sub = cfg.get("dataset_path"), cfg.get("dataset_name")
  return f"{path!r}" + (f" (subset {sub!r})" if sub else "") if path else "its dataset"


def check_task_data(
  tasks: Sequence[str], include_path: str | Sequence[str] | None = None
) -> list[str]:
  """Loads each of ``tasks`` (with its data) before any model is: a task whose dataset is not
  available offline is one clear error naming the dataset and how to give a local copy.

  Returns the task names (as :func:`check_tasks`).
  """
  import datasets  # pylint: disable=import-outside-toplevel

  manager = task_manager(include_path, tasks)
  names = check_tasks(list(tasks), manager)
  for name in names:
    try:
      manager.load([name])
    except (ConnectionError, FileNotFoundError) as e:
      if isinstance(e, FileNotFoundError) and "dataset" not in str(e).lower():
        raise
      raise ValueError(
        f"task {name!r} reads the dataset {_dataset_of(manager, name)}, which is not in the "
        f"local datasets cache ({datasets.config.HF_DATASETS_CACHE}), and nothing is downloaded "
        "here: copy the dataset into that cache (or point HF_DATASETS_CACHE at a cache that has "
        "it), or give the task as YAML with dataset_path: json and dataset_kwargs.data_files "
        "naming local files (--include_path=DIR; docs/evaluation.md)."
      ) from None
  return names


def run_tasks(
  lm: DiffjaxLM,
  tasks: Sequence[str],
  *,
  include_path=None,
  limit: int | float | None = None,
  num_fewshot: int | None = None,
  seed: int = 1234,
  log_samples: bool = False,
  bootstrap_iters: int = 1000,
) -> dict[str, Any]:
  """The harness's results dict (``results``, ``configs``, ``versions``, ...) of ``tasks``."""
  manager = task_manager(include_path, tasks)
  names = check_tasks(list(tasks), manager)
  results = evaluator.simple_evaluate(
    model=lm,
    tasks=names,
    num_fewshot=num_fewshot,
    limit=limit,
    task_manager=manager,
    log_samples=log_samples,
    bootstrap_iters=bootstrap_iters,
    random_seed=seed,
    numpy_random_seed=seed,
    torch_random_seed=seed,
    fewshot_random_seed=seed,
  )
  if results is None:  # another rank in a multi-process harness run
    return {}
  return dict(results)


def harness_scalars(results: Mapping[str, Any]) -> dict[str, float]:
  """``{"harness/<task>/<metric>": value}`` of every numeric metric (standard errors and the
  example count ``sample_len`` left out), the form the comparison report aggregates over seeds."""
  out = {}
  for task, metrics in sorted((results.get("results") or {}).items()):
    for key, value in metrics.items():
      metric = key.split(",")[0]
      if (
        metric in ("alias", "sample_len")
        or "_stderr" in metric
        or not isinstance(value, (int, float))
      ):
        continue
      if isinstance(value, bool) or (isinstance(value, float) and math.isnan(value)):
        continue
      out[f"harness/{task}/{metric}"] = float(value)
  return out
