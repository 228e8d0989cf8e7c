"""DIFF V1 (arXiv 2410.05258): two softmax maps per head, subtracted with one lambda per layer.

The math and its layout: the README's "What is exact"; its matching to a Transformer:
docs/model.md#the-lm. Its checkpoints are transformers' ``DiffLlamaForCausalLM``.
"""

from __future__ import annotations

import math

import numpy as np

from diffjax.arms.spec import ArmSpec, Retrofit, register
from diffjax.core import op_specs
from diffjax.core.reference import lambda_init_for_layer
from diffjax.nn.attention import DiffV1Attention


def build(cfg, layer_index: int, options, rngs, attention=DiffV1Attention, **kw):
  """The layer's module; ``attention`` and ``kw``: the grouped form's class and ratio."""
  return attention(
    cfg.d_model,
    cfg.num_heads,
    cfg.num_kv_heads,
    cfg.head_dim,
    **kw,
    layer_index=layer_index,
    options=options,
    norm_eps=cfg.diff_norm_eps,
    use_norm=cfg.diff_use_norm,
    fixed_lambda=cfg.diff_fixed_lambda,
    lambda_init_offset=cfg.diff_lambda_init_offset,
    rngs=rngs,
  )


def matmul_params(cfg) -> int:
  e, h, k, d = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  return e * h * 2 * d + 2 * e * k * 2 * d + h * 2 * d * e


def match(baseline, v2_match: str):
  """Half the heads and kv heads of the baseline, the same component width d."""
  del v2_match
  if baseline.num_heads % 2 or baseline.num_kv_heads % 2:
    raise ValueError(
      f"DIFF V1 pairs baseline heads, so num_heads={baseline.num_heads} and "
      f"num_kv_heads={baseline.num_kv_heads} must both be even."
    )
  return baseline.replace(
    attention="diff_v1", num_heads=baseline.num_heads // 2, num_kv_heads=baseline.num_kv_heads // 2
  )


def retrofit_config(source):
  """The matched V1 of a Transformer ``source`` (its MLP and head widths unchanged)."""
  if source.num_heads % 2 or source.num_kv_heads % 2:
    raise ValueError(
      f"num_heads={source.num_heads}, num_kv_heads={source.num_kv_heads}: DIFF V1 pairs the "
      "source's heads and kv heads, so both must be even."
    )
  return match(source, "heads")


def retrofit_attention(src, layer_index: int, rng=None) -> dict:
  """A V1 start from a Transformer layer with lambda = 0 (no V1 computes the source's function).

  q1/k1 of DIFF head i are source head 2i's query and key, q2 is zero (its map is then
  uniform over the visible keys) and k2 is head 2i+1's key; the value of kv group g is
  source kv heads 2g and 2g+1 side by side, W_o's two halves are source heads 2i and 2i+1's;
  the lambda vectors make lambda = 0 exactly (lq1 = lk1 = 0, lq2 . lk2 = log(1 + lambda_init))
  and the norm's gain is 1 / (1 - lambda_init), cancelling the output scale.
  """
  del rng
  q_ExNxD, k_ExKxD = np.asarray(src["q"]), np.asarray(src["k"])
  v_ExKxD, o_NxDxE = np.asarray(src["v"]), np.asarray(src["o"])
  e, n, d = q_ExNxD.shape
  q = np.zeros((e, n // 2, 2, d), q_ExNxD.dtype)
  q[:, :, 0] = q_ExNxD[:, 0::2]  # q1: heads 2i; q2 = 0
  lam_init = lambda_init_for_layer(layer_index)
  side = math.sqrt(math.log1p(lam_init) / d)
  f32 = np.float32
  return {
    "q": q,
    "k": np.stack([k_ExKxD[:, 0::2], k_ExKxD[:, 1::2]], axis=2),  # [E, K/2, 2, d]
    "v": np.concatenate([v_ExKxD[:, 0::2], v_ExKxD[:, 1::2]], axis=-1),  # [E, K/2, 2d]
    "o": np.concatenate([o_NxDxE[0::2], o_NxDxE[1::2]], axis=1),  # [N/2, 2d, E]
    "lambda_q1": np.zeros(d, f32),
    "lambda_k1": np.zeros(d, f32),
    "lambda_q2": np.full(d, side, f32),
    "lambda_k2": np.full(d, side, f32),
    "norm_scale": np.full(2 * d, 1.0 / (1.0 - lam_init), f32),
  }


SPEC = register(
  ArmSpec(
    name="diff_v1",
    title="DIFF V1",
    build=build,
    op=op_specs.DIFF_V1,
    decode_op=op_specs.DIFF_V1_DECODE,
    heads="DIFF V1 heads (each with both components and its 2d value)",
    value_head_dim=lambda cfg: 2 * cfg.head_dim,
    # The four lambda vectors (d each) and the norm gain (2d) are not matmul weights.
    attention_params=lambda cfg: matmul_params(cfg) + 6 * cfg.head_dim,
    matmul_params=matmul_params,
    # Two maps of d-wide components (2 x 2d) and the combined map times the 2d-wide value
    # (4d): 8d per DIFF head, the same as the two baseline heads it replaces.
    attention_flops=lambda cfg: 8 * cfg.head_dim * cfg.num_heads,
    match=match,
    lambda_report="scalar",
    layer_constants=lambda cfg: {
      "lambda_init": [
        lambda_init_for_layer(i, cfg.diff_lambda_init_offset) for i in range(cfg.num_layers)
      ]
    },
    head_norm=True,
    hf_architecture="DiffLlamaForCausalLM",
    retrofit=Retrofit(config=retrofit_config, attention=retrofit_attention),
    color="tab:blue",
  )
)

__all__ = ["SPEC", "build", "match", "retrofit_attention", "retrofit_config"]
