"""DIFF V2: query heads in pairs over the baseline's keys and values, lambda per token.

The math: the README's "What is exact"; matched "by params" (a narrower SwiGLU) or "by heads"
(every baseline width kept): docs/model.md#the-lm.
"""

from __future__ import annotations

import numpy as np

from diffjax.arms.spec import ArmSpec, Retrofit, register
from diffjax.core import op_specs
from diffjax.core.config import V2_MATCHING
from diffjax.nn.attention import DiffV2Attention, check_v2_ablation

# The retrofit's starts: exact (W_o doubled, the pair's heads equal) or mixed in over a ramp.
V2_INITS = ("exact", "mixed")
SECOND_HEADS = ("copy", "noise", "zeros")
# The default start: mixed in, second head small noise, a 100-step ramp. It recovered the
# source's loss faster than the exact start on both seeds of benchmarks/retrofit_cpu.py
# (docs/results/retrofit_cpu.md).
DEFAULT_V2_INIT = "mixed"
DEFAULT_MIX_STEPS = 100


def build(cfg, layer_index: int, options, rngs, attention=DiffV2Attention, **kw):
  """The layer's module; ``attention`` and ``kw``: the grouped form's class and ratio."""
  del layer_index
  return attention(
    cfg.d_model,
    cfg.num_heads,
    cfg.num_kv_heads,
    cfg.head_dim,
    **kw,
    options=options,
    pairing=cfg.v2_pairing,
    lambda_fn=cfg.v2_lambda,
    rngs=rngs,
  )


def attention_params(cfg) -> int:
  e, h, k, d = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  return e * 2 * h * d + 2 * e * k * d + h * d * e + e * h


def match(baseline, v2_match: str):
  """The baseline's heads; by "params" the SwiGLU width shrinks by round((h d + h) / 3)
  (its 3 E mlp_dim weights pay for the extra E h d + E h, which brings the total within
  0.5 % of the Transformer's; tests/model checks it); by "heads" nothing else changes."""
  if v2_match not in V2_MATCHING:
    raise ValueError(f"v2_match={v2_match!r} must be one of {V2_MATCHING}.")
  v2 = baseline.replace(attention="diff_v2")
  if v2_match == "heads":
    return v2
  h, d = baseline.num_heads, baseline.head_dim
  mlp_dim = baseline.mlp_dim - round((h * d + h) / 3)
  if mlp_dim < 1:
    raise ValueError(
      f"Cannot match DIFF V2's parameters by its FFN: mlp_dim={baseline.mlp_dim} is smaller "
      f"than the {round((h * d + h) / 3)} columns its extra query heads cost; use "
      "v2_match='heads' or a wider FFN."
    )
  return v2.replace(mlp_dim=mlp_dim)


def retrofit_config(
  source, *, init: str = DEFAULT_V2_INIT, second: str = "noise", mix_steps: int = DEFAULT_MIX_STEPS
):
  """V2 with the source's heads; ``init="mixed"`` ramps the subtraction in over
  ``mix_steps`` training steps (``v2_mix_steps``)."""
  if init not in V2_INITS:
    raise ValueError(f"init={init!r} is not one of {V2_INITS}.")
  if second not in SECOND_HEADS:
    raise ValueError(f"second={second!r} is not one of {SECOND_HEADS}.")
  if init == "mixed" and (isinstance(mix_steps, bool) or int(mix_steps) < 1):
    raise ValueError(
      f"mix_steps={mix_steps!r}: init='mixed' ramps the subtraction in over "
      "mix_steps >= 1 training steps."
    )
  cfg = match(source, "heads")
  return cfg.replace(v2_mix_steps=int(mix_steps)) if init == "mixed" else cfg


def retrofit_attention(
  src,
  layer_index: int,
  rng,
  *,
  init: str = DEFAULT_V2_INIT,
  second: str = "noise",
  mix_steps: int = DEFAULT_MIX_STEPS,
) -> dict:
  """Exact: each source query head becomes both heads of its pair, W_lambda is zero (so
  sigmoid(lambda) = 0.5) and W_o is doubled: the pair computes A V - 0.5 A V, and the doubled
  W_o returns the source's output. Mixed in: the pair's first head is the source head, the
  second a copy, small noise (std 0.02 x the source head's own) or zeros (``second``), W_o
  the source's; the ramp (``v2_mix_steps``) makes step 0 compute the source's output."""
  del layer_index, mix_steps
  q_ExHxD = np.asarray(src["q"])
  e, h = q_ExHxD.shape[:2]
  o = np.asarray(src["o"])
  if init == "exact":
    q2, o = q_ExHxD, 2 * o
  elif second == "copy":
    q2 = q_ExHxD
  elif second == "zeros":
    q2 = np.zeros_like(q_ExHxD)
  else:
    scale = 0.02 * np.std(q_ExHxD, axis=0, keepdims=True)
    q2 = (scale * rng.standard_normal(q_ExHxD.shape)).astype(q_ExHxD.dtype)
  return {
    "q": np.stack([q_ExHxD, q2], axis=2),
    "k": np.asarray(src["k"]),
    "v": np.asarray(src["v"]),
    "o": o,
    "w_lambda": np.zeros((e, h), q_ExHxD.dtype),
  }


SPEC = register(
  ArmSpec(
    name="diff_v2",
    title="DIFF V2",
    build=build,
    op=op_specs.DIFF_V2,
    decode_op=op_specs.DIFF_V2_DECODE,
    heads="DIFF V2 pairs",
    value_head_dim=lambda cfg: cfg.head_dim,
    attention_params=attention_params,
    matmul_params=attention_params,
    # Two query heads' scores (2 x 2d) and the combined map times the d-wide value (2d): 6d
    # per pair, where the baseline's head costs 4d.
    attention_flops=lambda cfg: 6 * cfg.head_dim * cfg.num_heads,
    match=match,
    lambda_report="sigmoid",
    check=lambda cfg: check_v2_ablation(cfg.v2_pairing, cfg.v2_lambda, cfg.num_kv_heads),
    hf_architecture="DiffjaxV2ForCausalLM",
    ramp=True,
    retrofit=Retrofit(
      config=retrofit_config,
      attention=retrofit_attention,
      options={"init": DEFAULT_V2_INIT, "second": "noise", "mix_steps": DEFAULT_MIX_STEPS},
    ),
    color="tab:orange",
  )
)
