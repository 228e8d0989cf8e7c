"""Named sizes: the Transformer (baseline) widths every arm is matched to.

A size names the baseline's widths (model width, layers, heads of width ``head_dim``,
kv heads, SwiGLU width); :func:`diffjax.model.matched_configs` derives the DIFF arms from
it. The paper lists DIFF heads; its baseline has twice as many of the same width d.
"""

from __future__ import annotations


def _round_up(x: float, multiple: int) -> int:
  return int(-(-x // multiple) * multiple)


def llama_ffn(d_model: int, multiple: int = 256) -> int:
  """SwiGLU hidden size 8/3 * d_model rounded up to ``multiple`` (where the paper gives none)."""
  return _round_up(8 * d_model / 3, multiple)


WIDTHS = ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim")

# (d_model, layers, baseline heads, kv heads, head dim, mlp_dim); mlp_dim None: llama_ffn.
_TABLE: dict[str, tuple[int, int, int, int, int, int | None]] = {
  # CPU sizes. "micro" learns associative recall in minutes (configs/compare/retrieval_cpu.py).
  "micro": (64, 2, 4, 4, 16, 176),
  "tiny": (128, 2, 4, 4, 32, 352),
  "default": (192, 3, 6, 6, 32, 512),
  "small": (256, 4, 8, 8, 32, 688),
  # One-GPU size (~350M parameters with a 100K vocabulary).
  "350m": (1024, 24, 16, 16, 64, 2816),
  # arXiv 2410.05258 section 3: 3B (FFN given), and the scaling sweep (FFN 8/3 d rounded).
  "3b": (3072, 28, 24, 24, 128, 8192),
  # d = d_model / (2 * DIFF heads): 96 for 830M, 128 for the others.
  "830m": (1536, 24, 16, 16, 96, None),
  "1.4b": (2048, 24, 16, 16, 128, None),
  "2.8b": (2560, 32, 20, 20, 128, None),
  "6.8b": (4096, 32, 32, 32, 128, None),
  "13.1b": (5120, 40, 40, 40, 128, None),
}
SIZES: dict[str, dict[str, int]] = {
  name: dict(zip(WIDTHS, (*row[:5], row[5] or llama_ffn(row[0])))) for name, row in _TABLE.items()
}
PAPER_SIZES = ("3b", "830m", "1.4b", "2.8b", "6.8b", "13.1b")
SWEEP_SIZES = ("830m", "1.4b", "2.8b", "6.8b", "13.1b")
# tiktoken cl100k_base as used by the paper, padded.
PAPER_VOCAB = 100288
# "custom": no named size; every width is given explicitly.
CUSTOM = "custom"


def size_widths(size: str) -> dict[str, int]:
  """The baseline widths of ``size`` (a copy)."""
  if size not in SIZES:
    raise ValueError(
      f"model.size={size!r} is not a known size; choose one of "
      f"{sorted(SIZES)} or {CUSTOM!r} (then set every width: {', '.join(WIDTHS)})."
    )
  return dict(SIZES[size])
