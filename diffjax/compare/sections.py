"""The typed sections of a comparison config: how the runs are evaluated, what the report says,
the swept key, and the named variants.

Each is a frozen dataclass, checked when built (:class:`diffjax.train.sections.Section`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from diffjax.arms import BASELINE
from diffjax.arms import names as registered_arms
from diffjax.model.sizes import WIDTHS
from diffjax.train.config import RunConfig
from diffjax.train.sections import Section, plain, refuse_unknown

EVAL_MODES = ("quick", "full", "none")
# What an unknown key is not a key of.
KIND = "comparison config"
# The metadata of a key that comparison_config() leaves out and a config adds where it needs it
# (the sweep report's settings), so that a comparison which does not set it keeps the
# compare_config.json it always had.
ADDED = {"added": True}
# A variant's model keys that matching it as its arm sets: the arm and the Transformer it is
# matched to (its size and widths, diffjax.model.sizes.WIDTHS, which would make the variant's
# Transformer another one than base's), and the widths that unmatch it.
MATCHING_KEYS = ("arm", "size", "v2_match", "unmatched", *WIDTHS)


def names(value: Any) -> tuple[str, ...]:
  """Names given as a sequence or as one string; "a,b" (how --config.arms=a,b arrives) counts
  as two."""
  items = (value,) if isinstance(value, str) else tuple(value or ())
  return tuple(n.strip() for item in items for n in str(item).split(",") if n.strip())


def _tuples(x: Any) -> Any:
  """Lists to tuples, recursively (EvalConfig fields are tuples)."""
  if isinstance(x, (list, tuple)):
    return tuple(_tuples(v) for v in x)
  if isinstance(x, Mapping):
    return {k: _tuples(v) for k, v in x.items()}
  return x


@dataclasses.dataclass(frozen=True)
class ComparisonEval(Section):
  """How every run is evaluated once trained (diffjax.eval), and the lm-eval tasks run on it."""

  prefix: ClassVar[str] = "eval"
  kind: ClassVar[str] = KIND

  # "quick" (small sizes, noisy), "full" (the trainer's eval_batches validation batches unless
  # overridden, so its val/loss reproduces the trainer's final eval loss) or "none".
  mode: str = "quick"
  # EvalConfig fields (diffjax.eval.config) set for every run; {}: the mode's own.
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  # lm-eval tasks scored on every run ("a,b" counts as two); (): none.
  harness_tasks: tuple[str, ...] = ()
  # A folder of task definitions besides lm-eval's own; "": none.
  harness_include_path: str = ""
  # Examples per task; 0: all of them.
  harness_limit: int = 0
  # Solved examples put before each question.
  harness_num_fewshot: int = 0
  # The seed of lm-eval's sampling.
  harness_seed: int = 1234

  def __post_init__(self):
    object.__setattr__(self, "harness_tasks", names(self.harness_tasks))
    super().__post_init__()

  def _check(self) -> None:
    from diffjax.eval.config import EvalConfig  # pylint: disable=import-outside-toplevel

    object.__setattr__(self, "overrides", plain(self.overrides))
    if self.mode not in EVAL_MODES:
      raise ValueError(f"eval.mode={self.mode!r} must be one of {EVAL_MODES}.")
    fields = {f.name for f in dataclasses.fields(EvalConfig)}
    unknown = sorted(set(self.overrides) - fields)
    if unknown:
      raise ValueError(f"Unknown eval.overrides {unknown}; EvalConfig fields are {sorted(fields)}.")
    if not self.harness_tasks:
      return
    if self.mode == "none":
      raise ValueError(
        f"eval.harness_tasks={self.harness_tasks} needs an evaluation: set "
        "eval.mode to 'quick' or 'full'."
      )
    try:
      from diffjax.eval.harness import check_tasks, task_manager  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise ValueError(f"eval.harness_tasks needs lm-eval: {e}") from e
    check_tasks(
      self.harness_tasks, task_manager(self.harness_include_path or None, self.harness_tasks)
    )

  @property
  def harness(self) -> dict[str, Any] | None:
    """The lm-eval settings of every run (as its eval.json records them), or None without
    tasks."""
    if not self.harness_tasks:
      return None
    return {
      "tasks": list(self.harness_tasks),
      "include_path": self.harness_include_path or None,
      "limit": self.harness_limit or None,
      "num_fewshot": self.harness_num_fewshot,
      "seed": self.harness_seed,
    }


def eval_config(section: ComparisonEval, run: RunConfig):
  """The `EvalConfig` of a run (its resolved run config), or None when ``section.mode`` is
  "none".

  As in ``python -m diffjax.eval``: quick or full sizes around the run's sequence length; a
  full evaluation uses the trainer's ``eval_batches`` validation batches unless overridden, so
  its val/loss reproduces the trainer's final eval loss.
  """
  from diffjax.eval.config import EvalConfig  # pylint: disable=import-outside-toplevel

  if section.mode == "none":
    return None
  overrides = _tuples(section.overrides)
  if section.mode == "full" and "val_batches" not in overrides:
    overrides["val_batches"] = run.eval_batches
  make = EvalConfig.quick if section.mode == "quick" else EvalConfig.full
  return make(run.seq_len, **overrides)


@dataclasses.dataclass(frozen=True)
class ComparisonReport(Section):
  """What report.md pairs, at which level, and the definitions of the sweep report."""

  prefix: ClassVar[str] = "report"
  kind: ClassVar[str] = KIND

  # The arm every other arm is paired with.
  baseline: str = BASELINE
  # The level of the intervals and paired tests.
  confidence: float = 0.95
  # > 0: a run has learned its task at the first step whose train loss averaged over the last
  # learned_window steps is below this (train/steps_to_learn and train/learned); 0: off.
  learned_below: float = 0.0
  learned_window: int = 25
  # The report's title.
  title: str = "Matched comparison"
  # The sweep report also pairs every arm with each of these arms.
  also_against: tuple[str, ...] = dataclasses.field(default=(), metadata=ADDED)
  # A spike: a step whose gradient norm before clipping exceeds spike_factor x the median of
  # the previous spike_window logged steps'.
  spike_factor: float = dataclasses.field(default=3.0, metadata=ADDED)
  spike_window: int = dataclasses.field(default=50, metadata=ADDED)
  # A run also diverged when, after warm-up, its train loss averaged over divergence_window
  # steps went below the unigram baseline and later back above it.
  divergence_window: int = dataclasses.field(default=20, metadata=ADDED)
  # Count a run whose loss ends above the unigram baseline (or goes back above it) as
  # diverged; False: only runs stopped on non-finite updates or with a non-finite loss, for
  # runs too short to get below the baseline.
  divergence_above_unigram: bool = dataclasses.field(default=True, metadata=ADDED)

  def __post_init__(self):
    object.__setattr__(self, "also_against", names(self.also_against))
    super().__post_init__()

  def _check(self) -> None:
    if self.learned_below < 0:
      raise ValueError(f"report.learned_below={self.learned_below} must be >= 0 (0: off).")
    if self.learned_window < 1:
      raise ValueError(f"report.learned_window={self.learned_window} must be >= 1.")
    if not 0.0 < self.confidence < 1.0:
      raise ValueError(f"report.confidence={self.confidence} must be in (0, 1).")


@dataclasses.dataclass(frozen=True)
class ComparisonSweep(Section):
  """One ``base`` key swept over values, a whole comparison at each (checked against ``base``
  by the comparison that holds it)."""

  prefix: ClassVar[str] = "sweep"
  kind: ClassVar[str] = KIND

  # The swept key of base, e.g. "optim.lr"; "": no sweep.
  key: str = ""
  # Its values: a comparison each, in sweep/<key>=<value>/.
  values: tuple[int | float, ...] = ()
  # Keys of base that keep their ratio to the swept one (each scaled by value / base's value).
  scaled: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Variant:
  """A named arm beyond the registered ones: one of them with some model fields changed, and
  matched as that arm."""

  # The registered arm it is (diffjax.arms).
  arm: str | None = None
  # The model fields it sets (none of the matching's: arm, size, v2_match, unmatched, and
  # the widths d_model, num_layers, num_heads, num_kv_heads, head_dim, mlp_dim).
  model: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    object.__setattr__(self, "model", plain(self.model or {}))

  @classmethod
  def from_config(cls, name: str, value: Any) -> Variant:
    """Variant ``name`` as it is, or built from its mapping; checked either way.

    Raises:
      ValueError: a variant named as an arm, an arm that is not registered, a model key that
        its matching sets, or a key a variant does not have.
    """
    if not isinstance(value, cls):
      if not hasattr(value, "keys"):
        raise ValueError(f"variants.{name}={value!r} must be a section of keys (arm, model).")
      values = plain(value)
      refuse_unknown(f"variants.{name}", values, [f.name for f in dataclasses.fields(cls)], KIND)
      value = cls(**values)
    if name in registered_arms():
      raise ValueError(f"variants.{name}: a variant cannot reuse an arm's name; rename it.")
    if value.arm not in registered_arms():
      raise ValueError(f"variants.{name}.arm={value.arm!r} must be one of {registered_arms()}.")
    bad = sorted(set(value.model) & set(MATCHING_KEYS))
    if bad:
      raise ValueError(
        f"variants.{name}.model sets {bad}: a variant is matched as its arm to base's "
        "Transformer, so it sets only other model fields (e.g. v2_pairing). For other widths, "
        "give them to base (--config.base.model.d_model=...: every arm is matched to that "
        "Transformer); for an unmatched model, train it with train.py and "
        "--config.model.unmatched.<width>=<n>, evaluate it with python -m diffjax.eval and "
        "report it beside the comparison's runs with python -m diffjax.eval.report."
      )
    return value
