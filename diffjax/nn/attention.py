"""Flax NNX attention modules: the baseline, DIFF V1 and DIFF V2.

Called as ``module(x_BxTxE, positions_BxT=None, segment_ids_BxT=None)``, with ``capture=True``
for their maps and ``cache=`` for a KV cache: docs/model.md#flax-nnx-modules.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from diffjax import ops
from diffjax.core import op_specs
from diffjax.core.config import IMPLEMENTATIONS, ROPE_STYLES, V2_LAMBDAS, V2_PAIRINGS
from diffjax.core.dtypes import accumulation_dtype, check_float64_enabled
from diffjax.nn.layers import NO_HOOKS, Hooks, make_param, normal_init, project, torch_linear_init
from diffjax.nn.rope import apply_rope
from diffjax.ops import reference as ref
from diffjax.sharding import constrain, context_parallel

# The layout of the heads' queries and outputs, [B, T, H, D].
_HEAD_AXES = ("batch", "length", "heads", "head_dim")


def _explicit_maps(capture: bool, hooks: Hooks) -> bool:
  """Whether this call materialises the attention maps (analysis); refused when the
  sequence is sharded over a context axis, whose token order the maps would not follow."""
  if not (capture or hooks.needs_reference):
    return False
  cp = context_parallel()
  if cp is not None:
    raise ValueError(
      "capture=True and logits/probs hooks need the whole sequence on one "
      f"device; the active mesh shards it over {cp.axis!r} ({cp.size}). Run "
      "the analysis without context parallelism."
    )
  return True


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """Settings every attention module shares.

  Attributes:
    rope_theta: RoPE base.
    rope_style: "interleaved" (default, as the DIFF reference code) or "half" (NeoX).
    dtype: compute dtype. float64 (with 64-bit JAX on) runs every step in float64;
      otherwise softmax, lambda, RoPE and the norm run in float32.
    init_std: std of the normal init of the projections.
    implementation: see :mod:`diffjax.ops.attention` ("auto", "xla", "pallas", ...).
    block_sizes: kernel block sizes (a dict or the kernel's BlockSizes), or None.
    interpret: run Pallas kernels in the interpreter (testing on CPU).
    causal: causal masking (decoder LMs).
    param_dtype: dtype of the projection matrices (float32 by default); DIFF V1's
      lambda vectors and norm gain are float32, or float64 with float64 here.
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
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(f"implementation={self.implementation!r} is not one of {IMPLEMENTATIONS}.")
    check_float64_enabled("dtype", self.dtype)
    check_float64_enabled("param_dtype", self.param_dtype)

  def kernel_kwargs(self) -> dict[str, Any]:
    return dict(
      causal=self.causal,
      implementation=self.implementation,
      block_sizes=self.block_sizes,
      interpret=self.interpret,
    )


def _check_heads(num_heads: int, num_kv_heads: int, d_model: int, head_dim: int) -> None:
  if num_heads <= 0 or num_kv_heads <= 0 or head_dim <= 0 or d_model <= 0:
    raise ValueError(
      f"Sizes must be positive: {d_model=}, {num_heads=}, {num_kv_heads=}, {head_dim=}."
    )
  if num_heads % num_kv_heads:
    raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}.")


def _positions(x_BxTxE, positions_BxT):
  """The positions of a call (0..T-1 by default); refuses an input that is not [B, T, E]."""
  if getattr(x_BxTxE, "ndim", None) != 3:
    raise ValueError(
      f"An attention module takes x_BxTxE of rank 3 [batch, length, d_model]; got shape "
      f"{getattr(x_BxTxE, 'shape', type(x_BxTxE).__name__)}: add the missing axis (x[None])."
    )
  if positions_BxT is not None:
    return positions_BxT
  b, t = x_BxTxE.shape[:2]
  return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))


def _rope(x, positions, opts: AttentionOptions):
  return apply_rope(x, positions, theta=opts.rope_theta, style=opts.rope_style)


# KV cache. A layer's cache is a dict of arrays [B, S, K, width] (S slots, preallocated):
# {"k", "v"} for the baseline and DIFF V2, {"k1", "k2", "v"} for DIFF V1 (v is 2D wide).
# Slot j of row b holds the key/value of that row's position j. Under cache_layout("head_major")
# the arrays are [B, K, S, width] instead.

CACHE_AXES = ("batch", "length", "kv_heads", "head_dim")
CACHE_LAYOUTS = ("sequence_major", "head_major")
_HEAD_MAJOR_AXES = ("batch", "kv_heads", "length", "head_dim")

# The layout of the caches made, written and read while a program traces.
_LAYOUT: contextvars.ContextVar[str] = contextvars.ContextVar(
  "cache_layout", default="sequence_major"
)


