"""The comparison config: one typed object per comparison (:class:`ComparisonConfig`), the
ConfigDict that config files edit (:func:`comparison_config`) and each run's train config
(:func:`run_config`): docs/evaluation.md#matched-comparisons, "The compare config".
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import ml_collections

from diffjax.arms import names as registered_arms
from diffjax.compare.sections import (
  KIND,
  ComparisonEval,
  ComparisonReport,
  ComparisonSweep,
  Variant,
  eval_config,
  names,
)
from diffjax.data import DataConfig
from diffjax.model import ARMS
from diffjax.train.config import RunConfig
from diffjax.train.sections import Section, field_hints, plain, refuse_unknown, set_config_value

# Keys a comparison config must state (the other keys keep their defaults when it lacks them).
REQUIRED = ("arms", "seeds", "base", "eval", "report")
# Seeds are below this: jax.random.key (and flax's Rngs) keep a seed's low 32 bits without
# 64-bit JAX, so seed k and k + 2**32 would draw the same initial weights.
SEED_LIMIT = 2**32


def arm_names(value: Any) -> tuple[str, ...]:
  """Arm names; "a,b" (how --config.arms=a,b arrives) counts as two."""
  return names(value)


@dataclasses.dataclass(frozen=True)
class ComparisonConfig(Section):
  """One comparison: its arms and seeds, the run they all train, and a section per concern.

  Build it with :meth:`from_config` from a config file's ConfigDict (what the command does), or
  with keywords, where a section may be given as a mapping of its keys. Either way every value
  is checked here, every arm's run at every sweep point included; a bad one raises ValueError
  naming it.
  """

  kind: ClassVar[str] = KIND

  # The arms trained: registered arms (diffjax.arms) or variants; "a,b" counts as two.
  arms: tuple[str, ...] = ARMS
  # Every arm is trained once per seed (base.seed = k); two or more give confidence intervals.
  seeds: tuple[int, ...] = (0, 1)
  # Runs trained at once, each in its own process (more than 1 only on a CPU).
  workers: int = 1
  # The run config every arm trains (configs/default.py's keys); model.arm and seed are each
  # run's own.
  base: ml_collections.ConfigDict = dataclasses.field(kw_only=True)
  eval: ComparisonEval = dataclasses.field(default_factory=ComparisonEval)
  report: ComparisonReport = dataclasses.field(default_factory=ComparisonReport)
  # Named arms beyond the registered ones, {name: Variant}; none by default.
  variants: Mapping[str, Variant] = dataclasses.field(default_factory=dict)
  # A run the trainer stops on non-finite updates is recorded as diverged (a DIVERGED marker,
  # no evaluation) instead of stopping the comparison.
  allow_divergence: bool = False
  sweep: ComparisonSweep = dataclasses.field(default_factory=ComparisonSweep)
  # The JSON of the ConfigDict this was resolved from, as compare_config.json and results.json
  # hold it ("": none; then the JSON of to_config_dict()).
  source_json: str = dataclasses.field(default="", compare=False, repr=False)

  def __post_init__(self):
    # In the order a reader checks a comparison: the arms (and variants), the seeds and the
    # workers; then the sections, base's data, the sweep and every run.
    variants = {
      name: Variant.from_config(name, v) for name, v in plain(self.variants or {}).items()
    }
    object.__setattr__(self, "variants", variants)
    object.__setattr__(self, "arms", self._checked_arms())
    object.__setattr__(self, "seeds", self._checked_seeds())
    workers = self.workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
      raise ValueError(
        f"workers={workers!r} must be a positive integer (runs trained at once; "
        "more than 1 only on a CPU)."
      )
    super().__post_init__()

  def _checked_arms(self) -> tuple[str, ...]:
    arms = arm_names(self.arms)
    if not arms:
      raise ValueError(f"arms is empty; choose one or more of {registered_arms()}.")
    unknown = [a for a in arms if a not in registered_arms() and a not in self.variants]
    if unknown:
      raise ValueError(
        f"Unknown arm(s) {unknown} in arms={arms}; choose from {registered_arms()} or the "
        f"variants {sorted(self.variants)}."
      )
    if len(set(arms)) != len(arms):
      raise ValueError(f"arms={arms} names an arm twice.")
    return arms

  def _checked_seeds(self) -> tuple[int, ...]:
    seeds = self.seeds
    seeds = tuple(seeds) if not isinstance(seeds, (int, str)) else (seeds,)
    if not seeds:
      raise ValueError(
        'seeds is empty; give at least one, e.g. --config.seeds="(0, 1)" (two or '
        "more are needed for confidence intervals)."
      )
    bad = [s for s in seeds if isinstance(s, bool) or not isinstance(s, int) or s < 0]
    if bad:
      raise ValueError(f"seeds={seeds} must be non-negative integers; got {bad}.")
    big = [s for s in seeds if s >= SEED_LIMIT]
    if big:
      raise ValueError(
        f"seeds={seeds} must be below 2**32; got {big}: JAX draws the initial weights from a "
        "seed's low 32 bits, so seeds 2**32 apart would start from the same weights (and "
        "from 2**63 on the trainer cannot take one). Choose smaller seeds."
      )
    if len(set(seeds)) != len(seeds):
      raise ValueError(f"seeds={seeds} repeats a seed.")
    return seeds

  def _check(self) -> None:
    for name in ("eval", "report", "sweep"):
      value = getattr(self, name)
      if not isinstance(value, Section) and not hasattr(value, "keys"):
        raise ValueError(f"{name}={value!r} must be a section of keys.")
    object.__setattr__(self, "eval", ComparisonEval.from_config(self.eval))
    object.__setattr__(self, "report", ComparisonReport.from_config(self.report))
    known = (*registered_arms(), *self.variants)
    for key, name in (("baseline", self.report.baseline),) + tuple(
      ("also_against", a) for a in self.report.also_against
    ):
      if name not in known:
        raise ValueError(f"report.{key}={name!r} is no arm; choose from {list(known)}.")
    if not isinstance(self.base, ml_collections.ConfigDict):
      if not isinstance(self.base, Mapping):
        raise ValueError(f"base={self.base!r} must be a run config (configs/default.py's keys).")
      object.__setattr__(self, "base", ml_collections.ConfigDict(plain(self.base)))
    try:
      DataConfig.from_dict(self.base.data.to_dict())
    except ValueError as e:
      raise ValueError(f"base.data: {e} Set it with --config.base.data.<key>=<value>.") from e
    object.__setattr__(self, "sweep", ComparisonSweep.from_config(self.sweep))
    self._check_sweep()
    self._check_runs()

  def _check_runs(self) -> None:
    """Resolves every arm's run (at the first seed) at every sweep point, with the trainer's
    checks of its batch that do not depend on the devices, and its evaluation."""
    for name, _, base in _point_bases(self):
      for arm in self.arms:
        try:
          run = RunConfig.from_config(_run_config(base, self.variants.get(arm), arm, self.seeds[0]))
          _check_batch(run)
        except ValueError as e:
          raise ValueError(
            f"{arm}" + (f" at sweep point {name}" if name else "") + f": {e}"
          ) from None
        try:
          eval_config(self.eval, run)
        except TypeError as e:
          raise ValueError(f"Bad eval.overrides: {e}.") from e

  def _check_sweep(self) -> None:
    """Refuses a sweep whose key is not in ``base``, whose values are empty, repeated or not
    numbers, or whose scaled keys are missing or cannot scale."""
    key = self.sweep.key
    if not key:
      return
    try:
      holder, last = _dotted(self.base, key)
    except (KeyError, TypeError, AttributeError):
      raise ValueError(f"sweep.key={key!r} is not a key of base (e.g. 'optim.lr').") from None
    values = self.sweep.values
    if not values:
      raise ValueError(
        f"sweep.values is empty; give the values of {key}, e.g. "
        "--config.sweep.values='(1e-3, 3e-3)'."
      )
    if len(set(values)) != len(values):
      raise ValueError(f"sweep.values={values} repeats a value.")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad:
      raise ValueError(f"sweep.values={values} must be numbers; got {bad}.")
    if self.sweep.scaled and (not _is_number(holder[last]) or not float(holder[last])):
      raise ValueError(
        f"sweep.scaled needs base.{key} a non-zero number (it is the scale's reference); it is "
        f"{holder[last]!r}."
      )
    for scaled in self.sweep.scaled:
      try:
        scaled_holder, scaled_last = _dotted(self.base, scaled)
      except (KeyError, TypeError, AttributeError):
        raise ValueError(f"sweep.scaled names {scaled!r}, which is not a key of base.") from None
      if not _is_number(scaled_holder[scaled_last]):
        raise ValueError(
          f"sweep.scaled names {scaled!r}, whose base value {scaled_holder[scaled_last]!r} is "
          "not a number to scale."
        )

  @classmethod
  def from_config(cls, config: Any) -> ComparisonConfig:
    """A ComparisonConfig as it is, or resolved from a comparison config file's ConfigDict (or a
    dict of the same keys): every key of :data:`REQUIRED` must be there, the others keep their
    defaults, and a key a comparison config does not have is refused, naming the keys it has.

    Raises:
      ValueError: naming the first missing, unknown or bad key.
    """
    if isinstance(config, cls):
      return config
    values = {k: config[k] for k in config.keys()}
    for key in REQUIRED:
      if key not in values:
        raise ValueError(
          f"The compare config has no {key!r}; build it with "
          "diffjax.compare.comparison_config (see configs/compare/tiny.py)."
        )
    known = [f.name for f in dataclasses.fields(cls) if f.name != "source_json"]
    refuse_unknown("", values, known, KIND)
    # A copy, so that changing the caller's ConfigDict afterwards changes no run of this one.
    values["base"] = copy.deepcopy(values["base"])
    source = config if hasattr(config, "to_json_best_effort") else ml_collections.ConfigDict(values)
    return cls(**values, source_json=source.to_json_best_effort())

  def to_config_dict(self) -> ml_collections.ConfigDict:
    """The comparison as the ConfigDict a config file would give: the keys, types and order of
    :func:`comparison_config`, and a key it leaves out where it differs from its default."""
    return _config_dict(type(self), _given(self))

  def to_json(self) -> str:
    """The JSON that compare_config.json and results.json hold: the ConfigDict's this was
    resolved from, as it was given."""
    return self.source_json or self.to_config_dict().to_json_best_effort()

  @property
  def base_run(self) -> RunConfig:
    """``base`` resolved: the schedule, batch and data every run shares."""
    return RunConfig.from_config(self.base)

  @property
  def v2_match(self) -> str:
    """How the comparison matches DIFF V2 (``base.model.v2_match``)."""
    return str(self.base.model.v2_match)

  def base_arm(self, name: str) -> str:
    """The model arm of ``name``: the name itself for a registered arm, a variant's ``arm``."""
    variant = self.variants.get(name)
    return name if variant is None else variant.arm


