"""Grouped differential attention, V1 style (GDA, arXiv 2510.06949; Motif-2-12.7B).

H signal heads share H / r noise heads (r = ``gda_ratio``; r = 1 is DIFF V1 exactly); the
layout, the matching and the sizes: docs/model.md#grouped-differential-attention.
"""

from __future__ import annotations

import math

from diffjax.arms import diff_v1
from diffjax.arms import spec as arms_spec
from diffjax.arms.spec import ArmSpec, register
from diffjax.core import op_specs
from diffjax.core.config import V2_MATCHING
from diffjax.core.reference import lambda_init_for_layer
from diffjax.nn.attention import GroupedDiffV1Attention, check_gda_heads


def build(cfg, layer_index: int, options, rngs):
  attention, ratio = GroupedDiffV1Attention, cfg.gda_ratio
  return diff_v1.build(cfg, layer_index, options, rngs, attention=attention, ratio=ratio)


def noise_heads(cfg) -> int:
  return cfg.num_heads // cfg.gda_ratio


def matmul_params(cfg) -> int:
  e, h, k, d = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  return e * (h + noise_heads(cfg)) * d + 2 * e * k * 2 * d + h * 2 * d * e


def pay_by_ffn(baseline, cfg, attention_params, what: str):
  """``cfg`` with its SwiGLU width changed by round(extra / 3), extra: its attention's
  parameters per model column beyond the baseline's (its 3 E mlp_dim weights pay)."""
  base = arms_spec.get(baseline.attention).attention_params(baseline)
  extra = round((attention_params(cfg) - base) / (3 * cfg.d_model))
  if baseline.mlp_dim - extra < 1:
    raise ValueError(
      f"Cannot match {what}'s parameters by its FFN: mlp_dim={baseline.mlp_dim} is smaller "
      f"than the {extra} columns its attention adds; use v2_match='heads'."
    )
  return cfg.replace(mlp_dim=baseline.mlp_dim - extra)


def match(baseline, v2_match: str):
  """The baseline's H_b query heads split r : 1 into H signal and
  N noise heads (the total V1 has), with gcd(K_b / 2, N) kv groups (V1's K_b / 2 when they
  divide N); by "params" the SwiGLU width pays for the difference (within 0.5 % of the
  Transformer's parameters; tests/arms/test_gda.py checks it), by "heads" nothing else changes."""
  if v2_match not in V2_MATCHING:
    raise ValueError(f"v2_match={v2_match!r} must be one of {V2_MATCHING}.")
  r, hb, kb = baseline.gda_ratio, baseline.num_heads, baseline.num_kv_heads
  if hb % (r + 1) or kb % 2:
    raise ValueError(
      f"V1-style grouped attention at gda_ratio={r} splits the baseline's num_heads={hb} "
      f"query heads {r}:1 into signal and noise heads and pairs its num_kv_heads={kb}, so "
      f"num_heads must be a multiple of {r + 1} and num_kv_heads even."
    )
  noise = hb // (r + 1)
  cfg = baseline.replace(
    attention="gda_v1", num_heads=r * noise, num_kv_heads=math.gcd(kb // 2, noise)
  )
  if v2_match == "heads":
    return cfg
  return pay_by_ffn(baseline, cfg, attention_params, "V1-style grouped attention")


def attention_params(cfg) -> int:
  return matmul_params(cfg) + 6 * cfg.head_dim


SPEC = register(
  ArmSpec(
    name="gda_v1",
    title="GDA (V1)",
    build=build,
    op=op_specs.GDA_V1,
    decode_op=op_specs.GDA_V1_DECODE,
    heads="grouped DIFF signal heads (each with its 2d value)",
    value_head_dim=lambda cfg: 2 * cfg.head_dim,
    attention_params=attention_params,
    matmul_params=matmul_params,
    # Scores of the H signal and N noise maps (2d each) and the combined map times the
    # 2d-wide value (4d per signal head): 6 d H + 2 d N (8 d H at r = 1, DIFF V1's).
    attention_flops=lambda cfg: (
      6 * cfg.head_dim * cfg.num_heads + 2 * cfg.head_dim * noise_heads(cfg)
    ),
    match=match,
    lambda_report="scalar",
    check=lambda cfg: check_gda_heads(cfg.num_heads, cfg.gda_ratio, cfg.num_kv_heads),
    layer_constants=lambda cfg: {
      "lambda_init": [
        lambda_init_for_layer(i, cfg.diff_lambda_init_offset) for i in range(cfg.num_layers)
      ]
    },
    head_norm=True,
    color="tab:green",
    by_default=False,
  )
)

__all__ = ["SPEC", "build", "match", "noise_heads"]
