"""Every GPU kernel the dispatcher can choose, compiled for a GPU on a machine without one.

  python -m tools.gpu_compile [--target=h100] [--scope=default|widths|full] [--json]

(from the repository root, with the ``[gpu-compile]`` extra installed). For each case
(kernel, variant, head dim, GQA group, dtype, segment ids) this lowers the public entry
point for the target's compile-only devices (:mod:`diffjax.kernels.gpu.targets`): the forward
with every gradient (:func:`~diffjax.kernels.gpu.mosaic.diff_v1_pallas_gpu` /
``diff_v2_pallas_gpu`` under ``jax.grad``: the forward and the fused backward kernel)
and decoding (:func:`~diffjax.kernels.gpu.mosaic_decode.diff_v1_decode_pallas_gpu`);
grouped differential attention (:func:`~diffjax.kernels.gpu.mosaic_gda.gda_v1_pallas_gpu` /
``gda_v2_pallas_gpu`` under ``jax.grad``: the grouped forward and backward).
Kernels are deduplicated by the digest of their Mosaic GPU module (the same text gives
the same ptxas result), each distinct program is compiled once through XLA and ptxas,
and the table reports per kernel: registers, spill stores/loads, shared memory as
launched next to the tiling model's count (:mod:`diffjax.kernels.gpu.mosaic_tiles`), and
the limit (:mod:`diffjax.hardware`), read back by :mod:`tools.gpu_compile.ptxas`.

The default scope is the kernels the paper presets run (the 3B layer: d 128, 12 heads,
T 4096, bf16, segment ids; V1 decoding at batch 8 x 4,096) and the grouped ops at
Motif-2-12.7B's layer (32 signal heads, 8 noise heads, 8 kv heads, d 128, T 4096, bf16,
segment ids; V1-style decoding at batch 8); ``widths`` adds V1 and V2 at
d 64, 80 and 96; ``full`` adds every head dim 64/80/96/128 with GQA 1 and 3, bf16 and
fp16, segment ids on and off, and decoding at each.

Run it in a fresh process: XLA's optimisation level is read once per process (the
test suite lowers it), and a persistent compilation cache would hide ptxas.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from diffjax.kernels.gpu import (
  mosaic,
  mosaic_decode,
  mosaic_gda,
  mosaic_gda_bwd,
  mosaic_gda_fwd,
  mosaic_tiles,
  targets,
)
from tools.gpu_compile import ptxas

KERNELS = ("forward", "backward", "decode")
_NAMES = {"forward": "fwd_mgpu", "decode": "decode_mgpu"}


@dataclasses.dataclass(frozen=True)
class Case:
  """One entry-point call: its kernels are compiled together.

  Attributes:
    op: "diff_v1", "diff_v2", "gda_v1", "gda_v2" (forward + every gradient),
      "diff_v1_decode" or "gda_v1_decode".
    d: head dim (V1's value dim is 2 d).
    group: query heads (V1: DIFF heads, V2: pairs, GDA: signal heads) per kv group.
    dtype: "bfloat16" or "float16".
    segments: segment ids passed (training ops only).
    batch, seq, kv_heads: shapes; decode reads a cache of ``seq`` slots.
    r: signal heads per noise head (GDA only).
  """

  op: str
  d: int
  group: int
  dtype: str
  segments: bool
  batch: int = 1
  seq: int = 256
  kv_heads: int = 2
  r: int = 1

  @property
  def variant(self) -> str:
    return "v2" if self.op in ("diff_v2", "gda_v2") else "v1"

  @property
  def dv(self) -> int:
    return 2 * self.d if self.variant == "v1" else self.d

  @property
  def heads(self) -> int:
    return self.group * self.kv_heads

  def label(self) -> str:
    seg = " seg" if self.segments else ""
    r = f" r{self.r}" if self.op.startswith("gda") else ""
    return (
      f"{self.op} d{self.d} g{self.group}{r} {self.dtype[:4]}{seg} "
      f"B{self.batch} T{self.seq} H{self.heads}"
    )


PAPER_3B = dict(batch=1, seq=4096, kv_heads=12)  # 12 DIFF heads (24 for V2's query heads)
# Motif-2-12.7B: 32 signal heads over 8 kv heads (group 4), one noise head per kv head (r 4).
MOTIF_2 = dict(batch=1, seq=4096, kv_heads=8, r=4)
SCOPES = ("default", "widths", "full")


def cases(scope: str = "default") -> list[Case]:
  """The cases of ``scope`` ("default" or "full")."""
  if scope not in SCOPES:
    raise ValueError(f"scope={scope!r} must be one of {SCOPES}.")
  out = [
    Case("diff_v1", 128, 1, "bfloat16", True, **PAPER_3B),
    Case("diff_v2", 128, 1, "bfloat16", True, **PAPER_3B),
    Case("diff_v1_decode", 128, 1, "bfloat16", False, batch=8, seq=4096, kv_heads=12),
    Case("gda_v1", 128, 4, "bfloat16", True, **MOTIF_2),
    Case("gda_v2", 128, 4, "bfloat16", True, **MOTIF_2),
    Case("gda_v1_decode", 128, 4, "bfloat16", False, **dict(MOTIF_2, batch=8)),
  ]
  if scope == "widths":  # the presets' kernels at every head dim
    for op, d in itertools.product(("diff_v1", "diff_v2"), (64, 80, 96)):
      out.append(Case(op, d, 1, "bfloat16", True))
  if scope == "full":
    for op, d, group, dtype, seg in itertools.product(
      ("diff_v1", "diff_v2"), (64, 80, 96, 128), (1, 3), ("bfloat16", "float16"), (True, False)
    ):
      out.append(Case(op, d, group, dtype, seg))
    for d, group, dtype in itertools.product((64, 80, 96, 128), (1, 3), ("bfloat16", "float16")):
      out.append(Case("diff_v1_decode", d, group, dtype, False, batch=4, seq=1024))
    # Grouped: r 2 and 4 (two noise heads a kv group at r 2), every head dim.
    for op, d, (group, r), seg in itertools.product(
      ("gda_v1", "gda_v2"), (64, 80, 96, 128), ((4, 2), (4, 4)), (True, False)
    ):
      out.append(Case(op, d, group, "bfloat16", seg, r=r))
  return list(dict.fromkeys(out))


def _program(case: Case, devices):
  """The jitted program of ``case`` and its abstract arguments, on ``devices``."""
  mesh = jax.sharding.Mesh(np.array(devices[:1]), ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  dt = jnp.dtype(case.dtype)
  arr = lambda shape, dtype=dt: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  b, t, kh, d = case.batch, case.seq, case.kv_heads, case.d
  h = case.heads
  ids = arr((b, t), jnp.int32) if case.segments else None
  if case.op in ("diff_v1_decode", "gda_v1_decode"):
    q, k, v = arr((b, 1, h, d)), arr((b, t, kh, d)), arr((b, t, kh, case.dv))
    q2 = arr((b, 1, h // case.r, d))
    fn = (
      mosaic_decode.gda_v1_decode_pallas_gpu
      if case.op == "gda_v1_decode"
      else mosaic_decode.diff_v1_decode_pallas_gpu
    )
    return jax.jit(fn), (q, q2, k, k, v, arr((h,), jnp.float32), arr((b,), jnp.int32))
  if case.op in ("gda_v1", "gda_v2"):
    q1, q2 = arr((b, t, h, d)), arr((b, t, h // case.r, d))
    k, v = arr((b, t, kh, d)), arr((b, t, kh, case.dv))
    fn = mosaic_gda.gda_v1_pallas_gpu if case.op == "gda_v1" else mosaic_gda.gda_v2_pallas_gpu
    loss = lambda *a: (
      fn(*a[:-1], q_segment_ids=a[-1], kv_segment_ids=a[-1]).astype(jnp.float32).sum()
    )
    if case.op == "gda_v1":
      args = (q1, q2, k, k, v, arr((h,), jnp.float32), ids)
    else:
      args = (q1, q2, k, v, arr((b, t, h), jnp.float32), ids)
    return jax.jit(jax.grad(loss, argnums=tuple(range(len(args) - 1)))), args
  if case.op == "diff_v1":
    q, k, v = arr((b, t, h, d)), arr((b, t, kh, d)), arr((b, t, kh, case.dv))
    loss = lambda q1, q2, k1, k2, v, lam, ids: (
      mosaic.diff_v1_pallas_gpu(q1, q2, k1, k2, v, lam, q_segment_ids=ids, kv_segment_ids=ids)
      .astype(jnp.float32)
      .sum()
    )
    args, argnums = (q, q, k, k, v, arr((h,), jnp.float32), ids), (0, 1, 2, 3, 4, 5)
  else:
    q, k, v = arr((b, t, 2 * h, d)), arr((b, t, kh, d)), arr((b, t, kh, d))
    loss = lambda q, k, v, lam, ids: (
      mosaic.diff_v2_pallas_gpu(q, k, v, lam, q_segment_ids=ids, kv_segment_ids=ids)
      .astype(jnp.float32)
      .sum()
    )
    args, argnums = (q, k, v, arr((b, t, h), jnp.float32), ids), (0, 1, 2, 3)
  return jax.jit(jax.grad(loss, argnums=argnums)), args


def lower(case: Case, devices):
  fn, args = _program(case, devices)
  return fn.trace(*args).lower(lowering_platforms=("cuda",))


def model_smem(case: Case, kernel: str) -> int:
  """The tiling model's shared memory for ``kernel`` of ``case``."""
  itemsize = jnp.dtype(case.dtype).itemsize
  if kernel == "decode":
    return mosaic_decode.decode_smem_bytes(
      case.d, case.dv, mosaic_decode.decode_stages(case.d, case.dv, itemsize), itemsize
    )
  if case.op.startswith("gda") and case.r > 1:
    shared_k = case.variant == "v2"
    if kernel == "forward":
      stages = mosaic_gda_fwd.forward_stages(case.d, case.dv, shared_k, case.segments, itemsize)
      return mosaic_gda_fwd.forward_smem_bytes(
        case.d, case.dv, 64, stages, shared_k, case.segments, itemsize
      )
    stages, parts = mosaic_gda_bwd.blocks(case.d, case.dv, case.segments, itemsize)
    return mosaic_gda_bwd.smem_bytes(case.d, case.dv, stages, parts, case.segments, itemsize)
  blocks = mosaic_tiles.MosaicBlockSizes.default(
    case.d, case.dv, case.variant, case.segments, itemsize
  )
  if kernel == "forward":
    return mosaic_tiles.forward_smem_bytes(
      case.d, case.dv, blocks.block_kv, blocks.stages, case.variant, case.segments, itemsize
    )
  return mosaic_tiles.backward_smem_bytes(
    case.d, case.dv, blocks.bwd_stages, blocks.dq_parts, case.variant, case.segments, itemsize
  )


def kernel_role(name: str) -> str:
  """ "forward", "backward" or "decode" from a Mosaic GPU kernel's name."""
  for role, suffix in _NAMES.items():
    if name.endswith(suffix):
      return role
  return "backward"


@dataclasses.dataclass(frozen=True)
class Row:
  """One compiled kernel of one case."""

  case: Case
  kernel: str
  report: ptxas.KernelReport
  model_smem: int
  smem_limit: int
  model_registers: int | None

  def as_dict(self) -> dict:
    return {
      "case": dataclasses.asdict(self.case),
      "label": self.case.label(),
      "kernel": self.kernel,
      **dataclasses.asdict(self.report),
      "model_smem": self.model_smem,
      "smem_limit": self.smem_limit,
      "model_registers": self.model_registers,
    }


def check(case_list: list[Case], target: str = "h100", log=None) -> tuple[list[Row], dict]:
  """Compiles every distinct kernel of ``case_list`` for ``target``.

  Returns (rows, stats): one row per kernel of each case (a kernel shared by two cases,
  by digest, is compiled once and reported for both), and counts and seconds spent.
  """
  tgt = targets.get(target)
  devices = targets.devices(tgt)
  reports: dict[str, ptxas.KernelReport] = {}
  rows, t0 = [], time.perf_counter()
  lower_s = compile_s = 0.0
  for case in case_list:
    t = time.perf_counter()
    lowered = lower(case, devices)
    kernels = ptxas.mosaic_kernels(lowered)
    lower_s += time.perf_counter() - t
    if any(k.digest not in reports for k in kernels):
      t = time.perf_counter()
      _, new_reports = ptxas.compile_with_report(lowered)
      compile_s += time.perf_counter() - t
      reports.update({r.digest: r for r in new_reports})
    for k in kernels:
      role = kernel_role(k.name)
      regs = None
      if role == "backward":
        grouped = case.op.startswith("gda") and case.r > 1
        regs = (mosaic_gda_bwd.registers if grouped else mosaic_tiles.backward_registers)(
          case.d, case.dv
        )
      rows.append(
        Row(case, role, reports[k.digest], model_smem(case, role), tgt.smem_per_block, regs)
      )
    if log is not None:
      for r in rows[-len(kernels) :]:
        rep = r.report
        log(
          f"{case.label()} {r.kernel}: {rep.registers} registers, spills "
          f"{rep.spill_stores}/{rep.spill_loads}, stack {rep.stack_bytes}, smem "
          f"{rep.smem_bytes} (model {r.model_smem}); {time.perf_counter() - t0:.0f} s"
        )
  stats = {
    "cases": len(case_list),
    "kernels": len(rows),
    "distinct": len(reports),
    "lower_s": round(lower_s, 1),
    "compile_s": round(compile_s, 1),
    "total_s": round(time.perf_counter() - t0, 1),
    "target": tgt.name,
    "jax": jax.__version__,
  }
  return rows, stats


def markdown(rows: list[Row]) -> str:
  """The table of registers, spills and shared memory per kernel and case."""
  lines = [
    "| case | kernel | registers | spill stores / loads (bytes) | shared memory (model) / limit |",
    "|---|---|---|---|---|",
  ]
  for r in rows:
    rep = r.report
    lines.append(
      f"| {r.case.label()} | {r.kernel} | {rep.registers} | {rep.spill_stores} / "
      f"{rep.spill_loads} | {rep.smem_bytes:,} ({r.model_smem:,}) / "
      f"{r.smem_limit:,} |"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    prog="python -m tools.gpu_compile", description=__doc__.splitlines()[0]
  )
  p.add_argument("--target", default="h100", help=f"one of {sorted(targets.TARGETS)}")
  p.add_argument("--scope", default="default", choices=SCOPES)
  p.add_argument("--json", action="store_true", help="print the rows as JSON, last line")
  a = p.parse_args(argv)
  tgt = targets.get(a.target)
  if not tgt.hopper:
    print(
      f"{tgt.name}: sm_{tgt.compute_capability[0]}{tgt.compute_capability[1]} is not a "
      "Hopper; the dispatcher runs the stock path there and compiles no kernel of ours."
    )
    return 0
  rows, stats = check(cases(a.scope), a.target, log=lambda m: print(m, file=sys.stderr))
  if a.json:
    print(json.dumps({"rows": [r.as_dict() for r in rows], "stats": stats}))
  else:
    print(markdown(rows))
    print(f"\n{stats}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
