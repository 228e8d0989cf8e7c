"""The model's typed configuration and the value lists its fields take.

A leaf: it imports nothing from the modules it configures, so every layer can read it.
What an arm's own fields mean and which values it accepts together is the arm's business
(:mod:`diffjax.arms`), checked when a model of the arm is built or resolved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from diffjax.core.dtypes import check_float64_enabled

# RoPE pairing: (x[2i], x[2i+1]) as the DIFF reference code, or (x[i], x[i + D/2]) as NeoX/HF.
ROPE_STYLES = ("interleaved", "half")
# What computes attention (diffjax.ops.dispatch): "auto" picks per platform and input.
IMPLEMENTATIONS = ("auto", "xla", "xla_cpu", "pallas", "pallas_tpu", "pallas_gpu", "stock")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
# The MLP's gate activation: LLaMA's silu, or Motif's PolyNorm (3 weights and a bias per layer).
MLP_ACTIVATIONS = ("swiglu", "polynorm")
# float64 needs 64-bit JAX (jax_enable_x64); it then runs end to end in float64.
DTYPES = {
  "float32": jnp.float32,
  "bfloat16": jnp.bfloat16,
  "float16": jnp.float16,
  "float64": jnp.float64,
}
# DIFF V2's ablations: which query heads pair up, and how lambda is squashed.
V2_PAIRINGS = ("group", "across_groups")
V2_LAMBDAS = ("sigmoid", "identity")
# How an arm is matched to its Transformer: the paper compares at matched parameters.
V2_MATCHING = ("heads", "params")
DEFAULT_V2_MATCH = "params"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A LLaMA-style decoder LM whose attention is the arm named by ``attention``.

  Head counts are those of the arm itself (see each arm in :mod:`diffjax.arms`);
  :func:`diffjax.model.matched_configs` derives the arms from one Transformer spec.
  """

  attention: str = "diff_v1"  # the arm: a name registered in diffjax.arms
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
  mlp_activation: str = "swiglu"  # one of MLP_ACTIVATIONS
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
  # lambda_init = 0.8 - 0.6 exp(-0.3 (l + offset)) for layer l from 0: 0 is the DIFF code's,
  # -1 Motif's (DIFF V1 and V1-style grouped attention).
  diff_lambda_init_offset: int = 0
  # Grouped differential attention (arms gda_v1, gda_v2): signal heads per noise head, r.
  gda_ratio: int = 4
  # DIFF V2 ablations of its write-up: pair query heads i and i + h, which read different kv
  # groups ("across_groups"); lambda = x W_lambda without the sigmoid ("identity").
  v2_pairing: str = "group"
  v2_lambda: str = "sigmoid"
  # DIFF V2 retrofitted with its second query heads "mixed in": the subtraction is scaled by
  # min(step / v2_mix_steps, 1), so step 0 is the source Transformer and the model is a plain
  # V2 from step v2_mix_steps on (0: no ramp). The train and eval steps pass the step.
  v2_mix_steps: int = 0

  def __post_init__(self):
    if not isinstance(self.attention, str) or not self.attention:
      raise ValueError(f"attention={self.attention!r} must name an arm (e.g. 'diff_v1').")
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
    _one_of("rope_style", self.rope_style, ROPE_STYLES)
    for name in ("dtype", "param_dtype"):
      _one_of(name, getattr(self, name), tuple(DTYPES))
      check_float64_enabled(name, DTYPES[getattr(self, name)])
    _one_of("remat", self.remat, REMAT_POLICIES)
    _one_of("mlp_activation", self.mlp_activation, MLP_ACTIVATIONS)
    _one_of("v2_pairing", self.v2_pairing, V2_PAIRINGS)
    _one_of("v2_lambda", self.v2_lambda, V2_LAMBDAS)
    for name in ("gda_ratio", "diff_lambda_init_offset"):
      if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
        raise ValueError(f"{name}={getattr(self, name)!r} must be an integer.")
    if self.gda_ratio < 1:
      raise ValueError(f"gda_ratio={self.gda_ratio} must be >= 1 (signal heads per noise head).")
    if isinstance(self.v2_mix_steps, bool) or int(self.v2_mix_steps) < 0:
      raise ValueError(f"v2_mix_steps={self.v2_mix_steps!r} must be an integer >= 0 (0: no ramp).")
    _one_of("implementation", self.implementation, IMPLEMENTATIONS)

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def weight_dtype(self):
    """dtype of the weight matrices; norm gains and lambda vectors: float32 (or float64)."""
    return DTYPES[self.param_dtype]

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
    """The retrofit ramp's scale at training ``step`` (a float32 scalar), or None without a
    ramp (``v2_mix_steps == 0``): the full subtraction. Only an arm that ramps reads it."""
    if not self.v2_mix_steps:
      return None
    return jnp.clip(jnp.asarray(step, jnp.float32) / float(self.v2_mix_steps), 0.0, 1.0)


def _one_of(name: str, value: Any, allowed: tuple) -> None:
  if value not in allowed:
    raise ValueError(f"{name}={value!r} is not one of {allowed}.")
