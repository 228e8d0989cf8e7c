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
SIZES: dict[str, dict[str, int]] = {
  # CPU sizes. "micro" learns associative recall in minutes (configs/compare/retrieval_cpu.py).
  "micro": dict(d_model=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, mlp_dim=176),
  "tiny": dict(d_model=128, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=32, mlp_dim=352),
  "default": dict(d_model=192, num_layers=3, num_heads=6, num_kv_heads=6, head_dim=32, mlp_dim=512),
  "small": dict(d_model=256, num_layers=4, num_heads=8, num_kv_heads=8, head_dim=32, mlp_dim=688),
  # One-GPU size (~350M parameters with a 100K vocabulary).
  "350m": dict(
    d_model=1024, num_layers=24, num_heads=16, num_kv_heads=16, head_dim=64, mlp_dim=2816
  ),
  # arXiv 2410.05258 section 3: 3B (FFN given), and the scaling sweep (FFN 8/3 d rounded).
  "3b": dict(
    d_model=3072, num_layers=28, num_heads=24, num_kv_heads=24, head_dim=128, mlp_dim=8192
  ),
  # d = d_model / (2 * DIFF heads): 96 for 830M, 128 for the others.
  "830m": dict(
    d_model=1536, num_layers=24, num_heads=16, num_kv_heads=16, head_dim=96, mlp_dim=llama_ffn(1536)
  ),
  "1.4b": dict(
    d_model=2048,
    num_layers=24,
    num_heads=16,
    num_kv_heads=16,
    head_dim=128,
    mlp_dim=llama_ffn(2048),
  ),
  "2.8b": dict(
    d_model=2560,
    num_layers=32,
    num_heads=20,
    num_kv_heads=20,
    head_dim=128,
    mlp_dim=llama_ffn(2560),
  ),
  "6.8b": dict(
    d_model=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    mlp_dim=llama_ffn(4096),
  ),
  "13.1b": dict(
    d_model=5120,
    num_layers=40,
    num_heads=40,
    num_kv_heads=40,
    head_dim=128,
    mlp_dim=llama_ffn(5120),
  ),
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
