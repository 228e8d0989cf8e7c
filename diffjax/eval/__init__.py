"""Evaluation: the sections of `evaluate_model`, measures on arrays, statistics, reports.

Importing this package registers the sections (one module each of `diffjax.eval.sections`); the
eval JSON, the sections and how to add one: docs/evaluation.md.
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
from diffjax.eval import measures, sections, stats
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
  "sections",
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
