"""The roofline's tables: every arm's ops at one shape, summed into rows per pass and part,
the headline ratios, and the text of one sequence length's section."""

from __future__ import annotations

import dataclasses
from typing import Any

from tools.tpu_roofline.fused import bwd_chunks, fused_ops, target_ops
from tools.tpu_roofline.model import GENERATIONS, KERNEL, PARTS, Op, Shape, Tiles
from tools.tpu_roofline.splash import transformer_ops, v1_stock_ops, v2_stock_ops

TRANSFORMER = "Transformer, splash"
V1_STOCK = "DIFF V1, stock"
V2_STOCK = "DIFF V2, stock"
V1_FUSED = "DIFF V1, fused"
V2_FUSED = "DIFF V2, fused"
V1_TARGET = "DIFF V1, fused target*"
V2_TARGET = "DIFF V2, fused target*"
ARMS = (TRANSFORMER, V1_STOCK, V2_STOCK, V1_FUSED, V2_FUSED, V1_TARGET, V2_TARGET)


def arm_ops(shape: Shape, tiles: Tiles) -> dict[str, dict[str, list[Op]]]:
  """Every arm's forward and backward ops at one shape."""
  return {
    TRANSFORMER: transformer_ops(shape, tiles),
    V1_STOCK: v1_stock_ops(shape, tiles),
    V2_STOCK: v2_stock_ops(shape, tiles),
    V1_FUSED: fused_ops(shape, tiles, 1),
    V2_FUSED: fused_ops(shape, tiles, 2),
    V1_TARGET: target_ops(shape, tiles, 1),
    V2_TARGET: target_ops(shape, tiles, 2),
  }


@dataclasses.dataclass
class Row:
  """One line of a table: an arm's pass (or part of it) summed over its ops."""

  arm: str
  pass_: str
  part: str
  bytes: int
  flops: int
  steps: int
  bound_us: dict[str, float]

  @property
  def intensity(self) -> float:
    return self.flops / self.bytes if self.bytes else 0.0


def summarize(name: str, pass_: str, part: str, ops: list[Op]) -> Row:
  """Totals of a group of ops; the bound of a sequence of ops is the sum of theirs."""
  return Row(
    name,
    pass_,
    part,
    sum(o.bytes for o in ops),
    sum(o.flops for o in ops),
    sum(o.steps for o in ops),
    {g: 1e6 * sum(o.bound_s(c) for o in ops) for g, c in GENERATIONS.items()},
  )


def arm_rows(arm: str, passes: dict[str, list[Op]]) -> list[Row]:
  """Per pass: a row per part, the pass's total; then fwd+bwd."""
  out = []
  for pass_ in ("fwd", "bwd"):
    ops = passes[pass_]
    for part in PARTS:
      group = [o for o in ops if o.part == part]
      if group:
        out.append(summarize(arm, pass_, part, group))
    out.append(summarize(arm, pass_, "total", ops))
  out.append(summarize(arm, "fwd+bwd", "total", passes["fwd"] + passes["bwd"]))
  return out


def ratios(arms: dict[str, dict[str, list[Op]]]) -> dict[str, float]:
  """The headline ratios (bytes, all passes) and their kernels-only variants."""
  total = lambda arm, kernels_only=False: sum(
    o.bytes for p in ("fwd", "bwd") for o in arms[arm][p] if not kernels_only or o.part == KERNEL
  )
  bwd = lambda arm: sum(o.bytes for o in arms[arm]["bwd"])
  return {
    "fused_v1_over_splash_transformer": total(V1_FUSED) / total(TRANSFORMER),
    "fused_v1_over_splash_transformer_kernels_only": total(V1_FUSED, True)
    / total(TRANSFORMER, True),
    "fused_v2_over_splash_transformer": total(V2_FUSED) / total(TRANSFORMER),
    "target_v1_bwd_over_fused_v1_bwd": bwd(V1_TARGET) / bwd(V1_FUSED),
    "target_v2_bwd_over_fused_v2_bwd": bwd(V2_TARGET) / bwd(V2_FUSED),
  }


def markdown_table(rows: list[Row], step_us: float) -> str:
  """The rows as a markdown table; ``step_us`` is the assumed cost of one grid step."""
  gens = list(GENERATIONS)
  head = ["arm", "pass", "part", "HBM MB", "MXU GFLOP", "FLOP/B", "grid steps", "step us"] + [
    f"{g} us" for g in gens
  ]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    cells = [
      r.arm,
      r.pass_,
      r.part,
      f"{r.bytes / 1e6:,.1f}",
      f"{r.flops / 1e9:,.1f}",
      f"{r.intensity:,.0f}",
      f"{r.steps:,}",
      f"{r.steps * step_us:,.0f}",
    ]
    cells += [f"{r.bound_us[g]:,.0f}" for g in gens]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def seq_section(shape: Shape, tiles: Tiles, step_us: float) -> tuple[str, dict[str, Any]]:
  """The markdown section of one sequence length (table, ratios, the fused V1 backward
  kernel's bytes by array) and every figure behind it."""
  arms = arm_ops(shape, tiles)
  rows = [r for arm in ARMS for r in arm_rows(arm, arms[arm])]
  rat = ratios(arms)
  n_calls = len(bwd_chunks(shape, tiles, 1))
  t = shape.seq
  ratio_line = (
    f"Ratios at T = {t} (HBM bytes, all passes): fused DIFF V1 fwd+bwd / splash "
    f"Transformer fwd+bwd = {rat['fused_v1_over_splash_transformer']:.2f} (kernels "
    f"only {rat['fused_v1_over_splash_transformer_kernels_only']:.2f}), fused DIFF V2 "
    f"= {rat['fused_v2_over_splash_transformer']:.2f}; target / fused backward "
    f"= {rat['target_v1_bwd_over_fused_v1_bwd']:.2f} (V1), "
    f"{rat['target_v2_bwd_over_fused_v2_bwd']:.2f} (V2). The fused V1 backward "
    f"runs {n_calls} query chunk{'s' if n_calls > 1 else ''} at this length."
  )
  kernel = lambda arm: next(o for o in arms[arm]["bwd"] if o.part == KERNEL)
  by = lambda arm: ", ".join(f"{k} {v / 1e6:,.1f}" for k, v in kernel(arm).detail.items())
  bytes_line = (
    f"Fused V1 backward kernel, MB by array: fused: {by(V1_FUSED)}; target: {by(V1_TARGET)}."
  )
  text = f"\n## T = {t}\n\n{markdown_table(rows, step_us)}\n\n{ratio_line}\n{bytes_line}"
  figures = {
    "rows": [dataclasses.asdict(r) | {"flop_per_byte": r.intensity} for r in rows],
    "ops": {
      arm: {p: [dataclasses.asdict(o) for o in ops] for p, ops in passes.items()}
      for arm, passes in arms.items()
    },
    "ratios": rat,
  }
  return text, figures
