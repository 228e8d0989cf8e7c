"""The "text" section: on validation text, the outliers of attention logits and hidden states
(paper Table 5), lambda of every layer, the correlation of the two maps over non-salient keys and
the negative mass of the combined map; the report's plot of lambda per layer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diffjax import arms
from diffjax.eval import display, measures
from diffjax.eval.registry import DESCRIPTIVE, Section
from diffjax.eval.runner import ModelRunner, causal_valid, layer_maps
from diffjax.eval.scoring import split_batch
from diffjax.eval.sections.context import Context

# ----------------------------------------------------------------------------------------------
# What differs between the arms.


def _paired_maps(arm: str, layer: Mapping[str, np.ndarray]) -> tuple[np.ndarray, ...]:
  """The maps the correlation probe pairs at the sampled rows, (a1, a2, logits1, logits2) each
  [B, H', R, S]: A1 and A2 of each DIFF head, or for an arm with one map per head (the
  Transformer) its query heads 2i and 2i+1 as would-be pairs (a control)."""
  if arms.get(arm).maps == 1:
    probs_BxHxRxS, logits_BxHxRxS = layer["probs"], layer["logits"]
    h2 = probs_BxHxRxS.shape[1] // 2 * 2
    return (
      probs_BxHxRxS[:, 0:h2:2],
      probs_BxHxRxS[:, 1:h2:2],
      logits_BxHxRxS[:, 0:h2:2],
      logits_BxHxRxS[:, 1:h2:2],
    )
  return layer["probs1"], layer["probs2"], layer["logits1"], layer["logits2"]


def _pairing_kind(arm: str) -> str:
  """The JSON's name for what `_paired_maps` pairs."""
  return "head_pairs" if arms.get(arm).maps == 1 else "a1_a2"


# The kinds of the per-token lambda distribution (an arm whose `lambda_report` is "sigmoid"):
# squashed into (0, 1), or the unsquashed projection of a `v2_lambda="identity"` model.
_PER_TOKEN_KINDS = ("sigmoid", "identity")


def _per_token_kind(config: Any) -> str:
  """ "identity" for a model whose per-token lambda has no sigmoid (`v2_lambda="identity"`),
  else "sigmoid"."""
  return "identity" if getattr(config, "v2_lambda", "sigmoid") == "identity" else "sigmoid"


def _lambda_summary(runner: ModelRunner, lam_values: list[list[np.ndarray]]) -> dict[str, Any]:
  """lambda per layer, as the arm reports it (:attr:`diffjax.arms.ArmSpec.lambda_report`):
  one scalar per layer (DIFF V1, with its per-layer constants such as lambda_init), the
  distribution of lambda over tokens and heads (DIFF V2: "sigmoid", or "identity" for a model
  with `v2_lambda="identity"`, whose lambda is unbounded), or {"kind": "none"}."""
  arm = arms.get(runner.config.attention)
  if arm.lambda_report == "scalar":
    constants = arm.layer_constants(runner.config)
    return {
      "kind": "scalar",
      "layers": [float(v[0][0]) for v in lam_values],
      **{name: [float(x) for x in values] for name, values in constants.items()},
    }
  if arm.lambda_report == "sigmoid":
    kind = _per_token_kind(runner.config)
    layers = [_distribution(np.concatenate(v), unit=kind == "sigmoid") for v in lam_values]
    heads = runner.config.num_heads
    for li, v in enumerate(lam_values):
      layers[li]["per_head_mean"] = np.concatenate(v).reshape(-1, heads).mean(0).tolist()
    return {"kind": kind, "layers": layers}
  return {"kind": "none"}


# ----------------------------------------------------------------------------------------------
# The pass and the statistics.


