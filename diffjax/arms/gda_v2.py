"""Grouped differential attention, V2 style (Motif 3's combine, on the baseline's keys).

Each group's r signal heads minus sigmoid(x W_lambda) times its noise head (r = ``gda_ratio``;
r = 1 is DIFF V2 exactly); layout and matching: docs/model.md#grouped-differential-attention.
"""

from __future__ import annotations

import math

from diffjax.arms import diff_v2
from diffjax.arms.gda_v1 import pay_by_ffn
from diffjax.arms.spec import ArmSpec, register
from diffjax.core import op_specs
from diffjax.core.config import V2_MATCHING
from diffjax.nn.attention import GroupedDiffV2Attention, check_gda_heads, check_v2_ablation


def build(cfg, layer_index: int, options, rngs):
  attention, ratio = GroupedDiffV2Attention, cfg.gda_ratio
  return diff_v2.build(cfg, layer_index, options, rngs, attention=attention, ratio=ratio)


def noise_heads(cfg) -> int:
  return cfg.num_heads // cfg.gda_ratio


def attention_params(cfg) -> int:
  e, h, k, d = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  return e * (h + noise_heads(cfg)) * d + 2 * e * k * d + h * d * e + e * h


def match(baseline, v2_match: str):
  """The baseline's H_b heads as signal heads and N = H_b / r noise heads, with
  gcd(K_b, N) kv heads (the baseline's when they divide N); by "params" the SwiGLU width
  pays for the difference (within 0.5 % of the Transformer's parameters), by "heads"
  nothing else changes."""
  if v2_match not in V2_MATCHING:
    raise ValueError(f"v2_match={v2_match!r} must be one of {V2_MATCHING}.")
  h, r = baseline.num_heads, baseline.gda_ratio
  if h % r:
    raise ValueError(
      f"Grouped DIFF V2 at gda_ratio={r} keeps the baseline's num_heads={h} as signal heads "
      f"in groups of {r}, so num_heads must be a multiple of {r}."
    )
  cfg = baseline.replace(attention="gda_v2", num_kv_heads=math.gcd(baseline.num_kv_heads, h // r))
  if v2_match == "heads":
    return cfg
  return pay_by_ffn(baseline, cfg, attention_params, "grouped DIFF V2")


def _check(cfg) -> None:
  check_v2_ablation(cfg.v2_pairing, cfg.v2_lambda, cfg.num_kv_heads)
  if cfg.v2_pairing != "group":
    raise ValueError(
      f"v2_pairing={cfg.v2_pairing!r}: grouped DIFF V2 keeps each group in one kv group; "
      "only v2_pairing='group' applies."
    )
  check_gda_heads(cfg.num_heads, cfg.gda_ratio, cfg.num_kv_heads)


SPEC = register(
  ArmSpec(
    name="gda_v2",
    title="GDA (V2)",
    build=build,
    op=op_specs.GDA_V2,
    decode_op=op_specs.GDA_V2_DECODE,
    heads="grouped DIFF V2 signal heads",
    value_head_dim=lambda cfg: cfg.head_dim,
    attention_params=attention_params,
    matmul_params=attention_params,
    # Scores of H signal and N noise heads (2d each) and the combined map times the d-wide
    # value (2d per signal head): 4 d H + 2 d N (6 d H at r = 1, DIFF V2's).
    attention_flops=lambda cfg: (
      4 * cfg.head_dim * cfg.num_heads + 2 * cfg.head_dim * noise_heads(cfg)
    ),
    match=match,
    lambda_report="sigmoid",
    check=_check,
    ramp=True,
    color="tab:red",
    by_default=False,
  )
)

__all__ = ["SPEC", "build", "match", "noise_heads"]
