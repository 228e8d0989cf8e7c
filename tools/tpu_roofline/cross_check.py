"""The roofline model against the TPU compiler: the fused V1 and V2 forward and
forward+backward compiled ahead of time for one chip of a TPU topology (libtpu, no TPU
needed), with the executables' memory and cost analyses and the row-statistics layouts
next to the model's figures at the same shape."""

from __future__ import annotations

import os
import re
import time
from typing import Any

from tools.tpu_roofline.fused import flavour, fused_fwd_kernel, fused_ops
from tools.tpu_roofline.model import F32, KERNEL, Op, Shape, Tiles


def _hlo_facts(text: str) -> dict[str, Any]:
  """What the compiled HLO says about the row-statistics layouts and where XLA put the
  ops around the kernels (S(1) is VMEM)."""
  found = re.findall(r"(f32\[[0-9,]+,(?:1|2|8)(?:,[0-9]+)?\])\{[0-9,]+:(T\([0-9,]+\))", text)
  facts: dict[str, Any] = {"row_stat_layouts": sorted({f"{a} {t}" for a, t in found})}
  entry = text[text.find("ENTRY") :]
  # Entry parameters whose layout is not row-major: the compiler picked them, which
  # turns some wrapper transposes into free bitcasts.
  params = re.findall(r"= \w+\[[0-9,]*\]\{([0-9,]+)[:}][^\n]* parameter\(", entry)
  facts["parameters"] = len(params)
  facts["parameters_not_row_major"] = sum(
    [int(x) for x in p.split(",")] != sorted((int(x) for x in p.split(",")), reverse=True)
    for p in params
  )
  ops = [
    m.group(1)
    for m in re.finditer(r"= (.*?) (?:fusion|copy|concatenate|transpose|convert)\(", entry)
  ]
  facts["xla_ops_outside_kernels"] = len(ops)
  facts["of_which_in_vmem"] = sum("S(1)" in result for result in ops)
  facts["kernels"] = sorted(set(re.findall(r"(diff_attention_(?:fwd|bwd))", entry)))
  return facts


def compiled_bytes(
  version: int, shape: Shape, tiles: Tiles, *, topology: str = "v5e:2x2"
) -> dict[str, dict[str, Any]]:
  """Compiles the fused forward and forward+backward (a VJP with the cotangent as an
  argument) of one layer for one chip of ``topology`` and reads the executables'
  memory and cost analyses. Raises if libtpu or the compile is unavailable."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  from diffjax.kernels import tpu as kt  # pylint: disable=import-outside-toplevel

  device = topologies.get_topology_desc(topology, "tpu").devices[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  dtype = jnp.bfloat16 if shape.itemsize == 2 else jnp.float32
  sds = lambda shp, dt=dtype: jax.ShapeDtypeStruct(shp, dt, sharding=sharding)
  fl = flavour(version, shape)
  b, t, d, h = shape.batch, shape.seq, shape.head_dim, fl.heads
  blocks = dict(
    block_q=tiles.block_q,
    block_kv=tiles.block_kv,
    block_q_bwd=tiles.block_q_bwd,
    block_kv_bwd=tiles.block_kv_bwd,
    dq_chunk=tiles.dq_chunk,
  )
  if version == 1:
    args = (sds((b, t, h, d)),) * 4 + (sds((b, t, h, 2 * d)), sds((h,), jnp.float32))
    fn = lambda *a: kt.diff_v1_pallas_tpu(*a, causal=shape.causal, block_sizes=blocks)
  else:
    args = (
      sds((b, t, 2 * h, d)),
      sds((b, t, h, d)),
      sds((b, t, h, d)),
      sds((b, t, h), jnp.float32),
    )
    fn = lambda *a: kt.diff_v2_pallas_tpu(*a, causal=shape.causal, block_sizes=blocks)
  cotangent = sds((b, t, h, fl.dv))

  def fwd_bwd(*a):
    *xs, ct = a
    out, vjp = jax.vjp(fn, *xs)
    return out, vjp(ct)

  results = {}
  # The Pallas lowering asks the default device which TPU it compiles for.
  with jax.default_device(device):
    for name, program, program_args in (
      ("fwd", fn, args),
      ("fwd+bwd", fwd_bwd, args + (cotangent,)),
    ):
      start = time.perf_counter()
      compiled = jax.jit(program).lower(*program_args).compile()
      mem = compiled.memory_analysis()
      cost = compiled.cost_analysis()
      cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
      results[name] = {
        "compile_s": time.perf_counter() - start,
        "argument_bytes": getattr(mem, "argument_size_in_bytes", None),
        "output_bytes": getattr(mem, "output_size_in_bytes", None),
        "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
        "alias_bytes": getattr(mem, "alias_size_in_bytes", None),
        "cost_bytes_accessed": cost.get("bytes accessed"),
        "cost_flops": cost.get("flops"),
        **_hlo_facts(compiled.as_text()),
      }
  return results


def _program_ops(version: int, shape: Shape, tiles: Tiles) -> dict[str, list[Op]]:
  """The model's ops of the two compiled programs: the forward alone (no residuals
  written) and the forward with residuals followed by the backward."""
  ops = fused_ops(shape, tiles, version)
  fwd = fused_fwd_kernel(shape, tiles, version)
  fwd.written -= fwd.detail["o2"] + fwd.detail["lse"]  # written only for a backward
  fwd_only = [fwd] + [
    o for o in ops["fwd"] if o.part != KERNEL and "lse" not in o.name and "o2" not in o.name
  ]
  return {"fwd": fwd_only, "fwd+bwd": ops["fwd"] + ops["bwd"]}


def _modelled_program(version: int, shape: Shape, tiles: Tiles) -> dict[str, dict[str, int]]:
  """The model's figures for the two compiled programs."""
  fl = flavour(version, shape)
  s, b, t, d, h = shape.itemsize, shape.batch, shape.seq, shape.head_dim, fl.heads
  if version == 1:
    inputs = b * t * h * (4 * d + 2 * d) * s + h * F32
  else:
    inputs = b * t * h * (2 * d + 2 * d) * s + b * t * h * F32
  out = b * t * h * fl.dv * s
  sizes = {"fwd": (inputs, out), "fwd+bwd": (inputs + out, out + inputs)}
  return {
    name: {
      "argument_bytes": sizes[name][0],
      "output_bytes": sizes[name][1],
      "bytes_accessed": sum(o.bytes for o in ops),
      "flops": sum(o.flops for o in ops),
    }
    for name, ops in _program_ops(version, shape, tiles).items()
  }


