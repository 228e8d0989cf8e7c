"""Evaluation: the sections of `evaluate_model` (retrieval, attention allocation, outliers,
low-bit robustness, probes, ...), measures on arrays, statistics over seeds, and reports.

Each section is one module of `diffjax.eval.sections`, registered in order; importing this
package registers them. The eval JSON's schema, the sections and how to add one:
docs/evaluation.md. The synthetic retrieval tasks live in `diffjax.data.tasks` (they are
training sources as well); their names are importable from here too.
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
