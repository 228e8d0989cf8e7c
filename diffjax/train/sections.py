"""The typed sections of a run config (``optim``, ``task_mix``, ``checkpoint``, ``mesh``, ...),
and the checks they share (:class:`Section`, :data:`FLOAT_RANGES`): docs/training.md#run-keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar

import ml_collections

from diffjax.sharding import (
  CONTEXT_STRATEGIES,
  check_dcn_axes,
  check_rules_within_slices,
  rules_from_config,
)

SCHEDULES = ("cosine", "linear", "constant")
# Tasks of diffjax.data.tasks that training can mix in ("none": text alone).
TASKS = ("none", "multi_needle", "associative_recall")
# Float options and the range each must lie in: (key, low, high, low_open, high_open);
# None is an unbounded side. Every one must also be finite: a NaN learning rate, say,
# gives NaN parameters while the loss still looks finite.
FLOAT_RANGES = (
  ("optim.lr", 0.0, None, True, False),
  ("optim.min_lr", 0.0, None, False, False),
  ("optim.b1", 0.0, 1.0, False, True),
  ("optim.b2", 0.0, 1.0, False, True),
  ("optim.eps", 0.0, None, True, False),
  ("optim.weight_decay", 0.0, None, False, False),
  ("optim.clip_norm", 0.0, None, False, False),  # 0 (or None) disables clipping
  ("task_mix.fraction", 0.0, 1.0, False, False),
  ("data.val_fraction", 0.0, 1.0, False, True),
  ("model.rope_theta", 0.0, None, True, False),
  ("model.norm_eps", 0.0, None, True, False),
  ("model.diff_norm_eps", 0.0, None, True, False),
  ("model.init_std", 0.0, None, True, False),
  ("model.diff_fixed_lambda", None, None, False, False),
  ("distributed.peer_timeout_s", 0.0, None, True, False),
  ("distributed.heartbeat_timeout_s", 0.0, None, True, False),
)


# ----------------------------------------------------------------------------------------------
# Checks shared by the sections.


def _range_text(low, high, low_open: bool, high_open: bool) -> str:
  if low is not None and high is not None:
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
  if low is not None:
    return f"{'>' if low_open else '>='} {low:g}"
  if high is not None:
    return f"{'<' if high_open else '<='} {high:g}"
  return "a finite number"


def check_floats(prefix: str, values: Mapping[str, Any]) -> None:
  """Refuses the non-finite or out-of-range float options of one section (``prefix``, e.g.
  "optim") among ``values`` (those present and not None), by :data:`FLOAT_RANGES`.

  Raises:
    ValueError: naming the key, the value seen and the allowed range.
  """
  for key, low, high, low_open, high_open in FLOAT_RANGES:
    section, _, name = key.rpartition(".")
    if section != prefix or values.get(name) is None:
      continue
    value = values[name]
    want = _range_text(low, high, low_open, high_open)
    try:
      x = float(value)
    except (TypeError, ValueError):
      raise ValueError(f"{key}={value!r} must be a number {want}.") from None
    bad = (
      not math.isfinite(x)
      or (low is not None and (x <= low if low_open else x < low))
      or (high is not None and (x >= high if high_open else x > high))
    )
    if bad:
      where = "" if want == "a finite number" else f", {want}"
      raise ValueError(f"{key}={x} must be a finite number{where}; set --config.{key}=<value>.")


def config_type(hint: Any) -> type:
  """The ConfigDict type of a field annotated ``hint`` (``int | None`` -> int)."""
  args = [a for a in typing.get_args(hint) if a is not type(None)]
  if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
    hint = args[0]
  origin = typing.get_origin(hint) or hint
  return dict if origin is Mapping else origin


def _optional(hint: Any) -> bool:
  return type(None) in typing.get_args(hint)


@functools.cache
def field_hints(cls: type) -> dict[str, Any]:
  """The annotations of a dataclass's fields, resolved to types."""
  return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, hint: Any) -> Any:
  """``value`` as the type of its annotation ``hint``; ValueError naming ``key`` otherwise."""
  if value is None:
    if _optional(hint):
      return None
    raise ValueError(f"{key}=None must be set; set --config.{key}=<value>.")
  kind = config_type(hint)
  if kind is bool:
    if isinstance(value, (str, float)) or value not in (0, 1):
      raise ValueError(f"{key}={value!r} must be True or False.")
    return bool(value)
  if kind is int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
      raise ValueError(f"{key}={value!r} must be an integer; set --config.{key}=<int>.")
    return int(value)
  if kind is float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
      raise ValueError(f"{key}={value!r} must be a number; set --config.{key}=<value>.")
    return float(value)
  if kind is str and not isinstance(value, str):
    raise ValueError(f"{key}={value!r} must be a string.")
  if kind is tuple:
    if isinstance(value, Mapping):  # a table given as a dict: its (key, value) pairs
      return tuple(value.items())
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
      raise ValueError(f"{key}={value!r} must be a tuple.")
    return tuple(value)
  return value


