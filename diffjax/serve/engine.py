"""Continuous batching: a fixed set of KV-cache slots, decoded together, refilled as they free.

:class:`Engine` prefills, decodes and hands out tokens on its own thread; the loop, its programs
and why a row's tokens depend only on its own request: docs/serving.md#continuous-batching.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import threading
import time
import traceback
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from diffjax import sharding as shd
from diffjax.generation.programs import (
  CACHE_MULTIPLE,
  MIN_PROMPT_BUCKET,
  bucket,
  decode_cache_layout,
  decode_rules,
  round_up,
  shape_struct,
  split_params,
)
from diffjax.model import DecoderLM
from diffjax.nn.attention import CACHE_LAYOUTS, cache_window
from diffjax.nn.attention import cache_layout as layout_of_cache

# The most alternatives a job may ask for per token (the OpenAI API's limit for completions).
MAX_TOP_LOGPROBS = 5
# What a mesh that does not fit the model is told to change (the serve command's --mesh).
MESH_FIX = (
  "Serve with another --mesh (the Engine's mesh=) whose axes divide the model, e.g. a smaller "
  "tensor size."
)


class QueueFull(RuntimeError):
  """The engine already holds as many waiting jobs as it accepts."""


class EngineStopped(RuntimeError):
  """The engine is shutting down and takes no new jobs."""


@dataclasses.dataclass(frozen=True)
class TokenEvent:
  """One generated token: its id, its log-probability under the model (before temperature and
  filters) and the job's ``top_logprobs`` most likely ``(id, logprob)`` alternatives."""

  token: int
  logprob: float
  top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class PromptEvent:
  """The prompt scored (``echo``): per prompt token, its log-probability given the tokens
  before it (None for the first) and the most likely alternatives there (None for the first)."""

  logprobs: tuple[float | None, ...]
  top: tuple[tuple[tuple[int, float], ...] | None, ...]


@dataclasses.dataclass(frozen=True)
class DoneEvent:
  """The job ended: ``reason`` is "stop" (a stop token, not passed on), "length"
  (``max_tokens`` or the cache is full), "cancelled" or "error" (with ``message``)."""

  reason: str
  message: str = ""


@dataclasses.dataclass(eq=False)
class Job:
  """One sequence to generate.

  Attributes:
    prompt: token ids (at least one).
    max_tokens: new tokens at most (0: score the prompt only, with ``echo``).
    temperature: 0 for greedy; else sample from the logits divided by it.
    top_k: sample among the k likeliest tokens (0, or k at least the vocabulary: all).
    top_p: sample among the likeliest tokens of mass p (1.0: all).
    seed: the job's random seed (taken modulo 2**31).
    stop_tokens: ids that end the job (the stop token itself is not passed on).
    top_logprobs: alternatives reported per token, 0 to :data:`MAX_TOP_LOGPROBS`.
    echo: score the prompt too (a :class:`PromptEvent` before the tokens).
    on_event: called from the engine's thread with each event, in order, ending with one
      :class:`DoneEvent`; it must not block.
  """

  prompt: Sequence[int]
  max_tokens: int
  on_event: Callable[[object], None]
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop_tokens: frozenset[int] = frozenset()
  top_logprobs: int = 0
  echo: bool = False
  cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
  submitted: float = dataclasses.field(default_factory=time.perf_counter)

  def cancel(self) -> None:
    """Ends the job at the engine's next step (its slot is freed, a "cancelled" DoneEvent)."""
    self.cancelled.set()


@dataclasses.dataclass
class _Slot:
  job: Job
  generated: int  # tokens produced so far (the next one's index, for its random key)
  pos: int  # the cache position of the token fed next
  seed: int  # the job's seed as the programs take it
  last: int = 0  # the token fed next


def _cache_batch_axes(model: DecoderLM, length: int):
  """Per cache leaf, the axis that indexes rows (where a cache of 1 and of 2 rows differ)."""
  one = jax.eval_shape(lambda: model.init_cache(1, length))
  two = jax.eval_shape(lambda: model.init_cache(2, length))

  def axis(a, b):
    diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
    if len(diff) != 1:
      raise ValueError(f"cannot find the row axis of a cache leaf of shape {a.shape}.")
    return diff[0]

  return jax.tree.map(axis, one, two)


