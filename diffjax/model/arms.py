"""From a run's ``model`` section to the model it trains: one arm, matched to one baseline.

A run names its arm and the Transformer it is matched to, never the arm's own widths:

  * ``arm``: "transformer", "diff_v1" or "diff_v2";
  * ``size``: a named baseline size (:mod:`diffjax.model.sizes`) or "custom";
  * the baseline widths ``d_model, num_layers, num_heads, num_kv_heads, head_dim, mlp_dim``:
    None takes the size's; a value replaces it (every arm follows, still matched);
  * ``v2_match``: how DIFF V2 is matched (:func:`diffjax.model.matched_configs`);
  * ``unmatched``: widths of the arm itself, applied after matching. Allowed, but the run is
    then not matched to its baseline, and :meth:`ArmModel.describe` says so with the counts;
  * every other key is a :class:`~diffjax.model.ModelConfig` field passed through as it is.

:func:`resolve_model` is the one place that turns such a section into a
:class:`~diffjax.model.ModelConfig`: training, comparisons, ahead-of-time compiles and
evaluation all go through it, so changing the arm always re-derives the widths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from diffjax.model.config import (
  ARMS,
  DEFAULT_V2_MATCH,
  V2_MATCHING,
  ModelConfig,
  count_params,
  matched_configs,
)
from diffjax.model.sizes import CUSTOM, WIDTHS, size_widths

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
    """Parameters of this model and of the matched arms of its baseline."""
    arms = matched_configs(self.baseline, v2_match=self.v2_match)
    counts = {arm: count_params(cfg) for arm, cfg in arms.items()}
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
        f"{counts['this run']:,} parameters (Transformer {counts['transformer']:,})"
      )
    sets = ", ".join(f"{k}={v}" for k, v in sorted(self.unmatched.items()))
    return (
      f"arm={self.arm} UNMATCHED ({sets} set explicitly): {counts['this run']:,} "
      f"parameters, while the {self.arm} arm matched to {base} has "
      f"{counts[self.arm]:,} and the Transformer {counts['transformer']:,}"
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
  if arm not in ARMS:
    raise ValueError(f"model.arm={arm!r} is not one of {ARMS}; set --config.model.arm=<arm>.")
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
        "attention": "transformer",
        "vocab_size": _MATCH_VOCAB if vocab == -1 else vocab,
      }
    )
    arm_cfg = matched_configs(baseline, v2_match=v2_match)[arm]
    # Only a width that differs from the matched one unmatches the run.
    unmatched = {k: v for k, v in unmatched.items() if getattr(arm_cfg, k) != v}
    if unmatched:
      arm_cfg = arm_cfg.replace(**unmatched)
  except ValueError as e:
    raise ValueError(f"model (arm={arm}, size={size}): {e}") from None
  return ArmModel(arm_cfg, baseline, v2_match, unmatched)
