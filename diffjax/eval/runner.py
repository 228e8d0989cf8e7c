"""Jitted forward passes of one NNX model for evaluation, and weight quantization.

:class:`ModelRunner` compiles each kind of pass (logits, the reference path with ``KNOBS``, the
gradients around a per-head norm, the sections' own) once per input shape and keeps it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from diffjax import arms
from diffjax.eval import measures
from diffjax.model import Hooks
from diffjax.nn.layers import STACKED_AXIS, is_weight_matrix, logical_names

LogitsFn = Callable[..., Any]

# Interventions of `ModelRunner.knob_fn`, all numbers (0 = off).
KNOBS = ("logits_bits", "act_bits", "kv_bits", "clamp")


def causal_valid(t: int, s: int, segment_ids_BxT=None):
  """(1 or B, 1, T, S) bool: the entries a causal (and, with segment ids, packed) map may use."""
  valid_1x1xTxS = jnp.asarray(measures.causal_valid_mask(t, s))[None, None]
  if segment_ids_BxT is None:
    return valid_1x1xTxS
  seg_BxT = jnp.asarray(segment_ids_BxT)
  return valid_1x1xTxS & (seg_BxT[:, None, :, None] == seg_BxT[:, None, None, :])


def layer_maps(cap: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """The combined map and its parts for one layer's captures ([B, H, T, S] each)."""
  if "probs" in cap:
    return {"combined": cap["probs"], "logits": [cap["logits"]]}
  lam = cap["lambda"].astype(jnp.float32)  # a scalar (DIFF V1) or [B, T, H] (DIFF V2)
  if lam.ndim == 0:
    combined_BxHxTxS = cap["probs1"] - lam * cap["probs2"]
  else:
    lam_BxHxTx1 = jnp.transpose(lam, (0, 2, 1))[..., None]
    combined_BxHxTxS = cap["probs1"] - lam_BxHxTx1 * cap["probs2"]
  return {"combined": combined_BxHxTxS, "logits": [cap["logits1"], cap["logits2"]]}


