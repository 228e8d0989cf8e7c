"""Cached generation for any :class:`~diffjax.model.DecoderLM`: prefill, then one token a step.

Layout of a ragged batch: prompts are left-aligned (row b's prompt fills positions
0..len_b-1; the rest of the prefill input is padding) and each row carries its own
length. Cache slot j of row b holds position j of that row, so RoPE positions and
the next write slot are both the row's current length; a row never attends to a
slot at or past its length, so padding and other rows cannot leak in. The cache is
preallocated for ``max_length`` slots (a multiple of :data:`CACHE_MULTIPLE`, so the
GPU and TPU decode kernels read it in place) and updated in place: each jitted step
donates it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from diffjax import sharding as shd
from diffjax.generation.sampling import LogitsProcessor, SamplingOptions, choose_tokens
from diffjax.model import DecoderLM
from diffjax.ops import preflight as kernel_preflight

# Cache lengths are rounded up to this: the GPU decode kernel's largest KV block, and
# the multiple the TPU kernel reads in place (diffjax.kernels.tpu.cache_length_multiple).
CACHE_MULTIPLE = 128


@dataclasses.dataclass
class Generation:
  """What :func:`generate` returns.

  Attributes:
    tokens: the new tokens of each row (the stop token that ended a row excluded).
    stopped: per row, True when it ended at a stop token (else it hit
      ``max_new_tokens`` or the end of the cache).
    prompt_tokens: the prompt lengths.
    compile_seconds, prefill_seconds, decode_seconds: wall times; prefill and decode
      exclude compilation.
    decode_steps: decode steps run (each generates one token per unfinished row).
  """
  tokens: list[list[int]]
  stopped: list[bool]
  prompt_tokens: list[int]
  compile_seconds: float
  prefill_seconds: float
  decode_seconds: float
  decode_steps: int


def _as_rows(prompts, lengths) -> tuple[np.ndarray, np.ndarray]:
  """Prompts as a left-aligned int32 [B, T] array and int32 [B] lengths."""
  if isinstance(prompts, (list, tuple)) and (not prompts or not np.isscalar(prompts[0])):
    if lengths is not None:
      raise ValueError("lengths= goes with a [B, T] prompt array, not with a list of prompts.")
    rows = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
    if not rows:
      raise ValueError("prompts is empty: pass at least one prompt.")
    lens = np.array([len(r) for r in rows], np.int32)
    arr = np.zeros((len(rows), max(1, int(lens.max()))), np.int64)
    for i, r in enumerate(rows):
      arr[i, :len(r)] = r
  else:
    arr = np.asarray(prompts)
    if arr.ndim != 2:
      raise ValueError(f"prompts must be a list of token-id lists or a [B, T] array; got an "
                       f"array of shape {arr.shape}.")
    lens = (np.full((arr.shape[0],), arr.shape[1], np.int32) if lengths is None
            else np.asarray(lengths, np.int32))
    if lens.shape != (arr.shape[0],) or (lens > arr.shape[1]).any():
      raise ValueError(f"lengths must be {arr.shape[0]} values <= {arr.shape[1]}; got "
                       f"{lens.tolist()}.")
  if (lens < 1).any():
    raise ValueError(f"every prompt needs at least one token; lengths are {lens.tolist()}.")
  return arr, lens


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def generate(model: DecoderLM, prompts, *, lengths=None, max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, stop_tokens: Sequence[int] | int = (),
             processors: Sequence[LogitsProcessor] = (), max_length: int | None = None,
             pad_id: int = 0, mesh: jax.sharding.Mesh | None = None, rules=None,
             on_tokens: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
             preflight: bool = True) -> Generation:
  """Generates up to ``max_new_tokens`` tokens after each prompt, with a KV cache.

  Args:
    model: any DecoderLM (its parameters are not changed).
    prompts: a list of token-id lists (of any lengths), or an int [B, T] array of
      left-aligned prompts with ``lengths`` (int [B]; default: all T).
    max_new_tokens: the most tokens a row generates.
    temperature, top_k, top_p, seed: see :class:`SamplingOptions` (greedy by default).
    stop_tokens: a row ends when it produces one of these (each row on its own).
    processors: functions ``(logits_BxV, step) -> logits_BxV`` applied first.
    max_length: cache slots per row (default: the longest prompt + max_new_tokens,
      rounded up to :data:`CACHE_MULTIPLE`); a row also ends when its cache is full.
    pad_id: the token fed to finished rows (its output is discarded).
    mesh, rules: generate sharded over a mesh (batch over data/fsdp, heads and the
      cache's kv heads over tensor); parameters are laid out by their logical axes.
    on_tokens: called after every step with ``(step, tokens_B, active_B)`` (numpy):
      the step's token of each row and whether the row was still generating; for
      streaming.
    preflight: on a GPU or TPU, run the fused kernels once against XLA first
      (:mod:`diffjax.ops.preflight`; a failing one is switched to the stock path).
  Returns:
    A :class:`Generation`.
  """
  options = SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
  if preflight:  # once per process: the fused attention and decode kernels on this device
    kernel_preflight.preflight_model(model.config, decode=True)
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive integer.")
  stops = np.asarray([stop_tokens] if np.isscalar(stop_tokens) else list(stop_tokens),
                     np.int64)
  prompt_BxT, lens_B = _as_rows(prompts, lengths)
  vocab = model.config.vocab_size
  if prompt_BxT.size and (prompt_BxT.min() < 0 or prompt_BxT.max() >= vocab):
    raise ValueError(f"prompt token ids must be in [0, {vocab}); got ids from "
                     f"{prompt_BxT.min()} to {prompt_BxT.max()}.")
  longest = int(lens_B.max())
  if max_length is None:
    max_length = _round_up(longest + max_new_tokens, CACHE_MULTIPLE)
  if longest > max_length:
    raise ValueError(f"a prompt of {longest} tokens does not fit the cache of "
                     f"max_length={max_length} slots: shorten the prompt or raise max_length.")
  b = prompt_BxT.shape[0]
  # The prefill input only needs the longest prompt's width.
  prompt_BxT = prompt_BxT[:, :longest].astype(np.int32)

  graphdef, params = nnx.split(model)
  # Decoding keeps each row's sequence whole: a training mesh's context axis only replicates.
  rules = tuple((name, None if name == "length" else axes)
                for name, axes in (rules or shd.DEFAULT_RULES))
  context = shd.activation_sharding(mesh, rules) if mesh is not None else _no_context()
  with context:
    if mesh is not None:
      pure = jax.device_put(nnx.to_pure_dict(params), shd.param_shardings(params, mesh, rules))
      nnx.replace_by_pure_dict(params, pure)
    steps = _compiled_steps(graphdef, params, b, longest, max_length, options,
                            tuple(processors))
    t0 = time.perf_counter()
    prefill, decode, make_cache = (steps[k] for k in ("prefill", "decode", "cache"))
    compile_s = time.perf_counter() - t0 + steps["seconds"]

    key = jax.random.key(options.seed)
    t0 = time.perf_counter()
    cache = make_cache()
    tok_B, cache = prefill(params, cache, jnp.asarray(prompt_BxT), jnp.asarray(lens_B), key)
    tok_np = np.asarray(tok_B)
    prefill_s = time.perf_counter() - t0

    out = [[] for _ in range(b)]
    stopped = np.zeros(b, bool)
    active = np.ones(b, bool)
    pos_B = lens_B.copy()
    step, t0 = 0, time.perf_counter()
    while True:
      was_active = active.copy()
      for i in np.nonzero(active)[0]:
        if np.isin(tok_np[i], stops):
          stopped[i], active[i] = True, False
        else:
          out[i].append(int(tok_np[i]))
      # A row ends when it stopped, has its tokens, or its next write would leave the cache.
      active &= np.array([len(o) < max_new_tokens for o in out]) & (pos_B < max_length)
      if on_tokens is not None:
        on_tokens(step, tok_np, was_active & ~stopped)
      if not active.any():
        break
      feed_B = np.where(active, tok_np, pad_id).astype(np.int32)
      step += 1
      tok_B, cache = decode(params, cache, jnp.asarray(feed_B), jnp.asarray(pos_B), key,
                            jnp.asarray(step, jnp.int32))
      tok_np = np.asarray(tok_B)
      pos_B = pos_B + active
    decode_s = time.perf_counter() - t0
  return Generation(tokens=out, stopped=stopped.tolist(), prompt_tokens=lens_B.tolist(),
                    compile_seconds=compile_s, prefill_seconds=prefill_s,
                    decode_seconds=decode_s, decode_steps=step)


class _no_context:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def _compiled_steps(graphdef, params, batch: int, prompt_len: int, max_length: int,
                    options: SamplingOptions, processors: tuple) -> dict:
  """The jitted cache constructor, prefill and decode step, compiled ahead of use."""

  def make_cache():
    return nnx.merge(graphdef, params).init_cache(batch, max_length)

  def prefill(params, cache, prompt_BxT, lens_B, key):
    model = nnx.merge(graphdef, params)
    logits_BxTxV, cache = model(prompt_BxT, cache=cache,
                                cache_lengths_B=jnp.zeros_like(lens_B))
    last_BxV = jnp.take_along_axis(logits_BxTxV, (lens_B - 1)[:, None, None], axis=1)[:, 0]
    return choose_tokens(last_BxV, jax.random.fold_in(key, 0), jnp.int32(0), options,
                         processors), cache

  def decode(params, cache, tok_B, pos_B, key, step):
    model = nnx.merge(graphdef, params)
    logits_Bx1xV, cache = model(tok_B[:, None], pos_B[:, None], cache=cache,
                                cache_lengths_B=pos_B)
    return choose_tokens(logits_Bx1xV[:, 0], jax.random.fold_in(key, step), step, options,
                         processors), cache

  t0 = time.perf_counter()
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  key = jax.eval_shape(lambda: jax.random.key(0))
  cache_fn = jax.jit(make_cache).lower().compile()
  # The steps take the cache laid out as it is made (sharded like activations on a mesh).
  cache_shape = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                             jax.eval_shape(make_cache), cache_fn.output_shardings)
  # The cache is donated: each step updates it in place.
  prefill_fn = jax.jit(prefill, donate_argnums=1).lower(
      params, cache_shape, i32(batch, prompt_len), i32(batch), key).compile()
  decode_fn = jax.jit(decode, donate_argnums=1).lower(
      params, cache_shape, i32(batch), i32(batch), key, i32()).compile()
  return {"cache": cache_fn, "prefill": _placing(prefill_fn), "decode": _placing(decode_fn),
          "seconds": time.perf_counter() - t0}


def _placing(compiled):
  """Calls ``compiled`` with its non-parameter inputs placed as it was compiled for."""
  shardings = compiled.input_shardings[0]

  def call(params, *args):
    return compiled(params, *jax.device_put(args, tuple(shardings[1:])))
  return call
