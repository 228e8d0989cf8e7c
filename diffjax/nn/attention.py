"""Flax NNX attention modules: the baseline, DIFF V1 and DIFF V2.

All three share the call signature

    out_BxTxE = module(x_BxTxE, positions_BxT=None, segment_ids_BxT=None)
    out_BxTxE, aux = module(x_BxTxE, ..., capture=True)

``capture=True`` (analysis) runs the explicit-map XLA path and also returns the
float32 attention logits and probabilities (and lambda for DIFF arms); it is a
Python switch, so normal calls pay nothing for it. ``hooks`` (see
:class:`~diffjax.nn.layers.Hooks`) apply analysis interventions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax import ops
from diffjax.nn.layers import NO_HOOKS, Hooks, make_param, normal_init, project, \
    torch_linear_init
from diffjax.nn.rope import ROPE_STYLES, apply_rope
from diffjax.ops import reference as ref
from diffjax.sharding import constrain


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """Settings every attention module shares.

  Attributes:
    rope_theta: RoPE base.
    rope_style: "interleaved" (default, as the DIFF reference code) or "half" (NeoX).
    dtype: compute dtype.
    init_std: std of the normal init of the projections.
    implementation: see :mod:`diffjax.ops.attention` ("auto", "xla", "pallas", ...).
    block_sizes: kernel block sizes (a dict or the kernel's BlockSizes), or None.
    interpret: run Pallas kernels in the interpreter (testing on CPU).
    causal: causal masking (decoder LMs).
    param_dtype: dtype of the projection matrices (float32 by default).
  """
  rope_theta: float = 10000.0
  rope_style: str = "interleaved"
  dtype: Any = jnp.float32
  init_std: float = 0.02
  implementation: str = "auto"
  block_sizes: Any = None
  interpret: bool = False
  causal: bool = True
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    if self.rope_style not in ROPE_STYLES:
      raise ValueError(f"rope_style={self.rope_style!r} is not one of {ROPE_STYLES}.")

  def kernel_kwargs(self) -> dict[str, Any]:
    return dict(causal=self.causal, implementation=self.implementation,
                block_sizes=self.block_sizes, interpret=self.interpret)


def _check_heads(num_heads: int, num_kv_heads: int, d_model: int, head_dim: int) -> None:
  if num_heads <= 0 or num_kv_heads <= 0 or head_dim <= 0 or d_model <= 0:
    raise ValueError(f"Sizes must be positive: {d_model=}, {num_heads=}, {num_kv_heads=}, "
                     f"{head_dim=}.")
  if num_heads % num_kv_heads:
    raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}.")


def _positions(x_BxTxE, positions_BxT):
  if positions_BxT is not None:
    return positions_BxT
  b, t = x_BxTxE.shape[:2]
  return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))


def _rope(x, positions, opts: AttentionOptions):
  return apply_rope(x, positions, theta=opts.rope_theta, style=opts.rope_style)


class Attention(nnx.Module):
  """Baseline multi-head / grouped-query attention with RoPE and no biases."""

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
               options: AttentionOptions = AttentionOptions(), rngs: nnx.Rngs):
    _check_heads(num_heads, num_kv_heads, d_model, head_dim)
    self.options = options
    init = normal_init(options.init_std)
    self.q = make_param(rngs, init, (d_model, num_heads, head_dim),
                        ("embed", "heads", "head_dim"), options.param_dtype)
    self.k = make_param(rngs, init, (d_model, num_kv_heads, head_dim),
                        ("embed", "kv_heads", "head_dim"), options.param_dtype)
    self.v = make_param(rngs, init, (d_model, num_kv_heads, head_dim),
                        ("embed", "kv_heads", "head_dim"), options.param_dtype)
    self.o = make_param(rngs, init, (num_heads, head_dim, d_model),
                        ("heads", "head_dim", "embed"), options.param_dtype)

  def __call__(self, x_BxTxE, positions_BxT=None, segment_ids_BxT=None, *,
               capture: bool = False, hooks: Hooks = NO_HOOKS):
    opts = self.options
    dt = opts.dtype
    pos = _positions(x_BxTxE, positions_BxT)
    q = _rope(project(x_BxTxE, self.q, "bte,ehd->bthd", dt, hooks), pos, opts)
    k = _rope(project(x_BxTxE, self.k, "bte,ekd->btkd", dt, hooks), pos, opts)
    v = project(x_BxTxE, self.v, "bte,ekd->btkd", dt, hooks)
    q = constrain(q, ("batch", "length", "heads", "head_dim"))
    if hooks.kv is not None:
      k, v = hooks.kv(k), hooks.kv(v)
    aux = None
    if capture or hooks.needs_reference:
      out, aux = ref.mha_reference(q, k, v, causal=opts.causal, segment_ids=segment_ids_BxT,
                                   return_aux=True, logits_fn=hooks.logits,
                                   probs_fn=hooks.probs)
    else:
      out = ops.dot_product_attention(q, k, v, segment_ids=segment_ids_BxT,
                                      **opts.kernel_kwargs())
    out = constrain(out, ("batch", "length", "heads", "head_dim"))
    y = project(out, self.o, "bthd,hde->bte", dt, hooks)
    return (y, aux) if capture else y


class DiffV1Attention(nnx.Module):
  """DIFF V1 (arXiv 2410.05258) multi-head differential attention.

  ``num_heads`` DIFF heads H, each with two query/key components of width
  ``head_dim`` d and one value of width 2d; ``num_kv_heads`` kv groups. Weights use
  the reference layout: the query projection reshaped to [H, 2, d] (component s of
  head i is d-block 2i+s), keys to [K, 2, d], values to [K, 2d].

  lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init (one scalar per layer),
  lambda_init = 0.8 - 0.6 exp(-0.3 layer_index). Head outputs pass an RMSNorm over
  2d channels (eps 1e-5, a gain shared by the heads) and are scaled by
  (1 - lambda_init). ``use_norm=False`` and ``fixed_lambda`` serve the paper's
  ablations.
  """

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
               layer_index: int, options: AttentionOptions = AttentionOptions(),
               norm_eps: float = 1e-5, use_norm: bool = True,
               fixed_lambda: float | None = None, rngs: nnx.Rngs):
    _check_heads(num_heads, num_kv_heads, d_model, head_dim)
    self.options = options
    self.head_dim = head_dim
    self.lambda_init = ref.lambda_init_for_layer(layer_index)
    self.norm_eps = norm_eps
    self.use_norm = use_norm
    self.fixed_lambda = fixed_lambda
    init = normal_init(options.init_std)
    self.q = make_param(rngs, init, (d_model, num_heads, 2, head_dim),
                        ("embed", "heads", None, "head_dim"), options.param_dtype)
    self.k = make_param(rngs, init, (d_model, num_kv_heads, 2, head_dim),
                        ("embed", "kv_heads", None, "head_dim"), options.param_dtype)
    self.v = make_param(rngs, init, (d_model, num_kv_heads, 2 * head_dim),
                        ("embed", "kv_heads", "head_dim"), options.param_dtype)
    self.o = make_param(rngs, init, (num_heads, 2 * head_dim, d_model),
                        ("heads", "head_dim", "embed"), options.param_dtype)
    lam_init = normal_init(0.1)
    # lambda vectors and the norm gain stay float32 whatever param_dtype is.
    self.lambda_q1 = make_param(rngs, lam_init, (head_dim,), ("norm",))
    self.lambda_k1 = make_param(rngs, lam_init, (head_dim,), ("norm",))
    self.lambda_q2 = make_param(rngs, lam_init, (head_dim,), ("norm",))
    self.lambda_k2 = make_param(rngs, lam_init, (head_dim,), ("norm",))
    self.norm_scale = make_param(rngs, nnx.initializers.ones, (2 * head_dim,), ("norm",))

  def lambda_value(self) -> jax.Array:
    """The layer's current lambda (float32 scalar)."""
    if self.fixed_lambda is not None:
      return jnp.float32(self.fixed_lambda)
    return ref.diff_v1_lambda(self.lambda_q1[...], self.lambda_k1[...], self.lambda_q2[...],
                              self.lambda_k2[...], self.lambda_init)

  def __call__(self, x_BxTxE, positions_BxT=None, segment_ids_BxT=None, *,
               capture: bool = False, hooks: Hooks = NO_HOOKS):
    opts = self.options
    dt = opts.dtype
    pos = _positions(x_BxTxE, positions_BxT)
    q_BxTxHx2xD = project(x_BxTxE, self.q, "bte,ehsd->bthsd", dt, hooks)
    k_BxSxKx2xD = project(x_BxTxE, self.k, "bte,eksd->btksd", dt, hooks)
    v_BxSxKx2D = project(x_BxTxE, self.v, "bte,ekd->btkd", dt, hooks)
    q1, q2 = (_rope(q_BxTxHx2xD[:, :, :, s], pos, opts) for s in (0, 1))
    k1, k2 = (_rope(k_BxSxKx2xD[:, :, :, s], pos, opts) for s in (0, 1))
    if hooks.kv is not None:
      k1, k2, v_BxSxKx2D = hooks.kv(k1), hooks.kv(k2), hooks.kv(v_BxSxKx2D)
    lam = self.lambda_value()
    aux = None
    if capture or hooks.needs_reference:
      core, aux = ref.diff_v1_reference(q1, q2, k1, k2, v_BxSxKx2D, lam, causal=opts.causal,
                                        segment_ids=segment_ids_BxT, return_aux=True,
                                        logits_fn=hooks.logits, probs_fn=hooks.probs)
      aux = dict(aux, **{"lambda": lam, "lambda_init": jnp.float32(self.lambda_init)})
    else:
      core = ops.diff_v1_attention_core(q1, q2, k1, k2, v_BxSxKx2D, lam,
                                        segment_ids=segment_ids_BxT, **opts.kernel_kwargs())
    core = constrain(core, ("batch", "length", "heads", "head_dim"))
    if self.use_norm:
      core = ref.rms_norm(core, self.norm_scale[...], self.norm_eps)
    core = (core.astype(jnp.float32) * (1.0 - self.lambda_init)).astype(dt)
    y = project(core, self.o, "bthd,hde->bte", dt, hooks)
    return (y, aux) if capture else y


class DiffV2Attention(nnx.Module):
  """DIFF V2 differential attention on paired query heads.

  ``num_heads`` h output heads, each from a pair of query heads (2h query heads in
  all; the query kernel is [E, h, 2, d], so flattening gives heads 2i+s); keys,
  values and the output projection are the baseline's. A per-token, per-pair
  lambda = sigmoid(x W_lambda), W_lambda: E -> h with no bias and PyTorch's default
  Linear init (so sigmoid(lambda) starts near 0.5). No per-head norm.
  """

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
               options: AttentionOptions = AttentionOptions(), rngs: nnx.Rngs):
    _check_heads(num_heads, num_kv_heads, d_model, head_dim)
    self.options = options
    init = normal_init(options.init_std)
    self.q = make_param(rngs, init, (d_model, num_heads, 2, head_dim),
                        ("embed", "heads", None, "head_dim"), options.param_dtype)
    self.k = make_param(rngs, init, (d_model, num_kv_heads, head_dim),
                        ("embed", "kv_heads", "head_dim"), options.param_dtype)
    self.v = make_param(rngs, init, (d_model, num_kv_heads, head_dim),
                        ("embed", "kv_heads", "head_dim"), options.param_dtype)
    self.o = make_param(rngs, init, (num_heads, head_dim, d_model),
                        ("heads", "head_dim", "embed"), options.param_dtype)
    self.w_lambda = make_param(rngs, torch_linear_init(d_model), (d_model, num_heads),
                               ("embed", "heads"), options.param_dtype)

  def __call__(self, x_BxTxE, positions_BxT=None, segment_ids_BxT=None, *,
               capture: bool = False, hooks: Hooks = NO_HOOKS):
    opts = self.options
    dt = opts.dtype
    b, t = x_BxTxE.shape[:2]
    pos = _positions(x_BxTxE, positions_BxT)
    q_BxTxHx2xD = project(x_BxTxE, self.q, "bte,ehsd->bthsd", dt, hooks)
    h, d = q_BxTxHx2xD.shape[2], q_BxTxHx2xD.shape[4]
    q_BxTxQxD = _rope(q_BxTxHx2xD.reshape(b, t, 2 * h, d), pos, opts)
    k = _rope(project(x_BxTxE, self.k, "bte,ekd->btkd", dt, hooks), pos, opts)
    v = project(x_BxTxE, self.v, "bte,ekd->btkd", dt, hooks)
    if hooks.kv is not None:
      k, v = hooks.kv(k), hooks.kv(v)
    lam_logits = project(x_BxTxE, self.w_lambda, "bte,eh->bth", dt, hooks)
    lam_BxTxH = jax.nn.sigmoid(lam_logits.astype(jnp.float32))
    aux = None
    if capture or hooks.needs_reference:
      out, aux = ref.diff_v2_reference(q_BxTxQxD, k, v, lam_BxTxH, causal=opts.causal,
                                       segment_ids=segment_ids_BxT, return_aux=True,
                                       logits_fn=hooks.logits, probs_fn=hooks.probs)
      aux = dict(aux, **{"lambda": lam_BxTxH})
    else:
      out = ops.diff_v2_attention(q_BxTxQxD, k, v, lam_BxTxH, segment_ids=segment_ids_BxT,
                                  **opts.kernel_kwargs())
    out = constrain(out, ("batch", "length", "heads", "head_dim"))
    y = project(out, self.o, "bthd,hde->bte", dt, hooks)
    return (y, aux) if capture else y
