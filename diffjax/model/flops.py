"""FLOPs per token of a model, from its config: what MFU divides by.

Model FLOPs count the math whatever runs it, hardware FLOPs add what ``remat`` recomputes; the
rules: docs/training.md#speed-mfu-and-where-the-time-goes.
"""

from __future__ import annotations

import dataclasses

from diffjax import arms, hardware
from diffjax.core.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
  """FLOPs per training token of one model at one sequence length.

  Attributes:
    matmul_forward: weight matmuls, forward (2 x matmul weights).
    attention_forward: attention scores and values, forward, at the average causal span.
    model: forward + backward of both (3x the forward): what MFU divides by.
    hardware: ``model`` plus what the model's ``remat`` policy recomputes.
  """

  matmul_forward: float
  attention_forward: float
  model: float
  hardware: float

  @property
  def forward(self) -> float:
    return self.matmul_forward + self.attention_forward


def matmul_weights(cfg: ModelConfig) -> int:
  """Weights that take part in a matmul per token: projections, MLP, LM head (or the tied
  embedding used as the head); not the norm gains, lambda vectors or the embedding lookup."""
  e = cfg.d_model
  attn = arms.get(cfg.attention).matmul_params(cfg)
  return cfg.num_layers * (attn + 3 * e * cfg.mlp_dim) + e * cfg.vocab_size


def attention_flops_per_pair(cfg: ModelConfig) -> int:
  """Forward FLOPs per query token and visible key, summed over the layer's heads."""
  return arms.get(cfg.attention).attention_flops(cfg)


def flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> FlopsPerToken:
  """The FLOPs of one training token of ``cfg`` in sequences of ``seq_len`` (see the module
  docstring). ``causal=False`` counts every key for every query (what a dense attention that
  masks instead of skipping computes)."""
  keys = (seq_len + 1) / 2 if causal else seq_len
  matmul = 2.0 * matmul_weights(cfg)
  attention = float(cfg.num_layers * attention_flops_per_pair(cfg) * keys)
  model = 3.0 * (matmul + attention)
  # Remat wraps the blocks: the LM head is never recomputed.
  blocks = matmul - 2.0 * cfg.d_model * cfg.vocab_size + attention
  recompute = {"none": 0.0, "dots": 0.0, "dots_no_batch": attention, "full": blocks}[cfg.remat]
  return FlopsPerToken(matmul, attention, model, model + recompute)


# Dense bf16 peak FLOP/s per chip or GPU, by device kind (the vendors' figures, without
# sparsity), as (prefix of ``jax.Device.device_kind``, peak) pairs: the hardware table's.
PEAK_FLOPS = tuple(
  (kind, a.dense_flops_per_s["bfloat16"])
  for a in hardware.ACCELERATORS.values()
  for kind in a.device_kinds
)


def peak_flops(device_kind: str) -> float | None:
  """The dense bf16 peak of a device kind (:func:`diffjax.hardware.peak_flops`), or None
  when it has none (a CPU: give ``peak_flops`` in the run config to see an MFU there)."""
  return hardware.peak_flops(device_kind)
