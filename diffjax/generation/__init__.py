"""Text generation with a KV cache for every arm: :func:`generate` and sampling.

``python -m diffjax.generation --workdir=RUN --prompt=...`` streams a trained run's
continuation of a prompt. See docs/generation.md.
"""

from diffjax.generation.engine import CACHE_MULTIPLE, Generation, generate
from diffjax.generation.programs import cache_info, clear_cache
from diffjax.generation.sampling import (
  LogitsProcessor,
  SamplingOptions,
  choose_tokens,
  top_k_filter,
  top_p_filter,
)

__all__ = [
  "CACHE_MULTIPLE",
  "Generation",
  "generate",
  "cache_info",
  "clear_cache",
  "LogitsProcessor",
  "SamplingOptions",
  "choose_tokens",
  "top_k_filter",
  "top_p_filter",
]