def plain(section: Any) -> dict[str, Any]:
  """A config section (ConfigDict or mapping) as a plain dict of plain values."""
  to_dict = getattr(section, "to_dict", None)
  return dict(to_dict() if to_dict is not None else section)


def set_config_value(c: ml_collections.ConfigDict, name: str, value: Any, hint: Any, field) -> None:
  """Sets ``c[name]`` for a field: None (and a field marked ``placeholder``) as a placeholder
  of the field's type, so that a config may set it to None and back."""
  if value is None or field.metadata.get("placeholder"):
    c[name] = ml_collections.config_dict.placeholder(
      field.metadata.get("config_type") or config_type(hint)
    )
    if value is None:
      return
  c[name] = value


def refuse_unknown(prefix: str, given, known, kind: str = "run config") -> None:
  """Refuses a key of ``given`` that is not in ``known`` (the keys of section ``prefix`` of a
  ``kind``), naming the nearest one and all of them."""
  unknown = [k for k in given if k not in known]
  if not unknown:
    return
  where = f"{prefix}." if prefix else ""
  near = difflib.get_close_matches(unknown[0], list(known), n=1)
  hint = f"did you mean {where}{near[0]}? " if near else ""
  raise ValueError(
    f"{where}{unknown[0]} is not a {kind} key; {hint}the keys of "
    f"{prefix or 'a ' + kind} are {', '.join(known)}."
  )


class Section:
  """A config section (of a run or a comparison): a frozen dataclass whose values are checked
  when it is built.

  Building one checks its float options against :data:`FLOAT_RANGES`, gives every value the
  type of its annotation (naming a value that has none of it) and runs the section's own
  ``_check``. ``prefix`` is the section's key in its config, ``kind`` what that config is.
  """

  prefix: ClassVar[str] = ""
  kind: ClassVar[str] = "run config"

  def __post_init__(self):
    names = [f.name for f in dataclasses.fields(self)]
    check_floats(self.prefix, {n: getattr(self, n) for n in names})
    hints = field_hints(type(self))
    for n in names:
      key = f"{self.prefix}.{n}" if self.prefix else n
      object.__setattr__(self, n, _coerce(key, getattr(self, n), hints[n]))
    self._check()

  def _check(self) -> None:
    """The section's own checks, on values of the annotated types."""

  @classmethod
  def from_config(cls, section: Any):
    """The section as it is, or built from its mapping (a ConfigDict section or a dict): keys
    it lacks keep their defaults; a key it does not have is refused, naming the keys it has."""
    if isinstance(section, cls):
      return section
    values = plain(section)
    refuse_unknown(cls.prefix, values, [f.name for f in dataclasses.fields(cls)], cls.kind)
    return cls(**values)


# ----------------------------------------------------------------------------------------------
# The sections.


