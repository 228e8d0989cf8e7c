"""The compiled prefill and decode programs of :func:`~diffjax.generation.generate`, kept per
:class:`ProgramKey` (model structure, bucketed shapes, sampling options without the seed,
processors, mesh) so that a stream of calls compiles a handful of programs, not one per call.
What the key holds and how shapes are bucketed: docs/generation.md, "Compiled once".
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax import arms
from diffjax import sharding as shd
from diffjax.generation.sampling import SamplingOptions, choose_tokens
from diffjax.model import DecoderLM
from diffjax.nn.attention import cache_layout, default_cache_layout

# Cache lengths are rounded up to this: the GPU decode kernel's largest KV block, and
# the multiple the TPU kernel reads in place (diffjax.kernels.tpu.cache_length_multiple).
CACHE_MULTIPLE = 128
# Prompts are padded to a power of two of at least this many tokens.
MIN_PROMPT_BUCKET = 16
# Stop tokens are padded (with -1, never a token) to a power of two of at least this many.
MIN_STOP_SLOTS = 4
# Programs kept, least recently used dropped first (each holds compiled executables only).
MAX_PROGRAMS = 64


def bucket(n: int, minimum: int = 1) -> int:
  """The power of two at or above ``max(n, minimum)``."""
  n = max(int(n), int(minimum), 1)
  return 1 << (n - 1).bit_length()


def round_up(n: int, multiple: int) -> int:
  return -(-int(n) // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class ProgramKey:
  """Everything a compiled program depends on (hashable; equal keys share programs)."""

  graphdef: Any
  treedef: Any
  leaves: tuple[tuple[tuple[int, ...], Any, Any], ...]  # (shape, dtype, sharding)
  batch: int
  prompt_len: int
  max_length: int
  stop_slots: int
  options: SamplingOptions  # seed 0: the seed is an input
  processors: tuple[Callable, ...]
  mesh: Any
  rules: Any
  cache_layout: str = "sequence_major"  # diffjax.nn.attention.cache_layout


def decode_rules(rules=None) -> tuple:
  """``rules`` (default: :data:`~diffjax.sharding.DEFAULT_RULES`) for decoding: the "length"
  axis is not split, so that every row's sequence stays whole."""
  return tuple(
    (name, None if name == "length" else axes) for name, axes in (rules or shd.DEFAULT_RULES)
  )


# What a mesh that does not fit the model is told to change, by default (generate's mesh=).
MESH_FIX = (
  "Pass a mesh= whose axes divide the model (e.g. a smaller tensor axis), or rules= that map "
  "that axis elsewhere."
)


def split_params(model: DecoderLM, mesh, rules, fix: str = MESH_FIX):
  """(graphdef, treedef, parameter leaves) of ``model``, the leaves placed on ``mesh`` by the
  rules when there is one: after :func:`check_mesh`, whose messages end with ``fix``."""
  graphdef, params = nnx.split(model)
  if mesh is not None:
    check_mesh(model, mesh, rules, params, fix)
    with shd.activation_sharding(mesh, rules):
      pure = jax.device_put(nnx.to_pure_dict(params), shd.param_shardings(params, mesh, rules))
    nnx.replace_by_pure_dict(params, pure)
  leaves, treedef = jax.tree.flatten(params)
  return graphdef, treedef, tuple(leaves)


def check_mesh(model: DecoderLM, mesh, rules, params=None, fix: str = MESH_FIX) -> None:
  """Refuses, in one line ending with ``fix``, a mesh that would split a head from its kv
  group or any parameter of ``model`` unevenly under ``rules`` (before anything is placed:
  ``jax.device_put`` would fail with a message that names neither)."""
  cfg = model.config
  shd.validate_mesh_for_model(
    mesh,
    cfg,
    heads=arms.get(cfg.attention).heads,
    rules=rules,
    params=nnx.state(model) if params is None else params,
    fix=fix,
  )


def shape_struct(a) -> jax.ShapeDtypeStruct:
  """The shape, dtype and sharding of ``a`` (an array or a struct), without its data."""
  return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)


