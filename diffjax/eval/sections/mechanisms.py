"""The "mechanisms" section: attention sinks, context RMS and, for DIFF V1, the per-head norm's
magnification of values and gradients, per layer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diffjax import arms
from diffjax.eval import measures
from diffjax.eval.registry import DESCRIPTIVE, Section
from diffjax.eval.runner import ModelRunner, causal_valid, layer_maps
from diffjax.eval.scoring import split_batch
from diffjax.eval.sections.context import Context

SQRT2 = float(np.sqrt(2.0))

# The per-token, per-head arrays gathered over batches, and the summary names of those pooled
# over layers.
_POOLED = {
  "rms": "context_rms",
  "rel": "relative_context_rms",
  "bound": "bounded_context_rms",
  "mag": "norm_magnification",
  "grad": "gradient_magnification",
}

# ----------------------------------------------------------------------------------------------
# What differs between the arms.


def _measures_norm_magnification(config) -> bool:
  """Whether the model has the per-head norm whose 1/RMS the section reports (an arm with a
  per-head norm, DIFF V1, with its norm on)."""
  return arms.get(config.attention).head_norm and config.diff_use_norm


def _norm_gradients(runner: ModelRunner, inputs, targets, positions, segment_ids, mask):
  """The gradients into and out of each layer's per-head norm (`ModelRunner.norm_gradients`)
  for an arm with one (DIFF V1), None for the others."""
  if not arms.get(runner.config.attention).head_norm:
    return None
  return runner.norm_gradients(inputs, targets, positions, segment_ids, mask)


# ----------------------------------------------------------------------------------------------
# The pass and the statistics.


def mechanism_pass(
  runner: ModelRunner, tokens_BxT, positions_BxT, segment_ids_BxT, starts_BxT
) -> list[dict[str, np.ndarray]]:
  """Per layer: each row's weight on its document's first token (``starts_BxT``) in the
  combined map (``sink_combined`` [B, H, T]) and, for DIFF, in A1 and A2 (``sink1``,
  ``sink2``); the attention output before any norm (``context`` [B, T, H, Dv]), the
  RMS of the values each row can see (``value_rms`` [B, T]) and the largest RMS among them
  (``value_rms_max`` [B, T], over keys and kv heads)."""

  def build():
    def f(state, tokens_BxT, positions_BxT, segment_ids_BxT, starts_BxT):
      _, caps = runner.merge(state)(tokens_BxT, positions_BxT, segment_ids_BxT, capture=True)
      t = tokens_BxT.shape[1]
      valid_BxTxS = jnp.broadcast_to(
        causal_valid(t, t, segment_ids_BxT)[:, 0], (tokens_BxT.shape[0], t, t)
      ).astype(jnp.float32)
      out = []
      for cap in caps:
        layer = {
          "sink_combined": measures.first_token_weight(layer_maps(cap)["combined"], starts_BxT),
          "context": cap["context"].astype(jnp.float32),
        }
        if "probs1" in cap:
          layer["sink1"] = measures.first_token_weight(cap["probs1"], starts_BxT)
          layer["sink2"] = measures.first_token_weight(cap["probs2"], starts_BxT)
        ms_BxSxK = jnp.mean(jnp.square(cap["values"].astype(jnp.float32)), axis=3)
        layer["value_rms"] = jnp.sqrt(
          jnp.einsum("bts,bs->bt", valid_BxTxS, ms_BxSxK.mean(2))
          / jnp.maximum(valid_BxTxS.sum(-1), 1.0)
        )
        layer["value_rms_max"] = jnp.sqrt(
          jnp.max(valid_BxTxS * ms_BxSxK.max(2)[:, None, :], axis=-1)
        )
        out.append(layer)
      return out

    return jax.jit(f)

  return runner.run_pass(
    "mechanisms", build, tokens_BxT, positions_BxT, segment_ids_BxT, starts_BxT
  )


def _add_layer(acc: dict[str, list], layer, rows, grads, v1_norm: bool, norm_eps: float) -> None:
  """Adds one layer's arrays of a batch to its accumulator."""
  acc["rows"].append(rows)
  acc["combined"].append(layer["sink_combined"])
  if "sink1" in layer:
    acc["a1"].append(layer["sink1"])
    acc["a2"].append(layer["sink2"])
  ctx_rms = measures.rms(layer["context"])
  acc["rms"].append(ctx_rms)
  acc["rel"].append(ctx_rms / np.maximum(layer["value_rms"][..., None], 1e-30))
  acc["bound"].append(ctx_rms / np.maximum(layer["value_rms_max"][..., None], 1e-30))
  if v1_norm:
    acc["mag"].append(measures.norm_magnification(layer["context"], norm_eps))
  if grads is not None:
    acc["grad"].append(measures.gradient_ratio(*grads))