def _pick(logits_BxV, temperature_B, top_k_B, top_p_B, keys_B):
  """(tokens, their log-probabilities, the top :data:`MAX_TOP_LOGPROBS` ids and logprobs) per
  row, each row greedy or sampled by its own options."""
  logits_BxV = logits_BxV.astype(jnp.float32)
  vocab = logits_BxV.shape[-1]
  logp_BxV = jax.nn.log_softmax(logits_BxV, axis=-1)
  greedy_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)

  def sampled(_):
    scaled_BxV = logits_BxV / jnp.maximum(temperature_B, 1e-6)[:, None]
    sorted_BxV = -jnp.sort(-scaled_BxV, axis=-1)
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, vocab), vocab)
    kth_Bx1 = jnp.take_along_axis(sorted_BxV, (k_B - 1)[:, None], axis=-1)
    sorted_BxV = jnp.where(sorted_BxV < kth_Bx1, -jnp.inf, sorted_BxV)
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    keep_Bx1 = jnp.sum(before_BxV < top_p_B[:, None], axis=-1, keepdims=True)
    pth_Bx1 = jnp.take_along_axis(sorted_BxV, keep_Bx1 - 1, axis=-1)
    floor_Bx1 = jnp.where(top_p_B[:, None] < 1, jnp.maximum(kth_Bx1, pth_Bx1), kth_Bx1)
    masked_BxV = jnp.where(scaled_BxV < floor_Bx1, -jnp.inf, scaled_BxV)
    drawn_B = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys_B, masked_BxV)
    return jnp.where(temperature_B > 0, drawn_B.astype(jnp.int32), greedy_B)

  tok_B = jax.lax.cond(jnp.any(temperature_B > 0), sampled, lambda _: greedy_B, None)
  lp_B = jnp.take_along_axis(logp_BxV, tok_B[:, None], axis=-1)[:, 0]
  top_lp_BxN, top_id_BxN = jax.lax.top_k(logp_BxV, min(MAX_TOP_LOGPROBS, vocab))
  return tok_B, lp_B, top_id_BxN.astype(jnp.int32), top_lp_BxN


