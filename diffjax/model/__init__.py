"""The LLaMA-style decoder LM and its typed configuration."""

from diffjax.model import layout, sizes
from diffjax.model.arms import ArmModel, resolve_model
from diffjax.model.config import ARMS, ModelConfig, attention_params, count_params, matched_configs
from diffjax.model.lm import Block, DecoderLM, make_attention
from diffjax.nn.layers import Hooks

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
