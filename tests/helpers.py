"""Helpers shared by the tests that run the project's commands in a fresh process."""

from __future__ import annotations

import re

# Lines that libraries print on stderr before any of our code runs: absl's notice and the
# CUDA plugin's "no driver" line (installed by the ``[gpu-compile]`` extra, loaded by jax
# even with JAX_PLATFORMS=cpu).
_LIBRARY_NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to "
    r"STDERR|[IWE]\d{4} [\d:.]+\s+\d+ cudart_stub\.cc:\d+\] .*)$")


def own_stderr(text: str) -> list[str]:
  """The lines of ``text`` (a child's stderr) that the libraries' start-up notices are not."""
  return [line for line in text.splitlines() if not _LIBRARY_NOISE.match(line)]