def _default(f: dataclasses.Field) -> Any:
  return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _given(section: Any) -> dict[str, Any]:
  """A section's values: those of its keys that comparison_config() leaves out only where they
  differ from their defaults."""
  return {
    f.name: getattr(section, f.name)
    for f in dataclasses.fields(section)
    if not (f.metadata.get("added") and getattr(section, f.name) == _default(f))
  }


def _config_dict(cls: type, values: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """The ConfigDict of ``cls`` (the comparison or one of its sections) holding ``values``, a
  key's default where ``values`` lacks it; a key marked ``ADDED`` (:mod:`diffjax.compare.sections`) only where ``values`` has
  it."""
  c = ml_collections.ConfigDict()
  hints = field_hints(cls)
  for f in dataclasses.fields(cls):
    if f.name == "source_json" or (f.name not in values and f.metadata.get("added")):
      continue
    if f.name not in values and dataclasses.is_dataclass(hints[f.name]):
      c[f.name] = _config_dict(hints[f.name], {})
      continue
    value = values[f.name] if f.name in values else _default(f)
    if dataclasses.is_dataclass(value):
      c[f.name] = _config_dict(type(value), _given(value))
    elif isinstance(value, Mapping):
      c[f.name] = ml_collections.ConfigDict(
        {k: _given(v) if dataclasses.is_dataclass(v) else v for k, v in value.items()}
      )
    else:
      set_config_value(c, f.name, value, hints[f.name], f)
  return c


def comparison_config(
  base: ml_collections.ConfigDict, seeds: Sequence[int] = (0, 1), arms: Sequence[str] = ARMS
) -> ml_collections.ConfigDict:
  """A compare config around ``base``, a full run config (its ``model.arm`` is replaced by
  each arm's, its ``seed`` by each seed's); every other key has its :class:`ComparisonConfig`
  default. docs/evaluation.md lists the fields."""
  values = {"arms": tuple(arms), "seeds": tuple(int(s) for s in seeds), "base": base}
  return _config_dict(ComparisonConfig, values)


def check_comparison_config(config: Any) -> ComparisonConfig:
  """The :class:`ComparisonConfig` a compare config (a ConfigDict, or a ComparisonConfig)
  resolves to; raises ValueError naming the first problem. Nothing is written before this
  passes."""
  return ComparisonConfig.from_config(config)


def _run_config(
  base: ml_collections.ConfigDict, variant: Variant | None, arm: str, seed: int
) -> ml_collections.ConfigDict:
  run = copy.deepcopy(base)
  with run.unlocked():
    run.model.arm = arm if variant is None else variant.arm
    for key, value in (variant.model if variant is not None else {}).items():
      run.model[key] = value
    run.seed = int(seed)
    run.log_batch_hash = True
  return run


def run_config(config: ComparisonConfig, arm: str, seed: int) -> ml_collections.ConfigDict:
  """The train config of run (arm, seed): ``base`` with ``model.arm = arm`` (a variant's arm
  and model fields) and ``seed``, logging its batch hashes."""
  return _run_config(config.base, config.variants.get(arm), arm, seed)


def run_name(arm: str, seed: int) -> str:
  """The run's directory name under <workdir>/runs."""
  return f"{arm}_seed{seed}"


# ----------------------------------------------------------------------------------------------
# Sweep points.


def _dotted(node: Any, key: str) -> tuple[Any, str]:
  """(the ConfigDict holding ``key``'s last part, that part) inside ``node``; KeyError if absent."""
  parts = key.split(".")
  for part in parts[:-1]:
    node = node[part]
  if parts[-1] not in node:
    raise KeyError(key)
  return node, parts[-1]


def format_value(value: Any) -> str:
  """A swept value as names and tables show it ("0.003", "1e+30", "8")."""
  return f"{value:g}" if isinstance(value, float) else str(value)


def point_name(key: str, value: Any) -> str:
  """The directory name of one sweep point, e.g. "lr=0.003"."""
  return f"{key.split('.')[-1]}={format_value(value)}"


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _set_number(holder: ml_collections.ConfigDict, last: str, value: float, what: str) -> None:
  """Sets ``holder[last]`` to ``value``: an integer key takes a whole value as an int, and
  refuses another (``what`` says where the value comes from)."""
  old = holder[last]
  if isinstance(old, int) and not isinstance(old, bool) and not isinstance(value, int):
    if not float(value).is_integer():
      raise ValueError(
        f"{what} gives {value:g} to an integer key; choose sweep values that make it whole."
      )
    value = int(value)
  try:
    holder[last] = value
  except TypeError as e:
    raise ValueError(f"{what}: {e}") from None


def _point_bases(config: ComparisonConfig) -> list[tuple[str, Any, ml_collections.ConfigDict]]:
  """[(point name, value, base at that value)]: ``base.<sweep.key>`` set to each value and each
  ``sweep.scaled`` key scaled by value / base's own value; [("", None, base)] without a sweep.
  An integer key gets an int (ValueError when the value is not whole)."""
  key = config.sweep.key
  if not key:
    return [("", None, config.base)]
  holder, last = _dotted(config.base, key)
  base_value = holder[last]
  points = []
  for value in config.sweep.values:
    base = copy.deepcopy(config.base)
    with base.unlocked():
      h, k = _dotted(base, key)
      _set_number(h, k, value, f"sweep.values: {key}={format_value(value)}")
      for scaled in config.sweep.scaled:
        sh, sk = _dotted(base, scaled)
        what = f"sweep.scaled: {scaled} scaled by {key}={format_value(value)}"
        _set_number(sh, sk, float(sh[sk]) * float(value) / float(base_value), what)
    points.append((point_name(key, value), value, base))
  return points


def sweep_points(config: ComparisonConfig) -> list[tuple[str, Any, ComparisonConfig]]:
  """[(point name, value, the comparison at that value)]: one point per ``sweep.values``, each
  ``config`` with that base (:func:`_point_bases`) and no sweep; [("", None, config)] without a
  sweep. A point's JSON is the comparison's with its base and an empty sweep."""
  if not config.sweep.key:
    return [("", None, config)]
  no_sweep = ComparisonSweep()
  points = []
  for name, value, base in _point_bases(config):
    source = json.loads(config.to_json())
    source["base"] = json.loads(base.to_json_best_effort())
    source["sweep"] = json.loads(_config_dict(ComparisonSweep, {}).to_json_best_effort())
    point = dataclasses.replace(config, base=base, sweep=no_sweep, source_json=json.dumps(source))
    points.append((name, value, point))
  return points


def describe_comparison(config: Any) -> str:
  """The comparison's runs, checked as the command checks them: each arm's model (what it is
  matched to and its parameters), the seeds and the shared run settings."""
  from diffjax.train.config_utils import describe_run  # pylint: disable=import-outside-toplevel

  config = ComparisonConfig.from_config(config)
  arms, seeds = config.arms, config.seeds
  lines = [
    f"{len(arms)} arms x {len(seeds)} seeds {seeds}; DIFF V2 matched by "
    f"{config.v2_match} (base.model.v2_match)"
  ]
  if config.sweep.key:
    points = [name for name, _, _ in _point_bases(config)]
    lines.append(
      f"sweep of {config.sweep.key} over {len(points)} values ({', '.join(points)}), each a "
      "whole comparison; the runs below are at the base value:"
    )
  for arm in arms:
    lines.append(
      f"[{arm}] " + describe_run(run_config(config, arm, seeds[0])).replace("\n", "\n  ")
    )
  return "\n".join(lines)


def _check_batch(run: RunConfig) -> None:
  """The trainer's checks of a run's batch that hold on any devices (`grad_accum_steps` must
  divide `global_batch_size`): the trainer's own, on a mesh of one device, so that what depends
  on the devices (the rows each holds) is left to the run."""
  import jax  # pylint: disable=import-outside-toplevel

  from diffjax.model import resolve_model  # pylint: disable=import-outside-toplevel
  from diffjax.sharding import MESH_AXES  # pylint: disable=import-outside-toplevel
  from diffjax.train.setup import _check_batch as check  # pylint: disable=import-outside-toplevel

  check(
    model_cfg=resolve_model(run.model).config,
    mesh=jax.sharding.AbstractMesh((1,) * len(MESH_AXES), MESH_AXES),
    rules=run.mesh.logical_rules,
    global_batch_size=run.global_batch_size,
    grad_accum_steps=run.grad_accum_steps,
  )