@dataclasses.dataclass(frozen=True)
class OptimConfig(Section):
  """AdamW with a linear warm-up, a decay to a floor, and global-norm clipping."""

  prefix: ClassVar[str] = "optim"

  # Peak learning rate, reached at the end of the warm-up.
  lr: float = 3e-3
  # The learning rate the decay ends at, and stays at.
  min_lr: float = 3e-4
  # Steps of the linear warm-up from 0 to lr.
  warmup_steps: int = 50
  # The decay after the warm-up: "cosine", "linear" or "constant" (lr throughout).
  schedule: str = "cosine"
  # The step at which the decay reaches min_lr.
  decay_steps: int = 1000
  # AdamW's decay rates of the first and second moments.
  b1: float = 0.9
  b2: float = 0.95
  # AdamW's epsilon, added to the root of the second moment.
  eps: float = 1e-8
  # Decoupled weight decay of the weight matrices (never of norm gains or lambda vectors).
  weight_decay: float = 0.1
  # The global gradient norm is clipped to this; 0 (or None) does not clip.
  clip_norm: float | None = 1.0

  def _check(self) -> None:
    if self.min_lr > self.lr:
      raise ValueError(f"optim.min_lr={self.min_lr} must be <= optim.lr={self.lr}.")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"optim.schedule={self.schedule!r} is not one of {SCHEDULES}.")
    if self.warmup_steps < 0 or self.decay_steps < self.warmup_steps:
      raise ValueError(
        f"Need 0 <= optim.warmup_steps <= decay steps; got warmup_steps={self.warmup_steps},"
        f" decay_steps={self.decay_steps}."
      )

  def decay_note(self, num_steps: int) -> str | None:
    """A line saying that the decay ends before step ``num_steps`` (the steps after it train at
    ``min_lr``: a run extended by a larger num_steps, say), or None."""
    if self.schedule == "constant" or self.decay_steps >= num_steps:
      return None
    return (
      f"note: the {self.schedule} decay reaches min_lr={self.min_lr} at optim.decay_steps="
      f"{self.decay_steps}, so steps {self.decay_steps + 1}-{num_steps} train at min_lr; "
      f"--config.optim.decay_steps={num_steps} spreads it over the run."
    )


@dataclasses.dataclass(frozen=True)
class TaskMixConfig(Section):
  """Synthetic retrieval examples mixed into the training data (diffjax/train/task_mix.py).

  The keys of the other task are ignored: multi_needle reads context_len, num_needles and
  num_queries; associative_recall reads num_pairs, num_queries, distractors_per_query, key_len,
  value_len, separator and grid.
  """

  prefix: ClassVar[str] = "task_mix"

  # The task of diffjax.data.tasks mixed in: "none", "multi_needle" or "associative_recall".
  task: str = "none"
  # The share of training tokens from task examples; 1: task examples alone, no corpus.
  fraction: float = 0.0
  # multi_needle: tokens per example.
  context_len: int = 512
  # multi_needle: needles hidden per example.
  num_needles: int = 2
  # Questions asked per example.
  num_queries: int = 1
  # associative_recall: key-value pairs in context.
  num_pairs: int = 16
  # associative_recall: pairs whose key resembles a queried key, per query.
  distractors_per_query: int = 1
  # associative_recall: tokens of a key, and of a value.
  key_len: int = 3
  value_len: int = 3
  # associative_recall: the text between a key and its value ("": none).
  separator: str = ":"
  # associative_recall: (num_pairs, distractors_per_query) settings mixed in equal shares
  # instead of the two keys above; empty: those keys.
  grid: tuple[tuple[int, int], ...] = ()
  # With fraction 1: how many task examples to train on (> 0).
  num_examples: int = 0
  # The tokens scored: "all", or "answers" (task examples alone only).
  loss: str = "all"

  @property
  def task_only(self) -> bool:
    """True when the run trains on task examples alone (fraction 1): no corpus is read."""
    return self.task != "none" and self.fraction == 1.0

  def _check(self) -> None:
    object.__setattr__(self, "grid", tuple(tuple(int(v) for v in g) for g in self.grid))
    if self.task not in TASKS:
      raise ValueError(f"task_mix.task={self.task!r} is not one of {TASKS}.")
    if self.task == "none" or self.fraction == 0.0:
      return
    if not 0.0 < self.fraction <= 1.0:
      raise ValueError(f"task_mix.fraction={self.fraction} must be in (0, 1].")
    if self.loss not in ("all", "answers"):
      raise ValueError(f"task_mix.loss={self.loss!r} must be 'all' or 'answers'.")
    if self.loss == "answers" and self.fraction != 1.0:
      raise ValueError(
        f"task_mix.loss='answers' scores task answers only, so it needs task "
        f"examples alone (task_mix.fraction=1); got fraction={self.fraction}."
      )
    if self.task == "multi_needle" and self.fraction == 1.0:
      raise ValueError(
        "task_mix.task='multi_needle' hides its needles in corpus text; it cannot "
        "train on task examples alone (fraction=1). Use a fraction below 1."
      )
    if self.fraction == 1.0 and self.num_examples <= 0:
      raise ValueError(
        f"task_mix.fraction=1 trains on task examples alone; set "
        f"task_mix.num_examples to how many (> 0), got {self.num_examples}."
      )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
  """Orbax checkpoints of the train state and the data position (diffjax/train/checkpoint.py)."""

  prefix: ClassVar[str] = "checkpoint"

  # Save every this many steps (and at the end, and on SIGTERM/SIGINT).
  every: int = 500
  # The newest checkpoints kept.
  keep: int = 2
  # Write in the background while training goes on.
  async_save: bool = True
  # A train.py workdir whose newest parameters a fresh run starts from (fresh optimizer state,
  # step 0); ignored once this run has a checkpoint of its own. "": none. None: a config that
  # requires one (a run without a checkpoint then stops, naming the flag).
  init_from: str | None = dataclasses.field(default="", metadata={"placeholder": True})
  # The model settings that change the function (diffjax.train.loading.FUNCTION_FIELDS, e.g.
  # rope_theta for a longer context) which this run may set otherwise than the init_from run;
  # any other difference is refused, naming the value to set.
  init_changes: tuple[str, ...] = ()

  def _check(self) -> None:
    if self.every <= 0 or self.keep <= 0:
      raise ValueError(
        f"checkpoint.every={self.every} and checkpoint.keep={self.keep} must be positive."
      )
    from diffjax.train.loading import FUNCTION_FIELDS  # pylint: disable=import-outside-toplevel

    bad = [f for f in self.init_changes if f not in FUNCTION_FIELDS]
    if bad:
      raise ValueError(
        f"checkpoint.init_changes names {bad[0]!r}, which is not one of {FUNCTION_FIELDS}."
      )
    object.__setattr__(self, "init_changes", tuple(self.init_changes))


