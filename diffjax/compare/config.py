"""The compare config: building it, checking it, and deriving each run's train and eval config.

A compare config holds ``arms``, ``seeds``, one ``base`` run config, and ``eval`` / ``report``
settings. Run (arm, seed k) is ``base`` with ``model.arm`` set to the arm and ``seed = k``: every
arm is resolved from the same baseline by `diffjax.model.resolve_model`, so the arms are matched
(``base.model.v2_match`` says how DIFF V2 is).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from diffjax.arms import BASELINE
from diffjax.arms import names as registered_arms
from diffjax.model import ARMS
from diffjax.train.config import RunConfig

EVAL_MODES = ("quick", "full", "none")


def comparison_config(
  base: ml_collections.ConfigDict, seeds: Sequence[int] = (0, 1), arms: Sequence[str] = ARMS
) -> ml_collections.ConfigDict:
  """A compare config around ``base``, a full run config (its ``model.arm`` is replaced by
  each arm's, its ``seed`` by each seed's); docs/evaluation.md lists the fields."""
  c = ml_collections.ConfigDict()
  c.arms = tuple(arms)
  c.seeds = tuple(int(s) for s in seeds)
  c.workers = 1
  c.base = base
  c.eval = ml_collections.ConfigDict(
    dict(
      mode="quick",
      overrides=ml_collections.ConfigDict(),
      harness_tasks=(),
      harness_include_path="",
      harness_limit=0,
      harness_num_fewshot=0,
      harness_seed=1234,
    )
  )
  c.report = ml_collections.ConfigDict(
    dict(
      baseline=BASELINE,
      confidence=0.95,
      learned_below=0.0,
      learned_window=25,
      title="Matched comparison",
    )
  )
  c.variants = ml_collections.ConfigDict()
  c.allow_divergence = False
  c.sweep = ml_collections.ConfigDict(dict(key="", values=(), scaled=()))
  return c


def variants(config: ml_collections.ConfigDict) -> dict[str, dict[str, Any]]:
  """The comparison's named variants: {name: {"arm", "model"}} (none by default)."""
  raw = config.get("variants", None)
  raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(raw or {})
  return {
    name: {"arm": v.get("arm"), "model": dict(v.get("model") or {})} for name, v in raw.items()
  }


def base_arm(config: ml_collections.ConfigDict, name: str) -> str:
  """The model arm of ``name``: the name itself for the three arms, a variant's ``arm``."""
  return variants(config).get(name, {}).get("arm", name)


