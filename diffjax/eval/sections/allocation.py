"""The "allocation" section: the attention that answer-predicting rows put on each region of the
context (sink, context, answer, query), per layer (paper Table 3), and the report's bars."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diffjax.data.tasks import REGION_NAMES, collate
from diffjax.eval import display, measures
from diffjax.eval.registry import DESCRIPTIVE, Section
from diffjax.eval.runner import ModelRunner, layer_maps
from diffjax.eval.scoring import chunks
from diffjax.eval.sections.context import Context

_MAP_NAMES = ("probs", "logits", "probs1", "probs2", "logits1", "logits2")


def attention_rows(
  runner: ModelRunner, tokens_BxT, idx_BxR
) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
  """Logits and, per layer, attention rows `idx_BxR` of every map: probs/logits (transformer)
  or probs1/probs2/logits1/logits2 and the combined map (B, H, R, S); lambda; lambda_init."""

  def build():
    def f(state, tokens_BxT, idx_BxR):
      logits_BxTxV, caps = runner.merge(state)(tokens_BxT, capture=True)
      # [B, H, T, S] -> [B, H, R, S]: the selected query rows of a map.
      take = lambda x_BxHxTxS: jnp.take_along_axis(x_BxHxTxS, idx_BxR[:, None, :, None], axis=2)
      out = []
      for cap in caps:
        layer = {k: take(v) for k, v in cap.items() if k in _MAP_NAMES}
        layer["combined"] = take(layer_maps(cap)["combined"])
        if "lambda" in cap:
          lam = cap["lambda"]  # a scalar (DIFF V1) or [B, T, H] (DIFF V2)
          layer["lambda"] = (
            lam if lam.ndim == 0 else jnp.take_along_axis(lam, idx_BxR[:, :, None], axis=1)
          )
        if "lambda_init" in cap:
          layer["lambda_init"] = cap["lambda_init"]
        out.append(layer)
      return logits_BxTxV, out

    return jax.jit(f)

  logits, layers = runner.compiled("rows", build)(
    runner.state, jnp.asarray(tokens_BxT), jnp.asarray(idx_BxR)
  )
  return np.asarray(logits), jax.tree.map(np.asarray, layers)


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
  for chunk in chunks(num_examples, batch_size):
    exs = task.examples(chunk)
    batch = collate(exs, pad_id=int(task.tokenizer.pad_id))
    idx_BxR, ok_BxR = _row_index(batch["prediction_rows"])
    _, layers = attention_rows(runner, batch["tokens"], idx_BxR)
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
  res = measures.attention_allocation(attn_BxHxRxS, ok_BxR, regions_BxS, len(REGION_NAMES))
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


def run(context: Context) -> dict[str, Any]:
  cfg = context.config
  return attention_allocation_by_layer(
    context.runner, context.standard_task, cfg.allocation_examples, cfg.capture_batch_size
  )


def scalars(result: Mapping[str, Any]) -> dict[str, float]:
  summary, names = result["summary"], result["regions"]
  return {
    f"allocation/{region}_{key}": summary[key][names.index(region)]
    for key in ("signed_share", "abs_share")
    for region in ("answer", "context")
  }


def plot(plt, groups, colors, out_dir):
  """allocation.png: signed and absolute share per region, bars per arm."""
  rows = {}
  for arm, rs in groups.items():
    al = [display.section_result(r, "allocation") for r in rs]
    al = [a for a in al if a]
    if al:
      rows[arm] = {
        k: np.asarray([a["summary"][k] for a in al], float) for k in ("signed_share", "abs_share")
      }
      rows[arm]["names"] = al[0]["regions"]
  if not rows:
    return None
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
  width = 0.8 / len(rows)
  for ax, key in zip(axes, ("signed_share", "abs_share")):
    for i, (arm, d) in enumerate(rows.items()):
      mean, lo, hi = display.band(d[key])
      x = np.arange(len(d["names"])) + i * width - 0.4 + width / 2
      yerr = None if lo is None else np.vstack([mean - lo, hi - mean])
      ax.bar(
        x,
        mean,
        width,
        yerr=yerr,
        color=colors[arm],
        label=f"{arm} (n={d[key].shape[0]})",
        capsize=3,
      )
    ax.set_xticks(range(len(d["names"])), d["names"])
    ax.axhline(0, color="black", lw=0.6)
    ax.set_title("signed share (sums to 1)" if key == "signed_share" else "absolute share")
    ax.grid(axis="y", alpha=0.3)
  axes[0].set_ylabel("attention of answer-predicting rows")
  axes[0].legend(fontsize=8)
  return display.save(
    fig,
    out_dir,
    "allocation.png",
    "Attention allocation by region, mean over layers and seeds "
    "(error bars: 95% t interval; range at n=2).",
  )


SECTION = Section(
  name="allocation",
  run=run,
  scalars=scalars,
  directions={"allocation/*": DESCRIPTIVE},
  headline=("allocation/answer_signed_share", "allocation/context_signed_share"),
  plot=plot,
)
