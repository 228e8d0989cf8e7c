"""The run config: one typed object per run (:class:`RunConfig`), and the ConfigDict that config
files edit (:func:`base_config`, :func:`model_section`): docs/training.md#run-keys.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

import ml_collections

from diffjax.core.config import DEFAULT_V2_MATCH
from diffjax.data import DataConfig
from diffjax.model import ModelConfig, resolve_model
from diffjax.model.sizes import CUSTOM, WIDTHS
from diffjax.train.sections import (
  CheckpointConfig,
  DistributedConfig,
  KernelsConfig,
  MeshConfig,
  OptimConfig,
  ProfileConfig,
  Section,
  TaskMixConfig,
  check_floats,
  field_hints,
  plain,
  refuse_unknown,
  set_config_value,
)
from diffjax.train.steps import check_grad_accum_reduce

# Keys a run config must state (the other keys keep their defaults when a config lacks them).
REQUIRED = (
  "model",
  "data",
  "optim",
  "checkpoint",
  "mesh",
  "seed",
  "seq_len",
  "global_batch_size",
  "grad_accum_steps",
  "num_steps",
  "log_every",
  "eval_every",
  "eval_batches",
)

# ----------------------------------------------------------------------------------------------
# The model section.

_MODEL_DEFAULTS = ModelConfig()
# model.vocab_size that stands for the tokenizer's vocabulary (resolve_model's, too).
TOKENIZER_VOCAB = -1


def model_section(
  arm: str | None = None, size: str = "default", **values
) -> ml_collections.ConfigDict:
  """A run's ``model`` section: ``arm`` (default: ModelConfig's) matched to the Transformer of
  ``size``.

  Every baseline width (``d_model, num_layers, num_heads, num_kv_heads, head_dim, mlp_dim``)
  is None (the size's) unless given; ``unmatched`` holds the arm's own widths, None unless
  an experiment sets them on purpose; ``vocab_size`` is -1 (the tokenizer's); the other keys are
  the ModelConfig fields with their defaults. ``values`` set keys.
  """
  m = ml_collections.ConfigDict()
  m.arm = _MODEL_DEFAULTS.attention if arm is None else arm
  m.size = size
  m.v2_match = DEFAULT_V2_MATCH
  for k in WIDTHS:
    m[k] = ml_collections.config_dict.placeholder(int)
  m.unmatched = ml_collections.ConfigDict(
    {k: ml_collections.config_dict.placeholder(int) for k in WIDTHS}
  )
  m.vocab_size = TOKENIZER_VOCAB
  hints = field_hints(ModelConfig)
  for f in dataclasses.fields(ModelConfig):
    if f.name in ("attention", "vocab_size", *WIDTHS):
      continue
    set_config_value(m, f.name, getattr(_MODEL_DEFAULTS, f.name), hints[f.name], f)
  for k, v in values.items():
    if k not in m:
      raise ValueError(f"model_section: unknown key {k!r}.")
    if k == "unmatched":
      for width, n in (v or {}).items():
        m.unmatched[width] = n
    else:
      m[k] = v
  return m


# ----------------------------------------------------------------------------------------------
# The run.


def _default_model() -> dict[str, Any]:
  return model_section().to_dict()


@dataclasses.dataclass(frozen=True)
class RunConfig(Section):
  """One training run: its schedule and batch, and a section per concern.

  Build it with :meth:`from_config` from a config file's ConfigDict (what commands do), or
  with keywords, where a section may be given as a mapping of its keys. Either way every value
  is checked here; a bad one raises ValueError naming it and the flag that sets it.
  """

  # Initialisation seed and the order of the training data.
  seed: int = 0
  # Tokens per training sequence.
  seq_len: int = 256
  # Sequences per step, over all devices and micro-batches.
  global_batch_size: int = 16
  # Micro-batches per step (each of global_batch_size / grad_accum_steps sequences).
  grad_accum_steps: int = 1
  # With micro-batches and a data axis: when gradients are summed over the data shards.
  # "micro_batch": each micro-batch's, inside its backward pass (overlapped with it);
  # "step": each shard sums its own micro-batches, then one reduction per step (1 /
  # grad_accum_steps of the bytes, e.g. over DCN across slices, after the last backward pass).
  grad_accum_reduce: str = "micro_batch"
  # Training steps.
  num_steps: int = 1000
  # A metrics line every this many steps.
  log_every: int = 50
  # Evaluate every this many steps (and at the end); 0: at the end only.
  eval_every: int = 250
  # Validation batches per evaluation.
  eval_batches: int = 8
  # TensorBoard event files in the workdir, besides metrics.jsonl.
  tensorboard: bool = True
  # A CRC32 of every batch's tokens in metrics.jsonl, to check that runs (e.g. the arms of a
  # comparison) saw the same data in the same order.
  log_batch_hash: bool = False
  # Updates skipped as non-finite (loss, gradient or update) before the run stops; each is
  # counted in metrics.jsonl (train/skipped) and final_metrics.json. 0: stop at the first.
  max_skipped_updates: int = 0
  # The arm and the Transformer it is matched to (model_section; diffjax.model.resolve_model).
  model: dict[str, Any] = dataclasses.field(default_factory=_default_model)
  # The training corpus, its tokenizer and the validation split (diffjax.data.DataConfig).
  # None only where the data is named when the run is launched (from_config's data_at_launch:
  # a dry run, an ahead-of-time compile); the trainer never gets None.
  data: DataConfig | None = dataclasses.field(default_factory=DataConfig)
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  task_mix: TaskMixConfig = dataclasses.field(default_factory=TaskMixConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
  # Dense bf16 peak FLOP/s per device for the MFU; None: by device kind (TPU, GPU), no MFU on
  # a CPU unless given.
  peak_flops: float | None = None
  profile: ProfileConfig = dataclasses.field(default_factory=ProfileConfig)
  kernels: KernelsConfig = dataclasses.field(default_factory=KernelsConfig)
  # The JSON of the ConfigDict this was resolved from, as checkpoints save it ("": none; then
  # the JSON of to_config_dict()).
  source_json: str = dataclasses.field(default="", compare=False, repr=False)

  def __post_init__(self):
    # In the order a reader checks a config: the model, the schedule, then each section.
    model = plain(self.model)
    model["unmatched"] = dict(model.get("unmatched") or {})
    object.__setattr__(self, "model", model)
    resolve_model(model)
    if isinstance(self.max_skipped_updates, bool) or not isinstance(
      self.max_skipped_updates, numbers.Integral
    ):
      self._refuse_skips()
    super().__post_init__()

  def _refuse_skips(self) -> None:
    raise ValueError(
      f"max_skipped_updates={self.max_skipped_updates!r} must be an integer >= 0 (updates "
      "skipped as non-finite before the run stops; 0 stops at the first)."
    )

  def _check(self) -> None:
    for k in (
      "seq_len",
      "global_batch_size",
      "grad_accum_steps",
      "num_steps",
      "log_every",
      "eval_batches",
    ):
      if getattr(self, k) <= 0:
        raise ValueError(f"{k}={getattr(self, k)} must be a positive integer.")
    if self.max_skipped_updates < 0:
      self._refuse_skips()
    if self.seed < 0:
      raise ValueError(
        f"seed={self.seed} must be an integer >= 0 (it draws the initial weights and the order "
        "of the training data)."
      )
    check_grad_accum_reduce(self.grad_accum_reduce)
    if self.eval_every < 0:
      raise ValueError(f"eval_every={self.eval_every} must be >= 0 (0 disables periodic eval).")
    for name, section in _SECTIONS.items():
      object.__setattr__(self, name, section.from_config(getattr(self, name)))
    if self.data is not None and not isinstance(self.data, DataConfig):
      data = plain(self.data)
      check_floats("data", data)
      object.__setattr__(self, "data", DataConfig.from_dict(data))
    if self.data is not None:
      check_floats("data", self.data.to_dict())
    check_floats("model", self.model)
    if self.mesh.context > 1:
      chunk = 2 * self.mesh.context if self.mesh.context_load_balance else self.mesh.context
      if self.seq_len % chunk:
        raise ValueError(
          f"seq_len={self.seq_len} must be a multiple of {chunk} to shard the "
          f"sequence over a context axis of {self.mesh.context}"
          f"{' in load-balanced halves' if chunk > self.mesh.context else ''}."
        )

  @property
  def fixed_vocab_size(self) -> int | None:
    """``model.vocab_size`` when the config fixes it; None when it is the tokenizer's."""
    vocab = int(self.model.get("vocab_size", TOKENIZER_VOCAB))
    return None if vocab == TOKENIZER_VOCAB else vocab

  @property
  def tokens_per_step(self) -> int:
    """Tokens of one step over all devices."""
    return self.global_batch_size * self.seq_len

  @classmethod
  def from_config(cls, config: Any, *, data_at_launch: bool = False) -> RunConfig:
    """A RunConfig as it is, or resolved from a run config file's ConfigDict (or a dict of the
    same keys): every key of :data:`REQUIRED` must be there, the others keep their defaults,
    and a key the run config does not have is refused, naming the keys it has.

    With ``data_at_launch``, a data section that does not make a DataConfig yet (a prepared
    corpus whose paths and tokenizer the launch command names) resolves to ``data=None``
    instead of raising: for a dry run or a compile, which read no data.

    Raises:
      ValueError: naming the first missing, unknown or bad key.
    """
    if isinstance(config, cls):
      return config
    values = plain(config)
    missing = [k for k in REQUIRED if k not in values]
    if missing:
      raise ValueError(f"Config is missing keys {missing}; start from configs/default.py.")
    known = [f.name for f in dataclasses.fields(cls) if f.name != "source_json"]
    refuse_unknown("", values, known)
    for name in (*_SECTIONS, "data"):
      value = values.get(name, {})
      if not isinstance(value, (Mapping, Section, DataConfig)) and value is not None:
        raise ValueError(f"{name}={value!r} must be a section of keys.")
    source = config if hasattr(config, "to_json_best_effort") else ml_collections.ConfigDict(values)
    source_json = source.to_json_best_effort()
    if data_at_launch and isinstance(values["data"], Mapping):
      check_floats("data", values["data"])
      try:
        values["data"] = DataConfig.from_dict(values["data"])
      except ValueError:
        values["data"] = None
    return cls(**values, source_json=source_json)

  def to_config_dict(self) -> ml_collections.ConfigDict:
    """The run as the ConfigDict a config file would give (keys, types and order of
    :func:`base_config`)."""
    return _to_config_dict(self)

  def to_json(self) -> str:
    """The JSON checkpoints save: the ConfigDict's this was resolved from, as it was given."""
    return self.source_json or self.to_config_dict().to_json_best_effort()


# The typed sections of a run, in the order they are checked.
_SECTIONS: dict[str, type[Section]] = {
  "checkpoint": CheckpointConfig,
  "optim": OptimConfig,
  "task_mix": TaskMixConfig,
  "mesh": MeshConfig,
  "distributed": DistributedConfig,
  "profile": ProfileConfig,
  "kernels": KernelsConfig,
}


def _to_config_dict(obj: Any) -> ml_collections.ConfigDict:
  if isinstance(obj, RunConfig) and obj.data is None:
    raise ValueError("The run's data is named at launch: set data.paths (and data.tokenizer).")
  c = ml_collections.ConfigDict()
  hints = field_hints(type(obj))
  for f in dataclasses.fields(obj):
    if f.name == "source_json":
      continue
    value = getattr(obj, f.name)
    if isinstance(obj, RunConfig) and f.name == "model":
      # A section without a size names its widths itself (resolve_model's "custom").
      c.model = model_section(**{"size": CUSTOM, **value})
    elif dataclasses.is_dataclass(value):
      c[f.name] = _to_config_dict(value)
    elif isinstance(obj, MeshConfig) and f.name == "rules" and value is not None:
      c.rules = [list(r) for r in value]
    else:
      set_config_value(c, f.name, value, hints[f.name], f)
  return c


def base_config() -> ml_collections.ConfigDict:
  """Every key a run reads, with its default (CPU-friendly; the default model is DIFF V1):
  the ConfigDict the files in ``configs/`` start from, generated from :class:`RunConfig`."""
  return RunConfig().to_config_dict()


def check_config(config: Any) -> RunConfig:
  """Validates a run config (a ConfigDict or a RunConfig) as a dry run does: everything but a
  data section whose corpus is named at launch (``data_at_launch``); returns the
  :class:`RunConfig` it resolves to.

  Raises:
    ValueError: a missing section, a model section that does not resolve (an unknown arm
      or size, a bad width), a non-positive count, or a float option that is not finite or
      out of its range; the message names the value.
  """
  return RunConfig.from_config(config, data_at_launch=True)
