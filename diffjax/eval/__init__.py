"""Evaluation: retrieval scoring, measures on arrays, statistics over seeds, and reports.

The synthetic retrieval tasks (multi-needle retrieval in real text and associative recall with
distractors) live in `diffjax.data.tasks`, since they are training sources as well; their names
are importable from here too.

Modules:
  * `measures`: pure array functions (exact match, attention allocation, outliers, absmax
    quantization, the clamp and correlation probes).
  * `stats`: t intervals over seeds, paired t-tests against the Transformer, verdicts in words.
  * `scoring`: loss and retrieval accuracy of any tokens -> logits function.
  * `runner`: `ModelRunner`, jitted passes of one NNX model (hooks, knobs, captured rows) and
    weight quantization.
  * `analysis`: attention allocation, outliers, lambda, the probes, low-bit robustness.
  * `config`: `EvalConfig`, sizes and sections (`EvalConfig.quick`, `EvalConfig.full`).
  * `evaluate`: `evaluate_model`, everything into one JSON; `command`: `python -m diffjax.eval
    --workdir=RUN [--out=PATH] [--quick]`.
  * `aggregate`: eval scalars of arms x seeds pooled (means with t intervals, paired
    differences against the baseline arm, verdicts); `plots`: the report's PNGs.
  * `report`: report.md and plots from the eval JSONs of arms x seeds;
    `python -m diffjax.eval.report RUN_DIR ... --out=DIR`.

Eval JSON (one file per run, written by the CLI to <workdir>/eval.json, schema "diffjax.eval/1"):

    {
      "schema": "diffjax.eval/1",
      "meta": {"arm": "transformer" | "diff_v1" | "diff_v2", "seed": int | null,
               "workdir": str, "step": int | null, "quick": bool,
               "model": {ModelConfig fields}, "eval_config": {EvalConfig fields},
               "seconds": {section: seconds}},
      "scalars": {name: number},      # flat summary; the report aggregates these over seeds
      "sections": {                   # full results, each optional
        "validation": {"loss", "perplexity", "tokens"},
        "retrieval":  {"context_len", "cells": {"N4_R2": acc}, "by_depth": {cell: {depth: acc}},
                       "mean"},
        "heatmap":    {"lengths": [L], "depths": [D], "accuracy": [[D x L]],
                       "mean_by_length": [L], "mean", "needles": [N, R]},
        "mqar":       {"accuracy", "all_correct", "num_answers", "num_examples",
                       "sequence_len", "task"},
        "mqar_grid":  {"cells": {"P8_D2": {"accuracy", "all_correct", "sequence_len",
                                           "settings"}}, "order": [cell names], "num_examples"},
        "allocation": {"regions": ["sink", "context", "answer", "query"],
                       "layers": [{"signed_share": [4], "abs_share": [4], "signed": [4],
                                   "absolute": [4], "row_total"}],
                       "summary": {same keys, mean over layers}, "by_depth": {depth: summary},
                       "num_examples"},
        "text":       {"outliers": {"attention_logits": {"top1", "top100", "median", "count",
                                                         "exact_median"},
                                    "hidden": {...}, "layers": [{"logits_top1", ...}]},
                       "lambda": {"kind": "scalar", "layers": [l], "lambda_init": [l]}
                               | {"kind": "sigmoid", "layers": [{"mean", "std", "quantiles",
                                                                 "histogram", "per_head_mean"}]}
                               | {"kind": "none"},
                       "correlation": {"kind": "a1_a2" | "head_pairs", "probs": [per layer],
                                       "logits": [per layer],
                                       "probs_per_head": [per layer [per head]],
                                       "salient_top_k"},
                       "negative_mass": [per layer]},
        "lowbit":     {"float" | "logits16" | ... | "w4a8" | "kv4" | "w4a8_kv4":
                          {"loss", "accuracy"},
                       "delta": {setting: {"loss", "accuracy"}}, "settings": {...}},
        "probes":     {"loss", "loss_clamped", "loss_delta", "accuracy", "accuracy_clamped",
                       "accuracy_delta"}
      }
    }

Scalar names: val/loss, val/perplexity, retrieval/N{n}_R{r}, retrieval/mean, heatmap/len{L},
heatmap/mean, mqar/accuracy, mqar_grid/P{p}_D{d}, mqar_grid/mean,
allocation/{answer,context}_{signed,abs}_share,
outliers/{attention_logits,hidden}_{top1,top100,median}, probe/map_correlation_mean,
probe/negative_mass_mean, lambda/mean, lowbit/{setting}/{loss,accuracy},
probe/clamp_loss_delta, probe/clamp_accuracy_delta.
"""

from diffjax.data.tasks import (
  DEPTHS,
  NEEDLE_GRID,
  REGION_NAMES,
  AssociativeRecallTask,
  ContextTooShort,
  MultiNeedleTask,
  RetrievalExample,
  collate,
)
from diffjax.eval import measures, stats
from diffjax.eval.measures import (
  OutlierAccumulator,
  answer_exact_match,
  attention_allocation,
  clamp_negative,
  combine_diff_maps,
  map_correlation,
  outlier_stats,
  quantize_absmax,
  quantize_activation_per_token,
  quantize_attention_logits,
  quantize_kv_per_head_token,
  quantize_weight_per_channel,
  retrieval_accuracy,
  salient_key_mask,
)
from diffjax.eval.stats import mean_ci, paired_difference, t_cdf, t_ppf, verdict

__all__ = [
  "measures",
  "stats",
  "OutlierAccumulator",
  "answer_exact_match",
  "attention_allocation",
  "clamp_negative",
  "combine_diff_maps",
  "map_correlation",
  "outlier_stats",
  "quantize_absmax",
  "quantize_activation_per_token",
  "quantize_attention_logits",
  "quantize_kv_per_head_token",
  "quantize_weight_per_channel",
  "retrieval_accuracy",
  "salient_key_mask",
  "mean_ci",
  "paired_difference",
  "t_cdf",
  "t_ppf",
  "verdict",
  "DEPTHS",
  "NEEDLE_GRID",
  "REGION_NAMES",
  "AssociativeRecallTask",
  "ContextTooShort",
  "MultiNeedleTask",
  "RetrievalExample",
  "collate",
]
