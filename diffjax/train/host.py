"""Settings of the host process that make CPU training faster.

XLA's CPU runtime allocates a step's temporaries with ``malloc`` and frees them when the
step ends. With glibc's defaults, large blocks come from fresh ``mmap`` pages and freed
memory at the top of the heap goes back to the kernel, so every step pays page faults to
touch its buffers again (an elementwise kernel writing a fresh buffer runs at about half
speed). :func:`keep_freed_memory` makes ``malloc`` serve blocks below 1 GiB
from the heap and keep freed memory for the next step. The process then holds on to its
peak memory, as a caching allocator would. The trainer (``train_and_evaluate``) calls it
on a CPU backend; set ``DIFFJAX_KEEP_FREED_MEMORY=0`` to leave ``malloc`` alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

ENV_VAR = "DIFFJAX_KEEP_FREED_MEMORY"
# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 1 << 30


def keep_freed_memory() -> bool:
  """Raises glibc's mmap and trim thresholds to 1 GiB; returns whether it did.

  Nothing is changed on other C libraries or systems, or when ``DIFFJAX_KEEP_FREED_MEMORY``
  is ``0``.
  """
  if os.environ.get(ENV_VAR, "1") == "0" or not sys.platform.startswith("linux"):
    return False
  try:
    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version  # pylint: disable=pointless-statement  # glibc only
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  return bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(
      mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES))
