"""The hardware table (diffjax.hardware): lookups by name and by device kind, the figures the
project used before there was one table, and the modules that read it."""

from __future__ import annotations

import ast
import dataclasses

import jax.numpy as jnp
import pytest
from helpers import REPO

from diffjax import aot, hardware
from diffjax.kernels.gpu import targets
from diffjax.kernels.tpu import block_sizes
from diffjax.model import flops

GIB = 1024**3

# What the five tables that this one replaced held, device kind by device kind.
OLD_PEAK_BF16 = {
  "TPU v6 lite": 918e12,
  "TPU v6e": 918e12,
  "TPU v5 lite": 197e12,
  "TPU v5e": 197e12,
  "TPU v5p": 459e12,
  "TPU v5": 459e12,
  "TPU v4": 275e12,
  "NVIDIA H200": 989e12,
  "NVIDIA H100 80GB HBM3": 989e12,
  "NVIDIA A100-SXM4-80GB": 312e12,
}
OLD_HBM_GIB = {
  "TPU v5 lite": 16,
  "TPU v5e": 16,
  "TPU v5p": 95,
  "TPU v5": 95,
  "TPU v6 lite": 32,
  "TPU v6e": 32,
  "TPU v4": 32,
}
OLD_ROOFLINE = {"v5e": (819e9, 197e12), "v5p": (2765e9, 459e12), "v6e": (1640e9, 918e12)}
OLD_MXU = {"v5e": 128, "v5p": 128, "v6e": 256}
# name: (compute capability, SMs, smem per block, smem per SM, memory, bandwidth, clock, L2)
OLD_GPUS = {
  "h100": ((9, 0), 132, 232_448, 233_472, 84_942_979_072, 3_352_320_000_000, 1.98, 52_428_800),
  "h200": ((9, 0), 132, 232_448, 233_472, 150_754_820_096, 4_800_000_000_000, 1.98, 52_428_800),
  "a100": ((8, 0), 108, 166_912, 167_936, 85_899_345_920, 2_039_000_000_000, 1.41, 41_943_040),
}


def test_every_known_accelerator_is_in_the_table_once():
  assert hardware.names("tpu") == ("v4", "v5e", "v5p", "v6e")
  assert hardware.names("gpu") == ("h100", "h200", "a100")
  assert hardware.names() == hardware.names("tpu") + hardware.names("gpu")
  for name in hardware.names():
    a = hardware.get(name)
    assert a.name == name and hardware.get(name.upper()) is a
    assert isinstance(a, hardware.Tpu if a.platform == "tpu" else hardware.Gpu)
    assert a.flops("bfloat16") > 0 and a.hbm_bytes > 0 and a.hbm_bytes_per_s > 0
    # Every device kind it claims leads back to it.
    assert all(hardware.for_device_kind(kind) is a for kind in a.device_kinds)
  with pytest.raises(ValueError, match=r"'v100'; use one of \['v4', 'v5e'.*'a100'\]"):
    hardware.get("v100")


def test_device_kinds_match_by_longest_prefix_and_case():
  kind = lambda k: getattr(hardware.for_device_kind(k), "name", None)
  assert kind("TPU v5 lite") == "v5e" and kind("TPU v5") == "v5p" and kind("TPU v5p") == "v5p"
  assert kind("TPU v6 lite") == "v6e" and kind("tpu v6e") == "v6e"
  assert kind("NVIDIA H100 80GB HBM3") == "h100" and kind("NVIDIA H100 PCIe") == "h100"
  assert kind("NVIDIA H200") == "h200" and kind("NVIDIA A100-SXM4-40GB") == "a100"
  assert kind("cpu") is None and kind("NVIDIA V100") is None and kind("TPU v3") is None


def test_peak_flops_by_dtype():
  assert hardware.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert hardware.peak_flops("NVIDIA H100 80GB HBM3", "float16") == 989e12
  assert hardware.peak_flops("NVIDIA A100-SXM4-80GB", jnp.bfloat16) == 312e12
  # No published figure in the table: None, not a guess.
  assert hardware.peak_flops("TPU v5p", "float16") is None
  assert hardware.peak_flops("cpu") is None


def test_the_table_holds_the_figures_of_the_tables_it_replaced():
  for kind, peak in OLD_PEAK_BF16.items():
    assert hardware.peak_flops(kind) == peak, kind
  for kind, gib in OLD_HBM_GIB.items():
    assert hardware.for_device_kind(kind).hbm_bytes == gib * GIB, kind
  for name, (bandwidth, peak) in OLD_ROOFLINE.items():
    chip = hardware.get(name)
    assert (chip.hbm_bytes_per_s, chip.flops()) == (bandwidth, peak), name
  for name, width in OLD_MXU.items():
    assert hardware.get(name).mxu_width == width, name
  for name, facts in OLD_GPUS.items():
    g = hardware.get(name)
    got = (
      g.compute_capability,
      g.sms,
      g.smem_per_block,
      g.smem_per_sm,
      g.hbm_bytes,
      g.hbm_bytes_per_s,
      g.clock_ghz,
      g.l2_bytes,
    )
    assert got == facts, name
  assert hardware.HOPPER == (9, 0)
  assert [n for n in hardware.names("gpu") if hardware.get(n).hopper] == ["h100", "h200"]


def test_records_are_frozen():
  h100 = hardware.get("h100")
  with pytest.raises(dataclasses.FrozenInstanceError):
    h100.sms = 1
  with pytest.raises(TypeError):
    h100.dense_flops_per_s["bfloat16"] = 1.0
  assert hash(h100) == hash(hardware.get("h100"))


def test_the_readers_take_their_figures_from_the_table():
  for name in hardware.names():
    a = hardware.get(name)
    for kind in a.device_kinds:
      assert flops.peak_flops(kind) == a.flops("bfloat16")
      assert aot.hbm_for(kind) == a.hbm_bytes / GIB
      gen = block_sizes.tpu_generation(kind)
      assert gen == (name if name in block_sizes.GENERATIONS else None), kind
  assert dict(flops.PEAK_FLOPS) == {
    k: hardware.get(n).flops() for n in hardware.names() for k in hardware.get(n).device_kinds
  }
  assert targets.TARGETS == {n: hardware.get(n) for n in hardware.names("gpu")}
  assert aot.hbm_for("cpu") is None and flops.peak_flops("cpu") is None


def test_the_table_imports_nothing_from_diffjax():
  with open(f"{REPO}/diffjax/hardware.py", encoding="utf-8") as f:
    tree = ast.parse(f.read())
  imported = [
    name
    for node in ast.walk(tree)
    for name in (
      [a.name for a in node.names]
      if isinstance(node, ast.Import)
      else [node.module or ""]
      if isinstance(node, ast.ImportFrom)
      else []
    )
  ]
  assert imported and not [n for n in imported if n.startswith("diffjax")], imported
