"""Attention laid out for CPU caches (plain XLA, no Pallas): :mod:`.attention`."""

from diffjax.kernels.cpu.attention import diff_v1_cpu, diff_v2_cpu, mha_cpu

__all__ = ["mha_cpu", "diff_v1_cpu", "diff_v2_cpu"]