class ModelRunner:
  """Jitted forward passes of one NNX model, compiled once per (kind, shape).

  `logits_fn(hooks)` and `knob_fn(knobs)` give a `LogitsFn`; `compiled(key, build)` keeps any
  other pass (a jitted function of `state` that calls `merge(state)`) and `run_pass` runs one
  on the model's tokens, positions and segment ids.
  """

  def __init__(self, model: nnx.Module):
    if getattr(model.config, "scan_layers", False):
      raise ValueError(
        "The analysis reads layers one by one: pass an unrolled model "
        "(scan_layers=False; diffjax.train.load_model returns one)."
      )
    self.model = model
    self.config = model.config
    self.graphdef, self.state = nnx.split(model)
    self._fns: dict[Any, Callable] = {}

  def merge(self, state) -> nnx.Module:
    """The model with `state` (e.g. the traced `self.state` inside a jitted pass) as its
    parameters."""
    return nnx.merge(self.graphdef, state)

  def compiled(self, key: Hashable, build: Callable[[], Callable]) -> Callable:
    """`build()`, called the first time `key` is asked for and kept: a pass of this model (a
    jitted function of `self.state` and arrays) is compiled once per runner and input shape,
    however many sections and evaluations use it."""
    if key not in self._fns:
      self._fns[key] = build()
    return self._fns[key]

  def run_pass(
    self,
    key: Hashable,
    build: Callable[[], Callable],
    tokens_BxT,
    positions_BxT,
    segment_ids_BxT,
    *arrays,
  ) -> Any:
    """Runs the pass `compiled(key, build)` on the model's parameters, the tokens, the positions
    and segment ids (either may be None) and ``arrays``, in that order; returns its outputs as
    numpy arrays."""
    out = self.compiled(key, build)(
      self.state,
      jnp.asarray(tokens_BxT),
      _optional_array(positions_BxT),
      _optional_array(segment_ids_BxT),
      *(jnp.asarray(a) for a in arrays),
    )
    return jax.tree.map(np.asarray, out)

  def logits_fn(self, hooks: Hooks | None = None, name: str = "plain") -> LogitsFn:
    """tokens (B, T) [, positions, segment_ids] -> float32 numpy logits (B, T, V)."""

    def build():
      def f(state, tokens, positions, segment_ids):
        model = self.merge(state)
        return (
          model(tokens, positions, segment_ids, hooks=hooks)
          if hooks is not None
          else model(tokens, positions, segment_ids)
        )

      return jax.jit(f)

    jf = self.compiled(("logits", name), build)

    def apply(tokens, positions=None, segment_ids=None):
      return np.asarray(jf(self.state, jnp.asarray(tokens), positions, segment_ids))

    return apply

  def knob_fn(
    self, granularity: str = "head", knobs: Mapping[str, float] | None = None, state=None
  ) -> LogitsFn:
    """A `LogitsFn` on the reference path with interventions set by numbers, not code, so one
    compiled function serves every setting (see `Knobs`): logits_bits, act_bits, kv_bits
    (0 = off) and clamp (1 = clamp negative attention weights). `state` replaces the model's
    parameters (e.g. quantized weights of the same model)."""

    def build():
      def f(state, tokens, positions, segment_ids, k):
        qmax = lambda bits: jnp.where(bits > 1, 2.0 ** (bits - 1) - 1, 0.0)
        hooks = Hooks(
          logits=lambda x: measures.quantize_attention_logits(x, k["logits_bits"], granularity),
          probs=lambda p: jnp.where(k["clamp"] > 0, jnp.maximum(p, 0), p),
          kv=lambda x: measures.fake_quant(x, qmax(k["kv_bits"]), axis=-1),
          activations=lambda x: measures.fake_quant(x, qmax(k["act_bits"]), axis=-1),
        )
        return self.merge(state)(tokens, positions, segment_ids, hooks=hooks)

      return jax.jit(f)

    jf = self.compiled(("knobs", granularity), build)
    k = {name: jnp.float32(0.0) for name in KNOBS}
    for name, v in (knobs or {}).items():
      if name not in KNOBS:
        raise ValueError(f"Unknown knob {name!r}; knobs are {KNOBS}.")
      k[name] = jnp.float32(v)
    st = self.state if state is None else state

    def apply(tokens, positions=None, segment_ids=None):
      return np.asarray(jf(st, jnp.asarray(tokens), positions, segment_ids, k))

    return apply

  def norm_gradients(
    self, tokens_BxT, targets_BxT, positions_BxT, segment_ids_BxT, mask_BxT
  ) -> list[tuple[np.ndarray, np.ndarray]]:
    """DIFF V1: per layer, the gradients of the mean masked next-token loss into its per-head
    norm's input and out of its output, ([B, T, H, 2d], [B, T, H, 2d]).

    Zero taps are added before and after each layer's norm (`Hooks.norm`, called in layer
    order as the unrolled model is traced) and the loss is differentiated by them."""
    if not _has_norm_taps(self.config):
      raise ValueError(
        f"norm_gradients needs a DIFF V1 model; this one is {self.config.attention!r}."
      )
    b, t = np.shape(tokens_BxT)
    cfg = self.config
    taps_shape = (b, t, cfg.num_heads, 2 * cfg.head_dim)

    def build():
      def loss(taps, state, tokens, targets, positions, segment_ids, mask):
        seen = {"pre": 0, "post": 0}

        def tap(x, where):
          i = seen[where]
          seen[where] += 1
          return x + taps[where][i].astype(x.dtype)

        logits = self.merge(state)(tokens, positions, segment_ids, hooks=Hooks(norm=tap))
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)

      return jax.jit(jax.grad(loss))

    zeros = [jnp.zeros(taps_shape, jnp.float32) for _ in range(cfg.num_layers)]
    g = self.compiled("norm_grads", build)(
      {"pre": zeros, "post": zeros},
      self.state,
      jnp.asarray(tokens_BxT),
      jnp.asarray(targets_BxT),
      _optional_array(positions_BxT),
      _optional_array(segment_ids_BxT),
      jnp.asarray(mask_BxT, jnp.float32),
    )
    return [(np.asarray(a), np.asarray(z)) for a, z in zip(g["pre"], g["post"])]

  def quantized_state(self, bits: int, include_head: bool = False):
    """The model's state with projection kernels absmax-quantized (see `quantize_model_weights`)."""
    return nnx.split(quantize_model_weights(self.model, bits, include_head=include_head))[1]


def _optional_array(x) -> jax.Array | None:
  """``x`` as a jax array; None stays None (a pass's positions and segment ids are optional)."""
  return None if x is None else jnp.asarray(x)


def _has_norm_taps(config) -> bool:
  """Whether `Hooks.norm` taps the model: an arm with a per-head norm (DIFF V1)."""
  return arms.get(config.attention).head_norm


def _input_axes(names: tuple) -> tuple[int, ...]:
  """Contracted (input) axes of a kernel with logical axis names ``names``.

  Kernels writing into the residual stream end with "embed" ([H, D, E], [F, E]): all their
  leading axes are contracted. Every other kernel contracts its first axis ([E, ...]). A
  scanned model's stacked ``layers`` axis is never contracted (each layer keeps its own scale).
  """
  own = [i for i, n in enumerate(names) if n != STACKED_AXIS]
  return tuple(own[:-1]) if names[-1] == "embed" else (own[0],)


def quantize_model_weights(
  model: nnx.Module, bits: int = 4, *, include_head: bool = False
) -> nnx.Module:
  """Returns a copy of `model` with every projection kernel (a weight matrix by its logical axes,
  `diffjax.nn.layers.is_weight_matrix`, in scanned and unrolled models alike) fake-quantized per
  output channel (absmax over its input axes).

  The embedding table and the untied LM head are left in float unless `include_head`.
  """
  qmodel = nnx.clone(model)
  for path, node in nnx.iter_graph(qmodel):
    names = logical_names(node) if isinstance(node, nnx.Param) else None
    if names is None or not is_weight_matrix(names):
      continue
    if not include_head and path and (path[-1] in ("embedding", "lm_head")):
      continue
    # In numpy: eager jax would compile a few kernels per distinct kernel shape.
    w = np.asarray(node[...])
    node[...] = jnp.asarray(measures.quantize_absmax(w, bits, axis=_input_axes(names)))
  return qmodel
