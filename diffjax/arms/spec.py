"""What an arm is, in one frozen object (:class:`ArmSpec`), and the registry of arms by name.

Everything the package asks about an arm is a field of its spec; :func:`register` adds one of
your own (docs/model.md#an-arm-of-your-own, docs/architecture.md#arms-one-spec-each).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

from diffjax.core.op_specs import OpSpec
from diffjax.ops import dispatch

# The arm every other arm is matched to and compared against.
BASELINE = "transformer"
# The order reports and tables list the builtin arms in.
_BUILTIN_ORDER = (BASELINE, "diff_v1", "diff_v2", "gda_v1", "gda_v2")
# What the evaluation reports about lambda (diffjax.eval): nothing, one value per layer, or a
# distribution over tokens and heads of a squashed lambda.
LAMBDA_REPORTS = ("none", "scalar", "sigmoid")


def _nothing(cfg) -> None:
  del cfg


def _no_constants(cfg) -> dict:
  del cfg
  return {}


@dataclasses.dataclass(frozen=True)
class Retrofit:
  """How an arm starts from a trained Transformer's parameters.

  Attributes:
    config: ``(source_cfg, **options) -> cfg``, the arm's model for a Transformer
      ``source_cfg`` (raises ValueError when the source cannot be retrofitted).
    attention: ``(source_attention_params, layer_index, rng, **options) -> params``, one
      layer's attention parameters (numpy) from the source layer's.
    options: the keyword options this arm's retrofit takes, with their defaults.
  """

  config: Callable[..., Any]
  attention: Callable[..., dict]
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ArmSpec:
  """One arm. Callables take a :class:`~diffjax.model.ModelConfig` ``cfg`` of this arm.

  Attributes:
    name: the arm's name (``model.arm``, ``ModelConfig.attention``).
    title: how reports and messages name it ("DIFF V1").
    build: ``(cfg, layer_index, options, rngs) -> nnx.Module``, the attention module of one
      layer (``options``: the :class:`~diffjax.nn.AttentionOptions` every arm shares).
    op, decode_op: the ops the module calls to attend and to decode one token.
    heads: what one of ``cfg.num_heads`` is, for messages ("DIFF V1 heads ...").
    value_head_dim: the width of one head's attention output.
    attention_params: the parameters of one layer's attention.
    matmul_params: those of them that take part in a matmul per token.
    attention_flops: forward FLOPs per query token and visible key, all heads of a layer.
    match: ``(baseline_cfg, v2_match) -> cfg``: this arm matched to a Transformer.
    lambda_report: what the evaluation reports about lambda (:data:`LAMBDA_REPORTS`).
    check: raises ValueError for a ``cfg`` this arm cannot build (its own fields).
    layer_constants: ``cfg -> {name: [value per layer]}``, constants the module takes per
      layer as call arguments when the layers are scanned (DIFF V1's lambda_init).
    ramp: the module takes ``mix`` (``ModelConfig.v2_mix``: a retrofit's ramp).
    head_norm: the module applies a per-head norm around which it calls ``Hooks.norm``.
    hf_architecture: the transformers class whose checkpoints hold this arm exactly, or
      None (:mod:`diffjax.convert`).
    retrofit: how it starts from a trained Transformer, or None.
    color: its color in the report's plots.
    by_default: whether comparisons, ``matched_configs()`` and the preset tables include it
      when not given their arms (the grouped arms, which only some head counts match, ask
      to be named).
  """

  name: str
  title: str
  build: Callable[..., Any]
  op: OpSpec
  decode_op: OpSpec
  heads: str
  value_head_dim: Callable[[Any], int]
  attention_params: Callable[[Any], int]
  matmul_params: Callable[[Any], int]
  attention_flops: Callable[[Any], int]
  match: Callable[[Any, str], Any]
  lambda_report: str = "none"
  check: Callable[[Any], None] = _nothing
  layer_constants: Callable[[Any], dict[str, list[float]]] = _no_constants
  ramp: bool = False
  head_norm: bool = False
  hf_architecture: str | None = None
  retrofit: Retrofit | None = None
  color: str = "tab:purple"
  by_default: bool = True

  def __post_init__(self):
    if self.lambda_report not in LAMBDA_REPORTS:
      raise ValueError(
        f"ArmSpec {self.name!r}: lambda_report={self.lambda_report!r} is not one of "
        f"{LAMBDA_REPORTS}."
      )

  @property
  def is_baseline(self) -> bool:
    return self.name == BASELINE

  @property
  def maps(self) -> int:
    """Softmax maps per output head: 1 (the Transformer) or 2 (DIFF)."""
    return self.op.maps


_ARMS: dict[str, ArmSpec] = {}
_MODULES: dict[str, str] = {}  # arm -> the module that registered it


def register(spec: ArmSpec, *, replace: bool = False) -> ArmSpec:
  """Adds ``spec`` to the registry (its ops to the dispatch table's ops); returns it.

  Register from the module that defines the arm, and name that module where a run needs
  it (a config file imports it; a saved run records it, see :func:`get`).
  """
  if not isinstance(spec, ArmSpec):
    raise TypeError(f"register takes an ArmSpec; got {type(spec).__name__}.")
  if spec.name in _ARMS and not replace and _ARMS[spec.name] is not spec:
    raise ValueError(
      f"An arm named {spec.name!r} is registered already (from "
      f"{_MODULES[spec.name]}); choose another name or pass replace=True."
    )
  for op in (spec.op, spec.decode_op):
    if op.name not in dispatch.OPS:
      dispatch.register_op(op)
  _ARMS[spec.name] = spec
  _MODULES[spec.name] = sys._getframe(1).f_globals.get("__name__", "")
  return spec


def get(name: str, module: str | None = None) -> ArmSpec:
  """The arm called ``name``. An unknown name is looked up once more after importing
  ``module`` (a saved run records the module that defines its arm)."""
  if name not in _ARMS and module:
    try:
      importlib.import_module(module)
    except ImportError as e:
      raise ValueError(
        f"arm {name!r} is defined in module {module!r}, which cannot be imported ({e}); "
        "put it on PYTHONPATH."
      ) from None
  if name not in _ARMS:
    raise ValueError(
      f"Unknown arm {name!r}; the arms are {names()}. An arm of your own must be registered "
      "(diffjax.arms.register) by a module the run imports, e.g. its config file."
    )
  return _ARMS[name]


def names() -> tuple[str, ...]:
  """The registered arms' names: the builtin ones first, then others in registration order."""
  return tuple(
    sorted(
      _ARMS, key=lambda n: _BUILTIN_ORDER.index(n) if n in _BUILTIN_ORDER else len(_BUILTIN_ORDER)
    )
  )


def default_names() -> tuple[str, ...]:
  """The arms taken when none are named (:attr:`ArmSpec.by_default`), in :func:`names` order."""
  return tuple(n for n in names() if _ARMS[n].by_default)


def all_arms() -> tuple[ArmSpec, ...]:
  """The registered arms, in the order of :func:`names`."""
  return tuple(_ARMS[n] for n in names())


def module_of(name: str) -> str:
  """The module that registered arm ``name`` (what a saved run records)."""
  get(name)
  return _MODULES[name]