def text_pass(
  runner: ModelRunner, tokens_BxT, positions_BxT, segment_ids_BxT, sample_idx_N, row_idx_BxR, k
) -> list[dict[str, np.ndarray]]:
  """Per layer: top-k |attention logits| over valid entries, |logits| at flat (t*S + s)
  indices `sample_idx_N`, |hidden|, lambda, and maps at rows `row_idx_BxR`."""

  def build():
    def f(state, tokens_BxT, positions_BxT, segment_ids_BxT, sample_idx_N, row_idx_BxR):
      _, caps = runner.merge(state)(tokens_BxT, positions_BxT, segment_ids_BxT, capture=True)
      b, t = tokens_BxT.shape
      valid_Bx1xTxT = causal_valid(t, t, segment_ids_BxT)
      # [B, H, T, S] -> [B, H, R, S]: the selected query rows of a map.
      take = lambda x_BxHxTxS: jnp.take_along_axis(x_BxHxTxS, row_idx_BxR[:, None, :, None], axis=2)
      out = []
      for cap in caps:
        maps = layer_maps(cap)
        tops, samples = [], []
        for logits_BxHxTxT in maps["logits"]:
          # Masked entries become -1, below every |logit|, so top_k never picks them.
          abs_BxHxTxT = jnp.where(valid_Bx1xTxT, jnp.abs(logits_BxHxTxT), -1.0)
          tops.append(jax.lax.top_k(abs_BxHxTxT.reshape(-1), k)[0])
          flat_BxHxTT = abs_BxHxTxT.reshape(b, abs_BxHxTxT.shape[1], t * t)
          samples.append(flat_BxHxTT[:, :, sample_idx_N].reshape(-1))
        layer = {
          "logit_top": jnp.concatenate(tops),
          "logit_sample": jnp.concatenate(samples),
          "hidden": cap["hidden"],
          "combined": take(maps["combined"]),
        }
        for name in ("probs1", "probs2", "logits1", "logits2", "probs", "logits"):
          if name in cap:
            layer[name] = take(cap[name])
        if "lambda" in cap:
          layer["lambda"] = cap["lambda"]
        out.append(layer)
      return out

    return jax.jit(f)

  return runner.run_pass(
    ("text", k), build, tokens_BxT, positions_BxT, segment_ids_BxT, sample_idx_N, row_idx_BxR
  )


def _text_rows(t: int, count: int, rng: np.random.Generator) -> np.ndarray:
  """`count` distinct row positions from the second half of a length-t window (rows with many
  keys make correlations meaningful)."""
  lo = t // 2
  count = min(count, t - lo)
  return np.sort(rng.choice(np.arange(lo, t), count, replace=False)).astype(np.int32)


def _row_key_valid(rows_BxR, t: int, seg_BxT=None) -> np.ndarray:
  """(B, R, S) keys a row at position rows[b, r] may attend to (causal, same document)."""
  ok = np.arange(t)[None, None, :] <= rows_BxR[:, :, None]
  if seg_BxT is not None:
    row_seg = np.take_along_axis(seg_BxT, rows_BxR, axis=1)
    ok &= seg_BxT[:, None, :] == row_seg[:, :, None]
  return ok


def _distribution(v: np.ndarray, unit: bool = True) -> dict[str, Any]:
  """Mean, std, quantiles and a 20-bin histogram of `v`: binned over [0, 1] when `unit` and
  every value lies there (a sigmoid's output), else over the values' own range, so that every
  value is counted."""
  qs = (0.05, 0.25, 0.5, 0.75, 0.95)
  unit = unit and v.size > 0 and 0.0 <= float(v.min()) and float(v.max()) <= 1.0
  hist, edges = np.histogram(v, bins=20, range=(0.0, 1.0) if unit else None)
  return {
    "mean": float(v.mean()),
    "std": float(v.std()),
    "quantiles": {f"{q:g}": float(np.quantile(v, q)) for q in qs},
    "histogram": {"counts": hist.tolist(), "edges": edges.tolist()},
  }


class _Sums:
  """What `text_statistics` gathers over batches: outliers over all layers and per layer, and
  per layer the lambda values, correlations and negative masses of every batch."""

  def __init__(self, num_layers: int, k: int):
    self.logits = measures.OutlierAccumulator(ks=(1, k))
    self.hidden = measures.OutlierAccumulator(ks=(1, k))
    self.layer_logits = [measures.OutlierAccumulator(ks=(1,)) for _ in range(num_layers)]
    self.layer_hidden = [measures.OutlierAccumulator(ks=(1,)) for _ in range(num_layers)]
    self.lam: list[list[np.ndarray]] = [[] for _ in range(num_layers)]
    self.corr_probs: list[list[float]] = [[] for _ in range(num_layers)]
    self.corr_logits: list[list[float]] = [[] for _ in range(num_layers)]
    self.corr_heads: list[list[np.ndarray]] = [[] for _ in range(num_layers)]
    self.negative: list[list[float]] = [[] for _ in range(num_layers)]

  def outliers(self) -> dict[str, Any]:
    return {
      "attention_logits": self.logits.result(),
      "hidden": self.hidden.result(),
      "layers": [
        {
          "logits_top1": l.result()["top1"],
          "logits_median": l.result()["median"],
          "hidden_top1": h.result()["top1"],
          "hidden_median": h.result()["median"],
        }
        for l, h in zip(self.layer_logits, self.layer_hidden)
      ],
    }


