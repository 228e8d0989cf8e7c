"""Matched arms and parameter counts, and a run's ``model`` section resolved to its model.

:func:`matched_configs`, :func:`count_params` (docs/model.md#the-lm) and :func:`resolve_model`,
the one place that turns a run's ``model`` section into its ``ModelConfig`` (docs/training.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from diffjax import arms
from diffjax.core.config import DEFAULT_V2_MATCH, V2_MATCHING, ModelConfig
from diffjax.model.sizes import CUSTOM, WIDTHS, size_widths


def matched_configs(
  baseline: ModelConfig, *, v2_match: str = DEFAULT_V2_MATCH, names=None
) -> dict[str, ModelConfig]:
  """The arms (``names``, default every registered arm) matched to one Transformer spec.

  DIFF V1 halves the heads and kv heads and keeps the component width d (value 2d), so its
  projections have the baseline's shapes (+6d parameters per layer). DIFF V2 keeps the
  baseline's heads and doubles the query heads inside the module, which adds E·h·d + E·h
  parameters per layer. ``v2_match`` says what V2 is matched on: ``"params"`` (the default:
  the SwiGLU width shrinks so the total is within 0.5 % of the Transformer's; the paper
  compares at matched parameters) or ``"heads"`` (the same heads and widths, V2 is larger).
  ``names`` defaults to :func:`diffjax.arms.default_names`; the grouped arms are matched
  when named (diffjax.arms.gda_v1 and gda_v2 give their rules).
  """
  if not arms.get(baseline.attention).is_baseline:
    raise ValueError(
      f"matched_configs takes the {arms.BASELINE} spec; got attention={baseline.attention!r}."
    )
  if v2_match not in V2_MATCHING:
    raise ValueError(f"v2_match={v2_match!r} must be one of {V2_MATCHING}.")
  return {name: arms.get(name).match(baseline, v2_match) for name in names or arms.default_names()}


def attention_params(cfg: ModelConfig) -> int:
  """Parameters of one attention layer."""
  return arms.get(cfg.attention).attention_params(cfg)


def count_params(cfg: ModelConfig) -> int:
  """Total parameters of the LM, computed from the config (no model is built)."""
  e = cfg.d_model
  # PolyNorm's 3 weights and bias per layer (mlp_activation="polynorm").
  poly = 4 if cfg.mlp_activation == "polynorm" else 0
  per_layer = attention_params(cfg) + 3 * e * cfg.mlp_dim + 2 * e + poly
  head = 0 if cfg.tie_embeddings else e * cfg.vocab_size
  return cfg.vocab_size * e + cfg.num_layers * per_layer + e + head


# Keys of a run's model section that are not ModelConfig fields.
RUN_KEYS = ("arm", "size", "v2_match", "unmatched")
# Any valid vocabulary for matching: the arms' widths do not depend on it.
_MATCH_VOCAB = 258


@dataclasses.dataclass(frozen=True)
class ArmModel:
  """The model a run trains and what it is matched to.

  Attributes:
    config: the arm's own model (its widths derived from ``baseline``).
    baseline: the Transformer the arms are matched to.
    v2_match: how DIFF V2 is matched.
    unmatched: the explicit arm widths applied after matching ({} when matched).
  """

  config: ModelConfig
  baseline: ModelConfig
  v2_match: str
  unmatched: dict[str, int] = dataclasses.field(default_factory=dict)

  @property
  def arm(self) -> str:
    return self.config.attention

  @property
  def matched(self) -> bool:
    return not self.unmatched

  def param_counts(self) -> dict[str, int]:
    """Parameters of this model and of the arms its baseline matches (an arm that cannot
    be matched to it, e.g. DIFF V1 for odd head counts, is left out)."""
    counts = {}
    for name in arms.names():
      try:
        counts[name] = count_params(arms.get(name).match(self.baseline, self.v2_match))
      except ValueError:
        continue
    counts["this run"] = count_params(self.config)
    return counts

  def describe(self) -> str:
    """One line: the arm, what it is matched to, and its parameters."""
    counts = self.param_counts()
    base = (
      f"the Transformer of {self.baseline.d_model} x {self.baseline.num_layers} layers, "
      f"{self.baseline.num_heads} heads of {self.baseline.head_dim}"
    )
    if self.matched:
      return (
        f"arm={self.arm} matched to {base} (v2_match={self.v2_match}): "
        f"{counts['this run']:,} parameters (Transformer {counts[arms.BASELINE]:,})"
      )
    sets = ", ".join(f"{k}={v}" for k, v in sorted(self.unmatched.items()))
    return (
      f"arm={self.arm} UNMATCHED ({sets} set explicitly): {counts['this run']:,} "
      f"parameters, while the {self.arm} arm matched to {base} has "
      f"{counts.get(self.arm, 0):,} and the Transformer {counts[arms.BASELINE]:,}"
    )


def _clean(value: Any) -> Any:
  return dict(value) if isinstance(value, Mapping) else value


def resolve_model(section: Mapping[str, Any], vocab_size: int | None = None) -> ArmModel:
  """The :class:`ArmModel` of a run's ``model`` section (see the module docstring).

  Args:
    section: the section as a mapping (``config.model.to_dict()``).
    vocab_size: the vocabulary to use where the section says -1 (the tokenizer's). None
      leaves a placeholder vocabulary of 258 there, enough for checks and widths (the
      parameter counts then assume it).
  Raises:
    ValueError: an unknown arm, size, key or v2_match, a width that is not set, or widths
      that do not match (e.g. odd head counts for DIFF V1), naming the key.
  """
  section = {k: _clean(v) for k, v in section.items()}
  if "attention" in section:
    raise ValueError(
      f"model.attention={section['attention']!r}: a run chooses its arm with "
      "model.arm (--config.model.arm=diff_v2), which re-derives the arm's widths "
      "from the baseline it is matched to."
    )
  arm = section.get("arm")
  if arm not in arms.names():
    raise ValueError(
      f"model.arm={arm!r} is not one of {arms.names()}; set --config.model.arm=<arm>."
    )
  v2_match = section.get("v2_match") or DEFAULT_V2_MATCH
  if v2_match not in V2_MATCHING:
    raise ValueError(f"model.v2_match={v2_match!r} must be one of {V2_MATCHING}.")
  size = section.get("size", CUSTOM)
  widths = {} if size == CUSTOM else size_widths(size)
  widths.update({k: int(section[k]) for k in WIDTHS if section.get(k) is not None})
  missing = [k for k in WIDTHS if k not in widths]
  if missing:
    raise ValueError(
      f"model.size={size!r} leaves {missing} unset; name a size "
      f"(--config.model.size=default) or set each width "
      f"(--config.model.{missing[0]}=<int>)."
    )
  unmatched = {k: int(v) for k, v in (section.get("unmatched") or {}).items() if v is not None}
  bad = sorted(set(unmatched) - set(WIDTHS))
  if bad:
    raise ValueError(f"model.unmatched keys {bad} are not widths; the widths are {WIDTHS}.")
  passed = {k: v for k, v in section.items() if k not in RUN_KEYS and k not in WIDTHS}
  vocab = int(passed.pop("vocab_size", -1))
  if vocab == -1 and vocab_size is not None:
    vocab = int(vocab_size)
  try:
    baseline = ModelConfig.from_dict(
      {
        **passed,
        **widths,
        "attention": arms.BASELINE,
        "vocab_size": _MATCH_VOCAB if vocab == -1 else vocab,
      }
    )
    arm_cfg = matched_configs(baseline, v2_match=v2_match, names=(arm,))[arm]
    # Only a width that differs from the matched one unmatches the run.
    unmatched = {k: v for k, v in unmatched.items() if getattr(arm_cfg, k) != v}
    if unmatched:
      arm_cfg = arm_cfg.replace(**unmatched)
    arms.get(arm).check(arm_cfg)
  except ValueError as e:
    raise ValueError(f"model (arm={arm}, size={size}): {e}") from None
  return ArmModel(arm_cfg, baseline, v2_match, unmatched)
