"""The "lowbit" section: loss and retrieval accuracy under quantization (attention logits only,
paper Figure 8; weights and activations; the KV cache), and the report's plot of the loss with
only the attention logits quantized."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from diffjax.eval import display
from diffjax.eval.config import EvalConfig
from diffjax.eval.registry import HIGHER_IS_BETTER, LOWER_IS_BETTER, Section
from diffjax.eval.runner import ModelRunner
from diffjax.eval.scoring import retrieval_accuracy, validation_loss
from diffjax.eval.sections.context import Context


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


def run(context: Context) -> dict[str, Any]:
  return low_bit(
    context.runner,
    context.val_batches,
    context.standard_task,
    context.config,
    context.standard_examples,
  )


def scalars(result: Mapping[str, Any]) -> dict[str, float]:
  out = {}
  for name, v in result.items():
    if name in ("delta", "settings"):
      continue
    out[f"lowbit/{name}/loss"] = v["loss"]
    out[f"lowbit/{name}/accuracy"] = v["accuracy"]
  # The loss each quantization adds to the same model's float loss: paired across arms by
  # seed, this is the robustness question itself.
  for name, d in result.get("delta", {}).items():
    out[f"lowbit/{name}/loss_increase"] = d["loss"]
  return out


def plot(plt, groups, colors, out_dir):
  """lowbit.png: validation loss against the attention-logit bits, one line per arm."""
  series = {}
  for arm, rs in groups.items():
    lbs = [display.section_result(r, "lowbit") for r in rs]
    lbs = [lb for lb in lbs if lb]
    if not lbs:
      continue
    bits = sorted({int(k[len("logits") :]) for k in lbs[0] if k.startswith("logits")}, reverse=True)
    if bits:
      vals = np.asarray(
        [[lb.get(f"logits{b}", {}).get("loss", np.nan) for b in bits] for lb in lbs]
      )
      base = np.asarray([lb["float"]["loss"] for lb in lbs])
      series[arm] = (bits, vals, base)
  if not series:
    return None
  fig, ax = plt.subplots(figsize=(6, 3.8))
  for arm, (bits, vals, base) in series.items():
    mean, lo, hi = display.band(vals)
    yerr = None if lo is None else np.vstack([mean - lo, hi - mean])
    ax.errorbar(
      [str(b) for b in bits],
      mean,
      yerr=yerr,
      color=colors[arm],
      marker="o",
      capsize=3,
      label=f"{arm} (float {np.mean(base):.3f}, n={len(vals)})",
    )
  display.label_axes(
    ax,
    "attention-logit bits (absmax)",
    "validation loss",
    "Loss with only the attention logits quantized",
  )
  return display.save(
    fig,
    out_dir,
    "lowbit.png",
    "Validation loss when only attention logits are quantized (mean over seeds).",
  )


SECTION = Section(
  name="lowbit",
  run=run,
  scalars=scalars,
  directions={
    "lowbit/*/loss": LOWER_IS_BETTER,
    "lowbit/*/loss_increase": LOWER_IS_BETTER,
    "lowbit/*/accuracy": HIGHER_IS_BETTER,
  },
  needs_validation=True,
  plot=plot,
)
