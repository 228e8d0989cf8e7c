"""Cached generation for any :class:`~diffjax.model.DecoderLM`: prefill, then one token a step.

Prompts are left-aligned and each row keeps its own length, which is both its RoPE position
and its next cache slot, so padding and other rows never leak in; the cache layout and the
decode loop: docs/generation.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from diffjax import arms
from diffjax import sharding as shd
from diffjax.generation.programs import (
  CACHE_MULTIPLE,
  MIN_PROMPT_BUCKET,
  MIN_STOP_SLOTS,
  ProgramKey,
  bucket,
  cache_info,
  decode_cache_layout,
  decode_rules,
  get_programs,
  round_up,
  split_params,
)
from diffjax.generation.sampling import LogitsProcessor, SamplingOptions
from diffjax.model import DecoderLM

# With on_tokens, the decode loop hands its tokens to the host every this many steps.
STREAM_EVERY = 8


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
      arr[i, : len(r)] = r
  else:
    arr = np.asarray(prompts)
    if arr.ndim != 2:
      raise ValueError(
        f"prompts must be a list of token-id lists or a [B, T] array; got an "
        f"array of shape {arr.shape}."
      )
    lens = (
      np.full((arr.shape[0],), arr.shape[1], np.int32)
      if lengths is None
      else np.asarray(lengths, np.int32)
    )
    if lens.shape != (arr.shape[0],) or (lens > arr.shape[1]).any():
      raise ValueError(
        f"lengths must be {arr.shape[0]} values <= {arr.shape[1]}; got {lens.tolist()}."
      )
  if (lens < 1).any():
    raise ValueError(f"every prompt needs at least one token; lengths are {lens.tolist()}.")
  return arr, lens


def generate(
  model: DecoderLM,
  prompts,
  *,
  lengths=None,
  max_new_tokens: int = 64,
  temperature: float = 0.0,
  top_k: int | None = None,
  top_p: float | None = None,
  seed: int = 0,
  stop_tokens: Sequence[int] | int = (),
  processors: Sequence[LogitsProcessor] = (),
  max_length: int | None = None,
  pad_id: int = 0,
  mesh: jax.sharding.Mesh | None = None,
  rules=None,
  on_tokens: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
  preflight: bool = True,
) -> Generation:
  """Generates up to ``max_new_tokens`` tokens after each prompt, with a KV cache.

  Runs two compiled programs kept per model structure and bucketed shape, so repeated calls
  compile nothing (docs/generation.md, "Compiled once").

  Args:
    model: any DecoderLM (its parameters are not changed).
    prompts: a list of token-id lists (of any lengths), or an int [B, T] array of
      left-aligned prompts with ``lengths`` (int [B]; default: all T).
    max_new_tokens: the most tokens a row generates.
    temperature, top_k, top_p, seed: see :class:`SamplingOptions` (greedy by default).
    stop_tokens: a row ends when it produces one of these (each row on its own).
    processors: functions ``(logits_BxV, step) -> logits_BxV`` applied first (part of
      the compiled program: pass the same function objects to reuse it).
    max_length: cache slots per row (default: the padded prompt width + max_new_tokens,
      rounded up to :data:`CACHE_MULTIPLE`); a row also ends when its cache is full.
    pad_id: the token fed to finished rows and padding rows (their output is discarded).
    mesh, rules: generate sharded over a mesh (batch over data/fsdp, heads and the
      cache's kv heads over tensor); parameters are laid out by their logical axes.
    on_tokens: called for every step with ``(step, tokens_B, active_B)`` (numpy): the
      step's token of each row and whether the row kept it; for streaming (the decode
      loop then returns to the host every :data:`STREAM_EVERY` steps).
    preflight: on a GPU or TPU, run the fused kernels once against XLA first
      (:mod:`diffjax.ops.preflight`; a failing one is switched to the stock path).
  Returns:
    A :class:`Generation`.
  Raises:
    ValueError: a bad prompt, length, token id, ``max_new_tokens`` or ``max_length``.
  """
  options = SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
  if preflight:  # once per process: the fused attention and decode kernels on this device
    arms.preflight(model.config, decode=True)
  stops, prompt_BxT, lens_B = _checked(model, prompts, lengths, max_new_tokens, stop_tokens, pad_id)
  batch = _pad_batch(prompt_BxT, lens_B, stops, max_new_tokens, max_length, pad_id, mesh, rules)
  programs, leaves, compile_s = _programs(model, batch, options, processors, mesh)
  rng = jax.random.key(options.seed)
  t0 = time.perf_counter()
  state = programs.prefill(
    leaves, *batch.prefill_inputs, np.int32(max_new_tokens), batch.stops_np, rng
  )
  jax.block_until_ready(state["tok_B"])
  prefill_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  state = _decode(programs, leaves, state, batch, max_new_tokens, pad_id, rng, on_tokens)
  out, count, stopped, step = jax.device_get(
    (state["out_BxW"], state["count_B"], state["stopped_B"], state["step"])
  )
  decode_s = time.perf_counter() - t0
  b = batch.rows
  return Generation(
    tokens=[out[i, : count[i]].tolist() for i in range(b)],
    stopped=[bool(x) for x in stopped[:b]],
    prompt_tokens=lens_B.tolist(),
    compile_seconds=compile_s,
    prefill_seconds=prefill_s,
    decode_seconds=decode_s,
    decode_steps=int(step),
  )


def _checked(model, prompts, lengths, max_new_tokens, stop_tokens, pad_id):
  """(stop tokens, prompts as rows, their lengths); ValueError naming what is wrong."""
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive integer.")
  stops = [int(t) for t in ([stop_tokens] if np.isscalar(stop_tokens) else stop_tokens)]
  prompt_BxT, lens_B = _as_rows(prompts, lengths)
  vocab = model.config.vocab_size
  if prompt_BxT.size and (prompt_BxT.min() < 0 or prompt_BxT.max() >= vocab):
    raise ValueError(
      f"prompt token ids must be in [0, {vocab}); got ids from "
      f"{prompt_BxT.min()} to {prompt_BxT.max()}."
    )
  if not 0 <= pad_id < vocab:
    raise ValueError(f"pad_id={pad_id} must be a token id in [0, {vocab}).")
  return stops, prompt_BxT, lens_B


@dataclasses.dataclass(frozen=True)
class _Batch:
  """The inputs padded to their buckets."""

  rows: int  # the caller's rows; the arrays have more when the batch is padded
  prompt_np: np.ndarray  # int32 [rows', width]
  lens_np: np.ndarray  # int32 [rows']
  valid_np: np.ndarray  # bool [rows']: False on padding rows
  stops_np: np.ndarray  # int32 stop-token slots, -1 where unused
  max_length: int
  rules: tuple

  @property
  def prefill_inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return self.prompt_np, self.lens_np, self.valid_np


def _pad_batch(prompt_BxT, lens_B, stops, max_new_tokens, max_length, pad_id, mesh, rules):
  """Pads rows, prompt width, cache and stop tokens to their buckets; ValueError when a prompt
  does not fit ``max_length``."""
  longest = int(lens_B.max())
  width = bucket(longest, MIN_PROMPT_BUCKET)
  if max_length is None:
    max_length = round_up(width + max_new_tokens, CACHE_MULTIPLE)
  if longest > max_length:
    raise ValueError(
      f"a prompt of {longest} tokens does not fit the cache of "
      f"max_length={max_length} slots: shorten the prompt or raise max_length."
    )
  width = min(width, max_length)
  b = prompt_BxT.shape[0]
  rules = decode_rules(rules)
  rows = round_up(bucket(b), shd.batch_rows_multiple(mesh, rules))
  # Padding rows hold one pad token and are never active.
  prompt_np = np.full((rows, width), pad_id, np.int32)
  prompt_np[:b, :longest] = prompt_BxT[:, :longest]
  lens_np = np.ones(rows, np.int32)
  lens_np[:b] = lens_B
  stops_np = np.full(bucket(len(stops), MIN_STOP_SLOTS), -1, np.int32)
  stops_np[: len(stops)] = stops
  return _Batch(b, prompt_np, lens_np, np.arange(rows) < b, stops_np, int(max_length), rules)


def _programs(model, batch: _Batch, options, processors, mesh):
  """(the compiled programs, the parameter leaves laid out for them, seconds spent compiling
  now: 0 when a kept program served)."""
  graphdef, treedef, leaves = split_params(model, mesh, batch.rules)
  key = ProgramKey(
    graphdef=graphdef,
    treedef=treedef,
    leaves=tuple((tuple(a.shape), a.dtype, getattr(a, "sharding", None)) for a in leaves),
    batch=batch.prompt_np.shape[0],
    prompt_len=batch.prompt_np.shape[1],
    max_length=batch.max_length,
    stop_slots=len(batch.stops_np),
    options=dataclasses.replace(options, seed=0),
    processors=tuple(processors),
    mesh=mesh,
    rules=batch.rules if mesh is not None else None,
    cache_layout=decode_cache_layout(mesh),
  )
  before = cache_info()["compiled"]
  programs = get_programs(key)
  compile_s = programs.compile_seconds if cache_info()["compiled"] > before else 0.0
  return programs, leaves, compile_s


def _decode(programs, leaves, state, batch: _Batch, max_new_tokens, pad_id, rng, on_tokens):
  """Runs the decode loop to its end; with ``on_tokens``, in slices of :data:`STREAM_EVERY`
  steps, handing every step's tokens to it in order."""
  i32 = np.int32
  if on_tokens is None:
    return programs.decode(
      leaves, state, i32(batch.max_length), i32(max_new_tokens), batch.stops_np, rng, i32(pad_id)
    )
  b = batch.rows
  done = 0  # steps already passed to on_tokens
  while True:
    step, active, trace, kept = jax.device_get(
      (state["step"], state["active_B"], state["trace_BxW"], state["kept_BxW"])
    )
    for s in range(done, int(step) + 1):
      on_tokens(s, trace[:b, s], kept[:b, s])
    done = int(step) + 1
    if not active.any():
      return state
    state = programs.decode(
      leaves, state, i32(step + STREAM_EVERY), i32(max_new_tokens), batch.stops_np, rng, i32(pad_id)
    )
