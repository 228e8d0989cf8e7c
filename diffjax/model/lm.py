"""LLaMA-style decoder LM; the three arms share every line but the attention module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax.core.dtypes import accumulation_dtype
from diffjax.model.config import ModelConfig
from diffjax.nn.attention import Attention, AttentionOptions, DiffV1Attention, DiffV2Attention
from diffjax.nn.layers import NO_HOOKS, Embed, Hooks, RMSNorm, SwiGLU, make_param, normal_init
from diffjax.sharding import constrain

_REMAT = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def make_attention(cfg: ModelConfig, layer_index: int, rngs: nnx.Rngs) -> nnx.Module:
  """The attention module of one layer for ``cfg.attention``."""
  opts = AttentionOptions(rope_theta=cfg.rope_theta, rope_style=cfg.rope_style,
                          dtype=cfg.compute_dtype, init_std=cfg.init_std,
                          implementation=cfg.implementation, block_sizes=cfg.block_sizes,
                          interpret=cfg.interpret, param_dtype=cfg.weight_dtype)
  args = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
  if cfg.attention == "transformer":
    return Attention(*args, options=opts, rngs=rngs)
  if cfg.attention == "diff_v1":
    return DiffV1Attention(*args, layer_index=layer_index, options=opts,
                           norm_eps=cfg.diff_norm_eps, use_norm=cfg.diff_use_norm,
                           fixed_lambda=cfg.diff_fixed_lambda, rngs=rngs)
  return DiffV2Attention(*args, options=opts, rngs=rngs)


class Block(nnx.Module):
  """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x))."""

  def __init__(self, cfg: ModelConfig, layer_index: int, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs,
                             param_dtype=cfg.weight_dtype)
    self.attn = make_attention(cfg, layer_index, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs,
                            param_dtype=cfg.weight_dtype)
    self.mlp = SwiGLU(cfg.d_model, cfg.mlp_dim, init_std=cfg.init_std, rngs=rngs,
                      param_dtype=cfg.weight_dtype)
    self.dtype = cfg.compute_dtype

  def __call__(self, x_BxTxE, positions_BxT, segment_ids_BxT, *, capture=False,
               hooks: Hooks = NO_HOOKS, cache=None, cache_lengths_B=None):
    if cache is not None:
      attn_BxTxE, cache = self.attn(self.attn_norm(x_BxTxE), positions_BxT, segment_ids_BxT,
                                    hooks=hooks, cache=cache, cache_lengths_B=cache_lengths_B)
      h_BxTxE = x_BxTxE + attn_BxTxE
      h_BxTxE = h_BxTxE + self.mlp(self.mlp_norm(h_BxTxE), self.dtype, hooks)
      return constrain(h_BxTxE, ("batch", "length", "embed")), cache
    out = self.attn(self.attn_norm(x_BxTxE), positions_BxT, segment_ids_BxT, capture=capture,
                    hooks=hooks)
    attn_BxTxE, aux = out if capture else (out, None)
    h_BxTxE = x_BxTxE + attn_BxTxE
    h_BxTxE = h_BxTxE + self.mlp(self.mlp_norm(h_BxTxE), self.dtype, hooks)
    h_BxTxE = constrain(h_BxTxE, ("batch", "length", "embed"))
    if capture:
      return h_BxTxE, dict(aux, hidden=h_BxTxE.astype(accumulation_dtype(self.dtype)))
    return h_BxTxE


class DecoderLM(nnx.Module):
  """Token embedding, ``num_layers`` pre-norm blocks, final RMSNorm, LM head.

  Call: ``logits_BxTxV = model(tokens_BxT, positions_BxT=None, segment_ids_BxT=None)``.
  ``positions`` default to 0..T-1 (pass per-document positions for packed data);
  ``segment_ids`` keep packed documents from attending to each other. Logits are
  float32 (float64 when ``cfg.dtype`` is float64). With ``capture=True`` it returns
  ``(logits, captures)``: one dict per layer with float32 attention logits and
  probabilities, lambda (DIFF arms) and the block's output hidden state ``hidden``
  [B, T, E].

  Generation: with ``cache=`` (one dict per layer, from :meth:`init_cache`) and
  ``cache_lengths_B`` (int [B], the filled slots of each row) it returns
  ``(logits, new_cache)``. A call with T > 1 is a prefill into an empty cache (the
  normal attention path; slots 0..T-1 are written); a call with T == 1 is a decode
  step that writes slot ``cache_lengths_B[b]`` and attends to the row's filled slots.
  Pass the positions (each row's own) explicitly when decoding.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.config = cfg
    self.embed = Embed(cfg.vocab_size, cfg.d_model, init_std=cfg.init_std, rngs=rngs,
                       param_dtype=cfg.weight_dtype)
    self.blocks = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)]) \
        if hasattr(nnx, "List") else [Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)]
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs,
                              param_dtype=cfg.weight_dtype)
    if not cfg.tie_embeddings:
      self.lm_head = make_param(rngs, normal_init(cfg.init_std), (cfg.d_model, cfg.vocab_size),
                                ("embed", "vocab"), cfg.weight_dtype)

  def init_cache(self, batch: int, max_length: int, dtype=None) -> list[dict[str, jax.Array]]:
    """An empty KV cache: one dict per layer (see the attention modules' ``init_cache``),
    ``max_length`` slots per row, in ``dtype`` (default: the compute dtype)."""
    return [block.attn.init_cache(batch, max_length, dtype) for block in self.blocks]

  def __call__(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None, *,
               capture: bool = False, hooks: Hooks = NO_HOOKS, cache=None,
               cache_lengths_B=None):
    cfg = self.config
    x_BxTxE, positions_BxT = self._embed(tokens_BxT, positions_BxT)
    captures = []
    if cache is not None:
      if len(cache) != len(self.blocks):
        raise ValueError(f"cache has {len(cache)} layers; the model has {len(self.blocks)}.")
      new_cache = []
      for block, layer_cache in zip(self.blocks, cache):
        x_BxTxE, layer_cache = block(x_BxTxE, positions_BxT, segment_ids_BxT, hooks=hooks,
                                     cache=layer_cache, cache_lengths_B=cache_lengths_B)
        new_cache.append(layer_cache)
      return self._logits(x_BxTxE), new_cache
    for block in self.blocks:
      if capture:
        x_BxTxE, aux = block(x_BxTxE, positions_BxT, segment_ids_BxT, capture=True,
                             hooks=hooks)
        captures.append(aux)
      elif cfg.remat != "none":
        x_BxTxE = _remat_block(block, x_BxTxE, positions_BxT, segment_ids_BxT, hooks,
                               cfg.remat)
      else:
        x_BxTxE = block(x_BxTxE, positions_BxT, segment_ids_BxT, hooks=hooks)
    logits_BxTxV = self._logits(x_BxTxE)
    return (logits_BxTxV, captures) if capture else logits_BxTxV

  def _logits(self, x_BxTxE) -> jax.Array:
    """Final norm and LM head: float32 (float64) logits [B, T, V]."""
    dt = self.config.compute_dtype
    x_BxTxE = self.final_norm(x_BxTxE)
    if self.config.tie_embeddings:
      logits_BxTxV = self.embed.attend(x_BxTxE, dt)
    else:
      logits_BxTxV = jnp.einsum("bte,ev->btv", x_BxTxE.astype(dt), self.lm_head[...].astype(dt),
                                preferred_element_type=accumulation_dtype(dt))
    return constrain(logits_BxTxV, ("batch", "length", "vocab"))

  def _embed(self, tokens_BxT, positions_BxT) -> tuple[jax.Array, jax.Array]:
    """The token embeddings [B, T, E] and the positions (default 0..T-1)."""
    if tokens_BxT.ndim != 2:
      raise ValueError(f"tokens must have shape [batch, length]; got {tokens_BxT.shape}.")
    b, t = tokens_BxT.shape
    if positions_BxT is None:
      positions_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    x_BxTxE = self.embed(tokens_BxT, self.config.compute_dtype)
    return constrain(x_BxTxE, ("batch", "length", "embed")), positions_BxT

  def lambda_summary(self, tokens_BxT: jax.Array | None = None,
                     positions_BxT: jax.Array | None = None,
                     segment_ids_BxT: jax.Array | None = None) -> dict[str, jax.Array]:
    """The differential attention's lambda per layer, for logging.

    Args:
      tokens_BxT, positions_BxT, segment_ids_BxT: a batch, as for ``__call__``; only
        DIFF V2 needs it (its lambda depends on the input).
    Returns:
      ``{"lambda/layer_<i>": lambda}`` (scalar) for each DIFF V1 layer, and
      ``{"lambda_mean/layer_<i>": mean of sigmoid(x W_lambda)}`` over the batch's
      B x T tokens and the pairs for each DIFF V2 layer when ``tokens_BxT`` is given.
      Empty for the Transformer.
    """
    out = {}
    v2_layers = []
    for i, block in enumerate(self.blocks):
      if isinstance(block.attn, DiffV1Attention):
        out[f"lambda/layer_{i}"] = block.attn.lambda_value()
      elif isinstance(block.attn, DiffV2Attention):
        v2_layers.append(i)
    if tokens_BxT is None or not v2_layers:
      return out
    # V2's lambda reads each layer's normed input: run the blocks up to the last V2
    # layer on the normal path (no attention maps are materialised).
    x_BxTxE, positions_BxT = self._embed(tokens_BxT, positions_BxT)
    for i, block in enumerate(self.blocks):
      if i in v2_layers:
        lam_BxTxH = block.attn.lambda_value(block.attn_norm(x_BxTxE))
        out[f"lambda_mean/layer_{i}"] = jnp.mean(lam_BxTxH)
      if i == v2_layers[-1]:
        break
      x_BxTxE = block(x_BxTxE, positions_BxT, segment_ids_BxT)
    return out


def _remat_block(block, x_BxTxE, positions_BxT, segment_ids_BxT, hooks, policy_name):
  policy = _REMAT[policy_name]

  def run(blk, x, pos, seg):
    return blk(x, pos, seg, hooks=hooks)

  return nnx.remat(run, policy=policy)(block, x_BxTxE, positions_BxT, segment_ids_BxT)