def cross_check(shape: Shape, tiles: Tiles) -> tuple[str, dict[str, Any]]:
  """The compiler's figures next to the model's, as markdown text and as figures (or the
  reason the compile was skipped)."""
  report: dict[str, Any] = {"seq": shape.seq}
  lines: list[str] = []
  line = lines.append
  try:
    for version in (1, 2):
      report[f"v{version}"] = {
        "compiled": compiled_bytes(version, shape, tiles),
        "modelled": _modelled_program(version, shape, tiles),
      }
  except Exception as e:  # pylint: disable=broad-except
    reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    line(f"\nCross-check skipped: no TPU compile here ({reason}).")
    report["skipped"] = reason
    return "\n".join(lines), report
  line(
    f"\n## Cross-check at T = {shape.seq}, B = {shape.batch}, one layer, one v5e chip "
    "(AOT compile, libtpu)\n"
  )
  line("| program | figure | modelled | read from the compiler |")
  line("|---|---|---|---|")
  fmt = lambda x: "n/a" if x is None else f"{x / 1e6:,.2f} MB"
  for version in (1, 2):
    got, want = report[f"v{version}"]["compiled"], report[f"v{version}"]["modelled"]
    want_ops = _program_ops(version, shape, tiles)
    for prog in ("fwd", "fwd+bwd"):
      c, m = got[prog], want[prog]
      name = f"fused V{version} {prog}"
      line(
        f"| {name} | arguments | {fmt(m['argument_bytes'])} | "
        f"{fmt(c['argument_bytes'])} (memory_analysis) |"
      )
      line(
        f"| {name} | outputs | {fmt(m['output_bytes'])} | "
        f"{fmt(c['output_bytes'])} (memory_analysis) |"
      )
      line(f"| {name} | temporaries | not modelled | {fmt(c['temp_bytes'])} (memory_analysis) |")
      line(
        f"| {name} | HBM bytes accessed | {fmt(m['bytes_accessed'])} | "
        f"{fmt(c['cost_bytes_accessed'])} (cost_analysis; Pallas calls: the kernels' "
        "declared CostEstimate) |"
      )
      flops = c["cost_flops"]
      line(
        f"| {name} | FLOPs | {m['flops'] / 1e9:,.2f} G (tile granularity) | "
        f"{'n/a' if flops is None else f'{flops / 1e9:,.2f} G'} (cost_analysis; Pallas "
        "calls: declared, half the square when causal) |"
      )
      n_ops = sum(1 for o in want_ops[prog] if o.part != KERNEL)
      line(
        f"| {name} | XLA ops around the kernels | {n_ops} HBM passes | "
        f"{c['xla_ops_outside_kernels']}, of which {c['of_which_in_vmem']} placed in "
        f"VMEM; {c['parameters_not_row_major']} of {c['parameters']} arguments in a "
        "layout the compiler chose (HLO) |"
      )
    layouts = sorted(set(got["fwd"]["row_stat_layouts"] + got["fwd+bwd"]["row_stat_layouts"]))
    line(
      f"| fused V{version} | row-statistics layouts | slabs (R, block_q), R on 8 sublanes | "
      f"{'; '.join(layouts) or 'none found'} (HLO) |"
    )
  line(
    "\nModelled figures come from the model's functions at the same shape; the "
    "compiler's come from the executables. A small buffer XLA keeps in VMEM moves no "
    "HBM bytes, so at this size the model overstates the XLA passes."
  )
  return "\n".join(lines), report