class Engine:
  """Serves :class:`Job` s from a running decode batch over ``slots`` KV-cache rows.

  Args:
    model: any DecoderLM (its parameters are not changed).
    slots: rows decoded together (the most jobs in flight).
    context: the longest sequence a job may reach, prompt plus new tokens (default: 2048).
    decode_chunk: decode steps per program call; a finished row's slot is refilled after the
      chunk, so a larger chunk costs less host time and adds up to ``decode_chunk - 1``
      wasted steps per finished row.
    max_waiting: jobs held beyond the slots; :meth:`submit` raises :class:`QueueFull` past it.
    max_prefill: prompts prefilled together at most (jobs admitted at once share a call).
    pad_id: the token fed to free slots and prompt padding.
    mesh, rules: decode sharded over a device mesh (rows over data/fsdp, heads over tensor).
    cache_layout: the KV cache's layout (:func:`diffjax.nn.attention.cache_layout`); default:
      head-major on a CPU, sequence-major elsewhere.
  """

  def __init__(
    self,
    model: DecoderLM,
    *,
    slots: int = 8,
    context: int | None = None,
    decode_chunk: int = 4,
    max_waiting: int = 256,
    max_prefill: int = 4,
    pad_id: int = 0,
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
    cache_layout: str | None = None,
  ):
    if min(slots, decode_chunk, max_prefill) < 1 or max_waiting < 0:
      raise ValueError(
        f"slots={slots}, decode_chunk={decode_chunk} and max_prefill={max_prefill} must be at "
        f"least 1 and max_waiting={max_waiting} at least 0."
      )
    vocab = model.config.vocab_size
    if not 0 <= pad_id < vocab:
      raise ValueError(f"pad_id={pad_id} must be a token id in [0, {vocab}).")
    self.model = model
    self.vocab_size = vocab
    self.context = int(context or 2048)
    if self.context < 2:
      raise ValueError(f"context={self.context} must be at least 2 tokens.")
    self.cache_length = round_up(
      max(self.context, bucket(self.context, MIN_PROMPT_BUCKET)), CACHE_MULTIPLE
    )
    self.rules = decode_rules(rules)
    self.mesh = mesh
    self.cache_layout = cache_layout or decode_cache_layout(mesh)
    if self.cache_layout not in CACHE_LAYOUTS:
      raise ValueError(f"cache_layout={self.cache_layout!r}: use one of {CACHE_LAYOUTS}.")
    self.slots = round_up(slots, shd.batch_rows_multiple(mesh, self.rules)) if mesh else slots
    self.decode_chunk = int(decode_chunk)
    self.max_waiting = int(max_waiting)
    self.pad_id = int(pad_id)
    self.max_prefill = min(int(max_prefill), self.slots)  # prompts per prefill call at most
    self._plan_programs()
    self._graphdef, self._treedef, self._leaves = split_params(model, mesh, self.rules, MESH_FIX)
    with layout_of_cache(self.cache_layout):
      self._axes = _cache_batch_axes(model, self.cache_length)
    self._programs: dict = {}
    self.compiles = 0  # programs compiled so far (warm_up compiles them all)
    self._cv = threading.Condition()
    self._waiting: collections.deque[Job] = collections.deque()
    self._dropped: list[Job] = []  # cancelled while waiting, not yet told (the loop tells them)
    self._admitting: list[Job] = []  # taken from the queue, not yet in a slot
    self._slots: list[_Slot | None] = [None] * self.slots
    self._stopping = False
    self._cancel_on_stop = False
    self._thread: threading.Thread | None = None
    self._cache = None
    # Jobs submitted, finished by reason and cancelled_on_stop; program calls; tokens.
    self.counts = collections.Counter()

  def _plan_programs(self) -> None:
    """The buckets the programs are compiled for: prompt widths, prefill rows, decode rows and
    the cache slots a decode step reads, each a power of two (capped by the cache)."""
    self.buckets = tuple(
      sorted({min(bucket(n, MIN_PROMPT_BUCKET), self.cache_length) for n in _powers(self.context)})
    )
    # Up to max_prefill prompts per call, padded with unused rows to a power of two (a program
    # per power of two).
    self.prefill_rows = tuple(sorted({bucket(n) for n in range(1, self.max_prefill + 1)}))
    # A decode program per (rows, slots read): the leading rows that hold jobs (jobs take the
    # lowest free slot) and the cache slots their lengths reach, each a power of two.
    multiple = shd.batch_rows_multiple(self.mesh, self.rules) if self.mesh else 1
    self.row_buckets = tuple(
      sorted({min(round_up(bucket(n), multiple), self.slots) for n in range(1, self.slots + 1)})
    )
    self.windows = tuple(
      sorted(
        {min(bucket(n, CACHE_MULTIPLE), self.cache_length) for n in _powers(self.cache_length)}
      )
    )

  # -- programs ----------------------------------------------------------------------------

  def _merge(self, leaves):
    return nnx.merge(self._graphdef, jax.tree.unflatten(self._treedef, list(leaves)))

  @contextlib.contextmanager
  def _context(self, rows: bool = True):
    """The cache layout, mesh and rules programs trace under; ``rows=False`` for the prefill,
    whose few rows are replicated over the batch axes rather than split."""
    with layout_of_cache(self.cache_layout):
      if self.mesh is None:
        yield
        return
      rules = self.rules if rows else tuple((n, None if n == "batch" else a) for n, a in self.rules)
      with shd.activation_sharding(self.mesh, rules):
        yield

  def _program(self, name):
    program = self._programs.get(name)
    if program is None:
      program = self._compile(name)
      self._programs[name] = program
      self.compiles += 1
    return program

  def _init_cache(self) -> None:
    if self._cache is None:  # the engine's cache, laid out as the decode programs want it
      with self._context():
        init = jax.jit(lambda: self._merge(self._leaves).init_cache(self.slots, self.cache_length))
        self._cache = init()

  def _compile(self, name):
    self._init_cache()
    leaves = tuple(shape_struct(a) for a in self._leaves)
    cache = jax.tree.map(shape_struct, self._cache)
    kind = name[0]
    make = {"decode": self._decode_fn, "prefill": self._prefill_fn, "move": self._move_fn}[kind]
    fn, args = make(*name[1:])
    with self._context(rows=kind != "prefill"):
      if self.mesh is None:
        jitted = jax.jit(fn, donate_argnums=1)
      else:  # the cache stays where it is; the small outputs are replicated
        cache_sharding = jax.tree.map(lambda a: a.sharding, self._cache)
        whole = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        rest = (whole,) * {"decode": 1, "prefill": 2, "move": 0}[kind]
        jitted = jax.jit(fn, donate_argnums=1, out_shardings=(cache_sharding, *rest))
      return jitted.lower(leaves, cache, *args).compile()

  def _decode_fn(self, s: int, window: int):
    """The decode program over the first ``s`` rows and ``window`` cache slots, and the shapes
    of its arguments after the parameters and the cache."""
    steps, pad = self.decode_chunk, self.pad_id

    def decode(leaves, cache, tok_S, pos_S, live_S, gen_S, temp_S, topk_S, topp_S, seed_S):
      model = self._merge(leaves)
      base_S = jax.vmap(jax.random.key)(seed_S)

      def step(k, carry):
        cache, tok_S, pos_S, gen_S, out = carry
        live = live_S & (pos_S < window)
        feed_S = jnp.where(live, tok_S, pad)
        with cache_window(window):  # the first s rows, their first `window` slots
          logits, cache = model(feed_S[:, None], pos_S[:, None], cache=cache, cache_lengths_B=pos_S)
        keys_S = jax.vmap(jax.random.fold_in)(base_S, gen_S)
        picked = _pick(logits[:, 0], temp_S, topk_S, topp_S, keys_S)
        out = tuple(o.at[:, k].set(p) for o, p in zip(out, picked))
        grow = live.astype(jnp.int32)
        return cache, picked[0], pos_S + grow, gen_S + grow, out

      n = min(MAX_TOP_LOGPROBS, self.vocab_size)
      out = (
        jnp.zeros((s, steps), jnp.int32),
        jnp.zeros((s, steps), jnp.float32),
        jnp.zeros((s, steps, n), jnp.int32),
        jnp.zeros((s, steps, n), jnp.float32),
      )
      cache, _, pos_S, gen_S, out = jax.lax.fori_loop(
        0, steps, step, (cache, tok_S, pos_S, gen_S, out)
      )
      return cache, out

    i32, f32, flag = (jax.ShapeDtypeStruct((s,), dt) for dt in (jnp.int32, jnp.float32, bool))
    return decode, (i32, i32, flag, i32, f32, i32, f32, i32)

  def _move_fn(self):
    """The program that copies cache row ``src`` (every position) into row ``dst``, and the
    shapes of its arguments after the parameters and the cache."""

    def move(leaves, cache, src, dst):
      del leaves

      def one(c, ax):
        row = jax.lax.dynamic_index_in_dim(c, src, ax, keepdims=True)
        return jax.lax.dynamic_update_index_in_dim(c, row, dst, ax)

      return (jax.tree.map(one, cache, self._axes),)

    return move, (jax.ShapeDtypeStruct((), jnp.int32),) * 2

  def _prefill_fn(self, rows: int, width: int):
    """The prefill program for ``rows`` prompts of ``width`` tokens, and the shapes of its
    arguments after the parameters and the cache."""
    n_top, axes = min(MAX_TOP_LOGPROBS, self.vocab_size), self._axes

    def prefill(
      leaves, cache, prompt_PxT, n_P, slot_P, valid_P, temp_P, topk_P, topp_P, seed_P, echo
    ):
      model = self._merge(leaves)
      # The prompts' own cache, as wide as their bucket; each row is then copied into its
      # slot's first positions (the rest of a slot keeps stale values no length reaches).
      # A padding row (valid False) writes back what its slot holds.
      fresh = model.init_cache(rows, width)
      logits_PxTxV, fresh = model(prompt_PxT, cache=fresh, cache_lengths_B=jnp.zeros_like(n_P))
      for p in range(rows):

        def put(big, new, ax, p=p):
          piece = jax.lax.slice_in_dim(new, p, p + 1, axis=ax).astype(big.dtype)
          start = tuple(slot_P[p] if i == ax else 0 for i in range(big.ndim))
          old = jax.lax.dynamic_slice(big, start, piece.shape)
          return jax.lax.dynamic_update_slice(big, jnp.where(valid_P[p], piece, old), start)

        cache = jax.tree.map(put, cache, fresh, axes)
      last_PxV = jnp.take_along_axis(logits_PxTxV, (n_P - 1)[:, None, None], axis=1)[:, 0]
      keys_P = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), 0))(seed_P)
      first = _pick(last_PxV, temp_P, topk_P, topp_P, keys_P)

      def scored(_):  # log p(prompt[t] | prompt[:t]) and the alternatives, at t = 1..T-1
        logp = jax.nn.log_softmax(logits_PxTxV[:, :-1].astype(jnp.float32), axis=-1)
        lp_PxT = jnp.take_along_axis(logp, prompt_PxT[:, 1:, None], axis=-1)[..., 0]
        top_lp, top_id = jax.lax.top_k(logp, n_top)
        return lp_PxT, top_id.astype(jnp.int32), top_lp

      zeros = (
        jnp.zeros((rows, width - 1), jnp.float32),
        jnp.zeros((rows, width - 1, n_top), jnp.int32),
        jnp.zeros((rows, width - 1, n_top), jnp.float32),
      )
      prompt_scores = jax.lax.cond(echo, scored, lambda _: zeros, None)
      return cache, first, prompt_scores

    i32, f32, flag = (jax.ShapeDtypeStruct((rows,), dt) for dt in (jnp.int32, jnp.float32, bool))
    prompts = jax.ShapeDtypeStruct((rows, width), jnp.int32)
    echo = jax.ShapeDtypeStruct((), bool)
    return prefill, (prompts, i32, i32, flag, f32, i32, f32, i32, echo)

  def program_names(self) -> list[tuple]:
    """Every program the engine runs: ``("decode", rows, slots read)``, ``("prefill", rows,
    prompt bucket)`` and, with more than one row bucket, ``("move",)``."""
    decode = [("decode", r, w) for r in self.row_buckets for w in self.windows]
    prefill = [("prefill", r, w) for r in self.prefill_rows for w in self.buckets]
    return [*decode, *prefill, *([("move",)] if len(self.row_buckets) > 1 else [])]

  def warm_up(self, progress: Callable[[str], None] | None = None) -> float:
    """Compiles every program (one decode program, one prefill per prompt bucket); returns the
    seconds it took."""
    t0 = time.perf_counter()
    for name in self.program_names():
      t1 = time.perf_counter()
      self._program(name)
      if progress is not None:
        if name[0] == "move":
          what = "the move of a job to another cache row"
        else:
          kind, n, width = name
          plural = "s" * (n > 1)
          what = (
            f"decode of {n} row{plural} over {width} cache slots"
            if kind == "decode"
            else f"prefill of {n} prompt{plural} of {width} tokens"
          )
        progress(f"compiled {what} in {time.perf_counter() - t1:.1f} s")
    return time.perf_counter() - t0

  # -- jobs --------------------------------------------------------------------------------

  def check(self, job: Job) -> None:
    """Raises ValueError naming what is wrong with ``job`` (before it is queued)."""
    n = len(job.prompt)
    if n < 1:
      raise ValueError("the prompt is empty: give at least one token.")
    if job.max_tokens < 0:
      raise ValueError(f"max_tokens={job.max_tokens} must be 0 or more.")
    if job.max_tokens == 0 and not job.echo:
      raise ValueError("max_tokens=0 generates nothing: ask for echo to score the prompt.")
    if n + job.max_tokens > self.context:
      raise ContextTooLong(n, job.max_tokens, self.context)
    ids = np.asarray(job.prompt)
    if ids.min() < 0 or ids.max() >= self.vocab_size:
      raise ValueError(
        f"prompt token ids must be in [0, {self.vocab_size}); got ids from {ids.min()} to "
        f"{ids.max()}."
      )
    if not 0 <= job.top_logprobs <= MAX_TOP_LOGPROBS:
      raise ValueError(f"logprobs={job.top_logprobs} must be between 0 and {MAX_TOP_LOGPROBS}.")
    if not (math.isfinite(job.temperature) and job.temperature >= 0):
      raise ValueError(f"temperature={job.temperature} must be a finite number >= 0.")
    if job.top_k < 0:
      raise ValueError(f"top_k={job.top_k} must be 0 (all tokens) or positive.")
    if not 0 < job.top_p <= 1:
      raise ValueError(f"top_p={job.top_p} must be in (0, 1].")

  def submit(self, job: Job) -> None:
    """Queues ``job`` (checked first: ValueError); :class:`QueueFull` when ``max_waiting``
    jobs already wait, :class:`EngineStopped` once :meth:`stop` was called."""
    self.check(job)
    with self._cv:
      if self._stopping:
        raise EngineStopped("the server is shutting down.")
      self._drop_cancelled()
      if len(self._waiting) >= self.max_waiting + self._free_slots():
        raise QueueFull(
          f"{len(self._waiting)} requests already wait for {self.slots} slots: retry later."
        )
      self._waiting.append(job)
      self.counts["submitted"] += 1
      self._cv.notify_all()

  def _drop_cancelled(self) -> None:
    """Takes the cancelled jobs out of the queue (the caller holds the lock), so that they
    neither count as waiting nor hold a place; the loop tells them that they ended."""
    if any(job.cancelled.is_set() for job in self._waiting):
      live = collections.deque()
      for job in self._waiting:
        (self._dropped if job.cancelled.is_set() else live).append(job)
      self._waiting = live
      self._cv.notify_all()

  def _free_slots(self) -> int:
    """Slots neither holding a job nor set aside for one being prefilled."""
    return sum(s is None for s in self._slots) - len(self._admitting)

  def load(self) -> dict[str, int]:
    """``{"running": jobs in slots, "waiting": jobs queued, "slots": slots}``."""
    with self._cv:
      self._drop_cancelled()
      return {
        "running": self.slots - self._free_slots(),
        "waiting": len(self._waiting),
        "slots": self.slots,
      }

  def start(self) -> Engine:
    """Starts the engine's thread (compiling on first use what :meth:`warm_up` has not)."""
    if self._thread is None:
      self._init_cache()
      self._thread = threading.Thread(target=self._run, name="diffjax-serve-engine", daemon=True)
      self._thread.start()
    return self

  def stop(self, *, cancel: bool = False, timeout: float | None = None) -> None:
    """Takes no new jobs; finishes those in flight and waiting (``cancel``: ends them with a
    "cancelled" event instead) and joins the thread."""
    with self._cv:
      self._stopping = True
      self._cancel_on_stop = self._cancel_on_stop or cancel
      self._cv.notify_all()
    if self._thread is not None:
      self._thread.join(timeout)

  # -- the loop ----------------------------------------------------------------------------

  def _run(self) -> None:
    try:
      while True:
        with self._cv:
          while not (self._stopping or self._waiting or self._dropped) and self._idle():
            self._cv.wait()
          self._drop_cancelled()
          for job in self._dropped:
            self._finish(job, "cancelled")
          self._dropped.clear()
          if self._stopping and self._cancel_on_stop:
            for job in list(self._waiting):
              self._end_on_stop(job)
            self._waiting.clear()
            for i, s in enumerate(self._slots):
              if s is not None:
                self._end_on_stop(s.job)
                self._slots[i] = None
          if self._stopping and not self._waiting and self._idle():
            return
          admit = []
          free = [i for i, s in enumerate(self._slots) if s is None]
          while free and self._waiting:
            job = self._waiting.popleft()
            if job.cancelled.is_set():
              self._finish(job, "cancelled")
              continue
            admit.append((free.pop(0), job))
          # Until a job's prefill has placed it, its slot counts as taken (it may already
          # have handed out its first token).
          self._admitting = [job for _, job in admit]
        if admit:
          self._admit(admit)
        with self._cv:
          self._admitting = []
        if any(s is not None for s in self._slots):
          self._compact()
          self._decode()
    except Exception as e:  # noqa: BLE001 - every job hears of it, then the server reports it
      message = f"{type(e).__name__}: {e}"
      with self._cv:
        self._stopping = True
        for job in self._dropped:
          self._finish(job, "cancelled")
        for job in [*self._admitting, *self._waiting]:
          self._finish(job, "error", message)
        self._dropped.clear()
        self._waiting.clear()
        self._admitting = []
        for i, s in enumerate(self._slots):
          if s is not None:
            self._finish(s.job, "error", message)
            self._slots[i] = None
      self.error = message
      traceback.print_exc()  # the server's log keeps the whole of it

  error: str | None = None

  def _idle(self) -> bool:
    return self._free_slots() == self.slots

  def _end_on_stop(self, job: Job) -> None:
    """Ends ``job`` because :meth:`stop` cancels what is left; ``counts["cancelled_on_stop"]``
    counts the jobs that nothing else had ended (no cancellation of their own)."""
    if not job.cancelled.is_set():
      self.counts["cancelled_on_stop"] += 1
    self._finish(job, "cancelled")

  def _finish(self, job: Job, reason: str, message: str = "") -> None:
    self.counts[f"finished_{reason}"] += 1
    job.on_event(DoneEvent(reason, message))

  def _admit(self, admitted: list[tuple[int, Job]]) -> None:
    """Prefills ``(slot, job)`` pairs, up to ``max_prefill`` at a time (the prompts of similar
    lengths together)."""
    admitted = sorted(admitted, key=lambda a: len(a[1].prompt))
    most = self.max_prefill
    for start in range(0, len(admitted), most):
      group = admitted[start : start + most]
      self._prefill(group)

  def _prefill(self, group: list[tuple[int, Job]]) -> None:
    rows = next(r for r in self.prefill_rows if r >= len(group))
    longest = max(len(job.prompt) for _, job in group)
    width = min(bucket(longest, MIN_PROMPT_BUCKET), self.cache_length)
    prompt = np.full((rows, width), self.pad_id, np.int32)
    n, slot = np.ones(rows, np.int32), np.zeros(rows, np.int32)
    valid = np.arange(rows) < len(group)
    temp, topk, topp = (
      np.zeros(rows, np.float32),
      np.zeros(rows, np.int32),
      np.ones(rows, np.float32),
    )
    seed = np.zeros(rows, np.int32)
    for p, (s, job) in enumerate(group):
      prompt[p, : len(job.prompt)] = job.prompt
      n[p], slot[p], seed[p] = len(job.prompt), s, job.seed % 2**31  # the programs take int32
      temp[p], topk[p], topp[p] = job.temperature, min(job.top_k, self.vocab_size), job.top_p
    echo = any(job.echo for _, job in group)
    self._cache, first, scores = self._program(("prefill", rows, width))(
      self._leaves, self._cache, prompt, n, slot, valid, temp, topk, topp, seed, np.bool_(echo)
    )
    self.counts["prefills"] += 1
    toks, lps, top_ids, top_lps = jax.device_get(first)
    if echo:
      scored = jax.device_get(scores)
    for p, (s, job) in enumerate(group):
      k = len(job.prompt)
      if job.echo:
        lp, top_id, top_lp = (x[p] for x in scored)
        job.on_event(
          PromptEvent(
            (None, *(float(x) for x in lp[: k - 1])),
            (None, *(_alternatives(top_id[t], top_lp[t], job.top_logprobs) for t in range(k - 1))),
          )
        )
      if job.max_tokens == 0:
        self._release(job, None)
        self._finish(job, "length")
        continue
      state = _Slot(job, generated=0, pos=k, seed=int(seed[p]))
      if self._take(state, int(toks[p]), float(lps[p]), top_ids[p], top_lps[p]):
        with self._cv:  # placed in its slot: no longer set aside
          self._slots[s] = state
          self._admitting.remove(job)

  def _take(
    self, state: _Slot, tok: int, lp: float, top_id, top_lp, slot: int | None = None
  ) -> bool:
    """Hands one token to the job of ``slot`` (None: a job being prefilled); False when the
    job ended with it, its slot freed first (:meth:`_release`)."""
    job = state.job
    if job.cancelled.is_set():
      reason = "cancelled"
    else:
      state.generated += 1
      self.counts["tokens"] += 1
      if tok in job.stop_tokens:
        reason = "stop"
      else:
        state.last = tok
        job.on_event(TokenEvent(tok, lp, _alternatives(top_id, top_lp, job.top_logprobs)))
        if state.generated < job.max_tokens and state.pos < self.cache_length:
          return True
        reason = "length"
    self._release(job, slot)
    self._finish(job, reason)
    return False

  def _release(self, job: Job, slot: int | None) -> None:
    """Frees what ``job`` holds, its slot or its place among the jobs being prefilled, before
    it hears that it ended: a job submitted on hearing it (a closed-loop client, a replica
    chosen by load) sees the room."""
    with self._cv:
      if slot is not None:
        self._slots[slot] = None
      elif job in self._admitting:
        self._admitting.remove(job)

  def _compact(self) -> None:
    """Moves the jobs of the highest slots into free lower ones until every job is in the
    smallest row bucket that holds them all: a decode step reads the leading rows up to the
    highest job's, so a job left in a high slot as lower ones end would have the step read
    rows no job holds (a copy of one cache row, against a step over twice the rows)."""
    busy = [i for i, st in enumerate(self._slots) if st is not None]
    rows = next(r for r in self.row_buckets if r >= len(busy))
    free = [i for i in range(rows) if self._slots[i] is None]
    for src in reversed(busy):
      if src < rows:
        break
      dst = free.pop(0)
      self._cache = self._program(("move",))(
        self._leaves, self._cache, np.int32(src), np.int32(dst)
      )[0]
      with self._cv:
        self._slots[dst], self._slots[src] = self._slots[src], None
      self.counts["moves"] += 1

  def _decode(self) -> None:
    busy = [i for i, st in enumerate(self._slots) if st is not None]
    s = next(r for r in self.row_buckets if r > busy[-1])
    reach = max(self._slots[i].pos for i in busy) + self.decode_chunk
    window = next((w for w in self.windows if w >= reach), self.cache_length)
    tok, pos, gen = np.zeros(s, np.int32), np.zeros(s, np.int32), np.zeros(s, np.int32)
    live = np.zeros(s, bool)
    temp, topk, topp = np.zeros(s, np.float32), np.zeros(s, np.int32), np.ones(s, np.float32)
    seeds = np.zeros(s, np.int32)
    for i in busy:
      st = self._slots[i]
      j = st.job
      tok[i], pos[i], gen[i], live[i] = st.last, st.pos, st.generated, True
      temp[i], topk[i], topp[i] = j.temperature, min(j.top_k, self.vocab_size), j.top_p
      seeds[i] = st.seed
    self._cache, out = self._program(("decode", s, window))(
      self._leaves, self._cache, tok, pos, live, gen, temp, topk, topp, seeds
    )
    toks, lps, top_ids, top_lps = jax.device_get(out)
    self.counts["decode_calls"] += 1
    toks, lps = toks.tolist(), lps.tolist()  # Python numbers at once, not one by one
    for i in busy:
      st = self._slots[i]
      for k in range(self.decode_chunk):
        st.pos += 1
        if not self._take(st, toks[i][k], lps[i][k], top_ids[i, k], top_lps[i, k], slot=i):
          break


class ContextTooLong(ValueError):
  """A prompt and its ``max_tokens`` do not fit the engine's context."""

  def __init__(self, prompt_tokens: int, max_tokens: int, context: int):
    super().__init__(
      f"this model's context is {context} tokens; the prompt has {prompt_tokens} and "
      f"max_tokens asks for {max_tokens} more: shorten the prompt or lower max_tokens."
    )


def _alternatives(ids, lps, k: int) -> tuple[tuple[int, float], ...]:
  if not k:
    return ()
  return tuple((int(i), float(v)) for i, v in zip(ids[:k], lps[:k]))


def _powers(context: int):
  n = MIN_PROMPT_BUCKET
  while n < context:
    yield n
    n *= 2
  yield context