def _flat(arrays: Sequence[np.ndarray]) -> np.ndarray:
  return np.concatenate([x.reshape(-1) for x in arrays])


def _context_stats(flat: Mapping[str, np.ndarray]) -> dict[str, Any]:
  """The context-RMS distributions of the per-token arrays ``flat`` (keys of `_POOLED`) and the
  fraction of token-heads above sqrt(2)."""
  return {
    "context_rms": measures.distribution(flat["rms"]),
    "relative_context_rms": measures.distribution(flat["rel"]),
    "bounded_context_rms": measures.distribution(flat["bound"]),
    "above_sqrt2": float(np.mean(flat["bound"] > SQRT2)),
  }


def _magnification_stats(flat: Mapping[str, np.ndarray]) -> dict[str, Any]:
  """The distributions of the per-head norm's magnifications, those ``flat`` has."""
  return {_POOLED[key]: measures.distribution(flat[key]) for key in ("mag", "grad") if key in flat}


def _finish_layer(acc: dict[str, list]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """One layer's results, and its flattened per-token arrays (keys of `_POOLED`)."""
  rows = np.concatenate(acc["rows"])
  sink = {"combined": measures.sink_mass(np.concatenate(acc["combined"]), rows)}
  if acc["a1"]:
    sink["a1"] = measures.sink_mass(np.concatenate(acc["a1"]), rows)
    sink["a2"] = measures.sink_mass(np.concatenate(acc["a2"]), rows)
  flat = {key: _flat(acc[key]) for key in _POOLED if acc[key]}
  layer = {"sink": sink, **_context_stats(flat), **_magnification_stats(flat)}
  return layer, flat


def _summary(layers: list[dict[str, Any]], pooled: dict[str, list[np.ndarray]]) -> dict[str, Any]:
  """The layers pooled: mean sink masses and the distributions over every layer's tokens."""
  sinks = {
    name: float(np.mean([l["sink"][name]["mean"] for l in layers])) for name in layers[0]["sink"]
  }
  diff_sinks = {f"sink_{name}": sinks[name] for name in ("a1", "a2") if name in sinks}
  flat = {key: np.concatenate(arrays) for key, arrays in pooled.items() if arrays}
  return {
    "sink_combined": sinks["combined"],
    **_context_stats(flat),
    **diff_sinks,
    **_magnification_stats(flat),
  }


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
  cfg = runner.config
  v1_norm = _measures_norm_magnification(cfg)
  acc: list[dict[str, list]] | None = None
  for batch in batches:
    inputs, targets, pos, seg, mask = split_batch(batch)
    starts = measures.document_starts(seg, pos, inputs.shape)
    rows = measures.sink_rows(starts)
    layers = mechanism_pass(runner, inputs, pos, seg, starts)
    grads = _norm_gradients(runner, inputs, targets, pos, seg, mask)
    if acc is None:
      acc = [{k: [] for k in ("rows", "combined", "a1", "a2", *_POOLED)} for _ in layers]
    for li, layer in enumerate(layers):
      layer_grads = None if grads is None else grads[li]
      _add_layer(acc[li], layer, rows, layer_grads, v1_norm, cfg.diff_norm_eps)
  if acc is None:
    raise ValueError("mechanisms needs at least one batch.")
  out_layers = []
  pooled: dict[str, list[np.ndarray]] = {k: [] for k in _POOLED}
  for a in acc:
    layer, flat = _finish_layer(a)
    out_layers.append(layer)
    for key, values in flat.items():
      pooled[key].append(values)
  return {"arm": cfg.attention, "layers": out_layers, "summary": _summary(out_layers, pooled)}


# ----------------------------------------------------------------------------------------------
# The section.


def run(context: Context) -> dict[str, Any]:
  return mechanisms(context.runner, context.capture_batches[: context.config.mechanism_batches])


def scalars(result: Mapping[str, Any]) -> dict[str, float]:
  summary = result["summary"]
  out = {
    f"mechanisms/{key}": summary[key]
    for key in ("sink_combined", "sink_a1", "sink_a2", "above_sqrt2")
    if key in summary
  }
  for key in _POOLED.values():
    if key in summary:
      for stat in ("median", "p99", "max"):
        out[f"mechanisms/{key}_{stat}"] = summary[key][stat]
  return out


SECTION = Section(
  name="mechanisms",
  run=run,
  scalars=scalars,
  directions={"mechanisms/*": DESCRIPTIVE},
  needs_validation=True,  # it measures the validation rows (in capture-sized batches)
)