def _add_outliers(sums: _Sums, li: int, layer, sample_N, valid_flat) -> None:
  """Adds one layer's attention-logit and hidden-state magnitudes of a batch."""
  # Entries that are not causally valid or cross documents come back as -1.
  top = layer["logit_top"]
  top = top[top >= 0]
  smp = layer["logit_sample"]
  smp = smp[smp >= 0]
  full_count = int(round(smp.size * valid_flat.size / max(sample_N.size, 1)))
  for acc in (sums.logits, sums.layer_logits[li]):
    acc.add_summary(top, smp, full_count, exact=sample_N.size == valid_flat.size)
  sums.hidden.add(layer["hidden"])
  sums.layer_hidden[li].add(layer["hidden"])


def _add_correlation(
  sums: _Sums, li: int, layer, arm: str, rows_BxR, key_ok_BxRxS, always_BxT, corr_top_k: int
) -> None:
  """Adds one layer's map correlation over non-salient keys at the sampled rows."""
  a1_BxHxRxS, a2_BxHxRxS, l1_BxHxRxS, l2_BxHxRxS = _paired_maps(arm, layer)
  if a1_BxHxRxS.shape[1] == 0:
    return
  salient_BxHxRxS = measures.salient_key_mask(
    a1_BxHxRxS, corr_top_k, always_BxT, row_positions_BxR=rows_BxR
  )
  keys_BxHxRxS = key_ok_BxRxS[:, None] & ~salient_BxHxRxS
  corr = measures.map_correlation(a1_BxHxRxS, a2_BxHxRxS, keys_BxHxRxS)
  sums.corr_probs[li].append(corr["mean"])
  sums.corr_heads[li].append(corr["per_head"])
  sums.corr_logits[li].append(
    measures.map_correlation(l1_BxHxRxS, l2_BxHxRxS, keys_BxHxRxS)["mean"]
  )