def decode_cache_layout(mesh=None) -> str:
  """The KV-cache layout for decoding on ``mesh``'s devices (default: the default backend's)."""
  platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
  return default_cache_layout(platform)


@dataclasses.dataclass
class Programs:
  prefill: Callable  # (leaves, prompt_BxT, lens_B, valid_B, max_new, stops_S, key) -> state
  decode: Callable  # (leaves, state, step_end, max_new, stops_S, key, pad) -> state
  compile_seconds: float


_LOCK = threading.Lock()
_PROGRAMS: collections.OrderedDict[ProgramKey, Programs] = collections.OrderedDict()
_COUNTS = {"compiled": 0, "reused": 0}


def cache_info() -> dict[str, int]:
  """``{"compiled": programs compiled, "reused": calls served by a kept program, "kept": programs
  kept now}`` since the process started (or :func:`clear_cache`). Each compiled program is one
  prefill and one decode executable."""
  with _LOCK:
    return {**_COUNTS, "kept": len(_PROGRAMS)}


def clear_cache() -> None:
  """Drops every kept program and zeroes the counts."""
  with _LOCK:
    _PROGRAMS.clear()
    _COUNTS.update(compiled=0, reused=0)


def get_programs(key: ProgramKey) -> Programs:
  """The programs of ``key``, compiled on first use."""
  with _LOCK:
    programs = _PROGRAMS.get(key)
    if programs is not None:
      _PROGRAMS.move_to_end(key)
      _COUNTS["reused"] += 1
      return programs
  programs = _compile(key)
  with _LOCK:
    _PROGRAMS[key] = programs
    _COUNTS["compiled"] += 1
    while len(_PROGRAMS) > MAX_PROGRAMS:
      _PROGRAMS.popitem(last=False)
  return programs


def _absorb(state: dict, max_new, stops_S, max_length: int) -> dict:
  """Takes in the tokens of ``state["step"]``: stop rows that chose a stop token, keep the
  others' tokens, and end rows that have their tokens or a full cache."""
  tok_B, active_B, count_B = state["tok_B"], state["active_B"], state["count_B"]
  is_stop_B = jnp.any(tok_B[:, None] == stops_S[None, :], axis=-1)
  keep_B = active_B & ~is_stop_B
  rows_B = jnp.arange(tok_B.shape[0])
  width = state["out_BxW"].shape[1]
  col_B = jnp.minimum(count_B, width - 1)
  out_BxW = (
    state["out_BxW"]
    .at[rows_B, col_B]
    .set(jnp.where(keep_B, tok_B, state["out_BxW"][rows_B, col_B]))
  )
  count_B = count_B + keep_B.astype(count_B.dtype)
  step = state["step"]
  trace_BxW = jax.lax.dynamic_update_slice(state["trace_BxW"], tok_B[:, None], (0, step))
  kept_BxW = jax.lax.dynamic_update_slice(state["kept_BxW"], keep_B[:, None], (0, step))
  # A row's next write goes to slot pos_B: it must stay inside the cache.
  active_B = keep_B & (count_B < max_new) & (state["pos_B"] < max_length)
  stopped_B = state["stopped_B"] | (state["active_B"] & is_stop_B)
  return {
    **state,
    "active_B": active_B,
    "stopped_B": stopped_B,
    "count_B": count_B,
    "out_BxW": out_BxW,
    "trace_BxW": trace_BxW,
    "kept_BxW": kept_BxW,
  }


