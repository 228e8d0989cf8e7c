"""`EvalConfig`: sizes and settings of an evaluation run, and JSON conversion helpers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from diffjax.data.tasks import DEPTHS, NEEDLE_GRID
from diffjax.eval.registry import section_names

# The EvalConfig fields that count examples, rows or batches a section needs at least one of.
_POSITIVE = (
  "context_len",
  "batch_size",
  "capture_batch_size",
  "samples_per_depth",
  "allocation_examples",
  "mqar_examples",
  "outlier_sample",
  "probe_rows",
  "mechanism_batches",
)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Sizes and settings of `evaluate_model`. Lengths are in tokens.

  Attributes:
    context_len: length of the retrieval examples in the table, allocation, low-bit and probe
      runs; use the training sequence length (the CLI does).
    batch_size: examples per forward pass for retrieval and loss.
    capture_batch_size: examples per pass with attention maps captured.
    samples_per_depth: examples per (cell, depth); the paper uses 50 per cell.
    depths: answer-needle depths (fractions of the context).
    needle_grid: (N, R) cells of the retrieval table.
    heatmap_lengths: context lengths of the heatmap; include lengths above the training length
      to measure length generalisation. Empty: skip the heatmap.
    heatmap_needles: (N, R) of the heatmap (the paper's 64K figure uses (8, 1)).
    heatmap_samples: examples per heatmap cell (depth, length); None: samples_per_depth. The
      paper uses 50.
    standard_needles: (N, R) of the task used for allocation, low-bit and probes.
    allocation_examples: examples for attention allocation (spread over `depths`).
    mqar: AssociativeRecallTask keyword arguments; None skips it.
    mqar_examples: examples of associative recall (per cell of `mqar_grid` too).
    mqar_grid: cells of an associative-recall difficulty grid, each a dict of
      AssociativeRecallTask keyword arguments (e.g. num_pairs, distractors_per_query); every
      cell is scored on `mqar_examples` examples. Empty: skip the grid.
    probe_task: the task of attention allocation, low-bit accuracy and the clamp probe:
      "needle" (multi-needle retrieval in text, `standard_needles`) or "mqar" (associative
      recall with the `mqar` settings), for models trained on that task.
    val_batches: validation batches to use (the caller supplies them); 0: none, so the sections
      that score validation batches are skipped.
    outlier_sample: |logit| values kept per layer and batch for the median estimate.
    probe_rows: query rows per text example for the map-correlation probe.
    corr_top_k: top-k keys of A1 counted as salient in the correlation probe.
    lowbit_bits: bit widths for attention-logit quantization.
    logit_granularity: absmax scale granularity for logits ("head", "row", "tensor").
    weight_bits, activation_bits, kv_bits: the deployed-quantization setting (W4A8, KV4).
    quantize_head: also quantize the embedding table and LM head (off: they stay float, as
      usual for weight quantization).
    mechanism_batches: capture batches (of `capture_batch_size` validation rows) measured by
      the "mechanisms" section: attention-sink mass, context RMS and, for DIFF V1, the
      per-head norm's magnification of values and gradients.
    seed: seed of every synthetic task.
    sections: which evaluations to run, by name (`diffjax.eval.sections`); empty: every
      registered section.
    options: settings of sections by name, for a section that brings its own
      (`--config.options="{'top1': {'k': 5}}"`; a section reads its own with
      `context.options(name)`).
  """

  context_len: int = 512
  batch_size: int = 8
  capture_batch_size: int = 2
  samples_per_depth: int = 10
  depths: tuple[float, ...] = DEPTHS
  needle_grid: tuple[tuple[int, int], ...] = NEEDLE_GRID
  heatmap_lengths: tuple[int, ...] = ()
  heatmap_needles: tuple[int, int] = (4, 1)
  heatmap_samples: int | None = None
  standard_needles: tuple[int, int] = (4, 1)
  allocation_examples: int = 20
  mqar: Mapping[str, Any] | None = dataclasses.field(
    default_factory=lambda: dict(num_pairs=16, num_queries=4, distractors_per_query=1)
  )
  mqar_examples: int = 64
  mqar_grid: tuple[Mapping[str, Any], ...] = ()
  probe_task: str = "needle"
  val_batches: int = 8
  outlier_sample: int = 1 << 16
  probe_rows: int = 16
  corr_top_k: int = 4
  lowbit_bits: tuple[int, ...] = (16, 8, 6, 4)
  logit_granularity: str = "head"
  weight_bits: int = 4
  activation_bits: int = 8
  kv_bits: int = 4
  quantize_head: bool = False
  mechanism_batches: int = 4
  seed: int = 1234
  sections: tuple[str, ...] = ()
  options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    unknown = (set(self.sections) | set(self.options)) - set(section_names())
    if unknown:
      raise ValueError(
        f"Unknown eval sections {sorted(unknown)}; choose from {section_names()} "
        "(or register yours with diffjax.eval.sections.register first)."
      )
    if self.probe_task not in ("needle", "mqar"):
      raise ValueError(f"probe_task={self.probe_task!r} must be 'needle' or 'mqar'.")
    if self.probe_task == "mqar" and self.mqar is None:
      raise ValueError("probe_task='mqar' needs the mqar settings; set mqar=dict(num_pairs=...).")
    for cell in self.mqar_grid:
      if not isinstance(cell, Mapping) or "num_pairs" not in cell:
        raise ValueError(
          f"mqar_grid cell {cell!r} must be a dict of AssociativeRecallTask "
          "keyword arguments with at least num_pairs."
        )
    self._check_counts()
    if self.logit_granularity not in ("head", "row", "tensor"):
      raise ValueError(
        f"logit_granularity={self.logit_granularity!r} must be 'head', 'row' or 'tensor'."
      )

  def _check_counts(self) -> None:
    """Refuses sizes a section cannot run with: every count of examples, rows or batches that
    a section divides by or draws from must be positive. `val_batches` may be 0 (no validation:
    the sections that score validation batches are skipped)."""
    for name in _POSITIVE:
      value = getattr(self, name)
      if value < 1:
        raise ValueError(f"{name}={value} must be >= 1.")
    if self.heatmap_samples is not None and self.heatmap_samples < 1:
      raise ValueError(
        f"heatmap_samples={self.heatmap_samples} must be >= 1, or None for samples_per_depth."
      )
    if self.val_batches < 0:
      raise ValueError(f"val_batches={self.val_batches} must be >= 0 (0: no validation).")
    if self.corr_top_k < 0:
      raise ValueError(f"corr_top_k={self.corr_top_k} must be >= 0.")

  @classmethod
  def full(cls, seq_len: int, **overrides) -> EvalConfig:
    """Paper-sized settings around training length `seq_len`: 50 samples a cell, a heatmap at
    1/2, 1, 2 and 4 times the training length."""
    kw = dict(
      context_len=seq_len,
      samples_per_depth=10,
      allocation_examples=50,
      heatmap_lengths=tuple(sorted({max(seq_len // 2, 256), seq_len, 2 * seq_len, 4 * seq_len})),
    )
    kw.update(overrides)
    return cls(**kw)

  @classmethod
  def quick(cls, seq_len: int, **overrides) -> EvalConfig:
    """A smoke-sized evaluation: seconds per section, 1-2 minutes in all on a CPU; noisy numbers.

    Retrieval needs room for needles and a question, so contexts are at least 256 tokens even
    when the model trained on shorter windows (RoPE lets it run; it measures extrapolation)."""
    ctx = max(int(seq_len), 256)
    kw = dict(
      context_len=ctx,
      batch_size=5,
      capture_batch_size=2,
      samples_per_depth=1,
      needle_grid=((1, 1), (2, 2)),
      heatmap_lengths=(ctx, 2 * ctx),
      heatmap_needles=(2, 1),
      standard_needles=(2, 1),
      allocation_examples=5,
      mqar=dict(num_pairs=8, num_queries=2, distractors_per_query=1),
      mqar_examples=8,
      val_batches=2,
      outlier_sample=1 << 12,
      probe_rows=4,
      lowbit_bits=(8, 4),
    )
    kw.update(overrides)
    return cls(**kw)

  def to_dict(self) -> dict[str, Any]:
    return _jsonable(dataclasses.asdict(self))


def _jsonable(x):
  """Numpy scalars/arrays and tuples to plain JSON types; NaN stays float('nan')."""
  if isinstance(x, Mapping):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, np.ndarray) or hasattr(x, "__array__") and not isinstance(x, (str, bytes)):
    arr = np.asarray(x)
    return arr.item() if arr.ndim == 0 else arr.tolist()
  if isinstance(x, (np.floating, np.integer, np.bool_)):
    return x.item()
  return x