def _sink_keys(b: int, t: int, seg_BxT) -> np.ndarray:
  """(B, T) the keys always counted salient: the first token, and each document's first."""
  always_BxT = np.zeros((b, t), bool)
  always_BxT[:, 0] = True
  if seg_BxT is not None:
    always_BxT[:, 1:] |= seg_BxT[:, 1:] != seg_BxT[:, :-1]
  return always_BxT


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
      "per_head_mean"}]} ("kind": "identity" for `v2_lambda="identity"`: lambda unbounded, the
      histogram over its range); Transformer: {"kind": "none"}.
    correlation: per layer (and per head: probs_per_head) Pearson correlation of A1 and A2 over
      non-salient keys (DIFF), or of query heads 2i and 2i+1 (Transformer, a control: what a
      plain model's would-be pairs share). Salient keys: the top-`corr_top_k` keys of A1, the
      first token and the query itself (`measures.salient_key_mask`). Both on probabilities
      and on logits.
    negative_mass: per layer, mean over sampled rows and heads of the summed negative weights.
  """
  rng = np.random.default_rng(seed)
  arm = runner.config.attention
  sums: _Sums | None = None
  for batch in batches:
    inputs_BxT, _, positions_BxT, segment_ids_BxT, _ = split_batch(batch)
    b, t = inputs_BxT.shape
    valid_flat = np.flatnonzero(measures.causal_valid_mask(t, t).reshape(-1))
    sample_N = (
      valid_flat
      if valid_flat.size <= outlier_sample
      else np.sort(rng.choice(valid_flat, outlier_sample, replace=False))
    )
    rows_BxR = np.stack([_text_rows(t, probe_rows, rng) for _ in range(b)])
    layers = text_pass(
      runner, inputs_BxT, positions_BxT, segment_ids_BxT, sample_N.astype(np.int32), rows_BxR, k
    )
    sums = sums or _Sums(len(layers), k)
    seg_BxT = None if segment_ids_BxT is None else np.asarray(segment_ids_BxT)
    always_BxT = _sink_keys(b, t, seg_BxT)
    key_ok_BxRxS = _row_key_valid(rows_BxR, t, seg_BxT)
    for li, layer in enumerate(layers):
      _add_outliers(sums, li, layer, sample_N, valid_flat)
      if "lambda" in layer:
        sums.lam[li].append(np.asarray(layer["lambda"], np.float64).reshape(-1))
      _add_correlation(sums, li, layer, arm, rows_BxR, key_ok_BxRxS, always_BxT, corr_top_k)
      sums.negative[li].append(float(np.minimum(layer["combined"], 0).sum(-1).mean()))
  if sums is None:
    raise ValueError("text_statistics needs at least one batch.")
  nanmean = lambda xs: float(np.nanmean(xs)) if np.isfinite(xs).any() else float("nan")
  correlation = {
    "kind": _pairing_kind(arm),
    "probs": [nanmean(np.asarray(c)) for c in sums.corr_probs],
    "logits": [nanmean(np.asarray(c)) for c in sums.corr_logits],
    "probs_per_head": [
      [nanmean(col) for col in np.asarray(c).T] if c else [] for c in sums.corr_heads
    ],
    "salient_top_k": int(corr_top_k),
  }
  return {
    "outliers": sums.outliers(),
    "lambda": _lambda_summary(runner, sums.lam),
    "correlation": correlation,
    "negative_mass": [float(np.mean(n)) for n in sums.negative],
  }


# ----------------------------------------------------------------------------------------------
# The section.


def run(context: Context) -> dict[str, Any]:
  cfg = context.config
  return text_statistics(
    context.runner,
    context.capture_batches,
    outlier_sample=cfg.outlier_sample,
    probe_rows=cfg.probe_rows,
    corr_top_k=cfg.corr_top_k,
    seed=cfg.seed,
  )


def scalars(result: Mapping[str, Any]) -> dict[str, float]:
  out = {
    f"outliers/{what}_{stat}": result["outliers"][what][stat]
    for what in ("attention_logits", "hidden")
    for stat in ("top1", "top100", "median")
  }
  corr = [c for c in result["correlation"]["probs"] if c == c]  # NaN: no pair in that layer
  if corr:
    out["probe/map_correlation_mean"] = float(np.mean(corr))
  out["probe/negative_mass_mean"] = float(np.mean(result["negative_mass"]))
  lam = result["lambda"]
  if lam["kind"] == "scalar":
    out["lambda/mean"] = float(np.mean(lam["layers"]))
  elif lam["kind"] in _PER_TOKEN_KINDS:
    out["lambda/mean"] = float(np.mean([l["mean"] for l in lam["layers"]]))
  return out


def plot(plt, groups, colors, out_dir):
  """lambda.png: DIFF V1 lambda per layer (seeds and mean, with lambda_init) and DIFF V2
  lambda per layer (mean and the 5-95 % band over tokens): sigmoid(lambda) in [0, 1], or the
  unbounded lambda of `v2_lambda="identity"` runs, in a panel of their own."""
  panels = []
  for arm, rs in groups.items():
    lams = [(display.section_result(r, "text") or {}).get("lambda") for r in rs]
    for kind in ("scalar", *_PER_TOKEN_KINDS):
      same = [l for l in lams if l and l.get("kind") == kind]
      if same:
        panels.append((arm, kind, same))
  if not panels:
    return None
  fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
  for ax, (arm, kind, lams) in zip(axes[0], panels):
    if kind == "scalar":
      vals = np.asarray([l["layers"] for l in lams], float)
      layers = np.arange(vals.shape[1])
      for v in vals:
        ax.plot(layers, v, color=colors[arm], alpha=0.35, marker=".")
      ax.plot(layers, vals.mean(0), color=colors[arm], marker="o", label=f"lambda (n={len(vals)})")
      ax.plot(layers, lams[0]["lambda_init"], color="black", ls="--", label="lambda_init")
      ax.set_ylabel("lambda")
    else:
      layers = _plot_per_token(ax, lams, colors[arm])
      if kind == "sigmoid":
        ax.set_ylim(0, 1)
      ax.set_ylabel("sigmoid(lambda)" if kind == "sigmoid" else "lambda (no sigmoid)")
    ax.set_xlabel("layer")
    ax.set_xticks(layers)
    ax.set_title(arm if kind != "identity" else f"{arm}, identity lambda")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
  return display.save(
    fig,
    out_dir,
    "lambda.png",
    "DIFF V1 lambda per layer (thin lines: seeds) and DIFF V2 lambda on evaluation text "
    "(sigmoid(lambda), or lambda itself for runs without the sigmoid).",
  )


def _plot_per_token(ax, lams, color) -> np.ndarray:
  """Draws the mean of a per-token lambda per layer and its 5-95 % band; returns the layers."""
  means = np.asarray([[x["mean"] for x in l["layers"]] for l in lams], float)
  q05 = np.asarray([[x["quantiles"]["0.05"] for x in l["layers"]] for l in lams], float).mean(0)
  q95 = np.asarray([[x["quantiles"]["0.95"] for x in l["layers"]] for l in lams], float).mean(0)
  layers = np.arange(means.shape[1])
  ax.plot(layers, means.mean(0), color=color, marker="o", label=f"mean (n={len(means)})")
  ax.fill_between(layers, q05, q95, color=color, alpha=0.2, label="5-95% of tokens")
  return layers


SECTION = Section(
  name="text",
  run=run,
  scalars=scalars,
  directions={
    "outliers/*": DESCRIPTIVE,
    "probe/map_correlation_mean": DESCRIPTIVE,
    "probe/negative_mass_mean": DESCRIPTIVE,
    "lambda/mean": DESCRIPTIVE,
  },
  headline=("outliers/attention_logits_top1", "outliers/hidden_top1"),
  needs_validation=True,
  plot=plot,
)
