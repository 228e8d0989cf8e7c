"""The LLaMA-style decoder LM, matched arms and parameter counts.

``ARMS`` names the arms a comparison trains unless told (the Transformer, DIFF V1 and DIFF
V2); :func:`diffjax.arms.names` lists every registered one, the grouped arms included.
"""

from diffjax import arms
from diffjax.core.config import ModelConfig
from diffjax.model import layout, sizes
from diffjax.model.lm import Block, DecoderLM, make_attention
from diffjax.model.matching import (
  ArmModel,
  attention_params,
  count_params,
  matched_configs,
  resolve_model,
)
from diffjax.nn.layers import Hooks

ARMS = arms.default_names()

__all__ = [
  "ARMS",
  "ModelConfig",
  "attention_params",
  "count_params",
  "matched_configs",
  "Block",
  "DecoderLM",
  "make_attention",
  "Hooks",
  "layout",
  "sizes",
  "ArmModel",
  "resolve_model",
]
