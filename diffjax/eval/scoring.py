"""Scoring a `LogitsFn` (tokens -> next-token logits): validation loss and retrieval accuracy.

Every function here needs only `fn(tokens_BxT) -> logits_BxTxV` (and, for packed validation
batches, `fn(inputs, positions, segment_ids)`), so a hand-written function (a "model" that always
answers right, or always wrong) tests them without any network.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from diffjax.data.tasks import (
  DEPTHS,
  NEEDLE_GRID,
  AssociativeRecallTask,
  ContextTooShort,
  MultiNeedleTask,
  collate,
)
from diffjax.eval import measures as M
from diffjax.eval.runner import LogitsFn

Batch = Mapping[str, np.ndarray]


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


def retrieval_accuracy(
  fn: LogitsFn, task, num_examples: int | None = None, batch_size: int = 8
) -> dict[str, Any]:
  """Teacher-forced exact-match accuracy of `task` (see `measures.answer_exact_match`).

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
    logits = fn(tokens)[: len(exs)]
    c, p = M.answer_exact_match(
      logits, batch["tokens"], batch["answer_segments"], num_segments=int(task.num_queries)
    )
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


def needle_table(
  fn: LogitsFn,
  context_len: int,
  grid: Sequence[tuple[int, int]] = NEEDLE_GRID,
  samples_per_depth: int = 10,
  depths: Sequence[float] = DEPTHS,
  seed: int = 0,
  batch_size: int = 8,
  filler=None,
) -> dict[str, Any]:
  """Accuracy per (N, R) cell at one context length, averaged over depths (paper Table 2).

  Returns {"context_len", "cells": {"N{n}_R{r}": accuracy}, "by_depth": {cell: {depth: acc}},
  "mean": mean over cells, "skipped": {cell: reason}} (cells whose needles and question do not
  fit in `context_len` are skipped, not failed).
  """
  cells, by_depth, skipped = {}, {}, {}
  for n, r in grid:
    try:
      task = MultiNeedleTask(
        context_len,
        n,
        r,
        depths=depths,
        num_examples=samples_per_depth * len(depths),
        seed=seed,
        filler=filler,
      )
    except ContextTooShort as e:
      skipped[f"N{n}_R{r}"] = str(e)
      continue
    res = retrieval_accuracy(fn, task, batch_size=batch_size)
    cells[f"N{n}_R{r}"] = res["accuracy"]
    by_depth[f"N{n}_R{r}"] = res["by_depth"]
  return {
    "context_len": int(context_len),
    "cells": cells,
    "by_depth": by_depth,
    "mean": float(np.mean(list(cells.values()))) if cells else float("nan"),
    "skipped": skipped,
  }


def retrieval_heatmap(
  fn: LogitsFn,
  lengths: Sequence[int],
  depths: Sequence[float] = DEPTHS,
  num_needles: int = 4,
  num_queries: int = 1,
  samples_per_cell: int = 10,
  seed: int = 0,
  batch_size: int = 8,
  filler=None,
) -> dict[str, Any]:
  """Accuracy per (depth, context length) cell (paper Figure 5).

  Returns {"lengths": [...], "depths": [...], "accuracy": [[depth-major rows]],
  "mean_by_length": [...], "mean": float, "needles": [N, R]}. Lengths too short for the
  needles are dropped (listed under "skipped_lengths").
  """
  fits = []
  for length in lengths:
    try:
      MultiNeedleTask(
        int(length),
        num_needles,
        num_queries,
        depths=(0.0,),
        num_examples=1,
        seed=seed,
        filler=filler,
      )
      fits.append(int(length))
    except ContextTooShort:
      pass
  skipped = [int(x) for x in lengths if int(x) not in fits]
  lengths = fits
  if not lengths:
    raise ContextTooShort(
      f"No heatmap length in {skipped} fits {num_needles} needles and {num_queries} queries."
    )
  acc = np.zeros((len(depths), len(lengths)))
  for j, length in enumerate(lengths):
    for i, depth in enumerate(depths):
      task = MultiNeedleTask(
        int(length),
        num_needles,
        num_queries,
        depths=(depth,),
        num_examples=samples_per_cell,
        seed=seed + 7919 * i,
        filler=filler,
      )
      acc[i, j] = retrieval_accuracy(fn, task, batch_size=batch_size)["accuracy"]
  return {
    "lengths": [int(x) for x in lengths],
    "depths": [float(d) for d in depths],
    "accuracy": acc.tolist(),
    "mean_by_length": acc.mean(axis=0).tolist(),
    "mean": float(acc.mean()),
    "needles": [int(num_needles), int(num_queries)],
    "skipped_lengths": skipped,
  }


def associative_recall(
  fn: LogitsFn, num_examples: int = 64, seed: int = 0, batch_size: int = 8, **task_kwargs
) -> dict[str, Any]:
  """MQAR accuracy (teacher-forced exact match of each queried value)."""
  task = AssociativeRecallTask(num_examples=num_examples, seed=seed, **task_kwargs)
  out = retrieval_accuracy(fn, task, batch_size=batch_size)
  out["sequence_len"] = int(task.example(0).tokens.size)
  out["task"] = task.name
  return out


def mqar_cell_name(cell: Mapping[str, Any]) -> str:
  """The scalar name of an associative-recall grid cell: P{pairs}_D{distractors}[_Q{q}]."""
  name = f"P{int(cell['num_pairs'])}_D{int(cell.get('distractors_per_query', 1))}"
  return name + (f"_Q{int(cell['num_queries'])}" if "num_queries" in cell else "")


def associative_recall_grid(
  fn: LogitsFn,
  grid: Sequence[Mapping[str, Any]],
  num_examples: int = 64,
  seed: int = 0,
  batch_size: int = 8,
  **common,
) -> dict[str, Any]:
  """MQAR accuracy on every cell of a difficulty grid (each a dict of `AssociativeRecallTask`
  arguments over `common`); cell c draws its examples from seed `seed + c`.

  Returns {"cells": {name: {"accuracy", "all_correct", "sequence_len", "settings"}},
  "order": [names in grid order], "num_examples"}.
  """
  cells, order = {}, []
  for c, cell in enumerate(grid):
    kw = {**common, **dict(cell)}
    kw.setdefault("num_queries", min(4, int(kw["num_pairs"])))
    r = associative_recall(fn, num_examples, seed + c, batch_size, **kw)
    name = mqar_cell_name(cell)
    if name in cells:
      raise ValueError(f"mqar_grid has two cells named {name!r}; give each cell distinct settings.")
    order.append(name)
    cells[name] = {
      "accuracy": r["accuracy"],
      "all_correct": r["all_correct"],
      "sequence_len": r["sequence_len"],
      "settings": kw,
    }
  return {"cells": cells, "order": order, "num_examples": int(num_examples)}


def greedy_exact_match(fn: LogitsFn, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
  """Exact match by greedy decoding (one forward per generated token, no cache).

  For each answer segment, the sequence up to the segment's start is the prompt (gold tokens,
  including earlier answers and the template between answers); the model then generates as many
  tokens as the answer has, feeding back its own tokens. Returns (correct_BxR, present_BxR) like
  `measures.answer_exact_match`, which it equals (see the measures module docstring); this slower
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
