"""LLaMA-style decoder LM; the three arms share every line but the attention module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax import arms
from diffjax.core.config import ModelConfig
from diffjax.core.dtypes import accumulation_dtype
from diffjax.nn.attention import AttentionOptions
from diffjax.nn.layers import (
  NO_HOOKS,
  Embed,
  Hooks,
  RMSNorm,
  make_mlp,
  make_param,
  matmul,
  normal_init,
  stack_modules,
)
from diffjax.sharding import constrain

_REMAT = {
  "full": None,
  "dots": jax.checkpoint_policies.checkpoint_dots,
  "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def make_attention(cfg: ModelConfig, layer_index: int, rngs: nnx.Rngs) -> nnx.Module:
  """The attention module of one layer: what ``cfg.attention``'s arm builds."""
  opts = AttentionOptions(
    rope_theta=cfg.rope_theta,
    rope_style=cfg.rope_style,
    dtype=cfg.compute_dtype,
    init_std=cfg.init_std,
    implementation=cfg.implementation,
    block_sizes=cfg.block_sizes,
    interpret=cfg.interpret,
    param_dtype=cfg.weight_dtype,
  )
  return arms.get(cfg.attention).build(cfg, layer_index, opts, rngs)


class Block(nnx.Module):
  """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x))."""

  def __init__(self, cfg: ModelConfig, layer_index: int, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs, param_dtype=cfg.weight_dtype)
    self.attn = make_attention(cfg, layer_index, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs, param_dtype=cfg.weight_dtype)
    self.mlp = make_mlp(
      cfg.mlp_activation,
      cfg.d_model,
      cfg.mlp_dim,
      init_std=cfg.init_std,
      rngs=rngs,
      param_dtype=cfg.weight_dtype,
    )
    self.dtype = cfg.compute_dtype
    self.ramp = arms.get(cfg.attention).ramp

  def __call__(
    self,
    x_BxTxE,
    positions_BxT,
    segment_ids_BxT,
    *,
    capture=False,
    hooks: Hooks = NO_HOOKS,
    cache=None,
    cache_lengths_B=None,
    v2_mix=None,
    **layer_constants,
  ):
    # The arm's per-layer constants as data (a scanned stack passes each layer's own, e.g.
    # DIFF V1's lambda_init), and a retrofit's ramp for an arm that takes one.
    extra = dict(layer_constants)
    if v2_mix is not None and self.ramp:
      extra["mix"] = v2_mix
    if cache is not None:
      attn_BxTxE, cache = self.attn(
        self.attn_norm(x_BxTxE),
        positions_BxT,
        segment_ids_BxT,
        hooks=hooks,
        cache=cache,
        cache_lengths_B=cache_lengths_B,
        **extra,
      )
      h_BxTxE = x_BxTxE + attn_BxTxE
      h_BxTxE = h_BxTxE + self.mlp(self.mlp_norm(h_BxTxE), self.dtype, hooks)
      return constrain(h_BxTxE, ("batch", "length", "embed")), cache
    out = self.attn(
      self.attn_norm(x_BxTxE), positions_BxT, segment_ids_BxT, capture=capture, hooks=hooks, **extra
    )
    attn_BxTxE, aux = out if capture else (out, None)
    h_BxTxE = x_BxTxE + attn_BxTxE
    h_BxTxE = h_BxTxE + self.mlp(self.mlp_norm(h_BxTxE), self.dtype, hooks)
    h_BxTxE = constrain(h_BxTxE, ("batch", "length", "embed"))
    if capture:
      return h_BxTxE, dict(aux, hidden=h_BxTxE.astype(accumulation_dtype(self.dtype)))
    return h_BxTxE


def _check_scannable(cfg: ModelConfig, blocks: list[Block]) -> None:
  """Refuses to stack layers whose attention modules hold a per-layer number (an attribute,
  not a parameter) that the arm's ``layer_constants`` do not pass to the scanned layers: built
  from layer 0, the stack would use layer 0's value in every layer."""
  passed = set(arms.get(cfg.attention).layer_constants(cfg))
  first = vars(blocks[0].attn)
  for i, block in enumerate(blocks[1:], 1):
    for name, value in vars(block.attn).items():
      if name in passed or not isinstance(value, (int, float)) or value == first.get(name):
        continue
      raise ValueError(
        f"Arm {cfg.attention!r} builds attention modules whose {name!r} differs by layer "
        f"({first.get(name)!r} in layer 0, {value!r} in layer {i}), but its ArmSpec's "
        "layer_constants do not pass it, so scanned layers (model.scan_layers=True) would all "
        f"use layer 0's: list it in layer_constants (as diffjax.arms.diff_v1 does for "
        "lambda_init), or set model.scan_layers=False."
      )


