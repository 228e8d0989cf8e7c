"""Runs every evaluation on a model and returns plain dicts of numbers (JSON-ready).

Entry points:
  * `evaluate_model(model, val_batches, EvalConfig(...))`: everything below, one dict (the
    schema is in `diffjax/eval/__init__.py`); the CLI (`python -m diffjax.eval`) writes it.
  * one function per evaluation, each taking a `LogitsFn` (tokens -> logits) or a `ModelRunner`:
    `validation_loss`, `retrieval_accuracy`, `needle_table`, `retrieval_heatmap`,
    `associative_recall`, `attention_allocation_by_layer`, `text_statistics` (outliers, lambda,
    map correlation), `low_bit`, `clamp_probe`, `greedy_exact_match`.

Retrieval functions need only `fn(tokens_BxT) -> logits_BxTxV`, so a hand-written function (a
"model" that always answers right, or always wrong) tests them without any network.

Analysis passes run the model's explicit-map reference path (`capture=True` or a logits/probs
hook); it materialises [B, H, T, S] maps per layer, so keep `capture_batch_size * T * T` modest
(the default 2 x 2048^2 x heads x layers float32 fits a CPU comfortably).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from diffjax.eval import metrics as M
from diffjax.eval.tasks import (DEPTHS, NEEDLE_GRID, REGION_NAMES, AssociativeRecallTask,
                                ContextTooShort, MultiNeedleTask, collate)
from diffjax.model import Hooks

LogitsFn = Callable[..., Any]
Batch = Mapping[str, np.ndarray]

# Interventions of `ModelRunner.knob_fn`, all numbers (0 = off).
KNOBS = ("logits_bits", "act_bits", "kv_bits", "clamp")


# ----------------------------------------------------------------------------------------------
# Configuration.


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Sizes and settings of `evaluate_model`. Lengths are in tokens.

  Attributes:
    context_len: length of the retrieval examples in the table, allocation, low-bit and probe
      runs; use the training sequence length (the CLI does).
    batch_size: examples per forward pass for retrieval and loss.
    capture_batch_size: examples per pass with attention maps captured.
    samples_per_depth: examples per (cell, depth); the paper uses 50 per cell.
    depths: answer-needle depths (fractions of the context).
    needle_grid: (N, R) cells of the retrieval table.
    heatmap_lengths: context lengths of the heatmap; include lengths above the training length
      to measure length generalisation. Empty: skip the heatmap.
    heatmap_needles: (N, R) of the heatmap (the paper's 64K figure uses (8, 1)).
    standard_needles: (N, R) of the task used for allocation, low-bit and probes.
    allocation_examples: examples for attention allocation (spread over `depths`).
    mqar: AssociativeRecallTask keyword arguments; None skips it.
    mqar_examples: examples of associative recall.
    val_batches: validation batches to use (the caller supplies them).
    outlier_sample: |logit| values kept per layer and batch for the median estimate.
    probe_rows: query rows per text example for the map-correlation probe.
    corr_top_k: top-k keys of A1 counted as salient in the correlation probe.
    lowbit_bits: bit widths for attention-logit quantization.
    logit_granularity: absmax scale granularity for logits ("head", "row", "tensor").
    weight_bits, activation_bits, kv_bits: the deployed-quantization setting (W4A8, KV4).
    quantize_head: also quantize the embedding table and LM head (off: they stay float, as
      usual for weight quantization).
    seed: seed of every synthetic task.
    sections: which evaluations to run (subset of SECTIONS).
  """

  context_len: int = 512
  batch_size: int = 8
  capture_batch_size: int = 2
  samples_per_depth: int = 10
  depths: tuple[float, ...] = DEPTHS
  needle_grid: tuple[tuple[int, int], ...] = NEEDLE_GRID
  heatmap_lengths: tuple[int, ...] = ()
  heatmap_needles: tuple[int, int] = (4, 1)
  standard_needles: tuple[int, int] = (4, 1)
  allocation_examples: int = 20
  mqar: Mapping[str, Any] | None = dataclasses.field(
      default_factory=lambda: dict(num_pairs=16, num_queries=4, distractors_per_query=1))
  mqar_examples: int = 64
  val_batches: int = 8
  outlier_sample: int = 1 << 16
  probe_rows: int = 16
  corr_top_k: int = 4
  lowbit_bits: tuple[int, ...] = (16, 8, 6, 4)
  logit_granularity: str = "head"
  weight_bits: int = 4
  activation_bits: int = 8
  kv_bits: int = 4
  quantize_head: bool = False
  seed: int = 1234
  sections: tuple[str, ...] = ()

  def __post_init__(self):
    unknown = set(self.sections) - set(SECTIONS)
    if unknown:
      raise ValueError(f"Unknown eval sections {sorted(unknown)}; choose from {SECTIONS}.")
    if self.logit_granularity not in ("head", "row", "tensor"):
      raise ValueError(f"logit_granularity={self.logit_granularity!r} must be 'head', 'row' or 'tensor'.")

  @classmethod
  def full(cls, seq_len: int, **overrides) -> "EvalConfig":
    """Paper-sized settings around training length `seq_len`: 50 samples a cell, a heatmap at
    1/2, 1, 2 and 4 times the training length."""
    kw = dict(context_len=seq_len, samples_per_depth=10, allocation_examples=50,
              heatmap_lengths=tuple(sorted({max(seq_len // 2, 256), seq_len, 2 * seq_len,
                                            4 * seq_len})))
    kw.update(overrides)
    return cls(**kw)

  @classmethod
  def quick(cls, seq_len: int, **overrides) -> "EvalConfig":
    """A smoke-sized evaluation: seconds per tiny model on a CPU; numbers are noisy.

    Retrieval needs room for needles and a question, so contexts are at least 256 tokens even
    when the model trained on shorter windows (RoPE lets it run; it measures extrapolation)."""
    ctx = max(int(seq_len), 256)
    kw = dict(context_len=ctx, batch_size=5, capture_batch_size=2, samples_per_depth=1,
              needle_grid=((1, 1), (2, 2)), heatmap_lengths=(ctx, 2 * ctx),
              heatmap_needles=(2, 1), standard_needles=(2, 1), allocation_examples=5,
              mqar=dict(num_pairs=8, num_queries=2, distractors_per_query=1), mqar_examples=8,
              val_batches=2, outlier_sample=1 << 12, probe_rows=4, lowbit_bits=(8, 4))
    kw.update(overrides)
    return cls(**kw)

  def to_dict(self) -> dict[str, Any]:
    return _jsonable(dataclasses.asdict(self))


SECTIONS = ("validation", "retrieval", "heatmap", "mqar", "allocation", "text", "lowbit", "probes")


# ----------------------------------------------------------------------------------------------
# Running a model.


def _causal_valid(t: int, s: int, segment_ids_BxT=None):
  valid = jnp.asarray(M.causal_valid_mask(t, s))[None, None]
  if segment_ids_BxT is not None:
    seg = jnp.asarray(segment_ids_BxT)
    valid = valid & (seg[:, None, :, None] == seg[:, None, None, :])
  return valid


def _layer_maps(cap: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """The combined map and its parts for one layer's captures ([B, H, T, S] each)."""
  if "probs" in cap:
    return {"combined": cap["probs"], "logits": [cap["logits"]]}
  lam = cap["lambda"].astype(jnp.float32)
  if lam.ndim == 0:
    combined = cap["probs1"] - lam * cap["probs2"]
  else:
    combined = cap["probs1"] - jnp.transpose(lam, (0, 2, 1))[..., None] * cap["probs2"]
  return {"combined": combined, "logits": [cap["logits1"], cap["logits2"]]}


class ModelRunner:
  """Jitted forward passes of one NNX model, compiled once per (kind, shape).

  `logits_fn(hooks)` gives a `LogitsFn`; `rows(tokens, idx)` returns attention rows;
  `text_pass(...)` returns the reductions of `text_statistics`.
  """

  def __init__(self, model: nnx.Module):
    self.model = model
    self.config = model.config
    self.graphdef, self.state = nnx.split(model)
    self._fns: dict[Any, Callable] = {}

  def _merge(self, state):
    return nnx.merge(self.graphdef, state)

  def logits_fn(self, hooks: Hooks | None = None, name: str = "plain") -> LogitsFn:
    """tokens (B, T) [, positions, segment_ids] -> float32 numpy logits (B, T, V)."""
    key = ("logits", name)
    if key not in self._fns:
      def f(state, tokens, positions, segment_ids):
        model = self._merge(state)
        return model(tokens, positions, segment_ids, hooks=hooks) if hooks is not None else \
            model(tokens, positions, segment_ids)
      self._fns[key] = jax.jit(f)
    jf = self._fns[key]

    def apply(tokens, positions=None, segment_ids=None):
      return np.asarray(jf(self.state, jnp.asarray(tokens), positions, segment_ids))
    return apply

  def knob_fn(self, granularity: str = "head", knobs: Mapping[str, float] | None = None,
              state=None) -> LogitsFn:
    """A `LogitsFn` on the reference path with interventions set by numbers, not code, so one
    compiled function serves every setting (see `Knobs`): logits_bits, act_bits, kv_bits
    (0 = off) and clamp (1 = clamp negative attention weights). `state` replaces the model's
    parameters (e.g. quantized weights of the same model)."""
    key = ("knobs", granularity)
    if key not in self._fns:
      def f(state, tokens, positions, segment_ids, k):
        qmax = lambda bits: jnp.where(bits > 1, 2.0 ** (bits - 1) - 1, 0.0)
        hooks = Hooks(
            logits=lambda x: M.quantize_attention_logits(x, k["logits_bits"], granularity),
            probs=lambda p: jnp.where(k["clamp"] > 0, jnp.maximum(p, 0), p),
            kv=lambda x: M.fake_quant(x, qmax(k["kv_bits"]), axis=-1),
            activations=lambda x: M.fake_quant(x, qmax(k["act_bits"]), axis=-1))
        return self._merge(state)(tokens, positions, segment_ids, hooks=hooks)
      self._fns[key] = jax.jit(f)
    jf = self._fns[key]
    k = {name: jnp.float32(0.0) for name in KNOBS}
    for name, v in (knobs or {}).items():
      if name not in KNOBS:
        raise ValueError(f"Unknown knob {name!r}; knobs are {KNOBS}.")
      k[name] = jnp.float32(v)
    st = self.state if state is None else state

    def apply(tokens, positions=None, segment_ids=None):
      return np.asarray(jf(st, jnp.asarray(tokens), positions, segment_ids, k))
    return apply

  def rows(self, tokens_BxT, idx_BxR) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
    """Logits and, per layer, attention rows `idx_BxR` of every map: probs/logits (transformer)
    or probs1/probs2/logits1/logits2 and the combined map (B, H, R, S); lambda; lambda_init."""
    if "rows" not in self._fns:
      def f(state, tokens, idx):
        logits, caps = self._merge(state)(tokens, capture=True)
        take = lambda x: jnp.take_along_axis(x, idx[:, None, :, None], axis=2)
        out = []
        for cap in caps:
          layer = {k: take(v) for k, v in cap.items()
                   if k in ("probs", "logits", "probs1", "probs2", "logits1", "logits2")}
          layer["combined"] = take(_layer_maps(cap)["combined"])
          if "lambda" in cap:
            lam = cap["lambda"]
            layer["lambda"] = lam if lam.ndim == 0 else jnp.take_along_axis(lam, idx[:, :, None], axis=1)
          if "lambda_init" in cap:
            layer["lambda_init"] = cap["lambda_init"]
          out.append(layer)
        return logits, out
      self._fns["rows"] = jax.jit(f)
    logits, layers = self._fns["rows"](self.state, jnp.asarray(tokens_BxT), jnp.asarray(idx_BxR))
    return np.asarray(logits), jax.tree.map(np.asarray, layers)

  def text_pass(self, tokens_BxT, positions_BxT, segment_ids_BxT, sample_idx_N, row_idx_BxR, k: int):
    """Per layer: top-k |attention logits| over valid entries, |logits| at flat (t*S + s)
    indices `sample_idx_N`, |hidden|, lambda, and maps at rows `row_idx_BxR`."""
    key = ("text", k)
    if key not in self._fns:
      def f(state, tokens, positions, segment_ids, sample_idx, row_idx):
        _, caps = self._merge(state)(tokens, positions, segment_ids, capture=True)
        b, t = tokens.shape
        valid = _causal_valid(t, t, segment_ids)
        take = lambda x: jnp.take_along_axis(x, row_idx[:, None, :, None], axis=2)
        out = []
        for cap in caps:
          maps = _layer_maps(cap)
          tops, samples = [], []
          for lg in maps["logits"]:
            a = jnp.where(valid, jnp.abs(lg), -1.0)
            tops.append(jax.lax.top_k(a.reshape(-1), k)[0])
            samples.append(a.reshape(b, a.shape[1], t * t)[:, :, sample_idx].reshape(-1))
          layer = {"logit_top": jnp.concatenate(tops), "logit_sample": jnp.concatenate(samples),
                   "hidden": cap["hidden"], "combined": take(maps["combined"])}
          for name in ("probs1", "probs2", "logits1", "logits2", "probs", "logits"):
            if name in cap:
              layer[name] = take(cap[name])
          if "lambda" in cap:
            layer["lambda"] = cap["lambda"]
          out.append(layer)
        return out
      self._fns[key] = jax.jit(f)
    seg = None if segment_ids_BxT is None else jnp.asarray(segment_ids_BxT)
    pos = None if positions_BxT is None else jnp.asarray(positions_BxT)
    out = self._fns[key](self.state, jnp.asarray(tokens_BxT), pos, seg,
                         jnp.asarray(sample_idx_N), jnp.asarray(row_idx_BxR))
    return jax.tree.map(np.asarray, out)

  def quantized_state(self, bits: int, include_head: bool = False):
    """The model's state with projection kernels absmax-quantized (see `quantize_model_weights`)."""
    return nnx.split(quantize_model_weights(self.model, bits, include_head=include_head))[1]


def _input_axes(node, path) -> tuple[int, ...]:
  """Contracted (input) axes of a kernel: those before its output axes."""
  names = None
  get_meta = getattr(node, "get_metadata", None)
  if get_meta is not None:
    meta = get_meta()
    names = meta.get("out_sharding") or meta.get("sharding_names")
  ndim = len(node.shape)
  if names is not None and len(names) == ndim:
    # Kernels writing into the residual stream end with "embed" ([H, D, E], [F, E]): all leading
    # axes are contracted. Every other kernel contracts its first axis ([E, ...]).
    return tuple(range(ndim - 1)) if names[-1] == "embed" else (0,)
  return tuple(range(ndim - 1)) if path and path[-1] == "o" else (0,)


def quantize_model_weights(model: nnx.Module, bits: int = 4, *, include_head: bool = False) -> nnx.Module:
  """Returns a copy of `model` with every projection kernel (ndim >= 2 `nnx.Param`)
  fake-quantized per output channel (absmax over its input axes).

  The embedding table and the untied LM head are left in float unless `include_head`.
  """
  qmodel = nnx.clone(model)
  for path, node in nnx.iter_graph(qmodel):
    if not isinstance(node, nnx.Param) or len(node.shape) < 2:
      continue
    if not include_head and path and (path[-1] in ("embedding", "lm_head")):
      continue
    # In numpy: eager jax would compile a few kernels per distinct kernel shape.
    w = np.asarray(node[...])
    node[...] = jnp.asarray(M.quantize_absmax(w, bits, axis=_input_axes(node, path)))
  return qmodel


# ----------------------------------------------------------------------------------------------
# Loss.


def _split_batch(batch) -> tuple[np.ndarray, np.ndarray, Any, Any, np.ndarray]:
  """(inputs, targets, positions, segment_ids, loss_mask) from a pipeline dict or a token array."""
  if isinstance(batch, Mapping):
    inputs = np.asarray(batch["inputs"])
    targets = np.asarray(batch["targets"])
    mask = np.asarray(batch.get("loss_mask", np.ones(inputs.shape, np.float32)), np.float64)
    return inputs, targets, batch.get("positions"), batch.get("segment_ids"), mask
  tokens = np.asarray(batch)
  if tokens.ndim != 2 or tokens.shape[1] < 2:
    raise ValueError(f"A token batch must be (B, T) with T >= 2; got {tokens.shape}.")
  return tokens[:, :-1], tokens[:, 1:], None, None, np.ones(tokens[:, 1:].shape)


def validation_loss(fn: LogitsFn, batches: Iterable[Any]) -> dict[str, float]:
  """Mean next-token loss (nats) and perplexity over `batches`, weighted by loss_mask.

  Batches are pipeline dicts (inputs, targets, segment_ids, positions, loss_mask) or (B, T)
  token arrays (every next-token prediction counted).
  """
  total, count = 0.0, 0.0
  for batch in batches:
    inputs, targets, pos, seg, mask = _split_batch(batch)
    logits = fn(inputs, pos, seg) if (pos is not None or seg is not None) else fn(inputs)
    nll = M.token_nll(logits, targets)
    total += float((nll * mask).sum())
    count += float(mask.sum())
  if count == 0:
    raise ValueError("No tokens to score: the batches are empty or fully masked.")
  loss = total / count
  return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(count)}


# ----------------------------------------------------------------------------------------------
# Retrieval.


def _chunks(n: int, size: int):
  for start in range(0, n, max(size, 1)):
    yield range(start, min(start + size, n))


def retrieval_accuracy(fn: LogitsFn, task, num_examples: int | None = None,
                       batch_size: int = 8) -> dict[str, Any]:
  """Teacher-forced exact-match accuracy of `task` (see `metrics.answer_exact_match`).

  Returns "accuracy" (over answers), "all_correct" (over examples), counts, and "by_depth":
  {depth: accuracy} over the examples whose answer needle was at that depth (when the task has
  depths).
  """
  n = task.num_examples if num_examples is None else int(num_examples)
  correct, present, depth_of = [], [], []
  for idx in _chunks(n, batch_size):
    exs = task.examples(idx)
    batch = collate(exs, pad_id=int(task.tokenizer.pad_id))
    tokens = batch["tokens"]
    if len(exs) < batch_size and n > batch_size:
      # Pad a short last batch with copies so a jitted model keeps its compiled shape.
      tokens = np.concatenate([tokens, np.repeat(tokens[:1], batch_size - len(exs), axis=0)])
    logits = fn(tokens)[:len(exs)]
    c, p = M.answer_exact_match(logits, batch["tokens"], batch["answer_segments"],
                                num_segments=int(task.num_queries))
    correct.append(c)
    present.append(p)
    depth_of += [ex.depth for ex in exs]
  correct_all, present_all = np.concatenate(correct), np.concatenate(present)
  out = M.retrieval_accuracy(correct_all, present_all)
  if any(d is not None for d in depth_of):
    depth_arr = np.asarray([np.nan if d is None else d for d in depth_of])
    by_depth = {}
    for d in sorted(set(depth_arr[np.isfinite(depth_arr)])):
      sel = depth_arr == d
      by_depth[f"{d:g}"] = float(correct_all[sel][present_all[sel]].mean())
    out["by_depth"] = by_depth
  return out


def needle_table(fn: LogitsFn, context_len: int, grid: Sequence[tuple[int, int]] = NEEDLE_GRID,
                 samples_per_depth: int = 10, depths: Sequence[float] = DEPTHS, seed: int = 0,
                 batch_size: int = 8, filler=None) -> dict[str, Any]:
  """Accuracy per (N, R) cell at one context length, averaged over depths (paper Table 2).

  Returns {"context_len", "cells": {"N{n}_R{r}": accuracy}, "by_depth": {cell: {depth: acc}},
  "mean": mean over cells, "skipped": {cell: reason}} (cells whose needles and question do not
  fit in `context_len` are skipped, not failed).
  """
  cells, by_depth, skipped = {}, {}, {}
  for n, r in grid:
    try:
      task = MultiNeedleTask(context_len, n, r, depths=depths,
                             num_examples=samples_per_depth * len(depths), seed=seed, filler=filler)
    except ContextTooShort as e:
      skipped[f"N{n}_R{r}"] = str(e)
      continue
    res = retrieval_accuracy(fn, task, batch_size=batch_size)
    cells[f"N{n}_R{r}"] = res["accuracy"]
    by_depth[f"N{n}_R{r}"] = res["by_depth"]
  return {"context_len": int(context_len), "cells": cells, "by_depth": by_depth,
          "mean": float(np.mean(list(cells.values()))) if cells else float("nan"),
          "skipped": skipped}


def retrieval_heatmap(fn: LogitsFn, lengths: Sequence[int], depths: Sequence[float] = DEPTHS,
                      num_needles: int = 4, num_queries: int = 1, samples_per_cell: int = 10,
                      seed: int = 0, batch_size: int = 8, filler=None) -> dict[str, Any]:
  """Accuracy per (depth, context length) cell (paper Figure 5).

  Returns {"lengths": [...], "depths": [...], "accuracy": [[depth-major rows]],
  "mean_by_length": [...], "mean": float, "needles": [N, R]}. Lengths too short for the
  needles are dropped (listed under "skipped_lengths").
  """
  fits = []
  for length in lengths:
    try:
      MultiNeedleTask(int(length), num_needles, num_queries, depths=(0.0,), num_examples=1,
                      seed=seed, filler=filler)
      fits.append(int(length))
    except ContextTooShort:
      pass
  skipped = [int(x) for x in lengths if int(x) not in fits]
  lengths = fits
  if not lengths:
    raise ContextTooShort(f"No heatmap length in {skipped} fits {num_needles} needles and "
                          f"{num_queries} queries.")
  acc = np.zeros((len(depths), len(lengths)))
  for j, length in enumerate(lengths):
    for i, depth in enumerate(depths):
      task = MultiNeedleTask(int(length), num_needles, num_queries, depths=(depth,),
                             num_examples=samples_per_cell, seed=seed + 7919 * i, filler=filler)
      acc[i, j] = retrieval_accuracy(fn, task, batch_size=batch_size)["accuracy"]
  return {"lengths": [int(x) for x in lengths], "depths": [float(d) for d in depths],
          "accuracy": acc.tolist(), "mean_by_length": acc.mean(axis=0).tolist(),
          "mean": float(acc.mean()), "needles": [int(num_needles), int(num_queries)],
          "skipped_lengths": skipped}


def associative_recall(fn: LogitsFn, num_examples: int = 64, seed: int = 0, batch_size: int = 8,
                       **task_kwargs) -> dict[str, Any]:
  """MQAR accuracy (teacher-forced exact match of each queried value)."""
  task = AssociativeRecallTask(num_examples=num_examples, seed=seed, **task_kwargs)
  out = retrieval_accuracy(fn, task, batch_size=batch_size)
  out["sequence_len"] = int(task.example(0).tokens.size)
  out["task"] = task.name
  return out


def greedy_exact_match(fn: LogitsFn, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
  """Exact match by greedy decoding (one forward per generated token, no cache).

  For each answer segment, the sequence up to the segment's start is the prompt (gold tokens,
  including earlier answers and the template between answers); the model then generates as many
  tokens as the answer has, feeding back its own tokens. Returns (correct_BxR, present_BxR) like
  `metrics.answer_exact_match`, which it equals (see the metrics module docstring); this slower
  function exists to check that claim.
  """
  tokens = np.asarray(batch["tokens"])
  segs = np.asarray(batch["answer_segments"])
  r = int(segs.max()) + 1
  correct = np.zeros((tokens.shape[0], r), bool)
  present = np.zeros((tokens.shape[0], r), bool)
  for k in range(r):
    for b in range(tokens.shape[0]):
      pos = np.flatnonzero(segs[b] == k)
      if pos.size == 0:
        continue
      present[b, k] = True
      seq = tokens[b].copy()
      for p in pos:  # answer positions are contiguous
        seq[p] = int(fn(seq[None, :p])[0, -1].argmax())
      correct[b, k] = bool(np.all(seq[pos] == tokens[b, pos]))
  return correct, present


# ----------------------------------------------------------------------------------------------
# Attention allocation, lambda, outliers and probes.


def _row_index(rows_BxT: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Row positions (B, R) padded by repeating the last one, and their validity (B, R)."""
  rows = np.asarray(rows_BxT, bool)
  r = max(int(rows.sum(axis=1).max()), 1)
  idx = np.zeros((rows.shape[0], r), np.int32)
  ok = np.zeros((rows.shape[0], r), bool)
  for b in range(rows.shape[0]):
    pos = np.flatnonzero(rows[b])
    if pos.size:
      idx[b, :pos.size], idx[b, pos.size:] = pos, pos[-1]
      ok[b, :pos.size] = True
  return idx, ok


def _mean_over_heads(d: dict[str, np.ndarray]) -> dict[str, Any]:
  return {k: (np.nanmean(v, axis=0).tolist() if np.ndim(v) == 2 else
              float(np.nanmean(v)) if np.ndim(v) == 1 else v) for k, v in d.items()}


def attention_allocation_by_layer(runner: ModelRunner, task, num_examples: int,
                                  batch_size: int = 2) -> dict[str, Any]:
  """Attention the answer-predicting rows put on each region, per layer (paper Table 3).

  Rows: the positions whose logits predict an answer token (`collate`'s prediction_rows).
  Maps: the combined map (A1 - lambda A2 for DIFF, A for the Transformer).

  Returns {"regions": REGION_NAMES, "layers": [per layer {"signed_share", "abs_share", "signed",
  "absolute"} each a list over regions, averaged over heads], "summary": the same averaged over
  layers, "by_depth": {depth: summary}}. Tables show "answer" and "context" of signed_share
  and abs_share (see `metrics.attention_allocation`).
  """
  per_layer_sums: list[dict[str, np.ndarray] | None] = []
  by_depth_sums: dict[str, list] = {}
  add = lambda a, b: b if a is None else {k: a[k] + b[k] for k in a}
  for chunk in _chunks(num_examples, batch_size):
    exs = task.examples(chunk)
    batch = collate(exs, pad_id=int(task.tokenizer.pad_id))
    idx, ok = _row_index(batch["prediction_rows"])
    _, layers = runner.rows(batch["tokens"], idx)
    if not per_layer_sums:
      per_layer_sums = [None] * len(layers)
    for b, ex in enumerate(exs):
      key = "none" if ex.depth is None else f"{ex.depth:g}"
      slot = by_depth_sums.setdefault(key, [None] * len(layers))
      for li, layer in enumerate(layers):
        raw = _alloc_raw(layer["combined"][b:b + 1], ok[b:b + 1], batch["regions"][b:b + 1])
        per_layer_sums[li] = add(per_layer_sums[li], raw)
        slot[li] = add(slot[li], raw)
  layers_out = [_alloc_finish(s) for s in per_layer_sums]
  summary = {k: np.mean([l[k] for l in layers_out], axis=0).tolist() for k in layers_out[0]}
  by_depth = {}
  for key, slots in by_depth_sums.items():
    fin = [_alloc_finish(s) for s in slots]
    by_depth[key] = {k: np.mean([f[k] for f in fin], axis=0).tolist() for k in fin[0]}
  return {"regions": list(REGION_NAMES), "layers": [{k: np.asarray(v).tolist() for k, v in l.items()}
                                                    for l in layers_out],
          "summary": summary, "by_depth": by_depth, "num_examples": int(num_examples)}


def _alloc_raw(attn_BxHxRxS, ok_BxR, regions_BxS) -> dict[str, np.ndarray]:
  """Per-head sums over rows (signed and absolute per region, totals, row count)."""
  res = M.attention_allocation(attn_BxHxRxS, ok_BxR, regions_BxS, len(REGION_NAMES))
  n = res["num_rows"]
  return {"signed": res["signed"] * n, "absolute": res["absolute"] * n,
          "tot_signed": res["row_total"] * n,
          "tot_abs": np.abs(np.asarray(attn_BxHxRxS, np.float64) *
                            np.asarray(ok_BxR, bool)[:, None, :, None]).sum(axis=(0, 2, 3)),
          "n": np.asarray(float(n))}


def _alloc_finish(s: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Head-averaged allocation from summed raw values (shares are ratios of sums per head)."""
  n = float(s["n"])
  with np.errstate(divide="ignore", invalid="ignore"):
    signed_share = s["signed"] / s["tot_signed"][:, None]
    abs_share = s["absolute"] / s["tot_abs"][:, None]
  return {"signed_share": np.nanmean(signed_share, axis=0), "abs_share": np.nanmean(abs_share, axis=0),
          "signed": (s["signed"] / n).mean(axis=0), "absolute": (s["absolute"] / n).mean(axis=0),
          "row_total": float((s["tot_signed"] / n).mean())}


def _text_rows(t: int, count: int, rng: np.random.Generator) -> np.ndarray:
  """`count` distinct row positions from the second half of a length-t window (rows with many
  keys make correlations meaningful)."""
  lo = t // 2
  count = min(count, t - lo)
  return np.sort(rng.choice(np.arange(lo, t), count, replace=False)).astype(np.int32)


def text_statistics(runner: ModelRunner, batches: Sequence[Any], *, outlier_sample: int = 1 << 16,
                    probe_rows: int = 16, corr_top_k: int = 4, seed: int = 0,
                    k: int = 100) -> dict[str, Any]:
  """Outliers (paper Table 5), lambda statistics and the map-correlation probe on text batches.

  Returns:
    outliers: {"attention_logits": {"top1", "top100", "median", ...}, "hidden": {...},
      "layers": [per layer {"logits_top1", "logits_median", "hidden_top1", "hidden_median"}]}.
      Attention logits are the scaled scores q.k/sqrt(d) on causally valid, same-document
      entries (both maps for DIFF); hidden states are every block's output.
    lambda: V1: {"kind": "scalar", "layers": [lambda], "lambda_init": [...]};
      V2: {"kind": "sigmoid", "layers": [{"mean", "std", "quantiles": {q: v}, "histogram",
      "per_head_mean"}]}; Transformer: {"kind": "none"}.
    correlation: per layer Pearson correlation of A1 and A2 over non-salient keys (DIFF), or of
      query heads 2i and 2i+1 (Transformer, a control: what a plain model's would-be pairs
      share). Salient keys: the top-`corr_top_k` keys of A1, the first token and the query
      itself (`metrics.salient_key_mask`). Both on probabilities and on logits.
    negative_mass: per layer, mean over sampled rows and heads of the summed negative weights.
  """
  rng = np.random.default_rng(seed)
  arm = runner.config.attention
  logit_acc = M.OutlierAccumulator(ks=(1, k))
  hidden_acc = M.OutlierAccumulator(ks=(1, k))
  layer_logit, layer_hidden = None, None
  lam_values: list[list[np.ndarray]] | None = None
  corr_p: list[list[float]] | None = None
  corr_l: list[list[float]] | None = None
  neg: list[list[float]] | None = None
  for batch in batches:
    inputs, _, pos, seg, _ = _split_batch(batch)
    b, t = inputs.shape
    valid_flat = np.flatnonzero(M.causal_valid_mask(t, t).reshape(-1))
    sample = valid_flat if valid_flat.size <= outlier_sample else np.sort(
        rng.choice(valid_flat, outlier_sample, replace=False))
    rows = np.stack([_text_rows(t, probe_rows, rng) for _ in range(b)])
    layers = runner.text_pass(inputs, pos, seg, sample.astype(np.int32), rows, k)
    if layer_logit is None:
      n_layers = len(layers)
      layer_logit = [M.OutlierAccumulator(ks=(1,)) for _ in range(n_layers)]
      layer_hidden = [M.OutlierAccumulator(ks=(1,)) for _ in range(n_layers)]
      lam_values = [[] for _ in range(n_layers)]
      corr_p, corr_l, neg = ([[] for _ in range(n_layers)] for _ in range(3))
    seg_arr = None if seg is None else np.asarray(seg)
    for li, layer in enumerate(layers):
      # Entries that are not causally valid or cross documents come back as -1.
      top = layer["logit_top"]
      top = top[top >= 0]
      smp = layer["logit_sample"]
      smp = smp[smp >= 0]
      full_count = int(round(smp.size * valid_flat.size / max(sample.size, 1)))
      for acc in (logit_acc, layer_logit[li]):
        acc.add_summary(top, smp, full_count, exact=sample.size == valid_flat.size)
      hid = layer["hidden"]
      hidden_acc.add(hid)
      layer_hidden[li].add(hid)
      if "lambda" in layer:
        lam_values[li].append(np.asarray(layer["lambda"], np.float64).reshape(-1) if np.ndim(layer["lambda"])
                              else np.asarray([float(layer["lambda"])]))
      # Correlation probe on the sampled rows.
      always = np.zeros((b, t), bool)
      always[:, 0] = True
      if seg_arr is not None:  # each document's first token is its sink
        always[:, 1:] |= seg_arr[:, 1:] != seg_arr[:, :-1]
      if arm == "transformer":
        p, lg = layer["probs"], layer["logits"]
        h2 = p.shape[1] // 2 * 2
        a1, a2, l1, l2 = p[:, 0:h2:2], p[:, 1:h2:2], lg[:, 0:h2:2], lg[:, 1:h2:2]
      else:
        a1, a2, l1, l2 = layer["probs1"], layer["probs2"], layer["logits1"], layer["logits2"]
      if a1.shape[1] > 0:
        key_ok = _row_key_valid(rows, t, seg_arr)
        sal = M.salient_key_mask(a1, corr_top_k, always, row_positions_BxR=rows)
        keys = key_ok[:, None] & ~sal
        corr_p[li].append(M.map_correlation(a1, a2, keys)["mean"])
        corr_l[li].append(M.map_correlation(l1, l2, keys)["mean"])
      comb = layer["combined"]
      neg[li].append(float(np.minimum(comb, 0).sum(-1).mean()))
  if layer_logit is None:
    raise ValueError("text_statistics needs at least one batch.")
  outliers = {"attention_logits": logit_acc.result(), "hidden": hidden_acc.result(),
              "layers": [{"logits_top1": l.result()["top1"], "logits_median": l.result()["median"],
                          "hidden_top1": h.result()["top1"], "hidden_median": h.result()["median"]}
                         for l, h in zip(layer_logit, layer_hidden)]}
  if arm == "diff_v1":
    lam = {"kind": "scalar", "layers": [float(v[0][0]) for v in lam_values],
           "lambda_init": [float(runner.model.blocks[i].attn.lambda_init)
                           for i in range(len(lam_values))]}
  elif arm == "diff_v2":
    lam = {"kind": "sigmoid", "layers": [_distribution(np.concatenate(v)) for v in lam_values]}
    heads = runner.config.num_heads
    for li, v in enumerate(lam_values):
      lam["layers"][li]["per_head_mean"] = np.concatenate(v).reshape(-1, heads).mean(0).tolist()
  else:
    lam = {"kind": "none"}
  nanmean = lambda xs: float(np.nanmean(xs)) if np.isfinite(xs).any() else float("nan")
  correlation = {"kind": "head_pairs" if arm == "transformer" else "a1_a2",
                 "probs": [nanmean(np.asarray(c)) for c in corr_p],
                 "logits": [nanmean(np.asarray(c)) for c in corr_l],
                 "salient_top_k": int(corr_top_k)}
  return {"outliers": outliers, "lambda": lam, "correlation": correlation,
          "negative_mass": [float(np.mean(n)) for n in neg]}


def _row_key_valid(rows_BxR, t: int, seg_BxT=None) -> np.ndarray:
  """(B, R, S) keys a row at position rows[b, r] may attend to (causal, same document)."""
  ok = np.arange(t)[None, None, :] <= rows_BxR[:, :, None]
  if seg_BxT is not None:
    row_seg = np.take_along_axis(seg_BxT, rows_BxR, axis=1)
    ok &= seg_BxT[:, None, :] == row_seg[:, :, None]
  return ok


def _distribution(v: np.ndarray) -> dict[str, Any]:
  qs = (0.05, 0.25, 0.5, 0.75, 0.95)
  hist, edges = np.histogram(v, bins=20, range=(0.0, 1.0))
  return {"mean": float(v.mean()), "std": float(v.std()),
          "quantiles": {f"{q:g}": float(np.quantile(v, q)) for q in qs},
          "histogram": {"counts": hist.tolist(), "edges": edges.tolist()}}


def lowbit_settings(cfg: EvalConfig) -> dict[str, dict[str, float]]:
  """Knobs of each low-bit setting (weights are handled separately: see `low_bit`)."""
  out = {"float": {}}
  out.update({f"logits{b}": {"logits_bits": b} for b in cfg.lowbit_bits})
  out[f"w{cfg.weight_bits}a{cfg.activation_bits}"] = {"act_bits": cfg.activation_bits}
  out[f"kv{cfg.kv_bits}"] = {"kv_bits": cfg.kv_bits}
  out[f"w{cfg.weight_bits}a{cfg.activation_bits}_kv{cfg.kv_bits}"] = {
      "act_bits": cfg.activation_bits, "kv_bits": cfg.kv_bits}
  return out


def low_bit(runner: ModelRunner, val_batches: Sequence[Any], task, cfg: EvalConfig,
            num_examples: int) -> dict[str, Any]:
  """Loss and retrieval accuracy under quantization.

  Settings (names follow cfg's bit widths; defaults shown): "float" (the reference path with no
  quantization; the comparison point), "logits{b}" for b in cfg.lowbit_bits (only the attention
  scores quantized, absmax with cfg.logit_granularity, paper Figure 8), "w4a8" (projection
  weights per output channel at cfg.weight_bits and their inputs per token at
  cfg.activation_bits), "kv4" (keys and values per token and head at cfg.kv_bits) and
  "w4a8_kv4" (both). Returns {setting: {"loss", "accuracy"}}, "delta": {setting: {"loss",
  "accuracy"}} relative to "float", and "settings".
  """
  out: dict[str, Any] = {}
  wstate = runner.quantized_state(cfg.weight_bits, include_head=cfg.quantize_head)
  for name, knobs in lowbit_settings(cfg).items():
    state = wstate if name.startswith("w") else None
    fn = runner.knob_fn(cfg.logit_granularity, knobs, state)
    out[name] = {"loss": validation_loss(fn, val_batches)["loss"],
                 "accuracy": retrieval_accuracy(fn, task, num_examples, cfg.batch_size)["accuracy"]}
  out["delta"] = {name: {k: out[name][k] - out["float"][k] for k in ("loss", "accuracy")}
                  for name in out if name != "float"}
  out["settings"] = {"logit_granularity": cfg.logit_granularity, "weight_bits": cfg.weight_bits,
                     "activation_bits": cfg.activation_bits, "kv_bits": cfg.kv_bits,
                     "quantize_head": cfg.quantize_head}
  return out


def clamp_probe(runner: ModelRunner, val_batches: Sequence[Any], task, num_examples: int,
                batch_size: int = 8) -> dict[str, Any]:
  """Clamp negative entries of the combined map to zero (the "signed weights" falsifier).

  Both runs use the reference path, so the deltas isolate the clamp. For the Transformer the
  map has no negative entries and the deltas are 0 (a sanity check).
  Returns {"loss", "loss_clamped", "loss_delta", "accuracy", "accuracy_clamped",
  "accuracy_delta"}.
  """
  base = runner.knob_fn()
  clamped = runner.knob_fn(knobs={"clamp": 1})
  l0, l1 = validation_loss(base, val_batches)["loss"], validation_loss(clamped, val_batches)["loss"]
  a0 = retrieval_accuracy(base, task, num_examples, batch_size)["accuracy"]
  a1 = retrieval_accuracy(clamped, task, num_examples, batch_size)["accuracy"]
  return {"loss": l0, "loss_clamped": l1, "loss_delta": l1 - l0, "accuracy": a0,
          "accuracy_clamped": a1, "accuracy_delta": a1 - a0}


# ----------------------------------------------------------------------------------------------
# Everything.


def evaluate_model(model: nnx.Module | ModelRunner, val_batches: Sequence[Any], cfg: EvalConfig,
                   meta: Mapping[str, Any] | None = None, filler=None,
                   log: Callable[[str], None] | None = None) -> dict[str, Any]:
  """Runs the sections of `cfg` and returns the eval JSON (schema in `diffjax.eval`).

  Args:
    model: a `DecoderLM`, or a `ModelRunner` (reuses its compiled functions).
    val_batches: validation batches (pipeline dicts or (B, T+1) token arrays); the first
      cfg.val_batches are used. Loss-based sections are skipped without them.
    cfg: sizes and sections.
    meta: merged into the JSON's "meta" (e.g. seed, workdir, step).
    filler: DocumentSource for needle filler (default: the standard-library corpus).
    log: called with one line per finished section.
  """
  log = log or (lambda _msg: None)
  runner = model if isinstance(model, ModelRunner) else ModelRunner(model)
  model = runner.model
  sections = cfg.sections or SECTIONS
  val_batches = list(val_batches)[:cfg.val_batches]
  fn = runner.logits_fn()
  out: dict[str, Any] = {"schema": SCHEMA, "meta": dict(meta or {}), "sections": {}}
  out["meta"].setdefault("arm", model.config.attention)
  out["meta"]["model"] = _jsonable(model.config.to_dict())
  out["meta"]["eval_config"] = cfg.to_dict()
  timings = {}
  n_std, r_std = cfg.standard_needles
  n_std_examples = max(len(cfg.depths), cfg.allocation_examples)
  std_task = None
  for n_try in range(n_std, 0, -1):  # fewer needles when the context cannot hold them all
    try:
      std_task = MultiNeedleTask(cfg.context_len, n_try, min(r_std, n_try), depths=cfg.depths,
                                 num_examples=n_std_examples, seed=cfg.seed + 1, filler=filler)
      break
    except ContextTooShort:
      continue
  if std_task is None:
    raise ContextTooShort(f"context_len={cfg.context_len} cannot hold even one needle and its "
                          "question; raise EvalConfig.context_len (e.g. --set context_len=256).")
  out["meta"]["standard_needles_used"] = [std_task.num_needles, std_task.num_queries]
  sec = out["sections"]

  def run(name, f):
    if name not in sections:
      return
    if name in ("validation", "text", "lowbit", "probes") and not val_batches:
      log(f"skipping {name}: no validation batches")
      return
    t0 = time.time()
    sec[name] = _jsonable(f())
    timings[name] = time.time() - t0
    log(f"{name}: {timings[name]:.1f}s")

  run("validation", lambda: validation_loss(fn, val_batches))
  run("retrieval", lambda: needle_table(fn, cfg.context_len, cfg.needle_grid, cfg.samples_per_depth,
                                        cfg.depths, cfg.seed, cfg.batch_size, filler))
  if cfg.heatmap_lengths:
    run("heatmap", lambda: retrieval_heatmap(fn, cfg.heatmap_lengths, cfg.depths, *cfg.heatmap_needles,
                                             samples_per_cell=cfg.samples_per_depth, seed=cfg.seed + 2,
                                             batch_size=cfg.batch_size, filler=filler))
  if cfg.mqar is not None:
    run("mqar", lambda: associative_recall(fn, cfg.mqar_examples, cfg.seed + 3, cfg.batch_size,
                                           **dict(cfg.mqar)))
  run("allocation", lambda: attention_allocation_by_layer(runner, std_task, cfg.allocation_examples,
                                                          cfg.capture_batch_size))
  cap_batches = [_rebatch(b, cfg.capture_batch_size) for b in val_batches]
  cap_batches = [x for group in cap_batches for x in group]
  run("text", lambda: text_statistics(runner, cap_batches, outlier_sample=cfg.outlier_sample,
                                      probe_rows=cfg.probe_rows, corr_top_k=cfg.corr_top_k,
                                      seed=cfg.seed))
  run("lowbit", lambda: low_bit(runner, val_batches, std_task, cfg, n_std_examples))
  run("probes", lambda: clamp_probe(runner, val_batches, std_task, n_std_examples, cfg.batch_size))
  out["meta"]["seconds"] = timings
  out["scalars"] = scalars_from_sections(sec)
  return out


def _rebatch(batch, size: int) -> list[Any]:
  """Splits a batch (dict or array) into pieces of at most `size` rows."""
  if isinstance(batch, Mapping):
    n = len(next(iter(batch.values())))
    return [{k: np.asarray(v)[i:i + size] for k, v in batch.items()} for i in range(0, n, size)]
  arr = np.asarray(batch)
  return [arr[i:i + size] for i in range(0, arr.shape[0], size)]


SCHEMA = "diffjax.eval/1"


def scalars_from_sections(sec: Mapping[str, Any]) -> dict[str, float]:
  """The flat {name: number} summary that reports aggregate over seeds (names in `diffjax.eval`)."""
  s: dict[str, float] = {}
  if "validation" in sec:
    s["val/loss"] = sec["validation"]["loss"]
    s["val/perplexity"] = sec["validation"]["perplexity"]
  if "retrieval" in sec:
    for cell, acc in sec["retrieval"]["cells"].items():
      s[f"retrieval/{cell}"] = acc
    s["retrieval/mean"] = sec["retrieval"]["mean"]
  if "heatmap" in sec:
    h = sec["heatmap"]
    for length, acc in zip(h["lengths"], h["mean_by_length"]):
      s[f"heatmap/len{length}"] = acc
    s["heatmap/mean"] = h["mean"]
  if "mqar" in sec:
    s["mqar/accuracy"] = sec["mqar"]["accuracy"]
  if "allocation" in sec:
    summ = sec["allocation"]["summary"]
    names = sec["allocation"]["regions"]
    for key in ("signed_share", "abs_share"):
      for region in ("answer", "context"):
        s[f"allocation/{region}_{key}"] = summ[key][names.index(region)]
  if "text" in sec:
    t = sec["text"]
    for what in ("attention_logits", "hidden"):
      for stat in ("top1", "top100", "median"):
        s[f"outliers/{what}_{stat}"] = t["outliers"][what][stat]
    corr = [c for c in t["correlation"]["probs"] if c == c]
    if corr:
      s["probe/map_correlation_mean"] = float(np.mean(corr))
    s["probe/negative_mass_mean"] = float(np.mean(t["negative_mass"]))
    lam = t["lambda"]
    if lam["kind"] == "scalar":
      s["lambda/mean"] = float(np.mean(lam["layers"]))
    elif lam["kind"] == "sigmoid":
      s["lambda/mean"] = float(np.mean([l["mean"] for l in lam["layers"]]))
  if "lowbit" in sec:
    for name, v in sec["lowbit"].items():
      if name in ("delta", "settings"):
        continue
      s[f"lowbit/{name}/loss"] = v["loss"]
      s[f"lowbit/{name}/accuracy"] = v["accuracy"]
  if "probes" in sec:
    s["probe/clamp_loss_delta"] = sec["probes"]["loss_delta"]
    s["probe/clamp_accuracy_delta"] = sec["probes"]["accuracy_delta"]
  return s


def _jsonable(x):
  """Numpy scalars/arrays and tuples to plain JSON types; NaN stays float('nan')."""
  if isinstance(x, Mapping):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, np.ndarray) or hasattr(x, "__array__") and not isinstance(x, (str, bytes)):
    arr = np.asarray(x)
    return arr.item() if arr.ndim == 0 else arr.tolist()
  if isinstance(x, (np.floating, np.integer, np.bool_)):
    return x.item()
  return x
