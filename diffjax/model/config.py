"""Typed model configuration, matched arms and parameter counts.

Head counts are those of the arm itself:
  * ``transformer``: ``num_heads`` query heads of width ``head_dim``;
  * ``diff_v1``: ``num_heads`` DIFF heads H, each with two ``head_dim``-wide
    components and a 2*``head_dim`` value (a baseline with 2H heads matches it);
  * ``diff_v2``: ``num_heads`` output heads h, each fed by a pair of query heads
    (2h query heads); keys, values and W_o are the baseline's.
:func:`matched_configs` derives the DIFF arms from one baseline spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from diffjax.core.dtypes import check_float64_enabled
from diffjax.nn.attention import check_v2_ablation
from diffjax.nn.rope import ROPE_STYLES
from diffjax.ops.dispatch import IMPLEMENTATIONS

ARMS = ("transformer", "diff_v1", "diff_v2")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
# float64 needs 64-bit JAX (jax_enable_x64); it then runs end to end in float64.
_DTYPES = {
  "float32": jnp.float32,
  "bfloat16": jnp.bfloat16,
  "float16": jnp.float16,
  "float64": jnp.float64,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A LLaMA-style decoder LM whose attention is one of :data:`ARMS`."""

  attention: str = "diff_v1"
  vocab_size: int = 258
  d_model: int = 256
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 4
  head_dim: int = 32
  mlp_dim: int = 688
  rope_theta: float = 10000.0
  rope_style: str = "interleaved"
  norm_eps: float = 1e-5
  diff_norm_eps: float = 1e-5
  tie_embeddings: bool = False
  init_std: float = 0.02
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: str = "none"
  # Stack the blocks' parameters and run them under lax.scan: the compiled program holds
  # one block, so deep models compile in seconds. Same parameters and results either way.
  scan_layers: bool = False
  implementation: str = "auto"
  block_sizes: Mapping[str, Any] | None = None
  interpret: bool = False
  # DIFF V1 ablations (paper Table 6): drop the per-head norm; a constant lambda.
  diff_use_norm: bool = True
  diff_fixed_lambda: float | None = None
  # DIFF V2 ablations of its write-up: pair query heads i and i + h, which read different kv
  # groups ("across_groups"); lambda = x W_lambda without the sigmoid ("identity").
  v2_pairing: str = "group"
  v2_lambda: str = "sigmoid"
  # DIFF V2 retrofitted with its second query heads "mixed in": the subtraction is scaled by
  # min(step / v2_mix_steps, 1), so step 0 is the source Transformer and the model is a plain
  # V2 from step v2_mix_steps on (0: no ramp). The train and eval steps pass the step.
  v2_mix_steps: int = 0

  def __post_init__(self):
    if self.attention not in ARMS:
      raise ValueError(f"attention={self.attention!r} is not one of {ARMS}.")
    for name in (
      "vocab_size",
      "d_model",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
      "mlp_dim",
    ):
      if int(getattr(self, name)) <= 0:
        raise ValueError(f"{name}={getattr(self, name)} must be a positive integer.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_heads={self.num_heads} must be a multiple of "
        f"num_kv_heads={self.num_kv_heads} (grouped-query attention)."
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE.")
    if self.rope_style not in ROPE_STYLES:
      raise ValueError(f"rope_style={self.rope_style!r} is not one of {ROPE_STYLES}.")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"{name}={getattr(self, name)!r} is not one of {tuple(_DTYPES)}.")
      check_float64_enabled(name, _DTYPES[getattr(self, name)])
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat={self.remat!r} is not one of {REMAT_POLICIES}.")
    if self.attention == "diff_v2":
      check_v2_ablation(self.v2_pairing, self.v2_lambda, self.num_kv_heads)
    if isinstance(self.v2_mix_steps, bool) or int(self.v2_mix_steps) < 0:
      raise ValueError(f"v2_mix_steps={self.v2_mix_steps!r} must be an integer >= 0 (0: no ramp).")
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(f"implementation={self.implementation!r} is not one of {IMPLEMENTATIONS}.")

  @property
  def compute_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def weight_dtype(self):
    """dtype of the weight matrices; norm gains and lambda vectors: float32 (or float64)."""
    return _DTYPES[self.param_dtype]

  @property
  def value_head_dim(self) -> int:
    return 2 * self.head_dim if self.attention == "diff_v1" else self.head_dim

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
    """Builds a config from a mapping (e.g. ``config.model.to_dict()``)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
      raise ValueError(f"Unknown model config keys {unknown}; valid keys are {sorted(fields)}.")
    d = dict(d)
    if d.get("block_sizes") is not None:
      d["block_sizes"] = dict(d["block_sizes"])
    return cls(**d)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def replace(self, **kw) -> ModelConfig:
    return dataclasses.replace(self, **kw)

  def v2_mix(self, step) -> Any:
    """The DIFF V2 subtraction's scale at training ``step`` (a float32 scalar), or None when
    there is no ramp (``v2_mix_steps == 0`` or another arm): the full subtraction."""
    if self.attention != "diff_v2" or not self.v2_mix_steps:
      return None
    return jnp.clip(jnp.asarray(step, jnp.float32) / float(self.v2_mix_steps), 0.0, 1.0)


V2_MATCHING = ("heads", "params")
# The one default everywhere (runs, comparisons, tables): the paper compares at matched
# parameters.
DEFAULT_V2_MATCH = "params"
# How close "params" matching must bring DIFF V2's total to the Transformer's.
PARAM_MATCH_TOLERANCE = 0.005


def matched_configs(
  baseline: ModelConfig, *, v2_match: str = DEFAULT_V2_MATCH
) -> dict[str, ModelConfig]:
  """The three arms matched to one baseline spec.

  DIFF V1 halves the heads and kv heads and keeps the component width d (value 2d),
  so its projections have the baseline's shapes (+6d parameters per layer). DIFF V2
  keeps the baseline's heads and doubles the query heads inside the module, which adds
  E·h·d + E·h parameters per layer. ``v2_match`` says what V2 is matched on:

    * ``"params"`` (the default): the SwiGLU width ``mlp_dim`` shrunk by round((h·d + h) / 3)
      per layer (its 3·E·mlp_dim weights pay for the extra E·h·d + E·h), so the total parameter
      count is within 0.5 % of the Transformer's; nothing else changes. The paper's
      comparisons are at matched parameters;
    * ``"heads"``: the same heads and everything else as the baseline (V2 is larger).
  """
  if baseline.attention != "transformer":
    raise ValueError(
      f"matched_configs takes the transformer spec; got attention={baseline.attention!r}."
    )
  if v2_match not in V2_MATCHING:
    raise ValueError(f"v2_match={v2_match!r} must be one of {V2_MATCHING}.")
  if baseline.num_heads % 2 or baseline.num_kv_heads % 2:
    raise ValueError(
      f"DIFF V1 pairs baseline heads, so num_heads={baseline.num_heads} and "
      f"num_kv_heads={baseline.num_kv_heads} must both be even."
    )
  v1 = baseline.replace(
    attention="diff_v1", num_heads=baseline.num_heads // 2, num_kv_heads=baseline.num_kv_heads // 2
  )
  v2 = baseline.replace(attention="diff_v2")
  if v2_match == "params":
    h, d = baseline.num_heads, baseline.head_dim
    mlp_dim = baseline.mlp_dim - round((h * d + h) / 3)
    if mlp_dim < 1:
      raise ValueError(
        f"Cannot match DIFF V2's parameters by its FFN: mlp_dim={baseline.mlp_dim} is smaller "
        f"than the {round((h * d + h) / 3)} columns its extra query heads cost; use "
        "v2_match='heads' or a wider FFN."
      )
    v2 = v2.replace(mlp_dim=mlp_dim)
    n_base, n_v2 = count_params(baseline), count_params(v2)
    if abs(n_v2 - n_base) > PARAM_MATCH_TOLERANCE * n_base:  # pragma: no cover - arithmetic
      raise ValueError(
        f"DIFF V2 with mlp_dim={mlp_dim} has {n_v2:,} parameters against the "
        f"Transformer's {n_base:,}, more than 0.5 % apart."
      )
  return {"transformer": baseline, "diff_v1": v1, "diff_v2": v2}


def attention_params(cfg: ModelConfig) -> int:
  """Parameters of one attention layer."""
  e, h, k, d = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  if cfg.attention == "transformer":
    return e * h * d + 2 * e * k * d + h * d * e
  if cfg.attention == "diff_v1":
    return e * h * 2 * d + e * k * 2 * d + e * k * 2 * d + h * 2 * d * e + 4 * d + 2 * d
  return e * 2 * h * d + 2 * e * k * d + h * d * e + e * h


def count_params(cfg: ModelConfig) -> int:
  """Total parameters of the LM, computed from the config (no model is built)."""
  e = cfg.d_model
  per_layer = attention_params(cfg) + 3 * e * cfg.mlp_dim + 2 * e
  head = 0 if cfg.tie_embeddings else e * cfg.vocab_size
  return cfg.vocab_size * e + cfg.num_layers * per_layer + e + head
