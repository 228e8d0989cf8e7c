"""The Transformer and DIFF V1 as transformers models, written for diffjax's exports (loaded with
``trust_remote_code=True`` from the export directory).

The Transformer is Llama under its own names. DIFF V1 is Llama's decoder with differential
attention: the two query components of every DIFF head are ordinary query heads (2h of them,
against 2k key heads: k1 then k2, so head j < h reads k1 and head h + j reads k2 of the same
group), and the value of a group is 2d wide, the pair of component value heads (g, k + g). The
maps go through transformers' attention-function registry (eager, sdpa, or any registered
backend) once per value half, so every call has equal query, key and value widths; the cache
holds the 2k key heads and the 2k value halves, as DiffLlama's does. Then, outside the attention
function, o_i = A1_i V - lambda A2_i V, an RMS norm over its 2d features scaled by
(1 - lambda_init), and the output projection. lambda = exp(lq1 . lk1) - exp(lq2 . lk2) +
lambda_init, with lambda_init = 0.8 - 0.6 exp(-0.3 l) at layer l (from 0).
"""

import inspect
import math

import torch
from torch import nn
from transformers.models.llama import modeling_llama as llama

from .configuration_diffjax import DiffjaxTransformerConfig, DiffjaxV1Config


def _cache_and_rest(kwargs):
  """(the KV cache, the remaining keyword arguments): transformers releases call the cache
  ``cache``, ``past_key_values`` or ``past_key_value``."""
  cache = None
  for name in ("cache", "past_key_values", "past_key_value"):
    given = kwargs.pop(name, None)
    cache = given if cache is None else cache
  return cache, kwargs


def _update(cache, key, value, layer_idx, sin, cos, kwargs):
  if "kwargs" in inspect.signature(cache.update).parameters:
    return cache.update(key, value, layer_idx, kwargs=kwargs)
  tables = {"sin": sin, "cos": cos, "cache_position": kwargs.get("cache_position")}
  return cache.update(key, value, layer_idx, tables)


class DiffjaxV1Attention(llama.LlamaAttention):
  """DIFF V1 attention over Llama's projections counted in component heads, with the four
  lambda vectors and the per-head RMS norm (its gain folded into o_proj by the export)."""

  def __init__(self, config: DiffjaxV1Config, layer_idx: int):
    super().__init__(config, layer_idx)
    d = self.head_dim
    self.num_diff_heads = config.num_attention_heads // 2
    self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_idx)
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
      setattr(self, name, nn.Parameter(torch.normal(0.0, config.lambda_std_dev, size=(d,))))
    self.norm_eps = config.rms_norm_eps

  def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    cache, kwargs = _cache_and_rest(kwargs)
    batch_time = hidden_states.shape[:-1]
    shape = (*batch_time, -1, self.head_dim)
    query = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # [B, 2h, T, d]
    key = self.k_proj(hidden_states).view(shape).transpose(1, 2)  # [B, 2k, T, d]
    value = self.v_proj(hidden_states).view(shape).transpose(1, 2)  # [B, 2k, T, d]: halves
    cos, sin = position_embeddings
    query, key = llama.apply_rotary_pos_emb(query, key, cos, sin)
    if cache is not None:
      key, value = _update(cache, key, value, self.layer_idx, sin, cos, kwargs)
    attention = llama.eager_attention_forward
    if self.config._attn_implementation != "eager":
      attention = llama.ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    groups = key.shape[1] // 2
    outs, weights = [], None
    for half in (value[:, :groups], value[:, groups:]):
      # Both key sets read this value half: kv head g and k + g hold the same one.
      out, w = attention(
        self,
        query,
        key,
        torch.cat([half, half], dim=1),
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
      )
      outs.append(out)
      weights = w if weights is None else weights
    out = torch.cat(outs, dim=-1)  # [B, T, 2h, 2d]: each query head's map times its group's V
    h = self.num_diff_heads
    lam = (
      torch.exp(torch.sum(self.lambda_q1.float() * self.lambda_k1.float()))
      - torch.exp(torch.sum(self.lambda_q2.float() * self.lambda_k2.float()))
      + self.lambda_init
    )
    diff = out[..., :h, :].float() - lam * out[..., h:, :].float()
    diff = diff * torch.rsqrt(diff.pow(2).mean(-1, keepdim=True) + self.norm_eps)
    diff = ((1.0 - self.lambda_init) * diff).to(hidden_states.dtype)
    return self.o_proj(diff.reshape(*batch_time, -1).contiguous()), weights


class DiffjaxTransformerPreTrainedModel(llama.LlamaPreTrainedModel):
  config_class = DiffjaxTransformerConfig


class DiffjaxTransformerModel(DiffjaxTransformerPreTrainedModel, llama.LlamaModel):
  """Llama's decoder."""


class DiffjaxTransformerForCausalLM(DiffjaxTransformerPreTrainedModel, llama.LlamaForCausalLM):
  """The Transformer language model: Llama's."""


class DiffjaxV1PreTrainedModel(llama.LlamaPreTrainedModel):
  config_class = DiffjaxV1Config
  _supports_attention_backend = True


class DiffjaxV1Model(DiffjaxV1PreTrainedModel, llama.LlamaModel):
  """Llama's decoder with DIFF V1 attention in every layer."""

  def __init__(self, config: DiffjaxV1Config):
    super().__init__(config)
    for index, layer in enumerate(self.layers):
      layer.self_attn = DiffjaxV1Attention(config, index)
    self.post_init()


class DiffjaxV1ForCausalLM(DiffjaxV1PreTrainedModel, llama.LlamaForCausalLM):
  """DIFF V1 language model: :class:`DiffjaxV1Model` and Llama's head, cache and generation."""

  def __init__(self, config: DiffjaxV1Config):
    super().__init__(config)
    self.model = DiffjaxV1Model(config)
    self.post_init()