@contextlib.contextmanager
def cache_layout(layout: str):
  """Caches made (``init_cache``), written and read inside are laid out as ``layout``.

  ``"sequence_major"`` (the default): [B, S, K, width], what the TPU and GPU decode kernels
  read in place. ``"head_major"``: [B, K, S, width]. XLA on a CPU multiplies each (row, head)
  block as one contiguous matrix, so a decode step over a head-major cache reads the slots it
  needs with plain slices (or nothing at all when it reads the whole cache) where a
  sequence-major one is first copied head by head. The results are the same; a cache must be
  used under the layout it was made in (:func:`default_cache_layout` picks one per platform).
  """
  if layout not in CACHE_LAYOUTS:
    raise ValueError(f"cache layout {layout!r}: use one of {CACHE_LAYOUTS}.")
  token = _LAYOUT.set(layout)
  try:
    yield
  finally:
    _LAYOUT.reset(token)


def default_cache_layout(platform: str) -> str:
  """The layout decoding programs use on ``platform`` (``"cpu"``, ``"tpu"``, ``"gpu"``...):
  head-major where decode attention runs as XLA on a CPU, else sequence-major."""
  return "head_major" if platform == "cpu" else "sequence_major"


def _head_major() -> bool:
  return _LAYOUT.get() == "head_major"


# The slots a decode step reads (None: all); set by cache_window() while a program traces.
_WINDOW: contextvars.ContextVar[int | None] = contextvars.ContextVar("cache_window", default=None)


@contextlib.contextmanager
def cache_window(slots: int | None):
  """Decode steps traced inside read only the first ``slots`` slots of each cache row.

  For a server whose rows are all shorter than its cache: the step's reads (its cost on a
  CPU, where decoding is bound by reading the cache) follow the rows' lengths, not the
  cache's. Every row's length after the step must be at most ``slots``. Writes are
  unchanged. A decode step whose batch is smaller than the cache's rows also reads (and
  writes) only the first rows, so a program can decode the leading rows of a larger cache.
  """
  token = _WINDOW.set(None if slots is None else int(slots))
  try:
    yield
  finally:
    _WINDOW.reset(token)


def _cache_arrays(shapes: dict[str, tuple[int, int, int, int]], dtype) -> dict[str, jax.Array]:
  """Zero arrays of the given [B, S, K, width] shapes, in the current layout; refuses a batch
  or max_length below 1."""
  b, s = next(iter(shapes.values()))[:2]
  if not all(isinstance(n, (int, np.integer)) and n >= 1 for n in (b, s)):
    raise ValueError(f"init_cache(batch={b!r}, max_length={s!r}): both must be integers >= 1.")
  if _head_major():
    return {
      name: constrain(jnp.zeros((b, k, s, w), dtype), _HEAD_MAJOR_AXES)
      for name, (b, s, k, w) in shapes.items()
    }
  return {name: constrain(jnp.zeros(shape, dtype), CACHE_AXES) for name, shape in shapes.items()}


def _check_cache_layout(cache: dict[str, jax.Array], new: dict[str, jax.Array]) -> None:
  """Refuses a cache whose heads and widths do not sit where the current layout puts them
  (a cache made under another :func:`cache_layout`, or for another module)."""
  head_axis = 1 if _head_major() else 2
  for name, x in new.items():
    c = cache.get(name)
    if c is None or c.ndim != 4 or (c.shape[head_axis], c.shape[3]) != x.shape[2:]:
      got = None if c is None else tuple(c.shape)
      raise ValueError(
        f"cache[{name!r}] has shape {got}; a {_LAYOUT.get()} cache of this layer holds "
        f"{x.shape[2]} heads of width {x.shape[3]} on axes {head_axis} and 3. Make the cache "
        "with init_cache under the cache_layout it is used in."
      )


def _write_cache(
  cache: dict[str, jax.Array], new: dict[str, jax.Array], lengths_B: jax.Array
) -> dict[str, jax.Array]:
  """Writes the T new positions of each row at slots lengths_B[b] .. lengths_B[b] + T - 1.

  A scatter into the given arrays: under jit with the cache donated it runs in place.
  Slots past the cache end are dropped (callers check lengths up front).
  """
  b, t = next(iter(new.values())).shape[:2]
  rows_BxT = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
  slots_BxT = lengths_B.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  if _head_major():  # [B, K, S, w]: the indexed axes first, so the update stays [B, T, K, w]
    return {
      name: constrain(
        cache[name]
        .at[rows_BxT, :, slots_BxT]
        .set(new[name].astype(cache[name].dtype), mode="drop"),
        _HEAD_MAJOR_AXES,
      )
      for name in cache
    }
  return {
    name: constrain(
      cache[name].at[rows_BxT, slots_BxT].set(new[name].astype(cache[name].dtype), mode="drop"),
      CACHE_AXES,
    )
    for name in cache
  }


