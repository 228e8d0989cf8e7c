"""Basic Flax NNX layers shared by every arm: projections, RMSNorm, the MLPs (SwiGLU and
Motif's PolyNorm-gated MLP), embedding.

Their parameters carry logical axis names and no eager sharding: docs/model.md#flax-nnx-modules.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from diffjax import compat
from diffjax.core.dtypes import accumulation_dtype
from diffjax.core.platform import current_platform
from diffjax.kernels.cpu import dense as cpu_dense
from diffjax.ops.reference import rms_norm


@dataclasses.dataclass(frozen=True)
class Hooks:
  """Analysis interventions, all optional; ``None`` everywhere costs nothing.

  Attributes:
    logits: applied to float32 attention scores [B, H, T, S] before the softmax
      (float64 in a float64 model).
    probs: applied to the combined attention map (A1 - lambda A2 for DIFF arms,
      A for the baseline) [B, H, T, S] before it multiplies V.
    kv: applied to keys and values after projection and RoPE (KV-cache quantization).
    activations: applied to the input of every linear projection.
    norm: DIFF V1 only: called as ``norm(x, "pre")`` on the head outputs [B, T, H, 2d]
      just before the per-head norm and ``norm(y, "post")`` just after it (before the
      (1 - lambda_init) scale); returning ``x + tap`` with zero taps makes the gradients
      into and out of the norm readable (the analysis's gradient magnification).
  """

  logits: Callable[[jax.Array], jax.Array] | None = None
  probs: Callable[[jax.Array], jax.Array] | None = None
  kv: Callable[[jax.Array], jax.Array] | None = None
  activations: Callable[[jax.Array], jax.Array] | None = None
  norm: Callable[[jax.Array, str], jax.Array] | None = None

  @property
  def needs_reference(self) -> bool:
    """Scores/probability hooks need the explicit-map XLA path."""
    return self.logits is not None or self.probs is not None


NO_HOOKS = Hooks()

_SHARDING_KEY = compat.FLAX_SHARDING_KEY


# Logical axes that say what a parameter is: per-channel vectors (RMSNorm gains, DIFF V1's
# per-head norm gain and lambda vectors) carry VECTOR_AXIS; a scanned model's stacked
# parameters gain STACKED_AXIS in front, which says nothing about the parameter itself.
VECTOR_AXIS = "norm"
STACKED_AXIS = "layers"


def is_weight_matrix(names: Sequence[str | None]) -> bool:
  """Whether a parameter with logical axis names ``names`` is a weight matrix (a projection,
  the MLP, the embedding or LM head, DIFF V2's W_lambda): two or more axes besides the
  stacked ``layers`` axis and no per-channel axis. Scanned and unrolled layouts agree."""
  own = [n for n in names if n != STACKED_AXIS]
  return VECTOR_AXIS not in own and len(own) >= 2


def logical_names(variable) -> tuple[str | None, ...] | None:
  """The logical axis names a variable was created with (:func:`make_param`), or None."""
  get_metadata = getattr(variable, "get_metadata", None)
  if get_metadata is None:
    return None
  names = get_metadata().get(_SHARDING_KEY)
  return None if names is None else tuple(names)


def stack_modules(modules: Sequence[nnx.Module], axis_name: str = "layers") -> nnx.Module:
  """One module whose variables stack those of ``modules`` along a new leading axis.

  The modules must have the same variables and shapes; the result has the structure
  (and static attributes) of ``modules[0]``, and each variable's logical axis names
  gain ``axis_name`` in front. Run it under ``jax.lax.scan`` over its split state.
  """
  if not modules:
    raise ValueError("stack_modules needs at least one module.")
  graphdef, *_ = nnx.split(modules[0])
  flats = [dict(nnx.to_flat_state(nnx.state(m))) for m in modules]
  stacked = []
  for path, first in flats[0].items():
    shapes = {tuple(f[path].shape) for f in flats if path in f}
    if len(shapes) != 1 or any(path not in f for f in flats):
      raise ValueError(
        f"Cannot stack variable {'/'.join(map(str, path))}: the modules differ "
        f"in it (shapes {sorted(shapes)})."
      )
    meta = dict(first.get_metadata())
    names = meta.get(_SHARDING_KEY)
    if names is not None:
      meta[_SHARDING_KEY] = (axis_name, *names)
    value = jnp.stack([f[path][...] for f in flats])
    with nnx.use_eager_sharding(False):
      stacked.append((path, type(first)(value, **meta)))
  return nnx.merge(graphdef, nnx.from_flat_state(stacked))


def make_param(
  rngs: nnx.Rngs, init, shape: Sequence[int], names: Sequence[str | None], dtype=jnp.float32
) -> nnx.Param:
  """Creates an ``nnx.Param`` with logical axis names and no eager placement."""
  if len(shape) != len(names):
    raise ValueError(f"shape {tuple(shape)} and logical names {tuple(names)} differ in rank.")
  with nnx.use_eager_sharding(False):
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), **{_SHARDING_KEY: tuple(names)})


def normal_init(std: float):
  return nnx.initializers.normal(stddev=std)


def torch_linear_init(fan_in: int):
  """PyTorch's default nn.Linear init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
  bound = 1.0 / math.sqrt(fan_in)
  return (
    nnx.initializers.uniform_range(-bound, bound)
    if hasattr(nnx.initializers, "uniform_range")
    else _uniform(bound)
  )


def _uniform(bound: float):
  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


@functools.cache
def _rows_form(spec: str) -> tuple[int, bool] | None:
  """``(n_contract, w_transposed)`` if ``spec`` reads ``x[..., C] w[C, O] -> y[..., O]``
  (or ``x[..., c] w[o, c] -> y[..., o]`` with a 2-D ``w``), else None."""
  ins, out = spec.split("->")
  xs, ws = ins.split(",")
  if len(set(xs)) != len(xs) or len(set(ws)) != len(ws):
    return None
  for n in range(1, min(len(xs), len(ws)) + 1):
    lead, contracted = xs[: len(xs) - n], xs[len(xs) - n :]
    if ws[:n] == contracted and out == lead + ws[n:] and not set(lead) & set(ws):
      return n, False
  if len(ws) == 2 and ws[1] == xs[-1] and out == xs[:-1] + ws[0] and ws[0] not in xs:
    return 1, True
  return None


def matmul(spec: str, x: jax.Array, w: jax.Array, dtype) -> jax.Array:
  """``einsum(spec, x, w)`` in ``dtype`` with float32 (float64) accumulation.

  On a CPU, in float32 and float64, specs of the form ``x[..., C] w[C, O] -> y[..., O]`` run
  through :func:`diffjax.kernels.cpu.dense.project` (the same product with row-major 2-D
  gradients, which XLA's CPU compiler runs without transposing cotangents).
  """
  acc = accumulation_dtype(dtype)
  if np.dtype(dtype) == acc and current_platform() == "cpu":
    form = _rows_form(spec)
    if form is not None:
      return cpu_dense.project(x.astype(dtype), w.astype(dtype), form[0], w_transposed=form[1])
  return jnp.einsum(spec, x.astype(dtype), w.astype(dtype), preferred_element_type=acc)


def project(x, kernel: nnx.Param, spec: str, dtype, hooks: Hooks) -> jax.Array:
  """``einsum(spec, x, kernel)`` in the compute dtype with float32 (float64) accumulation."""
  if hooks.activations is not None:
    x = hooks.activations(x)
  return matmul(spec, x, kernel[...], dtype).astype(dtype)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis with a learnable gain.

  Computed in float32 (float64 for float64 inputs); the gain is float32 unless
  ``param_dtype`` is float64.
  """

  def __init__(
    self,
    dim: int,
    *,
    eps: float = 1e-5,
    rngs: nnx.Rngs,
    names: Sequence[str | None] = ("norm",),
    param_dtype=jnp.float32,
  ):
    self.eps = eps
    self.scale = make_param(
      rngs, nnx.initializers.ones, (dim,), names, accumulation_dtype(param_dtype)
    )

  def __call__(self, x):
    return rms_norm(x, self.scale[...], self.eps)


class Embed(nnx.Module):
  """Token embedding table [vocab, embed]."""

  def __init__(
    self, vocab_size: int, dim: int, *, init_std: float, rngs: nnx.Rngs, param_dtype=jnp.float32
  ):
    self.embedding = make_param(
      rngs, normal_init(init_std), (vocab_size, dim), ("vocab", "embed"), param_dtype
    )

  def __call__(self, tokens_BxT, dtype):
    return jnp.take(self.embedding[...], tokens_BxT, axis=0).astype(dtype)

  def attend(self, x_BxTxE, dtype):
    """Tied output head: logits against the embedding table, float32 (float64)."""
    return matmul("bte,ve->btv", x_BxTxE, self.embedding[...], dtype)


class SwiGLU(nnx.Module):
  """LLaMA MLP: down(silu(x W_gate) * (x W_up)), no biases."""

  def __init__(
    self, dim: int, hidden: int, *, init_std: float, rngs: nnx.Rngs, param_dtype=jnp.float32
  ):
    init = normal_init(init_std)
    self.w_gate = make_param(rngs, init, (dim, hidden), ("embed", "mlp"), param_dtype)
    self.w_up = make_param(rngs, init, (dim, hidden), ("embed", "mlp"), param_dtype)
    self.w_down = make_param(rngs, init, (hidden, dim), ("mlp", "embed"), param_dtype)

  @jax.named_scope("mlp")
  def __call__(self, x_BxTxE, dtype, hooks: Hooks = NO_HOOKS):
    acc = accumulation_dtype(dtype)
    gate_BxTxF = project(x_BxTxE, self.w_gate, "bte,ef->btf", dtype, hooks)
    up_BxTxF = project(x_BxTxE, self.w_up, "bte,ef->btf", dtype, hooks)
    h_BxTxF = (jax.nn.silu(gate_BxTxF.astype(acc)) * up_BxTxF.astype(acc)).astype(dtype)
    return project(h_BxTxF, self.w_down, "btf,fe->bte", dtype, hooks)


# Motif's PolyNorm epsilon (a constant of the activation, not a config field there either).
POLYNORM_EPS = 1e-6


def poly_norm(x, weight_3, bias_1, eps: float = POLYNORM_EPS) -> jax.Array:
  """PolyNorm (arXiv 2411.03884): ``w0 n(x^3) + w1 n(x^2) + w2 n(x) + b``.

  ``n(y) = y / sqrt(mean(y^2) + eps)`` over the last axis. Computed in float32 (float64 for
  float64 ``x``) and returned in that dtype: the caller casts once, after the gate product.
  """
  acc = accumulation_dtype(x.dtype)
  x = x.astype(acc)
  w, b = weight_3.astype(acc), bias_1.astype(acc)

  def n(y):
    return y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + eps)

  x2 = x * x
  return w[0] * n(x2 * x) + w[1] * n(x2) + w[2] * n(x) + b[0]


class PolyNormGLU(nnx.Module):
  """Motif's MLP: down(PolyNorm(x W_gate) * (x W_up)), no biases in the projections.

  The projections are SwiGLU's (same names, shapes and init); PolyNorm adds ``poly_weight``
  [3] (initialised to 1/3 each) and ``poly_bias`` [1] (0), float32 like the norm gains.
  """

  def __init__(
    self,
    dim: int,
    hidden: int,
    *,
    init_std: float,
    rngs: nnx.Rngs,
    param_dtype=jnp.float32,
    eps: float = POLYNORM_EPS,
  ):
    init = normal_init(init_std)
    self.w_gate = make_param(rngs, init, (dim, hidden), ("embed", "mlp"), param_dtype)
    self.w_up = make_param(rngs, init, (dim, hidden), ("embed", "mlp"), param_dtype)
    self.w_down = make_param(rngs, init, (hidden, dim), ("mlp", "embed"), param_dtype)
    vec = accumulation_dtype(param_dtype)
    self.poly_weight = make_param(
      rngs, nnx.initializers.constant(1.0 / 3.0), (3,), (VECTOR_AXIS,), vec
    )
    self.poly_bias = make_param(rngs, nnx.initializers.zeros, (1,), (VECTOR_AXIS,), vec)
    self.eps = eps

  @jax.named_scope("mlp")
  def __call__(self, x_BxTxE, dtype, hooks: Hooks = NO_HOOKS):
    acc = accumulation_dtype(dtype)
    gate_BxTxF = project(x_BxTxE, self.w_gate, "bte,ef->btf", dtype, hooks)
    up_BxTxF = project(x_BxTxE, self.w_up, "bte,ef->btf", dtype, hooks)
    act_BxTxF = poly_norm(gate_BxTxF, self.poly_weight[...], self.poly_bias[...], self.eps)
    h_BxTxF = (act_BxTxF.astype(acc) * up_BxTxF.astype(acc)).astype(dtype)
    return project(h_BxTxF, self.w_down, "btf,fe->bte", dtype, hooks)


def make_mlp(
  activation: str, dim: int, hidden: int, *, init_std: float, rngs: nnx.Rngs, param_dtype
) -> nnx.Module:
  """The MLP named by ``ModelConfig.mlp_activation``: ``"swiglu"`` or ``"polynorm"``."""
  cls = {"swiglu": SwiGLU, "polynorm": PolyNormGLU}.get(activation)
  if cls is None:
    raise ValueError(f"mlp_activation={activation!r} is not one of ('swiglu', 'polynorm').")
  return cls(dim, hidden, init_std=init_std, rngs=rngs, param_dtype=param_dtype)
