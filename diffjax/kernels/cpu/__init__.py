"""Attention laid out for CPU caches (plain XLA, no Pallas): :mod:`.attention`."""

from diffjax.kernels.cpu.attention import (
  diff_v1_xla_cpu,
  diff_v2_xla_cpu,
  gda_v1_xla_cpu,
  gda_v2_xla_cpu,
  mha_xla_cpu,
)

__all__ = ["mha_xla_cpu", "diff_v1_xla_cpu", "diff_v2_xla_cpu", "gda_v1_xla_cpu", "gda_v2_xla_cpu"]