def _baseline_kv(module, x_BxTxE, pos_BxT, hooks: Hooks) -> tuple[jax.Array, jax.Array]:
  """The baseline's keys (RoPE applied) and values [B, S, K, D], after the kv hook; the
  Transformer and DIFF V2 share them (and so their KV cache)."""
  opts, dt = module.options, module.options.dtype
  k_BxSxKxD = _rope(project(x_BxTxE, module.k, "bte,ekd->btkd", dt, hooks), pos_BxT, opts)
  v_BxSxKxD = project(x_BxTxE, module.v, "bte,ekd->btkd", dt, hooks)
  if hooks.kv is not None:
    k_BxSxKxD, v_BxSxKxD = hooks.kv(k_BxSxKxD), hooks.kv(v_BxSxKxD)
  return k_BxSxKxD, v_BxSxKxD


def _init_queries(
  module,
  rngs: nnx.Rngs,
  options: AttentionOptions,
  d_model: int,
  num_heads: int,
  head_dim: int,
  *,
  paired: bool,
  group: int = 2,
):
  """Sets ``module.options`` and ``module.q`` (the first parameter drawn): [E, H, D], or
  [E, H, group, D] for DIFF's two maps per head (V1) or pair of heads (V2), and for the
  grouped forms' groups of r signal heads and a noise head (H: the groups, group = r + 1).
  Returns the weight initialiser the other projections use."""
  module.options = options
  init = normal_init(options.init_std)
  shape, axes = (
    ((d_model, num_heads, group, head_dim), ("embed", "heads", None, "head_dim"))
    if paired
    else ((d_model, num_heads, head_dim), ("embed", "heads", "head_dim"))
  )
  module.q = make_param(rngs, init, shape, axes, options.param_dtype)
  return init