def _functions(key: ProgramKey):
  """The prefill and decode functions of ``key`` (to be jitted)."""
  batch, max_length, options = key.batch, key.max_length, key.options

  def merge(leaves):
    return nnx.merge(key.graphdef, jax.tree.unflatten(key.treedef, list(leaves)))

  def prefill(leaves, prompt_BxT, lens_B, valid_B, max_new, stops_S, rng):
    model = merge(leaves)
    cache = model.init_cache(batch, max_length)
    logits_BxTxV, cache = model(prompt_BxT, cache=cache, cache_lengths_B=jnp.zeros_like(lens_B))
    last_BxV = jnp.take_along_axis(logits_BxTxV, (lens_B - 1)[:, None, None], axis=1)[:, 0]
    tok_B = choose_tokens(
      last_BxV, jax.random.fold_in(rng, 0), jnp.int32(0), options, key.processors
    )
    zeros_BxW = jnp.zeros((batch, max_length), jnp.int32)
    # The state both programs pass along, batch first.
    state = {
      "cache": cache,  # one dict per layer
      "tok_B": tok_B,  # the token each row chose at the current step
      "pos_B": lens_B,  # each row's next cache slot (its length so far)
      "active_B": valid_B,  # still generating
      "stopped_B": jnp.zeros_like(valid_B),  # ended at a stop token
      "count_B": jnp.zeros_like(lens_B),  # tokens kept (a row's final stop token is not)
      "out_BxW": zeros_BxW,  # the kept tokens, left-aligned
      "trace_BxW": zeros_BxW,  # every step's token of every row (for streaming)
      "kept_BxW": jnp.zeros((batch, max_length), bool),  # whether the row kept that token
      "step": jnp.int32(0),  # 0: the prefill's token
    }
    return _absorb(state, max_new, stops_S, max_length)

  def decode(leaves, state, step_end, max_new, stops_S, rng, pad):
    model = merge(leaves)

    def more(s):
      return (s["step"] < step_end) & jnp.any(s["active_B"])

    def one_step(s):
      step = s["step"] + 1
      active_B, pos_B = s["active_B"], s["pos_B"]
      feed_B = jnp.where(active_B, s["tok_B"], pad)
      logits_Bx1xV, cache = model(
        feed_B[:, None], pos_B[:, None], cache=s["cache"], cache_lengths_B=pos_B
      )
      tok_B = choose_tokens(
        logits_Bx1xV[:, 0], jax.random.fold_in(rng, step), step, options, key.processors
      )
      s = {
        **s,
        "cache": cache,
        "tok_B": tok_B,
        "pos_B": pos_B + active_B.astype(pos_B.dtype),
        "step": step,
      }
      return _absorb(s, max_new, stops_S, max_length)

    return jax.lax.while_loop(more, one_step, state)

  return prefill, decode


def _compile(key: ProgramKey) -> Programs:
  t0 = time.perf_counter()
  prefill, decode = _functions(key)
  leaves = tuple(
    jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype, sharding in key.leaves
  )
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  rng = jax.eval_shape(lambda: jax.random.key(0))
  b, s = key.batch, key.stop_slots
  if key.mesh is not None:
    context = shd.activation_sharding(key.mesh, key.rules)
  else:
    context = contextlib.nullcontext()
  with context, cache_layout(key.cache_layout):
    prefill_fn = (
      jax.jit(prefill)
      .lower(
        leaves, i32(b, key.prompt_len), i32(b), jax.ShapeDtypeStruct((b,), bool), i32(), i32(s), rng
      )
      .compile()
    )
    # The decode loop takes the state laid out as the prefill leaves it, and updates it in
    # place (donated).
    state = jax.tree.map(shape_struct, prefill_fn.out_info)
    decode_fn = (
      jax.jit(decode, donate_argnums=1)
      .lower(leaves, state, i32(), i32(), i32(s), rng, i32())
      .compile()
    )
  return Programs(
    prefill=_placing(prefill_fn, skip=1),
    decode=_placing(decode_fn, skip=2),
    compile_seconds=time.perf_counter() - t0,
  )


def _placing(compiled, skip: int):
  """Calls ``compiled`` with its inputs after the first ``skip`` placed as it was compiled for
  (the parameters and the state are already where they belong)."""
  shardings = tuple(compiled.input_shardings[0])

  def call(*args):
    head, rest = args[:skip], args[skip:]
    return compiled(*head, *jax.device_put(rest, shardings[skip:]))

  return call
