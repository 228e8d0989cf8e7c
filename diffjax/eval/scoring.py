"""Scoring a `LogitsFn` (tokens -> next-token logits): validation loss and retrieval accuracy.

Every function here needs only `fn(tokens_BxT) -> logits_BxTxV` (and, for packed validation
batches, `fn(inputs, positions, segment_ids)`), so a hand-written function (a "model" that always
answers right, or always wrong) tests them without any network.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from diffjax.data.tasks import collate
from diffjax.eval import measures
from diffjax.eval.runner import LogitsFn

Batch = Mapping[str, np.ndarray]


# ----------------------------------------------------------------------------------------------
# Loss.


def split_batch(batch) -> tuple[np.ndarray, np.ndarray, Any, Any, np.ndarray]:
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
    inputs, targets, pos, seg, mask = split_batch(batch)
    logits = fn(inputs, pos, seg) if (pos is not None or seg is not None) else fn(inputs)
    nll = measures.token_nll(logits, targets)
    total += float((nll * mask).sum())
    count += float(mask.sum())
  if count == 0:
    raise ValueError("No tokens to score: the batches are empty or fully masked.")
  loss = total / count
  return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(count)}


# ----------------------------------------------------------------------------------------------
# Retrieval.


def chunks(n: int, size: int):
  """Example indices 0..n-1 in ranges of at most `size`."""
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
  for idx in chunks(n, batch_size):
    exs = task.examples(idx)
    batch = collate(exs, pad_id=int(task.tokenizer.pad_id))
    tokens = batch["tokens"]
    if len(exs) < batch_size and n > batch_size:
      # Pad a short last batch with copies so a jitted model keeps its compiled shape.
      tokens = np.concatenate([tokens, np.repeat(tokens[:1], batch_size - len(exs), axis=0)])
    logits = fn(tokens)[: len(exs)]
    c, p = measures.answer_exact_match(
      logits, batch["tokens"], batch["answer_segments"], num_segments=int(task.num_queries)
    )
    correct.append(c)
    present.append(p)
    depth_of += [ex.depth for ex in exs]
  correct_all, present_all = np.concatenate(correct), np.concatenate(present)
  out = measures.retrieval_accuracy(correct_all, present_all)
  if any(d is not None for d in depth_of):
    depth_arr = np.asarray([np.nan if d is None else d for d in depth_of])
    by_depth = {}
    for d in sorted(set(depth_arr[np.isfinite(depth_arr)])):
      sel = depth_arr == d
      by_depth[f"{d:g}"] = float(correct_all[sel][present_all[sel]].mean())
    out["by_depth"] = by_depth
  return out


def greedy_exact_match(fn: LogitsFn, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
  """Exact match by greedy decoding (one forward per generated token, no cache).

  For each answer segment, the sequence up to the segment's start is the prompt (gold tokens,
  including earlier answers and the template between answers); the model then generates as many
  tokens as the answer has, feeding back its own tokens. Returns (correct_BxR, present_BxR) like
  `measures.answer_exact_match`, which it equals (see its docstring); this slower
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