class _BaselineKVCache:
  """The baseline's K, V and W_o and their KV cache, which the Transformer and DIFF V2 share."""

  def _baseline_kvo(
    self, rngs: nnx.Rngs, init, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int
  ) -> None:
    """Creates ``k``, ``v`` and ``o`` (after ``q``: the order fixes the initial draws)."""
    dtype = self.options.param_dtype
    kv_shape, kv_axes = (d_model, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim")
    self.k = make_param(rngs, init, kv_shape, kv_axes, dtype)
    self.v = make_param(rngs, init, kv_shape, kv_axes, dtype)
    self.o = make_param(
      rngs, init, (num_heads, head_dim, d_model), ("heads", "head_dim", "embed"), dtype
    )

  def init_cache(self, batch: int, max_length: int, dtype=None) -> dict[str, jax.Array]:
    """An empty cache: ``{"k", "v"}``, each [batch, max_length, K, D] in ``dtype``
    (default: the compute dtype); [batch, K, max_length, D] under ``cache_layout("head_major")``."""
    _, k, d = self.k.shape
    shape = (batch, max_length, k, d)
    return _cache_arrays({"k": shape, "v": shape}, dtype or self.options.dtype)


def _check_cache_call(x_BxTxE, cache, cache_lengths_B, capture: bool, hooks: Hooks) -> bool:
  """True for a decode step (T == 1), False for a prefill; refuses what cannot mix: a prefill
  longer than the cache, and one into a cache whose rows are known (outside jit) to be filled."""
  if capture or hooks.needs_reference:
    raise ValueError(
      "capture=True and reference hooks analyse a full forward; call without cache= for them."
    )
  if cache_lengths_B is None:
    raise ValueError("cache= needs cache_lengths_B (int [B]: the filled slots of each row).")
  t = x_BxTxE.shape[1]
  slots = next(iter(cache.values())).shape[2 if _head_major() else 1]
  if t > slots:
    raise ValueError(
      f"{t} tokens do not fit a KV cache of {slots} slots: make it with "
      f"init_cache(batch, max_length >= {t})."
    )
  if t > 1:
    try:
      filled = np.asarray(cache_lengths_B)
    except jax.errors.TracerArrayConversionError:  # under jit: the caller's to keep
      filled = None
    if filled is not None and filled.any():
      raise ValueError(
        f"A call of {t} tokens with cache= is a prefill into an empty cache: it attends to its "
        f"own tokens only, but cache_lengths_B={filled.tolist()} has filled slots. Prefill the "
        "whole prompt in one call, then decode one token per call."
      )
  return t == 1


@dataclasses.dataclass(frozen=True)
class _Call:
  """How one module call attends: a decode step over its cache, the explicit-map reference
  (analysis: returns the maps too), or the dispatched op."""

  opts: AttentionOptions
  segment_ids_BxT: Any
  hooks: Hooks
  explicit: bool = False
  decoding: bool = False
  cache: dict | None = None
  cache_lengths_B: Any = None
  cache_names: tuple[str, ...] = ()  # the op's keys, then its value
  capture: bool = False  # return the maps too (ignored with a cache)

  @classmethod
  def start(cls, module, x_BxTxE, segment_ids_BxT, capture, hooks, cache, cache_lengths_B, new):
    """The call, with ``new`` (the call's keys and values by cache name) written to the cache
    when there is one."""
    if cache is None:
      explicit = _explicit_maps(capture, hooks)
      return cls(module.options, segment_ids_BxT, hooks, explicit, capture=capture)
    _check_cache_layout(cache, new)
    decoding = _check_cache_call(x_BxTxE, cache, cache_lengths_B, capture, hooks)
    cache = _write_cache(cache, new, cache_lengths_B)
    opts = module.options
    return cls(opts, segment_ids_BxT, hooks, False, decoding, cache, cache_lengths_B, tuple(new))

  def attend(self, spec, decode_spec, arrays, probs_fn=None):
    """``spec`` on its ``arrays``: (out, maps or None). Decoding reads the op's keys and value
    from the cache."""
    if self.decoding:
      rows, window = arrays[spec.queries[0]].shape[0], _WINDOW.get()

      def view(c):  # the rows decoded and the slots read, [B, S, K, w] (slices, transposes)
        if _head_major():
          whole = (c.shape[0], window) in ((rows, None), (rows, c.shape[2]))
          return (c if whole else c[:rows, :, :window]).transpose(0, 2, 1, 3)
        return (
          c if (c.shape[0], window) in ((rows, None), (rows, c.shape[1])) else c[:rows, :window]
        )

      cached = dict(zip((*spec.keys, spec.value), (view(self.cache[n]) for n in self.cache_names)))
      arrays = tuple(cached.get(i, x) for i, x in enumerate(arrays))
      kw = dict(implementation=self.opts.implementation, interpret=self.opts.interpret)
      return ops.run_decode_op(decode_spec, (*arrays, self.cache_lengths_B + 1), **kw), None
    if self.explicit:
      return spec.reference(
        *arrays,
        causal=self.opts.causal,
        segment_ids=self.segment_ids_BxT,
        return_aux=True,
        logits_fn=self.hooks.logits,
        probs_fn=probs_fn,
      )
    kw = self.opts.kernel_kwargs()
    return ops.run_op(spec, arrays, segment_ids=self.segment_ids_BxT, **kw), None

  def attend_aux(self, spec, decode_spec, arrays, values, lam=None):
    """:meth:`attend` with the probs hook; the maps (when explicit) come with the output
    (``context``), the ``values`` and DIFF's ``lambda`` (``lam``, when given)."""
    out, aux = self.attend(spec, decode_spec, arrays, self.hooks.probs)
    if aux is not None:
      aux = dict(aux, context=out, values=values)
      if lam is not None:
        aux["lambda"] = lam
    return out, aux

  def output(self, module, out_BxTxHxD, aux):
    """The module's result: the heads' outputs projected by its W_o, with the written cache
    when there is one, or with ``aux`` when capturing."""
    y_BxTxE = project(out_BxTxHxD, module.o, "bthd,hde->bte", self.opts.dtype, self.hooks)
    if self.cache is not None:
      return y_BxTxE, self.cache
    return (y_BxTxE, aux) if self.capture else y_BxTxE


class Attention(_BaselineKVCache, nnx.Module):
  """Baseline multi-head / grouped-query attention with RoPE and no biases."""

  def __init__(
    self,
    d_model: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    options: AttentionOptions = AttentionOptions(),
    rngs: nnx.Rngs,
  ):
    _check_heads(num_heads, num_kv_heads, d_model, head_dim)
    init = _init_queries(self, rngs, options, d_model, num_heads, head_dim, paired=False)
    self._baseline_kvo(rngs, init, d_model, num_heads, num_kv_heads, head_dim)

  @jax.named_scope("attention_transformer")
  def __call__(
    self,
    x_BxTxE,
    positions_BxT=None,
    segment_ids_BxT=None,
    *,
    capture: bool = False,
    hooks: Hooks = NO_HOOKS,
    cache=None,
    cache_lengths_B=None,
  ):
    opts = self.options
    dt = opts.dtype
    pos_BxT = _positions(x_BxTxE, positions_BxT)
    q_BxTxHxD = _rope(project(x_BxTxE, self.q, "bte,ehd->bthd", dt, hooks), pos_BxT, opts)
    q_BxTxHxD = constrain(q_BxTxHxD, _HEAD_AXES)
    k_BxSxKxD, v_BxSxKxD = _baseline_kv(self, x_BxTxE, pos_BxT, hooks)
    new = {"k": k_BxSxKxD, "v": v_BxSxKxD}
    call = _Call.start(self, x_BxTxE, segment_ids_BxT, capture, hooks, cache, cache_lengths_B, new)
    arrays = (q_BxTxHxD, k_BxSxKxD, v_BxSxKxD)
    out_BxTxHxD, aux = call.attend_aux(op_specs.MHA, op_specs.MHA_DECODE, arrays, v_BxSxKxD)
    return call.output(self, constrain(out_BxTxHxD, _HEAD_AXES), aux)


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
  ablations; ``lambda_init_offset`` shifts l (Motif's models: -1).
  """

  OP, DECODE_OP = op_specs.DIFF_V1, op_specs.DIFF_V1_DECODE

  def _init_q(self, rngs, options, d_model, num_heads, head_dim):
    return _init_queries(self, rngs, options, d_model, num_heads, head_dim, paired=True)

  def _queries(self, x_BxTxE, pos_BxT, hooks):
    """The two query components [B, T, H, D] (RoPE applied)."""
    q_BxTxHx2xD = project(x_BxTxE, self.q, "bte,ehsd->bthsd", self.options.dtype, hooks)
    return tuple(_rope(q_BxTxHx2xD[:, :, :, s], pos_BxT, self.options) for s in (0, 1))

  def __init__(
    self,
    d_model: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    layer_index: int,
    options: AttentionOptions = AttentionOptions(),
    norm_eps: float = 1e-5,
    use_norm: bool = True,
    fixed_lambda: float | None = None,
    lambda_init_offset: int = 0,
    rngs: nnx.Rngs,
  ):
    _check_heads(num_heads, num_kv_heads, d_model, head_dim)
    self.head_dim = head_dim
    self.lambda_init = ref.lambda_init_for_layer(layer_index, lambda_init_offset)
    self.norm_eps = norm_eps
    self.use_norm = use_norm
    self.fixed_lambda = fixed_lambda
    init = self._init_q(rngs, options, d_model, num_heads, head_dim)
    self.k = make_param(
      rngs,
      init,
      (d_model, num_kv_heads, 2, head_dim),
      ("embed", "kv_heads", None, "head_dim"),
      options.param_dtype,
    )
    self.v = make_param(
      rngs,
      init,
      (d_model, num_kv_heads, 2 * head_dim),
      ("embed", "kv_heads", "head_dim"),
      options.param_dtype,
    )
    self.o = make_param(
      rngs,
      init,
      (num_heads, 2 * head_dim, d_model),
      ("heads", "head_dim", "embed"),
      options.param_dtype,
    )
    lam_init = normal_init(0.1)
    # lambda vectors and the norm gain stay float32 (bfloat16 would coarsen lambda),
    # or float64 in a float64 model.
    small_dtype = accumulation_dtype(options.param_dtype)
    self.lambda_q1 = make_param(rngs, lam_init, (head_dim,), ("norm",), small_dtype)
    self.lambda_k1 = make_param(rngs, lam_init, (head_dim,), ("norm",), small_dtype)
    self.lambda_q2 = make_param(rngs, lam_init, (head_dim,), ("norm",), small_dtype)
    self.lambda_k2 = make_param(rngs, lam_init, (head_dim,), ("norm",), small_dtype)
    self.norm_scale = make_param(
      rngs, nnx.initializers.ones, (2 * head_dim,), ("norm",), small_dtype
    )

  def lambda_value(self, lambda_init: jax.Array | float | None = None) -> jax.Array:
    """The layer's current lambda: a float32 scalar (float64 in a float64 model).

    ``lambda_init`` overrides the layer's own (a scanned stack of layers passes each
    layer's value as data, since the stacked module was built from layer 0).
    """
    acc = accumulation_dtype(self.options.dtype)
    if self.fixed_lambda is not None:
      return jnp.asarray(self.fixed_lambda, acc)
    lam_init = self.lambda_init if lambda_init is None else lambda_init
    return ref.diff_v1_lambda(
      self.lambda_q1[...],
      self.lambda_k1[...],
      self.lambda_q2[...],
      self.lambda_k2[...],
      lam_init,
      dtype=acc,
    )

  def init_cache(self, batch: int, max_length: int, dtype=None) -> dict[str, jax.Array]:
    """An empty cache: ``{"k1", "k2"}`` [batch, max_length, K, D] and ``"v"``
    [batch, max_length, K, 2D], in ``dtype`` (default: the compute dtype); K before
    max_length under ``cache_layout("head_major")``."""
    _, k, _, d = self.k.shape
    shapes = {
      "k1": (batch, max_length, k, d),
      "k2": (batch, max_length, k, d),
      "v": (batch, max_length, k, self.v.shape[-1]),
    }
    return _cache_arrays(shapes, dtype or self.options.dtype)

  @jax.named_scope("attention_diff_v1")
  def __call__(
    self,
    x_BxTxE,
    positions_BxT=None,
    segment_ids_BxT=None,
    *,
    capture: bool = False,
    hooks: Hooks = NO_HOOKS,
    cache=None,
    cache_lengths_B=None,
    lambda_init: jax.Array | float | None = None,
  ):
    opts = self.options
    dt = opts.dtype
    acc = accumulation_dtype(dt)
    lam_init = self.lambda_init if lambda_init is None else lambda_init
    pos_BxT = _positions(x_BxTxE, positions_BxT)
    q1_BxTxHxD, q2_BxTxHxD = self._queries(x_BxTxE, pos_BxT, hooks)
    k_BxSxKx2xD = project(x_BxTxE, self.k, "bte,eksd->btksd", dt, hooks)
    # Dv = 2·D: one value per kv group, twice the width of a query/key component.
    v_BxSxKxDv = project(x_BxTxE, self.v, "bte,ekd->btkd", dt, hooks)
    k1_BxSxKxD, k2_BxSxKxD = (_rope(k_BxSxKx2xD[:, :, :, s], pos_BxT, opts) for s in (0, 1))
    if hooks.kv is not None:
      k1_BxSxKxD, k2_BxSxKxD = hooks.kv(k1_BxSxKxD), hooks.kv(k2_BxSxKxD)
      v_BxSxKxDv = hooks.kv(v_BxSxKxDv)
    lam = self.lambda_value(lam_init)
    new = {"k1": k1_BxSxKxD, "k2": k2_BxSxKxD, "v": v_BxSxKxDv}
    call = _Call.start(self, x_BxTxE, segment_ids_BxT, capture, hooks, cache, cache_lengths_B, new)
    arrays = (q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam)
    core_BxTxHxDv, aux = call.attend_aux(self.OP, self.DECODE_OP, arrays, v_BxSxKxDv, lam)
    if aux is not None:
      aux["lambda_init"] = jnp.asarray(lam_init, acc)
    core_BxTxHxDv = constrain(core_BxTxHxDv, _HEAD_AXES)
    if hooks.norm is not None:
      core_BxTxHxDv = hooks.norm(core_BxTxHxDv, "pre")
    if self.use_norm:
      core_BxTxHxDv = ref.rms_norm(core_BxTxHxDv, self.norm_scale[...], self.norm_eps)
    if hooks.norm is not None:
      core_BxTxHxDv = hooks.norm(core_BxTxHxDv, "post")
    core_BxTxHxDv = (core_BxTxHxDv.astype(acc) * (1.0 - lam_init)).astype(dt)
    return call.output(self, core_BxTxHxDv, aux)


def check_v2_ablation(pairing: str, lambda_fn: str, num_kv_heads: int) -> None:
  """Refuses an unknown DIFF V2 pairing or lambda function, and a cross-group pairing
  that cannot differ from the grouped one (a single kv head)."""
  if pairing not in V2_PAIRINGS:
    raise ValueError(f"v2_pairing={pairing!r} is not one of {V2_PAIRINGS}.")
  if lambda_fn not in V2_LAMBDAS:
    raise ValueError(f"v2_lambda={lambda_fn!r} is not one of {V2_LAMBDAS}.")
  if pairing == "across_groups" and num_kv_heads < 2:
    raise ValueError(
      f"v2_pairing='across_groups' pairs query heads from different kv groups, "
      f"which needs num_kv_heads >= 2 (got {num_kv_heads})."
    )


def _cross_group_pairs(out_BxTxQxD, lam_BxTxH):
  """o_i = out_i - lam_i out_{i+h}: pair i is query heads i and i + h (two kv groups)."""
  h = lam_BxTxH.shape[-1]
  acc = lam_BxTxH.dtype
  first, second = out_BxTxQxD[:, :, :h].astype(acc), out_BxTxQxD[:, :, h:].astype(acc)
  return (first - lam_BxTxH[..., None] * second).astype(out_BxTxQxD.dtype)


class DiffV2Attention(_BaselineKVCache, nnx.Module):
  """DIFF V2 differential attention on paired query heads.

  ``num_heads`` h output heads, each from a pair of query heads (2h query heads in
  all; the query kernel is [E, h, 2, d], so flattening gives heads 2i+s); keys,
  values and the output projection are the baseline's. A per-token, per-pair
  lambda = sigmoid(x W_lambda), W_lambda: E -> h with no bias and PyTorch's default
  Linear init (so sigmoid(lambda) starts near 0.5). No per-head norm.

  Two ablations of the V2 write-up (the defaults are V2 itself):
    * ``pairing="across_groups"``: pair i is query heads i and i + h of the flattened
      2h heads, which read different kv groups (the pair no longer shares K and V);
      the maps run as ordinary grouped-query attention over 2h heads and the pair is
      combined after. Needs ``num_kv_heads >= 2``.
    * ``lambda_fn="identity"``: lambda = x W_lambda, unbounded (no sigmoid).
  """

  OP, DECODE_OP = op_specs.DIFF_V2, op_specs.DIFF_V2_DECODE

  def __init__(
    self,
    d_model: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    options: AttentionOptions = AttentionOptions(),
    pairing: str = "group",
    lambda_fn: str = "sigmoid",
    rngs: nnx.Rngs,
  ):
    _check_heads(num_heads, num_kv_heads, d_model, head_dim)
    check_v2_ablation(pairing, lambda_fn, num_kv_heads)
    self.pairing = pairing
    self.lambda_fn = lambda_fn
    init = self._init_q(rngs, options, d_model, num_heads, head_dim)
    self._baseline_kvo(rngs, init, d_model, num_heads, num_kv_heads, head_dim)
    self.w_lambda = make_param(
      rngs,
      torch_linear_init(d_model),
      (d_model, num_heads),
      ("embed", "heads"),
      options.param_dtype,
    )

  def _init_q(self, rngs, options, d_model, num_heads, head_dim):
    return _init_queries(self, rngs, options, d_model, num_heads, head_dim, paired=True)

  def _arrays(self, q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH):
    """The op's arrays from the RoPE'd query heads [B, T, Q, D]."""
    return (q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)

  def lambda_value(self, x_BxTxE: jax.Array, hooks: Hooks = NO_HOOKS) -> jax.Array:
    """lambda = sigmoid(x W_lambda) per token and pair, [B, T, H] in float32 (float64);
    x W_lambda itself with ``lambda_fn="identity"``."""
    dt = self.options.dtype
    lam_logits_BxTxH = project(x_BxTxE, self.w_lambda, "bte,eh->bth", dt, hooks)
    lam_logits_BxTxH = lam_logits_BxTxH.astype(accumulation_dtype(dt))
    if self.lambda_fn == "identity":
      return lam_logits_BxTxH
    return jax.nn.sigmoid(lam_logits_BxTxH)

  @jax.named_scope("attention_diff_v2")
  def __call__(
    self,
    x_BxTxE,
    positions_BxT=None,
    segment_ids_BxT=None,
    *,
    capture: bool = False,
    hooks: Hooks = NO_HOOKS,
    cache=None,
    cache_lengths_B=None,
    mix: jax.Array | float | None = None,
  ):
    """``mix`` scales the subtraction (lambda times mix): a retrofit's ramp from the source
    Transformer (0) to plain V2 (1, or None)."""
    opts = self.options
    dt = opts.dtype
    b, t = x_BxTxE.shape[:2]
    pos_BxT = _positions(x_BxTxE, positions_BxT)
    q_BxTxHxGxD = project(x_BxTxE, self.q, "bte,ehsd->bthsd", dt, hooks)
    h, g, d = q_BxTxHxGxD.shape[2:]
    # Flattening [H, 2] puts the pair's heads at 2i and 2i+1 (Q = 2H query heads); the
    # grouped form's [N, r + 1] its groups' heads, the noise head last.
    q_BxTxQxD = _rope(q_BxTxHxGxD.reshape(b, t, h * g, d), pos_BxT, opts)
    k_BxSxKxD, v_BxSxKxD = _baseline_kv(self, x_BxTxE, pos_BxT, hooks)
    lam_BxTxH = self.lambda_value(x_BxTxE, hooks)
    if mix is not None:
      lam_BxTxH = lam_BxTxH * jnp.asarray(mix, lam_BxTxH.dtype)
    new = {"k": k_BxSxKxD, "v": v_BxSxKxD}
    call = _Call.start(self, x_BxTxE, segment_ids_BxT, capture, hooks, cache, cache_lengths_B, new)
    if self.pairing == "across_groups":
      out_BxTxHxD, aux = self._across_groups(call, q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
    else:
      arrays = self._arrays(q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
      out_BxTxHxD, aux = call.attend_aux(self.OP, self.DECODE_OP, arrays, v_BxSxKxD, lam_BxTxH)
    return call.output(self, constrain(out_BxTxHxD, _HEAD_AXES), aux)

  def _across_groups(self, call: _Call, q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH):
    """The cross-group ablation: grouped-query attention over the 2h query heads, then
    pair i = heads i and i + h. Returns (out [B, T, H, D], aux or None)."""
    h = lam_BxTxH.shape[-1]
    if call.hooks.probs is not None:
      raise ValueError(
        "v2_pairing='across_groups' has no single combined map (the pair's two "
        "maps weight different values), so a probs hook is not defined for it."
      )
    arrays = (q_BxTxQxD, k_BxSxKxD, v_BxSxKxD)
    out_BxTxQxD, maps = call.attend(op_specs.MHA, op_specs.MHA_DECODE, arrays)
    out_BxTxHxD = _cross_group_pairs(out_BxTxQxD, lam_BxTxH)
    aux = None
    if maps is not None:
      aux = {
        "logits1": maps["logits"][:, :h],
        "logits2": maps["logits"][:, h:],
        "probs1": maps["probs"][:, :h],
        "probs2": maps["probs"][:, h:],
        "lambda": lam_BxTxH,
        "context": out_BxTxHxD,
        "values": v_BxSxKxD,
      }
    return out_BxTxHxD, aux


def check_gda_heads(num_heads: int, ratio: int, num_kv_heads: int) -> None:
  """Refuses a grouped arm's head counts that do not form groups: ``num_heads`` signal
  heads, ``ratio`` r of them per noise head, the noise heads a multiple of the kv heads."""
  if isinstance(ratio, bool) or int(ratio) < 1:
    raise ValueError(f"gda_ratio={ratio!r} must be an integer >= 1 (signal heads per noise head).")
  if num_heads % ratio:
    raise ValueError(
      f"num_heads={num_heads} signal heads cannot form groups of gda_ratio={ratio}; "
      "num_heads must be a multiple of gda_ratio."
    )
  if (num_heads // ratio) % num_kv_heads:
    raise ValueError(
      f"The {num_heads // ratio} noise heads (num_heads={num_heads} / gda_ratio={ratio}) must "
      f"be a multiple of num_kv_heads={num_kv_heads}, so that each group of signal heads and "
      "its noise head read one kv group."
    )


class _GroupedQueries:
  """The grouped forms' query kernel [E, N, r + 1, d]: each group's r = ``ratio`` signal
  heads, then its noise head."""

  def _init_q(self, rngs, options, d_model, num_heads, head_dim):
    n = num_heads // self.ratio
    return _init_queries(
      self, rngs, options, d_model, n, head_dim, paired=True, group=self.ratio + 1
    )


class GroupedDiffV1Attention(_GroupedQueries, DiffV1Attention):
  """Grouped differential attention, V1 style (GDA, arXiv 2510.06949; Motif-2).

  ``num_heads`` signal heads H share N = H / ``ratio`` noise heads: noise head n serves
  signal heads n r .. n r + r - 1 and its map is repeated over them, like GQA repeats keys.
  Everything else is DIFF V1's: K1, K2 and a 2d-wide V per kv group, the lambda
  re-parameterisation, the per-head RMSNorm with a shared gain and the (1 - lambda_init)
  scale. The query kernel is Motif's layout [E, N, r + 1, d] (each group's r signal heads,
  then its noise head); ``ratio=1`` is :class:`DiffV1Attention` exactly (same parameters,
  same draws, same outputs).
  """

  OP, DECODE_OP = op_specs.GDA_V1, op_specs.GDA_V1_DECODE

  def __init__(
    self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, *, ratio: int, **kw
  ):
    check_gda_heads(num_heads, ratio, num_kv_heads)
    self.ratio = int(ratio)
    super().__init__(d_model, num_heads, num_kv_heads, head_dim, **kw)

  def _queries(self, x_BxTxE, pos_BxT, hooks):
    """(signal [B, T, H, D], noise [B, T, N, D]), RoPE applied."""
    q_BxTxNxGxD = project(x_BxTxE, self.q, "bte,ehsd->bthsd", self.options.dtype, hooks)
    b, t, n, g, d = q_BxTxNxGxD.shape
    q1_BxTxHxD = q_BxTxNxGxD[:, :, :, : g - 1].reshape(b, t, n * (g - 1), d)
    q2_BxTxNxD = q_BxTxNxGxD[:, :, :, g - 1]
    return _rope(q1_BxTxHxD, pos_BxT, self.options), _rope(q2_BxTxNxD, pos_BxT, self.options)


class GroupedDiffV2Attention(_GroupedQueries, DiffV2Attention):
  """Grouped differential attention, V2 style (Motif 3's combine on the baseline's keys).

  One attention over all N (r + 1) query heads, then each group's r signal heads minus
  sigmoid(x W_lambda) times the group's noise head: ``num_heads`` H signal (output) heads,
  N = H / ``ratio`` noise heads, W_lambda: E -> H, no per-head norm; keys, values, W_o and
  the KV cache are the baseline's. The query kernel is [E, N, r + 1, d] (the noise head of
  a group last); ``ratio=1`` is :class:`DiffV2Attention` exactly.
  """

  OP, DECODE_OP = op_specs.GDA_V2, op_specs.GDA_V2_DECODE

  def __init__(
    self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, *, ratio: int, **kw
  ):
    check_gda_heads(num_heads, ratio, num_kv_heads)
    if kw.get("pairing", "group") != "group":
      raise ValueError(
        f"v2_pairing={kw['pairing']!r}: the grouped form keeps a group in one kv group; "
        "only v2_pairing='group' applies."
      )
    self.ratio = int(ratio)
    super().__init__(d_model, num_heads, num_kv_heads, head_dim, **kw)

  def _arrays(self, q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH):
    q1_BxTxHxD, q2_BxTxNxD = ref.split_groups(q_BxTxQxD, self.q.shape[1])
    return (q1_BxTxHxD, q2_BxTxNxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