def harness_task_names(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The comparison's lm-eval tasks ("a,b" counts as two; none by default)."""
  value = config.eval.get("harness_tasks", ()) or ()
  items = (value,) if isinstance(value, str) else tuple(value)
  return tuple(n.strip() for item in items for n in str(item).split(",") if n.strip())


def arm_names(value: Any) -> tuple[str, ...]:
  """Arm names; "a,b" (how --config.arms=a,b arrives) counts as two."""
  items = (value,) if isinstance(value, str) else tuple(value)
  return tuple(n.strip() for item in items for n in str(item).split(",") if n.strip())


def _tuples(x: Any) -> Any:
  """Lists to tuples, recursively (EvalConfig fields are tuples)."""
  if isinstance(x, (list, tuple)):
    return tuple(_tuples(v) for v in x)
  if isinstance(x, Mapping):
    return {k: _tuples(v) for k, v in x.items()}
  return x


def run_config(config: ml_collections.ConfigDict, arm: str, seed: int) -> ml_collections.ConfigDict:
  """The train config of run (arm, seed): ``base`` with ``model.arm = arm`` and ``seed``."""
  run = copy.deepcopy(config.base)
  variant = variants(config).get(arm)
  with run.unlocked():
    run.model.arm = arm if variant is None else variant["arm"]
    for key, value in (variant or {}).get("model", {}).items():
      run.model[key] = value
    run.seed = int(seed)
    run.log_batch_hash = True
  return run


def _dotted(node: Any, key: str) -> tuple[Any, str]:
  """(the ConfigDict holding ``key``'s last part, that part) inside ``node``; KeyError if absent."""
  parts = key.split(".")
  for part in parts[:-1]:
    node = node[part]
  if parts[-1] not in node:
    raise KeyError(key)
  return node, parts[-1]


def sweep_key(config: ml_collections.ConfigDict) -> str:
  """The swept ``base`` key, or "" without a sweep."""
  sweep = config.get("sweep", None)
  return str(sweep.get("key", "") or "") if sweep is not None else ""


def format_value(value: Any) -> str:
  """A swept value as names and tables show it ("0.003", "1e+30", "8")."""
  return f"{value:g}" if isinstance(value, float) else str(value)


def point_name(key: str, value: Any) -> str:
  """The directory name of one sweep point, e.g. "lr=0.003"."""
  return f"{key.split('.')[-1]}={format_value(value)}"


def sweep_points(
  config: ml_collections.ConfigDict,
) -> list[tuple[str, Any, ml_collections.ConfigDict]]:
  """[(point name, value, the comparison at that value)]: one point per ``sweep.values``, each
  a copy of ``config`` with ``base.<sweep.key>`` set (and each ``sweep.scaled`` key scaled by
  value / the base's own value) and no sweep; [("", None, config)] without a sweep."""
  key = sweep_key(config)
  if not key:
    return [("", None, config)]
  holder, last = _dotted(config.base, key)
  base_value = holder[last]
  points = []
  for value in config.sweep["values"]:
    point = copy.deepcopy(config)
    with point.unlocked():
      h, k = _dotted(point.base, key)
      h[k] = value
      for scaled in config.sweep.get("scaled", ()) or ():
        sh, sk = _dotted(point.base, scaled)
        sh[sk] = float(sh[sk]) * float(value) / float(base_value)
      point.sweep = ml_collections.ConfigDict(dict(key="", values=(), scaled=()))
    points.append((point_name(key, value), value, point))
  return points


def check_sweep(config: ml_collections.ConfigDict) -> None:
  """Refuses a sweep whose key is not in ``base``, whose values are empty, repeated or not
  numbers, or whose scaled keys are missing or cannot scale."""
  key = sweep_key(config)
  if not key:
    return
  try:
    holder, last = _dotted(config.base, key)
  except (KeyError, TypeError, AttributeError):
    raise ValueError(f"sweep.key={key!r} is not a key of base (e.g. 'optim.lr').") from None
  values = tuple(config.sweep.get("values", ()) or ())
  if not values:
    raise ValueError(
      f"sweep.values is empty; give the values of {key}, e.g. --config.sweep.values='(1e-3, 3e-3)'."
    )
  if len(set(values)) != len(values):
    raise ValueError(f"sweep.values={values} repeats a value.")
  bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float))]
  if bad:
    raise ValueError(f"sweep.values={values} must be numbers; got {bad}.")
  for scaled in config.sweep.get("scaled", ()) or ():
    try:
      _dotted(config.base, scaled)
    except (KeyError, TypeError, AttributeError):
      raise ValueError(f"sweep.scaled names {scaled!r}, which is not a key of base.") from None
    if not float(holder[last]):
      raise ValueError(f"sweep.scaled needs base.{key} non-zero (it is the scale's reference).")


def v2_matching(config: ml_collections.ConfigDict) -> str:
  """How the comparison matches DIFF V2 (``base.model.v2_match``)."""
  return str(config.base.model.v2_match)


def run_name(arm: str, seed: int) -> str:
  """The run's directory name under <workdir>/runs."""
  return f"{arm}_seed{seed}"


def eval_config(config: ml_collections.ConfigDict, run: RunConfig):
  """The `EvalConfig` of a run (its resolved run config), or None when ``eval.mode`` is
  "none".

  As in ``python -m diffjax.eval``: quick or full sizes around the run's sequence length; a
  full evaluation uses the trainer's ``eval_batches`` validation batches unless overridden, so
  its val/loss reproduces the trainer's final eval loss.
  """
  from diffjax.eval.config import EvalConfig  # pylint: disable=import-outside-toplevel

  mode = config.eval.mode
  if mode == "none":
    return None
  overrides = _tuples(config.eval.overrides.to_dict())
  if mode == "full" and "val_batches" not in overrides:
    overrides["val_batches"] = run.eval_batches
  make = EvalConfig.quick if mode == "quick" else EvalConfig.full
  return make(run.seq_len, **overrides)


