"""Running lm-eval tasks on a :class:`~diffjax.eval.harness.model.DiffjaxLM`, offline.

Tasks are the harness's own or YAML files given with ``include_path``; nothing is downloaded
(``HF_DATASETS_OFFLINE=1`` unless set): docs/evaluation.md#lm-evaluation-harness-tasks.
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
from lm_eval.utils import simple_parse_args_string

from diffjax.eval.harness.model import DiffjaxLM, generation_options


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


def _generation_checked(loaded: Mapping[str, Any], gen_kwargs: Mapping[str, Any] | None) -> None:
  """Every generation task's options (with ``gen_kwargs`` over them) are ones the model reads."""
  for name, task in (loaded.get("tasks") or {}).items():
    if task.get_config("output_type") == "generate_until":
      options = dict(task.get_config("generation_kwargs") or {})
      generation_options({**options, **(gen_kwargs or {})}, task=name)


def parse_gen_kwargs(gen_kwargs: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
  """lm-eval's ``--gen_kwargs`` form (``"temperature=0,top_p=0.9"``) or a dict, as a dict."""
  if gen_kwargs is None or isinstance(gen_kwargs, Mapping):
    return dict(gen_kwargs) if gen_kwargs else None
  bad = [piece for piece in gen_kwargs.split(",") if piece.strip() and "=" not in piece]
  if bad:
    raise ValueError(
      f"gen_kwargs={gen_kwargs!r}: {bad[0]!r} is not KEY=VALUE; write e.g. "
      "--gen_kwargs=max_new_tokens=32,temperature=0."
    )
  parsed = simple_parse_args_string(gen_kwargs)
  return parsed or None


def check_task_data(
  tasks: Sequence[str],
  include_path: str | Sequence[str] | None = None,
  gen_kwargs: Mapping[str, Any] | None = None,
) -> list[str]:
  """Loads each of ``tasks`` (with its data) before any model is: a task whose dataset is not
  available offline is one clear error naming the dataset and how to give a local copy, and
  so is a generation option the model cannot honour (``gen_kwargs`` over the task's own).

  Returns the task names (as :func:`check_tasks`).
  """
  import datasets  # pylint: disable=import-outside-toplevel

  manager = task_manager(include_path, tasks)
  names = check_tasks(list(tasks), manager)
  for name in names:
    try:
      loaded = manager.load([name])
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
    _generation_checked(loaded, gen_kwargs)
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
  gen_kwargs: str | Mapping[str, Any] | None = None,
  predict_only: bool = False,
  use_cache: str | None = None,
  evaluation_tracker=None,
  model_args: Mapping[str, Any] | None = None,
  checked: bool = False,
) -> dict[str, Any]:
  """The harness's results dict (``results``, ``configs``, ``versions``, ...) of ``tasks``.

  ``gen_kwargs`` (lm-eval's ``--gen_kwargs``) update every generation task's options;
  ``predict_only`` keeps the outputs (``samples``) and computes no metric; ``use_cache`` is
  the path prefix of lm-eval's SQLite cache of model answers (``<use_cache>_rank0.db``: a
  rerun answers the requests it holds without the model); ``evaluation_tracker`` (an
  ``lm_eval.loggers.EvaluationTracker``) records the run for its output files. Every
  generation option is checked before any request runs (``checked``: already done by
  :func:`check_task_data`).
  """
  manager = task_manager(include_path, tasks)
  names = check_tasks(list(tasks), manager)
  gen_kwargs = parse_gen_kwargs(gen_kwargs)
  if not checked:
    _generation_checked(manager.load(names), gen_kwargs)
  results = evaluator.simple_evaluate(
    model=lm,
    model_args=dict(model_args or {}),
    tasks=names,
    num_fewshot=num_fewshot,
    limit=limit,
    task_manager=manager,
    log_samples=log_samples or predict_only,
    bootstrap_iters=0 if predict_only else bootstrap_iters,
    gen_kwargs=gen_kwargs,
    predict_only=predict_only,
    use_cache=use_cache,
    evaluation_tracker=evaluation_tracker,
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
