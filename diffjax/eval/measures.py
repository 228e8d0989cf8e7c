"""Evaluation measures as pure array functions (numpy in, numpy or python numbers out).

Nothing here calls a model; the sections feed these functions with logits, attention maps and
hidden states. Shape letters: B batch, T query positions, S key positions, H heads, V
vocabulary, E width.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# ----------------------------------------------------------------------------------------------
# Loss and retrieval accuracy.


def token_nll(logits_BxTxV, targets_BxT) -> np.ndarray:
  """Per-token negative log-likelihood in nats, float64 (B, T); a log-softmax in float64."""
  logits_BxTxV = np.asarray(logits_BxTxV, np.float64)
  max_BxTx1 = logits_BxTxV.max(axis=-1, keepdims=True)
  sum_exp_BxTx1 = np.exp(logits_BxTxV - max_BxTx1).sum(axis=-1, keepdims=True)
  logz_BxT = (max_BxTx1 + np.log(sum_exp_BxTx1))[..., 0]
  targets_BxTx1 = np.asarray(targets_BxT)[..., None].astype(np.int64)
  picked_BxT = np.take_along_axis(logits_BxTxV, targets_BxTx1, -1)[..., 0]
  return logz_BxT - picked_BxT


def answer_token_correct(logits_BxTxV, tokens_BxT) -> np.ndarray:
  """(B, T) bool: position t > 0 is True when argmax(logits[t - 1]) == tokens[t]; t = 0 False."""
  pred_BxTm1 = np.asarray(logits_BxTxV).argmax(axis=-1)[:, :-1]
  tokens_BxT = np.asarray(tokens_BxT)
  correct_BxT = np.zeros(tokens_BxT.shape, bool)
  correct_BxT[:, 1:] = pred_BxTm1 == tokens_BxT[:, 1:]
  return correct_BxT


def answer_exact_match(
  logits_BxTxV, tokens_BxT, answer_segments_BxT, num_segments: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """Teacher-forced exact match of every answer segment.

  An answer is correct when the argmax of the logits at every answer position (the logits at
  t - 1 predict the token at t) equals the answer token. For exact match of a whole answer this
  is identical to greedy decoding from the prompt: if every teacher-forced argmax is right,
  greedy decoding feeds back exactly the answer tokens and reproduces them; if the first wrong
  argmax is at answer token j, greedy decoding has reproduced the first j tokens and then emits
  the same wrong token. One forward pass per batch therefore gives the greedy exact-match
  accuracy (`diffjax.eval.scoring.greedy_exact_match` checks this by decoding).

  Args:
    logits_BxTxV: next-token logits of the whole sequence (prompt and answers).
    tokens_BxT: the sequence.
    answer_segments_BxT: r >= 0 at the tokens of answer r, -1 elsewhere.
    num_segments: R; defaults to max segment id + 1.

  Returns:
    correct_BxR bool: all tokens of answer r are predicted; present_BxR bool: example b has
    answer r (examples may have fewer answers than R).
  """
  correct_BxT = answer_token_correct(logits_BxTxV, tokens_BxT)
  return segment_exact_match(correct_BxT, np.asarray(answer_segments_BxT), num_segments)


def segment_exact_match(
  token_correct_BxT, answer_segments_BxT, num_segments: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """Per-segment all-tokens-correct from a (B, T) per-token correctness array; see above."""
  segments_BxT = np.asarray(answer_segments_BxT)
  token_correct_BxT = np.asarray(token_correct_BxT, bool)
  if segments_BxT[:, 0].max(initial=-1) >= 0:
    raise ValueError(
      "An answer token at position 0 has no logits to predict it; answers must "
      "follow at least one prompt token."
    )
  b = segments_BxT.shape[0]
  r = int(segments_BxT.max(initial=-1)) + 1 if num_segments is None else int(num_segments)
  present_BxR = np.zeros((b, r), bool)
  correct_BxR = np.zeros((b, r), bool)
  for k in range(r):
    in_k_BxT = segments_BxT == k
    present_BxR[:, k] = in_k_BxT.any(axis=1)
    correct_BxR[:, k] = present_BxR[:, k] & np.all(token_correct_BxT | ~in_k_BxT, axis=1)
  return correct_BxR, present_BxR


def retrieval_accuracy(correct_BxR, present_BxR) -> dict[str, float]:
  """Accuracy over answers ("accuracy": mean over every present answer, the paper's number) and
  over examples ("all_correct": fraction of examples with every answer right)."""
  correct_BxR, present_BxR = np.asarray(correct_BxR, bool), np.asarray(present_BxR, bool)
  n = int(present_BxR.sum())
  if n == 0:
    raise ValueError("No answers to score: every answer_segments entry is -1.")
  has_any_B = present_BxR.any(axis=1)
  all_ok = np.all(correct_BxR | ~present_BxR, axis=1)[has_any_B]
  return {
    "accuracy": float(correct_BxR[present_BxR].mean()),
    "all_correct": float(all_ok.mean()),
    "num_answers": n,
    "num_examples": int(has_any_B.sum()),
  }


# ----------------------------------------------------------------------------------------------
# Attention allocation.


def combine_diff_maps(probs1_BxHxTxS, probs2_BxHxTxS, lam) -> np.ndarray:
  """A1 - lambda A2 with lambda a scalar (DIFF V1) or per token and head (B, T, H) (DIFF V2)."""
  p1_BxHxTxS = np.asarray(probs1_BxHxTxS, np.float32)
  p2_BxHxTxS = np.asarray(probs2_BxHxTxS, np.float32)
  lam = np.asarray(lam, np.float32)
  if lam.ndim == 0:
    return p1_BxHxTxS - lam * p2_BxHxTxS
  if lam.ndim == 3:
    lam_BxHxTx1 = np.transpose(lam, (0, 2, 1))[..., None]
    return p1_BxHxTxS - lam_BxHxTx1 * p2_BxHxTxS
  raise ValueError(f"lambda must be a scalar or (B, T, H); got shape {lam.shape}.")


def attention_allocation(
  attn_BxHxTxS, rows_BxT, regions_BxS, num_regions: int
) -> dict[str, np.ndarray]:
  """Attention mass that the query rows put on each region of keys, per head.

  Args:
    attn_BxHxTxS: attention weights; signed for DIFF (A1 - lambda A2), rows may not sum to 1.
    rows_BxT: bool, the query rows to average over (e.g. `collate`'s prediction_rows).
    regions_BxS: int region label per key (-1 = ignore, e.g. padding); labels < num_regions.
    num_regions: number of region labels.

  Returns (all float64, shape (H, num_regions) unless said otherwise):
    signed: mean over rows of the signed sum of weights on the region.
    absolute: mean over rows of the sum of |weights| on the region.
    signed_share: signed summed over rows, divided by the rows' summed signed total. The regions
      add up to 1 (the paper's Figure 1 normalisation); a ratio of sums, not a mean of
      per-row ratios, because a DIFF row's total 1 - lambda can be near zero.
    abs_share: absolute summed over rows / the rows' summed absolute total; in [0, 1].
    row_total: (H,) mean signed row sum (1 for softmax, 1 - lambda for DIFF V1).
    num_rows: number of rows averaged.
  """
  attn_BxHxTxS = np.asarray(attn_BxHxTxS, np.float64)
  rows_BxT = np.asarray(rows_BxT, bool)
  regions_BxS = np.asarray(regions_BxS)
  b, _, t, s = attn_BxHxTxS.shape
  if rows_BxT.shape != (b, t) or regions_BxS.shape != (b, s):
    raise ValueError(
      f"rows {rows_BxT.shape} must be (B, T) = {(b, t)} and regions "
      f"{regions_BxS.shape} (B, S) = {(b, s)}."
    )
  n = int(rows_BxT.sum())
  if n == 0:
    raise ValueError("No query rows selected: rows_BxT is all False.")
  onehot_BxSxR = (regions_BxS[..., None] == np.arange(num_regions)).astype(np.float64)
  sel_BxHxTxS = attn_BxHxTxS * rows_BxT[:, None, :, None]
  signed_HxR = np.einsum("bhts,bsr->hr", sel_BxHxTxS, onehot_BxSxR)
  abs_HxR = np.einsum("bhts,bsr->hr", np.abs(sel_BxHxTxS), onehot_BxSxR)
  total_signed_H = sel_BxHxTxS.sum(axis=(0, 2, 3))
  total_abs_H = np.abs(sel_BxHxTxS).sum(axis=(0, 2, 3))
  with np.errstate(divide="ignore", invalid="ignore"):
    signed_share = signed_HxR / total_signed_H[:, None]
    abs_share = abs_HxR / total_abs_H[:, None]
  return {
    "signed": signed_HxR / n,
    "absolute": abs_HxR / n,
    "signed_share": signed_share,
    "abs_share": abs_share,
    "row_total": total_signed_H / n,
    "num_rows": n,
  }


# ----------------------------------------------------------------------------------------------
# Outliers.


def outlier_stats(x, ks: Sequence[int] = (1, 100)) -> dict[str, float]:
  """Order statistics of |x| (paper Table 5): "top{k}" is the k-th largest |x|, plus "median".

  NaNs are ignored. Raises ValueError when x has fewer than max(ks) finite entries.
  """
  a = np.abs(np.asarray(x, np.float64).reshape(-1))
  a = a[np.isfinite(a)]
  k_max = max(ks)
  if a.size < k_max:
    raise ValueError(f"Need at least {k_max} values for top-{k_max}; got {a.size}.")
  top = np.sort(np.partition(a, a.size - k_max)[a.size - k_max :])[::-1]
  out = {f"top{k}": float(top[k - 1]) for k in ks}
  out["median"] = float(np.median(a))
  out["count"] = int(a.size)
  return out


class OutlierAccumulator:
  """Streaming `outlier_stats` over many arrays.

  Top-k values are exact (the `max_k` largest are kept). The median is exact while at most
  `max_sample` values have been seen; past that it is the median of a deterministic uniform
  sample of `max_sample` values per `add` call pooled over calls (an estimate; `exact_median`
  says which).
  """

  def __init__(self, ks: Sequence[int] = (1, 100), max_sample: int = 1 << 20, seed: int = 0):
    self.ks, self.max_k = tuple(ks), max(ks)
    self.max_sample = int(max_sample)
    self._top = np.zeros(0)
    self._sample: list[np.ndarray] = []
    self._rng = np.random.default_rng(seed)
    self.count = 0
    self.exact_median = True

  def add(self, x, mask=None) -> None:
    """Adds |x| (only entries where the boolean `mask`, broadcast to x, is True)."""
    a = np.abs(np.asarray(x, np.float64))
    if mask is not None:
      a = a[np.broadcast_to(np.asarray(mask, bool), a.shape)]
    a = a.reshape(-1)
    a = a[np.isfinite(a)]
    if a.size == 0:
      return
    top = a if a.size <= self.max_k else np.partition(a, a.size - self.max_k)[a.size - self.max_k :]
    exact = a.size <= self.max_sample
    sample = a if exact else self._rng.choice(a, self.max_sample, replace=False)
    self.add_summary(top, sample, a.size, exact=exact)

  def add_summary(self, top, sample, count: int, exact: bool) -> None:
    """Adds a pre-reduced block: its largest |values| (at least min(max_k, count) of them), a
    uniform sample of its |values|, and how many values it had (`exact`: the sample is all)."""
    top = np.abs(np.asarray(top, np.float64).reshape(-1))
    sample = np.abs(np.asarray(sample, np.float64).reshape(-1))
    if count == 0:
      return
    self.count += int(count)
    self.exact_median &= bool(exact)
    self._top = np.sort(np.concatenate([self._top, top[np.isfinite(top)]]))[::-1][: self.max_k]
    self._sample.append(sample[np.isfinite(sample)])

  def result(self) -> dict[str, float]:
    if self.count < self.max_k:
      raise ValueError(f"Need at least {self.max_k} values for top-{self.max_k}; got {self.count}.")
    out = {f"top{k}": float(self._top[k - 1]) for k in self.ks}
    out["median"] = float(np.median(np.concatenate(self._sample)))
    out["count"] = int(self.count)
    out["exact_median"] = bool(self.exact_median)
    return out


# ----------------------------------------------------------------------------------------------
# Quantization (framework-agnostic: works on numpy and jax arrays through the array's own ops).


def _xp(x):
  if isinstance(x, np.ndarray) or np.isscalar(x):
    return np
  import jax.numpy as jnp

  return jnp


def quantize_absmax(x, bits: int, axis: int | Sequence[int] | None = None):
  """Symmetric round-to-nearest absmax fake quantization (returns x's dtype).

  q(x) = round(x / s) * s with s = max|x| / (2^(bits-1) - 1) per slice: the error is at most
  s / 2 per entry, and nothing is clipped (|x| / s <= 2^(bits-1) - 1).

  Args:
    x: numpy or jax array.
    bits: 2..32; the integer grid is [-(2^(bits-1) - 1), 2^(bits-1) - 1].
    axis: axes reduced to one scale (None: one scale for the whole array). E.g. per token of
      activations (..., E): axis=-1; per output channel of a (in, out) kernel: axis=0.

  Returns:
    q(x) with |x - q(x)| <= absmax / (2^(bits-1) - 1) / 2 in every slice; all-zero slices stay 0.
  """
  if not 2 <= int(bits) <= 32:
    raise ValueError(f"bits must be in [2, 32]; got {bits}.")
  return fake_quant(x, float(2 ** (int(bits) - 1) - 1), axis)


def fake_quant(x, qmax, axis=None, valid=None):
  """`quantize_absmax` with the grid size qmax = 2^(bits-1) - 1 given directly (it may be a traced
  jax scalar, so one compiled function serves every bit width); qmax <= 0 returns x unchanged.
  `valid` (bool, broadcastable to x) limits the absmax to those entries and leaves the others
  as they are."""
  xp = _xp(x)
  dtype = x.dtype
  xf = xp.asarray(x).astype(xp.float32)
  ax = xp.abs(xf) if valid is None else xp.where(valid, xp.abs(xf), 0.0)
  absmax = xp.max(ax, axis=axis, keepdims=True)
  qmax_safe = xp.maximum(xp.asarray(qmax, xp.float32), 1.0)
  scale = absmax / qmax_safe
  safe = xp.where(scale > 0, scale, 1.0)
  q = xp.clip(xp.round(xf / safe), -qmax_safe, qmax_safe) * safe
  q = xp.where(scale > 0, q, 0.0)
  if valid is not None:
    q = xp.where(valid, q, xf)
  return xp.where(xp.asarray(qmax) > 0, q, xf).astype(dtype)


def absmax_error_bound(x, bits: int, axis=None):
  """The bound absmax / (2^(bits-1) - 1) / 2 of `quantize_absmax`, broadcastable to x.

  Float32 rounding adds up to a few ulps of |x| on top of it; tests allow for that.
  """
  xp = _xp(x)
  absmax = xp.max(xp.abs(xp.asarray(x).astype(xp.float32)), axis=axis, keepdims=True)
  return absmax / (2 ** (bits - 1) - 1) / 2


def quantize_weight_per_channel(w, bits: int = 4, input_axes: Sequence[int] = (0,)):
  """W4 by default: one scale per output channel, i.e. absmax over the kernel's input axes.

  Flax kernels are (in, out) (`nnx.Linear`) or (in, ..., out) for einsum kernels whose leading
  axes are the contracted ones; pass `input_axes` for other layouts.
  """
  return quantize_absmax(w, bits, axis=tuple(input_axes))


def quantize_activation_per_token(x_BxTxE, bits: int = 8):
  """A8 by default: one scale per token (absmax over the last, feature axis)."""
  return quantize_absmax(x_BxTxE, bits, axis=-1)


def quantize_kv_per_head_token(x, bits: int = 4):
  """KV4 by default: one scale per (token, head) vector, i.e. absmax over the head-dim axis
  (the last axis of (B, S, K, D) keys or values)."""
  return quantize_absmax(x, bits, axis=-1)


def causal_valid_mask(t: int, s: int):
  """(T, S) bool: query i (at absolute position i + S - T) may attend to key j <= that position."""
  return np.arange(s)[None, :] <= (np.arange(t)[:, None] + (s - t))


_GRANULARITY_AXES = {"head": (-2, -1), "row": (-1,), "tensor": None}


def quantize_attention_logits(logits_BxHxTxS, bits, granularity: str = "head"):
  """Absmax-quantizes raw attention scores, taking the scale over causally valid entries only.

  granularity: "head" (one scale per example and head over its whole T x S map; the default),
  "row" (per query row), or "tensor" (one scale per call; note that it couples the examples
  of a batch). Entries above the causal diagonal are masked by the model anyway; excluding them
  from the absmax keeps the scale that of the scores that matter. `bits` may be a traced
  jax scalar (then bits <= 1 means no quantization).
  """
  if granularity not in _GRANULARITY_AXES:
    raise ValueError(f"granularity must be 'head', 'row' or 'tensor'; got {granularity!r}.")
  xp = _xp(logits_BxHxTxS)
  t, s = logits_BxHxTxS.shape[-2], logits_BxHxTxS.shape[-1]
  qmax = 2.0 ** (xp.asarray(bits, xp.float32) - 1) - 1
  return fake_quant(
    logits_BxHxTxS, qmax, _GRANULARITY_AXES[granularity], valid=xp.asarray(causal_valid_mask(t, s))
  )


# ----------------------------------------------------------------------------------------------
# Mechanism probes (the open questions of the Differential Transformer discussion).


def clamp_negative(probs):
  """max(p, 0): the probe that removes the negative weights of A1 - lambda A2."""
  xp = _xp(probs)
  return xp.maximum(probs, 0)


def salient_key_mask(
  probs1_BxHxTxS, top_k: int = 4, always_BxS=None, row_positions_BxR=None
) -> np.ndarray:
  """(B, H, T, S) bool: the keys of each row that count as salient for the correlation probe.

  Salient = the top_k keys of A1 in that row, plus every key where `always_BxS` is True (e.g. the
  answer needle and the first token, the attention sink), plus the query's own position. The
  diagonal and sink are included because both maps put weight there for reasons unrelated to
  noise, which would inflate a correlation meant to measure shared noise.

  Rows are the last T positions of S keys, or, when the maps hold selected rows only,
  `row_positions_BxR` gives each row's position (then T = R).
  """
  probs1_BxHxTxS = np.asarray(probs1_BxHxTxS)
  t, s = probs1_BxHxTxS.shape[-2:]
  k = min(int(top_k), s)
  mask_BxHxTxS = np.zeros(probs1_BxHxTxS.shape, bool)
  if k > 0:
    top_BxHxTxK = np.argpartition(-probs1_BxHxTxS, k - 1, axis=-1)[..., :k]
    np.put_along_axis(mask_BxHxTxS, top_BxHxTxK, True, axis=-1)
  if always_BxS is not None:
    mask_BxHxTxS |= np.asarray(always_BxS, bool)[:, None, None, :]
  if row_positions_BxR is None:
    diag_1x1xTxS = (np.arange(t)[:, None] + (s - t) == np.arange(s)[None, :])[None, None]
    mask_BxHxTxS |= diag_1x1xTxS
  else:
    diag_Bx1xRxS = np.asarray(row_positions_BxR)[:, None, :, None] == np.arange(s)
    mask_BxHxTxS |= diag_Bx1xRxS
  return mask_BxHxTxS


def map_correlation(
  a1_BxHxTxS, a2_BxHxTxS, keys_BxHxTxS, rows_BxT=None, min_keys: int = 3
) -> dict[str, np.ndarray]:
  """Pearson correlation of A1 and A2 across the selected keys of each row, per head.

  Args:
    a1_BxHxTxS, a2_BxHxTxS: the two maps (probabilities, or logits: correlation of logits equals
      correlation of log-probabilities, because a row's log-softmax only shifts its logits).
    keys_BxHxTxS: bool, which keys enter each row's correlation (e.g. causal & non-salient).
    rows_BxT: bool, rows to use (default all).
    min_keys: rows with fewer selected keys, or with zero variance in either map, are skipped.

  Returns:
    per_head (H,) mean over used rows of the per-row correlation (NaN for a head with no row);
    mean: mean over heads of per_head (NaN-aware); rows_used (H,).
  """
  a1_BxHxTxS = np.asarray(a1_BxHxTxS, np.float64)
  a2_BxHxTxS = np.asarray(a2_BxHxTxS, np.float64)
  keys_BxHxTxS = np.asarray(keys_BxHxTxS, bool)
  if rows_BxT is not None:
    keys_BxHxTxS = keys_BxHxTxS & np.asarray(rows_BxT, bool)[:, None, :, None]
  n_BxHxT = keys_BxHxTxS.sum(-1)
  denom_BxHxT = np.maximum(n_BxHxT, 1)
  mu1_BxHxT = np.where(keys_BxHxTxS, a1_BxHxTxS, 0).sum(-1) / denom_BxHxT
  mu2_BxHxT = np.where(keys_BxHxTxS, a2_BxHxTxS, 0).sum(-1) / denom_BxHxT
  d1_BxHxTxS = np.where(keys_BxHxTxS, a1_BxHxTxS - mu1_BxHxT[..., None], 0)
  d2_BxHxTxS = np.where(keys_BxHxTxS, a2_BxHxTxS - mu2_BxHxT[..., None], 0)
  cov_BxHxT = (d1_BxHxTxS * d2_BxHxTxS).sum(-1)
  v1_BxHxT, v2_BxHxT = (d1_BxHxTxS**2).sum(-1), (d2_BxHxTxS**2).sum(-1)
  # Relative variance floor: a constant row (e.g. all probabilities equal) has no correlation.
  tiny = 1e-24
  ok_BxHxT = (n_BxHxT >= min_keys) & (v1_BxHxT > tiny) & (v2_BxHxT > tiny)
  r_BxHxT = np.where(
    ok_BxHxT, cov_BxHxT / np.sqrt(np.where(ok_BxHxT, v1_BxHxT * v2_BxHxT, 1.0)), 0.0
  )
  used_H = ok_BxHxT.sum(axis=(0, 2))
  with np.errstate(invalid="ignore"):
    per_head_H = r_BxHxT.sum(axis=(0, 2)) / np.where(used_H > 0, used_H, np.nan)
  mean = float(np.nanmean(per_head_H)) if np.isfinite(per_head_H).any() else float("nan")
  return {"per_head": per_head_H, "mean": mean, "rows_used": used_H}


# ----------------------------------------------------------------------------------------------
# Mechanisms: attention sinks, context RMS, the per-head norm's gradient magnification.


def document_starts(segment_ids_BxT=None, positions_BxT=None, shape=None):
  """(B, T) int: the index of the first token of each token's document.

  From ``segment_ids`` (a new document where the id changes), else from per-document
  ``positions`` (t - position), else 0 everywhere (one document per row of ``shape``).
  """
  if segment_ids_BxT is not None:
    seg = np.asarray(segment_ids_BxT)
    t = np.arange(seg.shape[1])[None, :]
    new = np.concatenate([np.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    return np.maximum.accumulate(np.where(new, t, 0), axis=1).astype(np.int32)
  if positions_BxT is not None:
    pos = np.asarray(positions_BxT)
    return (np.arange(pos.shape[1])[None, :] - pos).astype(np.int32)
  b, t = shape
  return np.zeros((b, t), np.int32)


def sink_rows(starts_BxT) -> np.ndarray:
  """(B, T) bool: the rows a sink mass averages over, the tokens with at least one earlier
  token of their document (a document's first token can only attend to itself)."""
  return np.arange(starts_BxT.shape[1])[None, :] > np.asarray(starts_BxT)


def first_token_weight(attn_BxHxTxS, starts_BxT):
  """(B, H, T): each row's weight on the first token of its document (numpy or jax)."""
  xp = _xp(attn_BxHxTxS)
  idx = xp.asarray(starts_BxT)[:, None, :, None]
  return xp.take_along_axis(attn_BxHxTxS, idx, axis=3)[..., 0]


def sink_mass(weight_BxHxT, rows_BxT) -> dict[str, float | list[float]]:
  """Mean weight on the document's first token over ``rows_BxT`` (see `sink_rows`) and every
  head: {"mean", "per_head"}. A uniform row over n keys gives 1/n, a row one-hot on the first
  token 1; for a DIFF map (A1 - lambda A2) the weight can be negative."""
  w = np.asarray(weight_BxHxT, np.float64)
  rows = np.broadcast_to(np.asarray(rows_BxT, bool)[:, None, :], w.shape)
  if not rows.any():
    return {"mean": float("nan"), "per_head": [float("nan")] * w.shape[1]}
  per_head = [float(w[:, h][rows[:, h]].mean()) for h in range(w.shape[1])]
  return {"mean": float(w[rows].mean()), "per_head": per_head}


def rms(x, axis=-1) -> np.ndarray:
  """Root mean square over ``axis`` (float64)."""
  x = np.asarray(x, np.float64)
  return np.sqrt(np.mean(x * x, axis=axis))


def visible_value_rms(values_BxSxKxD, valid_BxTxS) -> np.ndarray:
  """(B, T): RMS of the values a row can attend to (its ``valid`` keys, every kv head and
  channel): the scale a convex mix of those values is measured against."""
  ms_BxS = np.mean(np.asarray(values_BxSxKxD, np.float64) ** 2, axis=(2, 3))
  valid = np.asarray(valid_BxTxS, np.float64)
  return np.sqrt(np.einsum("bts,bs->bt", valid, ms_BxS) / np.maximum(valid.sum(-1), 1.0))


def largest_visible_value_rms(values_BxSxKxD, valid_BxTxS) -> np.ndarray:
  """(B, T): the largest RMS (over channels) among the values a row can attend to, over its
  ``valid`` keys and every kv head. A convex mix of values has at most this RMS; a difference
  A1 V - lambda A2 V at most (1 + |lambda|) times it."""
  rms_BxSxK = np.sqrt(np.mean(np.asarray(values_BxSxKxD, np.float64) ** 2, axis=3))
  return np.max(np.where(np.asarray(valid_BxTxS, bool), rms_BxSxK.max(2)[:, None, :], 0.0), axis=-1)


def distribution(x) -> dict[str, float]:
  """{"median", "p99", "max", "mean"} of the finite entries of ``x`` (NaN when none)."""
  v = np.asarray(x, np.float64).reshape(-1)
  v = v[np.isfinite(v)]
  if v.size == 0:
    return {k: float("nan") for k in ("median", "p99", "max", "mean")}
  return {
    "median": float(np.median(v)),
    "p99": float(np.quantile(v, 0.99)),
    "max": float(v.max()),
    "mean": float(v.mean()),
  }


def norm_magnification(context_BxTxHxD, eps: float) -> np.ndarray:
  """(B, T, H): the factor an RMSNorm (no gain) scales each head output by, 1 / sqrt(ms + eps)."""
  x = np.asarray(context_BxTxHxD, np.float64)
  return 1.0 / np.sqrt(np.mean(x * x, axis=-1) + eps)


def gradient_ratio(grad_in_BxTxHxD, grad_out_BxTxHxD) -> np.ndarray:
  """(B, T, H): ||gradient into a map's input|| / ||gradient at its output|| per token and
  head (NaN where the output gradient is zero)."""
  gin = np.linalg.norm(np.asarray(grad_in_BxTxHxD, np.float64), axis=-1)
  gout = np.linalg.norm(np.asarray(grad_out_BxTxHxD, np.float64), axis=-1)
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.where(gout > 0, gin / np.where(gout > 0, gout, 1.0), np.nan)
