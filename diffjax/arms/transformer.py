"""The Transformer: LLaMA-style multi-head / grouped-query attention, the baseline arm.

``num_heads`` query heads of width ``head_dim`` read ``num_kv_heads`` kv heads; W_q, W_k,
W_v, W_o without biases. Every other arm is matched to a Transformer spec. Its checkpoints
are transformers' ``LlamaForCausalLM``.
"""

from __future__ import annotations

from diffjax.arms.spec import ArmSpec, register
from diffjax.core import op_specs
from diffjax.nn.attention import Attention


def attention_params(cfg) -> int:
  e, h, k, d = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  return e * h * d + 2 * e * k * d + h * d * e


def match(baseline, v2_match: str):
  del v2_match
  return baseline


SPEC = register(
  ArmSpec(
    name="transformer",
    title="Transformer",
    build=lambda cfg, layer_index, options, rngs: Attention(
      cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, options=options, rngs=rngs
    ),
    op=op_specs.MHA,
    decode_op=op_specs.MHA_DECODE,
    heads="attention heads",
    value_head_dim=lambda cfg: cfg.head_dim,
    attention_params=attention_params,
    matmul_params=attention_params,
    # Scores q.k (2d) and P V (2d) per head.
    attention_flops=lambda cfg: 4 * cfg.head_dim * cfg.num_heads,
    match=match,
    hf_architecture="LlamaForCausalLM",
    color="tab:gray",
  )
)