class DecoderLM(nnx.Module):
  """Token embedding, ``num_layers`` pre-norm blocks, final RMSNorm, LM head.

  Call: ``logits_BxTxV = model(tokens_BxT, positions_BxT=None, segment_ids_BxT=None)``.
  ``positions`` default to 0..T-1 (pass per-document positions for packed data);
  ``segment_ids`` keep packed documents from attending to each other. Logits are
  float32 (float64 when ``cfg.dtype`` is float64). With ``capture=True`` it returns
  ``(logits, captures)``: one dict per layer with float32 attention logits and
  probabilities, lambda (DIFF arms) and the block's output hidden state ``hidden``
  [B, T, E].

  Layers: with ``cfg.scan_layers`` the blocks live in one stacked module
  ``self.layers`` (every parameter gains a leading ``layers`` axis) and run under
  ``jax.lax.scan``, so the compiled program holds one block however deep the model
  is; otherwise ``self.blocks`` is a list of blocks unrolled in Python. Both build
  the same initial parameters and compute the same function; :meth:`layer` returns
  block ``i`` either way, and :mod:`diffjax.model.layout` converts parameter trees
  (and optimizer states) between the two layouts.

  Generation: with ``cache=`` (one dict per layer, from :meth:`init_cache`) and
  ``cache_lengths_B`` (int [B], the filled slots of each row) it returns
  ``(logits, new_cache)``. A call with T > 1 is a prefill into an empty cache (the
  normal attention path; slots 0..T-1 are written); a call with T == 1 is a decode
  step that writes slot ``cache_lengths_B[b]`` and attends to the row's filled slots.
  Pass the positions (each row's own) explicitly when decoding.

  Retrofit ramp: ``v2_mix`` scales a ramping arm's subtraction (``ModelConfig.v2_mix``);
  a call without it uses the attribute ``v2_mix_at`` if set (a float: the loaders set it
  to the ramp at the checkpoint's step, so the model computes what the trainer computed
  there), else the full subtraction.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    arms.get(cfg.attention).check(cfg)  # the arm's own fields (an unknown arm says so)
    self.config = cfg
    self.embed = Embed(
      cfg.vocab_size, cfg.d_model, init_std=cfg.init_std, rngs=rngs, param_dtype=cfg.weight_dtype
    )
    # Built one by one in both layouts, so a scanned model starts from the same draws.
    blocks = [Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)]
    if cfg.scan_layers:
      _check_scannable(cfg, blocks)
      self.layers = stack_modules(blocks, axis_name="layers")
    else:
      self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks
    self.final_norm = RMSNorm(
      cfg.d_model, eps=cfg.norm_eps, rngs=rngs, param_dtype=cfg.weight_dtype
    )
    if not cfg.tie_embeddings:
      self.lm_head = make_param(
        rngs,
        normal_init(cfg.init_std),
        (cfg.d_model, cfg.vocab_size),
        ("embed", "vocab"),
        cfg.weight_dtype,
      )

  def layer(self, i: int) -> Block:
    """Block ``i``. For a scanned model, a copy of layer ``i``'s slice of the stack
    (reading it is exact; assigning to it does not change the model)."""
    n = self.config.num_layers
    if not -n <= i < n:
      raise IndexError(f"layer {i} out of range for a model of {n} layers.")
    i %= n
    if not self.config.scan_layers:
      return self.blocks[i]
    graphdef, state = nnx.split(self.layers)
    block = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
    # The stack was built from layer 0: give the copy layer i's own constants.
    for name, values in arms.get(self.config.attention).layer_constants(self.config).items():
      setattr(block.attn, name, values[i])
    return block

  def init_cache(self, batch: int, max_length: int, dtype=None) -> list[dict[str, jax.Array]]:
    """An empty KV cache: one dict per layer (see the attention modules' ``init_cache``),
    ``max_length`` slots per row, in ``dtype`` (default: the compute dtype)."""
    return [
      self.layer(i).attn.init_cache(batch, max_length, dtype) for i in range(self.config.num_layers)
    ]

  def __call__(
    self,
    tokens_BxT,
    positions_BxT=None,
    segment_ids_BxT=None,
    *,
    capture: bool = False,
    hooks: Hooks = NO_HOOKS,
    cache=None,
    cache_lengths_B=None,
    v2_mix=None,
  ):
    cfg = self.config
    x_BxTxE, positions_BxT = self._embed(tokens_BxT, positions_BxT)
    if v2_mix is None:
      v2_mix = getattr(self, "v2_mix_at", None)
    mix = {} if v2_mix is None else {"v2_mix": v2_mix}
    if cache is not None:
      if len(cache) != cfg.num_layers:
        raise ValueError(f"cache has {len(cache)} layers; the model has {cfg.num_layers}.")
      new_cache = []
      for i, layer_cache in enumerate(cache):
        x_BxTxE, layer_cache = self.layer(i)(
          x_BxTxE,
          positions_BxT,
          segment_ids_BxT,
          hooks=hooks,
          cache=layer_cache,
          cache_lengths_B=cache_lengths_B,
          **mix,
        )
        new_cache.append(layer_cache)
      return self._logits(x_BxTxE), new_cache
    if cfg.scan_layers:
      x_BxTxE, captures = self._scan_blocks(
        x_BxTxE, positions_BxT, segment_ids_BxT, hooks, capture, mix
      )
    else:
      captures = []
      for block in self.blocks:
        if capture:
          x_BxTxE, aux = block(
            x_BxTxE, positions_BxT, segment_ids_BxT, capture=True, hooks=hooks, **mix
          )
          captures.append(aux)
        elif cfg.remat != "none":
          x_BxTxE = _remat_block(
            block, x_BxTxE, positions_BxT, segment_ids_BxT, hooks, cfg.remat, mix
          )
        else:
          x_BxTxE = block(x_BxTxE, positions_BxT, segment_ids_BxT, hooks=hooks, **mix)
    logits_BxTxV = self._logits(x_BxTxE)
    return (logits_BxTxV, captures) if capture else logits_BxTxV

  def _scan_blocks(self, x_BxTxE, positions_BxT, segment_ids_BxT, hooks, capture, mix):
    """The stacked blocks under ``lax.scan``; per-layer captures are split out again."""
    cfg = self.config
    graphdef, state = nnx.split(self.layers)
    # The arm's per-layer constants (DIFF V1's lambda_init) are scanned with the layers as
    # data: the stacked module was built from layer 0.
    acc = accumulation_dtype(cfg.compute_dtype)
    constants_L = {
      name: jnp.asarray(values, acc)
      for name, values in arms.get(cfg.attention).layer_constants(cfg).items()
    }

    def body(x_BxTxE, xs):
      layer_state, constants = xs
      block = nnx.merge(graphdef, layer_state)
      extra = {**constants, **mix}
      if capture:
        return block(x_BxTxE, positions_BxT, segment_ids_BxT, capture=True, hooks=hooks, **extra)
      return block(x_BxTxE, positions_BxT, segment_ids_BxT, hooks=hooks, **extra), None

    if cfg.remat != "none" and not capture:
      body = jax.checkpoint(body, policy=_REMAT[cfg.remat], prevent_cse=False)
    x_BxTxE, stacked = jax.lax.scan(body, x_BxTxE, (state, constants_L))
    if not capture:
      return x_BxTxE, []
    return x_BxTxE, [jax.tree.map(lambda a: a[i], stacked) for i in range(cfg.num_layers)]

  def _logits(self, x_BxTxE) -> jax.Array:
    """Final norm and LM head: float32 (float64) logits [B, T, V]."""
    dt = self.config.compute_dtype
    x_BxTxE = self.final_norm(x_BxTxE)
    if self.config.tie_embeddings:
      logits_BxTxV = self.embed.attend(x_BxTxE, dt)
    else:
      logits_BxTxV = matmul("bte,ev->btv", x_BxTxE, self.lm_head[...], dt)
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

  def lambda_summary(
    self,
    tokens_BxT: jax.Array | None = None,
    positions_BxT: jax.Array | None = None,
    segment_ids_BxT: jax.Array | None = None,
  ) -> dict[str, jax.Array]:
    """The differential attention's lambda per layer, for logging.

    Args:
      tokens_BxT, positions_BxT, segment_ids_BxT: a batch, as for ``__call__``; only an
        arm whose lambda depends on the input (DIFF V2) needs it.
    Returns:
      ``{"lambda/layer_<i>": lambda}`` for an arm with one lambda per layer (DIFF V1:
      ``lambda_value()``), ``{"lambda_mean/layer_<i>": mean of its lambda}`` over the batch's
      B x T tokens and the heads for an arm with a lambda per token (DIFF V2:
      ``lambda_value(x)`` of the layer's normed input) when ``tokens_BxT`` is given, and
      nothing for the Transformer (the arm's ``lambda_report``).
    """
    report = arms.get(self.config.attention).lambda_report
    blocks = [self.layer(i) for i in range(self.config.num_layers)]
    if report == "scalar":
      return {f"lambda/layer_{i}": b.attn.lambda_value() for i, b in enumerate(blocks)}
    if report == "none" or tokens_BxT is None:
      return {}
    # The lambda reads each layer's normed input: run the blocks on the normal path (no
    # attention maps are materialised), the last one only up to its lambda.
    out = {}
    x_BxTxE, positions_BxT = self._embed(tokens_BxT, positions_BxT)
    for i, block in enumerate(blocks):
      out[f"lambda_mean/layer_{i}"] = jnp.mean(block.attn.lambda_value(block.attn_norm(x_BxTxE)))
      if i + 1 < len(blocks):
        x_BxTxE = block(x_BxTxE, positions_BxT, segment_ids_BxT)
    return out


def _remat_block(block, x_BxTxE, positions_BxT, segment_ids_BxT, hooks, policy_name, mix):
  policy = _REMAT[policy_name]

  def run(blk, x, pos, seg):
    return blk(x, pos, seg, hooks=hooks, **mix)

  return nnx.remat(run, policy=policy)(block, x_BxTxE, positions_BxT, segment_ids_BxT)
