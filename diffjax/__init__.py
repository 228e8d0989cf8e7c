"""diffjax: the Differential Transformer (DIFF V1 and V2) in JAX / Flax NNX.

The public API (ops, NNX modules, arms, the LM, ``generate``, ``cpu_setup``) is listed in
docs/model.md#public-api.
"""

from diffjax import arms
from diffjax.cpu import cpu_compiler_options, cpu_setup
from diffjax.generation import generate
from diffjax.model import ARMS, DecoderLM, Hooks, ModelConfig, count_params, matched_configs
from diffjax.nn import (
  Attention,
  AttentionOptions,
  DiffV1Attention,
  DiffV2Attention,
  RMSNorm,
  SwiGLU,
  apply_rope,
)
from diffjax.ops import (
  diff_v1_attention,
  diff_v1_attention_core,
  diff_v2_attention,
  dot_product_attention,
  lambda_init_for_layer,
)

__version__ = "0.1.0"

__all__ = [
  "arms",
  "ARMS",
  "DecoderLM",
  "Hooks",
  "ModelConfig",
  "count_params",
  "matched_configs",
  "Attention",
  "AttentionOptions",
  "DiffV1Attention",
  "DiffV2Attention",
  "RMSNorm",
  "SwiGLU",
  "apply_rope",
  "diff_v1_attention",
  "diff_v1_attention_core",
  "diff_v2_attention",
  "dot_product_attention",
  "lambda_init_for_layer",
  "generate",
  "cpu_setup",
  "cpu_compiler_options",
]
