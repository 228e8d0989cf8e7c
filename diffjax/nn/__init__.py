"""Flax NNX modules: attention (baseline, DIFF V1, DIFF V2, their grouped forms), RoPE, norms,
MLPs."""

from diffjax.nn.attention import (
  Attention,
  AttentionOptions,
  DiffV1Attention,
  DiffV2Attention,
  GroupedDiffV1Attention,
  GroupedDiffV2Attention,
)
from diffjax.nn.layers import Embed, Hooks, PolyNormGLU, RMSNorm, SwiGLU, poly_norm
from diffjax.nn.rope import apply_rope
from diffjax.sharding import activation_sharding, constrain, logical_to_spec

__all__ = [
  "Attention",
  "AttentionOptions",
  "DiffV1Attention",
  "DiffV2Attention",
  "Embed",
  "GroupedDiffV1Attention",
  "GroupedDiffV2Attention",
  "Hooks",
  "PolyNormGLU",
  "RMSNorm",
  "SwiGLU",
  "activation_sharding",
  "constrain",
  "logical_to_spec",
  "apply_rope",
  "poly_norm",
]