@dataclasses.dataclass(frozen=True)
class MeshConfig(Section):
  """The device mesh and how arrays are laid out on it (docs/scaling.md)."""

  prefix: ClassVar[str] = "mesh"

  # (data, fsdp, tensor[, context]); one entry may be -1 ("the rest").
  shape: tuple[int, ...] = (-1, 1, 1)
  # How many devices the mesh spans: 0 takes every device; N > 0 the first N of a
  # single-process run (e.g. one device of a host that has several).
  num_devices: int = 0
  # The logical-axis rules table as [name, mesh axes] pairs (or a dict); None:
  # diffjax.sharding's. Kept as the normalised table.
  rules: tuple | None = dataclasses.field(default=None, metadata={"config_type": list})
  # On several TPU slices: how many slices each axis of (data, fsdp, tensor[, context])
  # spans, ``shape`` being then the mesh within one slice. Empty: every slice on data. Only
  # data and fsdp may cross slices (docs/scaling.md, "Several slices").
  dcn_shape: tuple[int, ...] = ()
  # Attention over a context axis larger than 1: "ring" or "all_gather".
  context_strategy: str = "ring"
  # Split each sequence into 2 x context chunks in zig-zag order, so every device holds an
  # equal share of the causal work.
  context_load_balance: bool = True

  def _check(self) -> None:
    object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
    if self.num_devices < 0:
      raise ValueError(
        f"mesh.num_devices={self.num_devices} must be 0 (every device) or a device count."
      )
    if self.rules is not None:
      object.__setattr__(self, "rules", rules_from_config(self.rules))
    object.__setattr__(self, "dcn_shape", tuple(int(s) for s in self.dcn_shape or ()))
    if self.dcn_shape:
      check_dcn_axes(self.dcn_shape)
      check_rules_within_slices(self.logical_rules, self.dcn_shape)
    if self.context_strategy not in CONTEXT_STRATEGIES:
      raise ValueError(
        f"mesh.context_strategy={self.context_strategy!r} is not one of {CONTEXT_STRATEGIES}."
      )

  @property
  def logical_rules(self) -> tuple:
    """The rules table the run uses (diffjax.sharding's when ``rules`` is None)."""
    return rules_from_config(self.rules)

  def devices(self) -> list | None:
    """The devices the mesh spans (None: every device), checked against what this process
    sees."""
    import jax  # pylint: disable=import-outside-toplevel

    if not self.num_devices:
      return None
    available = jax.device_count()
    if jax.process_count() > 1 and self.num_devices != available:
      # A restart on another number of processes changes the device count: 0 follows it.
      raise ValueError(
        f"mesh.num_devices={self.num_devices}: a run of {jax.process_count()} processes "
        f"spans all {available} devices (every device of every process). Set "
        f"mesh.num_devices=0 (or {available})."
      )
    if self.num_devices > available:
      raise ValueError(
        f"mesh.num_devices={self.num_devices}, but this process sees {available} "
        f"{jax.default_backend()} device(s). Set mesh.num_devices to at most {available} "
        "(0 takes them all)."
      )
    return jax.devices()[: self.num_devices]

  @property
  def context(self) -> int:
    """The size of the context axis (1 for a 3-entry shape)."""
    return self.shape[3] if len(self.shape) == 4 else 1

  def context_options(self) -> dict[str, Any]:
    """The context-parallel settings, as keyword arguments of the train step's setup."""
    return {
      "context_strategy": self.context_strategy,
      "context_load_balance": self.context_load_balance,
    }