def check_comparison_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first problem; nothing is written before this passes."""
  from diffjax.data import DataConfig  # pylint: disable=import-outside-toplevel

  for key in ("arms", "seeds", "base", "eval", "report"):
    if key not in config:
      raise ValueError(
        f"The compare config has no {key!r}; build it with "
        "diffjax.compare.comparison_config (see configs/compare/tiny.py)."
      )
  arms = _check_arms(config)
  seeds = _check_seeds(config)
  workers = config.get("workers", 1)
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
    raise ValueError(
      f"workers={workers!r} must be a positive integer (runs trained at once; "
      "more than 1 only on a CPU)."
    )
  _check_eval(config)
  if float(config.report.get("learned_below", 0.0)) < 0:
    raise ValueError(f"report.learned_below={config.report.learned_below} must be >= 0 (0: off).")
  if int(config.report.get("learned_window", 25)) < 1:
    raise ValueError(f"report.learned_window={config.report.learned_window} must be >= 1.")
  if not 0.0 < float(config.report.confidence) < 1.0:
    raise ValueError(f"report.confidence={config.report.confidence} must be in (0, 1).")
  try:
    DataConfig.from_dict(config.base.data.to_dict())
  except ValueError as e:
    raise ValueError(f"base.data: {e} Set it with --config.base.data.<key>=<value>.") from e
  check_sweep(config)
  for name, _, point in sweep_points(config):
    for arm in arms:
      try:
        run = RunConfig.from_config(run_config(point, arm, seeds[0]))
      except ValueError as e:
        raise ValueError(
          f"{arm}" + (f" at sweep point {name}" if name else "") + f": {e}"
        ) from None
      try:
        eval_config(point, run)
      except TypeError as e:
        raise ValueError(f"Bad eval.overrides: {e}.") from e


def _check_arms(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The arms, once the variants and the arm names are valid."""
  arms = arm_names(config.arms)
  named = variants(config)
  for name, v in named.items():
    if name in registered_arms():
      raise ValueError(f"variants.{name}: a variant cannot reuse an arm's name; rename it.")
    if v["arm"] not in registered_arms():
      raise ValueError(f"variants.{name}.arm={v['arm']!r} must be one of {registered_arms()}.")
    bad = sorted(set(v["model"]) & {"arm", "size", "v2_match", "unmatched"})
    if bad:
      raise ValueError(
        f"variants.{name}.model sets {bad}: a variant is matched as its arm; "
        "set only other model fields (e.g. v2_pairing)."
      )
  if not arms:
    raise ValueError(f"arms is empty; choose one or more of {registered_arms()}.")
  unknown = [a for a in arms if a not in registered_arms() and a not in named]
  if unknown:
    raise ValueError(
      f"Unknown arm(s) {unknown} in arms={arms}; choose from {registered_arms()} or the "
      f"variants {sorted(named)}."
    )
  if len(set(arms)) != len(arms):
    raise ValueError(f"arms={arms} names an arm twice.")
  return arms


def _check_seeds(config: ml_collections.ConfigDict) -> tuple[Any, ...]:
  seeds = tuple(config.seeds) if not isinstance(config.seeds, (int, str)) else (config.seeds,)
  if not seeds:
    raise ValueError(
      'seeds is empty; give at least one, e.g. --config.seeds="(0, 1)" (two or '
      "more are needed for confidence intervals)."
    )
  bad = [s for s in seeds if isinstance(s, bool) or not isinstance(s, int) or s < 0]
  if bad:
    raise ValueError(f"seeds={seeds} must be non-negative integers; got {bad}.")
  if len(set(seeds)) != len(seeds):
    raise ValueError(f"seeds={seeds} repeats a seed.")
  return seeds


def _check_eval(config: ml_collections.ConfigDict) -> None:
  """The eval mode, the EvalConfig overrides and the lm-eval tasks."""
  from diffjax.eval.config import EvalConfig  # pylint: disable=import-outside-toplevel

  if config.eval.mode not in EVAL_MODES:
    raise ValueError(f"eval.mode={config.eval.mode!r} must be one of {EVAL_MODES}.")
  fields = {f.name for f in dataclasses.fields(EvalConfig)}
  unknown = sorted(set(config.eval.overrides.to_dict()) - fields)
  if unknown:
    raise ValueError(f"Unknown eval.overrides {unknown}; EvalConfig fields are {sorted(fields)}.")
  harness_tasks = harness_task_names(config)
  if harness_tasks:
    if config.eval.mode == "none":
      raise ValueError(
        f"eval.harness_tasks={harness_tasks} needs an evaluation: set "
        "eval.mode to 'quick' or 'full'."
      )
    try:
      from diffjax.eval.harness import check_tasks, task_manager  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise ValueError(f"eval.harness_tasks needs lm-eval: {e}") from e
    check_tasks(
      harness_tasks, task_manager(config.eval.get("harness_include_path") or None, harness_tasks)
    )


def describe_comparison(config: ml_collections.ConfigDict) -> str:
  """The comparison's runs, checked as the command checks them: each arm's model (what it is
  matched to and its parameters), the seeds and the shared run settings."""
  from diffjax.train.config_utils import describe_run  # pylint: disable=import-outside-toplevel

  check_comparison_config(config)
  arms, seeds = arm_names(config.arms), tuple(config.seeds)
  lines = [
    f"{len(arms)} arms x {len(seeds)} seeds {seeds}; DIFF V2 matched by "
    f"{v2_matching(config)} (base.model.v2_match)"
  ]
  for arm in arms:
    lines.append(
      f"[{arm}] " + describe_run(run_config(config, arm, seeds[0])).replace("\n", "\n  ")
    )
  return "\n".join(lines)
