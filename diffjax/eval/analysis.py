"""Mechanism analyses on a `ModelRunner`: attention allocation, outliers, lambda, the
correlation and clamp probes, and low-bit robustness."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from diffjax.data.tasks import REGION_NAMES, collate
from diffjax.eval import measures as M
from diffjax.eval.config import EvalConfig
from diffjax.eval.runner import ModelRunner
from diffjax.eval.scoring import _chunks, _split_batch, retrieval_accuracy, validation_loss


def _row_index(rows_BxT: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Row positions (B, R) padded by repeating the last one, and their validity (B, R)."""
  rows = np.asarray(rows_BxT, bool)
  r = max(int(rows.sum(axis=1).max()), 1)
  idx = np.zeros((rows.shape[0], r), np.int32)
  ok = np.zeros((rows.shape[0], r), bool)
  for b in range(rows.shape[0]):
    pos = np.flatnonzero(rows[b])
    if pos.size:
      idx[b, : pos.size], idx[b, pos.size :] = pos, pos[-1]
      ok[b, : pos.size] = True
  return idx, ok


def attention_allocation_by_layer(
  runner: ModelRunner, task, num_examples: int, batch_size: int = 2
) -> dict[str, Any]:
  """Attention the answer-predicting rows put on each region, per layer (paper Table 3).

  Rows: the positions whose logits predict an answer token (`collate`'s prediction_rows).
  Maps: the combined map (A1 - lambda A2 for DIFF, A for the Transformer).

  Returns {"regions": REGION_NAMES, "layers": [per layer {"signed_share", "abs_share", "signed",
  "absolute"} each a list over regions, averaged over heads], "summary": the same averaged over
  layers, "by_depth": {depth: summary}}. Tables show "answer" and "context" of signed_share
  and abs_share (see `measures.attention_allocation`).
  """
  per_layer_sums: list[dict[str, np.ndarray] | None] = []
  by_depth_sums: dict[str, list] = {}
  add = lambda a, b: b if a is None else {k: a[k] + b[k] for k in a}
  for chunk in _chunks(num_examples, batch_size):
    exs = task.examples(chunk)
    batch = collate(exs, pad_id=int(task.tokenizer.pad_id))
    idx_BxR, ok_BxR = _row_index(batch["prediction_rows"])
    _, layers = runner.rows(batch["tokens"], idx_BxR)
    if not per_layer_sums:
      per_layer_sums = [None] * len(layers)
    for b, ex in enumerate(exs):
      key = "none" if ex.depth is None else f"{ex.depth:g}"
      slot = by_depth_sums.setdefault(key, [None] * len(layers))
      for li, layer in enumerate(layers):
        raw = _alloc_raw(
          layer["combined"][b : b + 1], ok_BxR[b : b + 1], batch["regions"][b : b + 1]
        )
        per_layer_sums[li] = add(per_layer_sums[li], raw)
        slot[li] = add(slot[li], raw)
  layers_out = [_alloc_finish(s) for s in per_layer_sums]
  summary = {k: np.mean([l[k] for l in layers_out], axis=0).tolist() for k in layers_out[0]}
  by_depth = {}
  for key, slots in by_depth_sums.items():
    fin = [_alloc_finish(s) for s in slots]
    by_depth[key] = {k: np.mean([f[k] for f in fin], axis=0).tolist() for k in fin[0]}
  return {
    "regions": list(REGION_NAMES),
    "layers": [{k: np.asarray(v).tolist() for k, v in l.items()} for l in layers_out],
    "summary": summary,
    "by_depth": by_depth,
    "num_examples": int(num_examples),
  }


def _alloc_raw(attn_BxHxRxS, ok_BxR, regions_BxS) -> dict[str, np.ndarray]:
  """Per-head sums over rows (signed and absolute per region, totals, row count)."""
  res = M.attention_allocation(attn_BxHxRxS, ok_BxR, regions_BxS, len(REGION_NAMES))
  n = res["num_rows"]
  return {
    "signed": res["signed"] * n,
    "absolute": res["absolute"] * n,
    "tot_signed": res["row_total"] * n,
    "tot_abs": np.abs(
      np.asarray(attn_BxHxRxS, np.float64) * np.asarray(ok_BxR, bool)[:, None, :, None]
    ).sum(axis=(0, 2, 3)),
    "n": np.asarray(float(n)),
  }