@dataclasses.dataclass(frozen=True)
class DistributedConfig(Section):
  """Several processes: start-up, lost peers, supervision (diffjax/train/distributed.py)."""

  prefix: ClassVar[str] = "distributed"

  # Call jax.distributed.initialize(); None: when the environment says there are several
  # processes (TPU VMs, SLURM, DIFFJAX_COORDINATOR, a Kubernetes Indexed Job).
  initialize: bool | None = None
  # A process whose peer stops answering this long says so and exits (75).
  peer_timeout_s: float = 60.0
  # The distributed runtime's own lost-peer timeout (jax.distributed.initialize's
  # heartbeat_timeout_seconds), after which it aborts the survivors itself; None: the larger
  # of 100 s and 3 x peer_timeout_s. It must exceed peer_timeout_s, so that the watchdog's
  # one line and exit status come first.
  heartbeat_timeout_s: float | None = None
  # XLA flags and NCCL/JAX variables set before JAX starts, by name (diffjax/train/cluster.py,
  # docs/gpu_clusters.md): "none", or "gpu_multinode" for several GPU nodes. Each XLA flag and
  # variable the environment already sets is left as the user set it.
  xla_preset: str = "none"

  def _check(self) -> None:
    from diffjax.train.cluster import check_preset  # pylint: disable=import-outside-toplevel

    check_preset(self.xla_preset)
    beat = self.heartbeat_timeout_s
    if beat is not None and beat <= self.peer_timeout_s:
      raise ValueError(
        f"distributed.heartbeat_timeout_s={beat:g} must exceed distributed.peer_timeout_s="
        f"{self.peer_timeout_s:g}: the runtime would abort the processes before the watchdog "
        "says which peer was lost; raise it, or lower peer_timeout_s."
      )

  def runtime_heartbeat_s(self) -> int:
    """The heartbeat timeout passed to ``jax.distributed.initialize`` (whole seconds)."""
    beat = self.heartbeat_timeout_s
    return int(math.ceil(beat)) if beat is not None else int(max(100, 3 * self.peer_timeout_s))

  # With several processes, train.py trains in a child process, so that a lost coordinator
  # is said in one line too (diffjax/train/supervise.py).
  supervise: bool = True


@dataclasses.dataclass(frozen=True)
class ProfileConfig(Section):
  """Profiler traces and the train step's HLO (diffjax/train/perf.py), on process 0."""

  prefix: ClassVar[str] = "profile"

  # (first, last): a profiler trace of those steps (1-based, inclusive); (): none.
  steps: tuple[int, ...] = ()
  # Write the compiled train step's HLO to <workdir>/train_step.hlo.txt.
  dump_hlo: bool = False

  def _check(self) -> None:
    steps = self.steps
    if steps and (len(steps) != 2 or not 1 <= int(steps[0]) <= int(steps[1])):
      raise ValueError(
        f"profile.steps={steps!r} must be (first, last) with 1 <= first <= last, "
        'e.g. --config.profile.steps="(10, 12)".'
      )
    object.__setattr__(self, "steps", tuple(int(s) for s in steps))


@dataclasses.dataclass(frozen=True)
class KernelsConfig(Section):
  """Checks of the fused kernels the model chose (diffjax/ops/preflight.py)."""

  prefix: ClassVar[str] = "kernels"

  # On a GPU or TPU, run each fused kernel once against XLA before the first step; a failing
  # one is switched to the stock path.
  preflight: bool = True
