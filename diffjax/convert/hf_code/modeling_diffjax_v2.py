"""DIFF V2 as a transformers model, written for diffjax's exports (loaded with
``trust_remote_code=True`` from the export directory).

Everything but the attention is Llama's. The attention projects 2h query heads and Llama's
keys and values, runs the maps through transformers' attention-function registry (eager,
sdpa, or any other registered backend) as ordinary grouped-query attention over the 2h query
heads, and only then subtracts: o_i = out_(2i) - lambda_i * out_(2i+1), with lambda_i =
sigmoid(x W_lambda)_i per token. The subtraction stays outside the attention function, so a
backend that replaces that function computes the same model.
"""

import inspect

import torch
from torch import nn
from transformers.models.llama import modeling_llama as llama

from .configuration_diffjax_v2 import DiffjaxV2Config


class DiffjaxV2Attention(llama.LlamaAttention):
  """DIFF V2 attention: Llama's over 2h query heads, a lambda projection E -> h, the pairs'
  subtraction after the attention function, and an output projection from h heads."""

  def __init__(self, config: DiffjaxV2Config, layer_idx: int):
    # Llama's projections count 2h query heads (num_attention_heads), so q_proj and the
    # grouping are already V2's: query head j reads kv head j // (2h / h_kv), and pair i
    # (heads 2i, 2i+1) reads kv head i // (h / h_kv). Only o_proj reads h heads.
    super().__init__(config, layer_idx)
    pairs = config.num_attention_heads // 2
    self.num_pairs = pairs
    self.o_proj = nn.Linear(pairs * self.head_dim, config.hidden_size, bias=config.attention_bias)
    self.lambda_proj = nn.Linear(config.hidden_size, pairs, bias=False)

  def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    # transformers releases name the KV cache differently (past_key_value, past_key_values,
    # cache) and give its update the RoPE tables or their own keyword arguments.
    cache = None
    for name in ("cache", "past_key_values", "past_key_value"):
      given = kwargs.pop(name, None)
      cache = given if cache is None else cache
    batch_time = hidden_states.shape[:-1]
    shape = (*batch_time, -1, self.head_dim)
    query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
    key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
    value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = llama.apply_rotary_pos_emb(query, key, cos, sin)
    if cache is not None:
      if "kwargs" in inspect.signature(cache.update).parameters:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
      else:
        tables = {"sin": sin, "cos": cos, "cache_position": kwargs.get("cache_position")}
        key, value = cache.update(key, value, self.layer_idx, tables)
    attention = llama.eager_attention_forward
    if self.config._attn_implementation != "eager":
      attention = llama.ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    out, weights = attention(
      self,
      query,
      key,
      value,
      attention_mask,
      dropout=0.0 if not self.training else self.attention_dropout,
      scaling=self.scaling,
      **kwargs,
    )
    # out: [batch, time, 2h, head_dim]; the pairs' subtraction, lambda in float32.
    out = out.reshape(*batch_time, 2 * self.num_pairs, self.head_dim)
    if self.config.v2_pairing == "group":
      out = out.unflatten(-2, (self.num_pairs, 2))
      first, second = out[..., 0, :], out[..., 1, :]
    else:
      first, second = out[..., : self.num_pairs, :], out[..., self.num_pairs :, :]
    lam = self.lambda_proj(hidden_states).float()
    if self.config.v2_lambda == "sigmoid":
      lam = torch.sigmoid(lam)
    combined = first.float() - lam[..., None] * second.float()
    combined = combined.to(hidden_states.dtype).reshape(*batch_time, -1).contiguous()
    return self.o_proj(combined), weights


class DiffjaxV2PreTrainedModel(llama.LlamaPreTrainedModel):
  config_class = DiffjaxV2Config
  _supports_attention_backend = True


class DiffjaxV2Model(DiffjaxV2PreTrainedModel, llama.LlamaModel):
  """Llama's decoder with DIFF V2 attention in every layer."""

  def __init__(self, config: DiffjaxV2Config):
    super().__init__(config)
    for index, layer in enumerate(self.layers):
      layer.self_attn = DiffjaxV2Attention(config, index)
    self.post_init()


class DiffjaxV2ForCausalLM(DiffjaxV2PreTrainedModel, llama.LlamaForCausalLM):
  """DIFF V2 language model: :class:`DiffjaxV2Model` and Llama's head, cache and generation."""

  def __init__(self, config: DiffjaxV2Config):
    super().__init__(config)
    self.model = DiffjaxV2Model(config)
    self.post_init()