def _alloc_finish(s: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Head-averaged allocation from summed raw values (shares are ratios of sums per head)."""
  n = float(s["n"])
  with np.errstate(divide="ignore", invalid="ignore"):
    signed_share = s["signed"] / s["tot_signed"][:, None]
    abs_share = s["absolute"] / s["tot_abs"][:, None]
  return {
    "signed_share": np.nanmean(signed_share, axis=0),
    "abs_share": np.nanmean(abs_share, axis=0),
    "signed": (s["signed"] / n).mean(axis=0),
    "absolute": (s["absolute"] / n).mean(axis=0),
    "row_total": float((s["tot_signed"] / n).mean()),
  }


def _text_rows(t: int, count: int, rng: np.random.Generator) -> np.ndarray:
  """`count` distinct row positions from the second half of a length-t window (rows with many
  keys make correlations meaningful)."""
  lo = t // 2
  count = min(count, t - lo)
  return np.sort(rng.choice(np.arange(lo, t), count, replace=False)).astype(np.int32)


def text_statistics(
  runner: ModelRunner,
  batches: Sequence[Any],
  *,
  outlier_sample: int = 1 << 16,
  probe_rows: int = 16,
  corr_top_k: int = 4,
  seed: int = 0,
  k: int = 100,
) -> dict[str, Any]:
  """Outliers (paper Table 5), lambda statistics and the map-correlation probe on text batches.

  Returns:
    outliers: {"attention_logits": {"top1", "top100", "median", ...}, "hidden": {...},
      "layers": [per layer {"logits_top1", "logits_median", "hidden_top1", "hidden_median"}]}.
      Attention logits are the scaled scores q.k/sqrt(d) on causally valid, same-document
      entries (both maps for DIFF); hidden states are every block's output.
    lambda: V1: {"kind": "scalar", "layers": [lambda], "lambda_init": [...]};
      V2: {"kind": "sigmoid", "layers": [{"mean", "std", "quantiles": {q: v}, "histogram",
      "per_head_mean"}]}; Transformer: {"kind": "none"}.
    correlation: per layer (and per head: probs_per_head) Pearson correlation of A1 and A2 over
      non-salient keys (DIFF), or of query heads 2i and 2i+1 (Transformer, a control: what a
      plain model's would-be pairs share). Salient keys: the top-`corr_top_k` keys of A1, the
      first token and the query itself (`measures.salient_key_mask`). Both on probabilities
      and on logits.
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
  corr_h: list[list[np.ndarray]] | None = None
  neg: list[list[float]] | None = None
  for batch in batches:
    inputs_BxT, _, positions_BxT, segment_ids_BxT, _ = _split_batch(batch)
    b, t = inputs_BxT.shape
    valid_flat = np.flatnonzero(M.causal_valid_mask(t, t).reshape(-1))
    sample = (
      valid_flat
      if valid_flat.size <= outlier_sample
      else np.sort(rng.choice(valid_flat, outlier_sample, replace=False))
    )
    rows_BxR = np.stack([_text_rows(t, probe_rows, rng) for _ in range(b)])
    layers = runner.text_pass(
      inputs_BxT, positions_BxT, segment_ids_BxT, sample.astype(np.int32), rows_BxR, k
    )
    if layer_logit is None:
      n_layers = len(layers)
      layer_logit = [M.OutlierAccumulator(ks=(1,)) for _ in range(n_layers)]
      layer_hidden = [M.OutlierAccumulator(ks=(1,)) for _ in range(n_layers)]
      lam_values = [[] for _ in range(n_layers)]
      corr_p, corr_l, corr_h, neg = ([[] for _ in range(n_layers)] for _ in range(4))
    seg_BxT = None if segment_ids_BxT is None else np.asarray(segment_ids_BxT)
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
        lam_values[li].append(np.asarray(layer["lambda"], np.float64).reshape(-1))
      # Correlation probe on the sampled rows.
      always_BxT = np.zeros((b, t), bool)
      always_BxT[:, 0] = True
      if seg_BxT is not None:  # each document's first token is its sink
        always_BxT[:, 1:] |= seg_BxT[:, 1:] != seg_BxT[:, :-1]
      # Maps at the sampled rows, [B, H', R, S]: A1 and A2 of each DIFF head, or for the
      # Transformer its query heads 2i and 2i+1 as would-be pairs.
      if arm == "transformer":
        probs_BxHxRxS, logits_BxHxRxS = layer["probs"], layer["logits"]
        h2 = probs_BxHxRxS.shape[1] // 2 * 2
        a1_BxHxRxS, a2_BxHxRxS = probs_BxHxRxS[:, 0:h2:2], probs_BxHxRxS[:, 1:h2:2]
        l1_BxHxRxS, l2_BxHxRxS = logits_BxHxRxS[:, 0:h2:2], logits_BxHxRxS[:, 1:h2:2]
      else:
        a1_BxHxRxS, a2_BxHxRxS = layer["probs1"], layer["probs2"]
        l1_BxHxRxS, l2_BxHxRxS = layer["logits1"], layer["logits2"]
      if a1_BxHxRxS.shape[1] > 0:
        key_ok_BxRxS = _row_key_valid(rows_BxR, t, seg_BxT)
        salient_BxHxRxS = M.salient_key_mask(
          a1_BxHxRxS, corr_top_k, always_BxT, row_positions_BxR=rows_BxR
        )
        keys_BxHxRxS = key_ok_BxRxS[:, None] & ~salient_BxHxRxS
        corr = M.map_correlation(a1_BxHxRxS, a2_BxHxRxS, keys_BxHxRxS)
        corr_p[li].append(corr["mean"])
        corr_h[li].append(corr["per_head"])
        corr_l[li].append(M.map_correlation(l1_BxHxRxS, l2_BxHxRxS, keys_BxHxRxS)["mean"])
      combined_BxHxRxS = layer["combined"]
      neg[li].append(float(np.minimum(combined_BxHxRxS, 0).sum(-1).mean()))
  if layer_logit is None:
    raise ValueError("text_statistics needs at least one batch.")
  outliers = {
    "attention_logits": logit_acc.result(),
    "hidden": hidden_acc.result(),
    "layers": [
      {
        "logits_top1": l.result()["top1"],
        "logits_median": l.result()["median"],
        "hidden_top1": h.result()["top1"],
        "hidden_median": h.result()["median"],
      }
      for l, h in zip(layer_logit, layer_hidden)
    ],
  }
  if arm == "diff_v1":
    lam = {
      "kind": "scalar",
      "layers": [float(v[0][0]) for v in lam_values],
      "lambda_init": [
        float(runner.model.layer(i).attn.lambda_init) for i in range(len(lam_values))
      ],
    }
  elif arm == "diff_v2":
    lam = {"kind": "sigmoid", "layers": [_distribution(np.concatenate(v)) for v in lam_values]}
    heads = runner.config.num_heads
    for li, v in enumerate(lam_values):
      lam["layers"][li]["per_head_mean"] = np.concatenate(v).reshape(-1, heads).mean(0).tolist()
  else:
    lam = {"kind": "none"}
  nanmean = lambda xs: float(np.nanmean(xs)) if np.isfinite(xs).any() else float("nan")
  correlation = {
    "kind": "head_pairs" if arm == "transformer" else "a1_a2",
    "probs": [nanmean(np.asarray(c)) for c in corr_p],
    "logits": [nanmean(np.asarray(c)) for c in corr_l],
    "probs_per_head": [[nanmean(col) for col in np.asarray(c).T] if c else [] for c in corr_h],
    "salient_top_k": int(corr_top_k),
  }
  return {
    "outliers": outliers,
    "lambda": lam,
    "correlation": correlation,
    "negative_mass": [float(np.mean(n)) for n in neg],
  }


SQRT2 = float(np.sqrt(2.0))


def mechanisms(runner: ModelRunner, batches: Sequence[Any]) -> dict[str, Any]:
  """Attention sinks, context RMS and (DIFF V1) the per-head norm's magnification, per layer.

  Measured on ``batches`` (pipeline dicts or token arrays), every layer on the explicit-map path:
    sink: mean weight on the first token of the row's document over rows with at least one
      earlier token of their document (`measures.sink_mass`): "combined" is the map that
      weights the values (A, or A1 - lambda A2), "a1"/"a2" DIFF's two softmax maps;
    context_rms: the distribution (median, p99, max, mean) over tokens and heads of the RMS
      of the attention output before any norm or projection;
    relative_context_rms: the same divided by the RMS of the values the row can see
      (`measures.visible_value_rms`);
    bounded_context_rms: divided instead by the largest RMS among those values
      (`measures.largest_visible_value_rms`): at most 1 for the Transformer (a convex mix), at
      most 1 + sigma(lambda) < 2 for DIFF V2; ``above_sqrt2`` is the fraction of token-heads
      above sqrt(2), the bound the V2 write-up derives for equal-RMS orthogonal values;
    norm_magnification (DIFF V1 with its norm): 1 / sqrt(ms + eps), the factor the per-head
      RMSNorm scales each head output by;
    gradient_magnification (DIFF V1): ||dL/d(norm input)|| / ||dL/d(norm output)|| per token
      and head, L the mean next-token loss of the batch.
  Returns {"arm", "layers": [...], "summary": {...}} (summary pools the layers).
  """
  arm = runner.config.attention
  cfg = runner.config
  v1_norm = arm == "diff_v1" and cfg.diff_use_norm
  acc: list[dict[str, list]] | None = None
  for batch in batches:
    inputs, targets, pos, seg, mask = _split_batch(batch)
    starts = M.document_starts(seg, pos, inputs.shape)
    rows = M.sink_rows(starts)
    layers = runner.mechanism_pass(inputs, pos, seg, starts)
    grads = runner.norm_gradients(inputs, targets, pos, seg, mask) if arm == "diff_v1" else None
    if acc is None:
      acc = [
        {k: [] for k in ("rows", "combined", "a1", "a2", "rms", "rel", "bound", "mag", "grad")}
        for _ in layers
      ]
    for li, layer in enumerate(layers):
      a = acc[li]
      a["rows"].append(rows)
      a["combined"].append(layer["sink_combined"])
      if "sink1" in layer:
        a["a1"].append(layer["sink1"])
        a["a2"].append(layer["sink2"])
      ctx_rms = M.rms(layer["context"])
      a["rms"].append(ctx_rms)
      a["rel"].append(ctx_rms / np.maximum(layer["value_rms"][..., None], 1e-30))
      a["bound"].append(ctx_rms / np.maximum(layer["value_rms_max"][..., None], 1e-30))
      if v1_norm:
        a["mag"].append(M.norm_magnification(layer["context"], cfg.diff_norm_eps))
      if grads is not None:
        a["grad"].append(M.gradient_ratio(*grads[li]))
  if acc is None:
    raise ValueError("mechanisms needs at least one batch.")
  out_layers = []
  pooled: dict[str, list[np.ndarray]] = {k: [] for k in ("rms", "rel", "bound", "mag", "grad")}
  for a in acc:
    rows = np.concatenate(a["rows"])
    sink = {"combined": M.sink_mass(np.concatenate(a["combined"]), rows)}
    if a["a1"]:
      sink["a1"] = M.sink_mass(np.concatenate(a["a1"]), rows)
      sink["a2"] = M.sink_mass(np.concatenate(a["a2"]), rows)
    rel = np.concatenate([x.reshape(-1) for x in a["rel"]])
    bound = np.concatenate([x.reshape(-1) for x in a["bound"]])
    layer = {
      "sink": sink,
      "context_rms": M.distribution(np.concatenate([x.reshape(-1) for x in a["rms"]])),
      "relative_context_rms": M.distribution(rel),
      "bounded_context_rms": M.distribution(bound),
      "above_sqrt2": float(np.mean(bound > SQRT2)),
    }
    for key, name in (("mag", "norm_magnification"), ("grad", "gradient_magnification")):
      if a[key]:
        values = np.concatenate([x.reshape(-1) for x in a[key]])
        layer[name] = M.distribution(values)
        pooled[key].append(values)
    pooled["rms"].append(np.concatenate([x.reshape(-1) for x in a["rms"]]))
    pooled["rel"].append(rel)
    pooled["bound"].append(bound)
    out_layers.append(layer)
  summary = {
    "sink_combined": float(np.mean([l["sink"]["combined"]["mean"] for l in out_layers])),
    "context_rms": M.distribution(np.concatenate(pooled["rms"])),
    "relative_context_rms": M.distribution(np.concatenate(pooled["rel"])),
    "bounded_context_rms": M.distribution(np.concatenate(pooled["bound"])),
    "above_sqrt2": float(np.mean(np.concatenate(pooled["bound"]) > SQRT2)),
  }
  if "a1" in out_layers[0]["sink"]:
    summary["sink_a1"] = float(np.mean([l["sink"]["a1"]["mean"] for l in out_layers]))
    summary["sink_a2"] = float(np.mean([l["sink"]["a2"]["mean"] for l in out_layers]))
  if pooled["mag"]:
    summary["norm_magnification"] = M.distribution(np.concatenate(pooled["mag"]))
  if pooled["grad"]:
    summary["gradient_magnification"] = M.distribution(np.concatenate(pooled["grad"]))
  return {"arm": arm, "layers": out_layers, "summary": summary}


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
  return {
    "mean": float(v.mean()),
    "std": float(v.std()),
    "quantiles": {f"{q:g}": float(np.quantile(v, q)) for q in qs},
    "histogram": {"counts": hist.tolist(), "edges": edges.tolist()},
  }


def lowbit_settings(cfg: EvalConfig) -> dict[str, dict[str, float]]:
  """Knobs of each low-bit setting (weights are handled separately: see `low_bit`)."""
  out = {"float": {}}
  out.update({f"logits{b}": {"logits_bits": b} for b in cfg.lowbit_bits})
  out[f"w{cfg.weight_bits}a{cfg.activation_bits}"] = {"act_bits": cfg.activation_bits}
  out[f"kv{cfg.kv_bits}"] = {"kv_bits": cfg.kv_bits}
  out[f"w{cfg.weight_bits}a{cfg.activation_bits}_kv{cfg.kv_bits}"] = {
    "act_bits": cfg.activation_bits,
    "kv_bits": cfg.kv_bits,
  }
  return out


def low_bit(
  runner: ModelRunner, val_batches: Sequence[Any], task, cfg: EvalConfig, num_examples: int
) -> dict[str, Any]:
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
    out[name] = {
      "loss": validation_loss(fn, val_batches)["loss"],
      "accuracy": retrieval_accuracy(fn, task, num_examples, cfg.batch_size)["accuracy"],
    }
  out["delta"] = {
    name: {k: out[name][k] - out["float"][k] for k in ("loss", "accuracy")}
    for name in out
    if name != "float"
  }
  out["settings"] = {
    "logit_granularity": cfg.logit_granularity,
    "weight_bits": cfg.weight_bits,
    "activation_bits": cfg.activation_bits,
    "kv_bits": cfg.kv_bits,
    "quantize_head": cfg.quantize_head,
  }
  return out


def clamp_probe(
  runner: ModelRunner, val_batches: Sequence[Any], task, num_examples: int, batch_size: int = 8
) -> dict[str, Any]:
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
  return {
    "loss": l0,
    "loss_clamped": l1,
    "loss_delta": l1 - l0,
    "accuracy": a0,
    "accuracy_clamped": a1,
    "accuracy_delta": a1 - a0,
  }
