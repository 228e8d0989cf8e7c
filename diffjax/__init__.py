"""diffjax: the Differential Transformer (DIFF V1 and V2) in JAX / Flax NNX.

Public API:
  * ops (arrays in, arrays out): :func:`dot_product_attention`,
    :func:`diff_v1_attention_core`, :func:`diff_v1_attention`, :func:`diff_v2_attention`
    (each with ``implementation=``), and the reference math in ``diffjax.ops.reference``;
  * Flax NNX modules: :class:`Attention`, :class:`DiffV1Attention`,
    :class:`DiffV2Attention`, :class:`RMSNorm`, :class:`SwiGLU`, :func:`apply_rope`;
  * the arms (:mod:`diffjax.arms`): one spec per attention variant, and your own with
    ``diffjax.arms.register``;
  * the LM: :class:`ModelConfig`, :class:`DecoderLM`, :func:`matched_configs`,
    :func:`count_params`, :class:`Hooks` for analysis interventions;
  * generation with a KV cache: :func:`generate` (from :mod:`diffjax.generation`);
  * the trainer's CPU settings for a loop of your own: :func:`cpu_setup`,
    :func:`cpu_compiler_options` (from :mod:`diffjax.cpu`).
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
