"""Text generation with a KV cache for every arm: :func:`generate` and sampling.

:func:`generate` compiles its prefill and decode loop once per model structure and
bucketed shape and keeps them (:mod:`diffjax.generation.programs`; :func:`cache_info`
counts them).

``python -m diffjax.generation --workdir=RUN --prompt=...`` streams a trained run's
continuation of a prompt (:mod:`diffjax.generation.command`).
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
