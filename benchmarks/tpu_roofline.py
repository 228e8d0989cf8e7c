"""HBM traffic and MXU FLOPs of the TPU attention kernels, and the time they bound.

Prints the tables of the roofline MODEL in ``tools/tpu_roofline`` (what it
counts and why is written there): for one attention layer, per arm (the splash
Transformer, the stock DIFF paths, the fused DIFF kernels and a design target), the HBM
bytes, MXU FLOPs and grid steps, and the lower bound they set per TPU generation.
Nothing runs on a TPU.

  python benchmarks/tpu_roofline.py                       # T = 4K, 8K, 32K, 3B shapes
  python benchmarks/tpu_roofline.py --seq 1024 --json /tmp/roofline.json
  python benchmarks/tpu_roofline.py --cross-check         # + AOT compile at T = 1024

``--cross-check`` compiles the fused V1 and V2 forward and forward+backward for one
layer at ``--cross-check-seq`` (1024) for one chip of a v5e:2x2 topology (libtpu, no
TPU needed) and prints, next to the model's figures at that shape, what the compiled
executable reports: argument, output and temporary sizes (``memory_analysis()``) and
``cost_analysis()`` bytes accessed and FLOPs (for a Pallas call XLA takes the kernel's
own declared CostEstimate), plus the layouts of the row-statistics arrays. Every figure
there is marked "modelled" or "read from the compiler".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from diffjax.kernels.tpu.block_sizes import BlockSizes  # noqa: E402
from tools.tpu_roofline import GENERATIONS, Shape, Tiles, cross_check, seq_section  # noqa: E402


def _parse_seqs(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
  p = argparse.ArgumentParser(
    description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--d-model", type=int, default=3072)
  p.add_argument(
    "--diff-heads",
    type=int,
    default=12,
    help="DIFF heads H; the Transformer has 2H heads of width d",
  )
  p.add_argument("--head-dim", type=int, default=128, help="component width d")
  p.add_argument(
    "--seq", type=_parse_seqs, default=[4096, 8192, 32768], help="comma-separated sequence lengths"
  )
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
  p.add_argument("--block-q", type=int, default=None)
  p.add_argument("--block-kv", type=int, default=None)
  p.add_argument("--block-q-bwd", type=int, default=None)
  p.add_argument("--block-kv-bwd", type=int, default=None)
  p.add_argument(
    "--dq-chunk",
    type=int,
    default=None,
    help="query rows per call of the fused backward (default: the kernel's rule)",
  )
  p.add_argument(
    "--splash-block", type=int, default=512, help="splash tile of the stock wrappers (512)"
  )
  p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
  p.add_argument(
    "--segment-ids",
    action="store_true",
    help="the fused kernels get segment ids (the stock paths always do)",
  )
  p.add_argument(
    "--step-overhead-us",
    type=float,
    default=0.35,
    help="assumed fixed cost of one grid step, masked or not",
  )
  p.add_argument("--json", default=None, help="write every figure to this path")
  p.add_argument(
    "--cross-check",
    action="store_true",
    help="also AOT-compile the fused kernels for a v5e chip (libtpu)",
  )
  p.add_argument("--cross-check-seq", type=int, default=1024)
  a = p.parse_args(argv)

  # The kernels' defaults for this head width (BlockSizes.get_default), unless given.
  resolved = BlockSizes.get_default(a.head_dim)
  tiles = Tiles(
    block_q=a.block_q or resolved.block_q,
    block_kv=a.block_kv or resolved.block_kv,
    block_q_bwd=a.block_q_bwd or resolved.block_q_bwd,
    block_kv_bwd=a.block_kv_bwd or resolved.block_kv_bwd,
    splash=a.splash_block,
    dq_chunk=a.dq_chunk,
  )
  BlockSizes(
    tiles.block_q, tiles.block_kv, tiles.block_q_bwd, tiles.block_kv_bwd, tiles.dq_chunk
  )  # validate
  itemsize = 2 if a.dtype == "bf16" else 4
  print("# TPU attention roofline: a MODEL of HBM bytes and MXU FLOPs, not a measurement\n")
  print(
    f"d_model {a.d_model}, {a.diff_heads} DIFF heads (Transformer {2 * a.diff_heads} heads, "
    f"DIFF V2 {2 * a.diff_heads} pairs) of d = {a.head_dim}, batch {a.batch}, {a.dtype}, "
    f"{'causal' if a.causal else 'full'} attention, one layer. Fused tiles fwd "
    f"{tiles.block_q}x{tiles.block_kv}, bwd {tiles.block_q_bwd}x{tiles.block_kv_bwd}; "
    f"splash {tiles.splash}. Step overhead {a.step_overhead_us} us (assumed)."
  )
  if a.d_model != 2 * a.diff_heads * a.head_dim:
    print(
      f"Note: d_model {a.d_model} != 2 x {a.diff_heads} x {a.head_dim}; the model uses "
      "the heads and d as given."
    )
  print(
    "Per-generation columns: lower bound sum over ops of max(bytes / HBM bandwidth, "
    "FLOPs / bf16 peak), in us, without the step overhead. "
    + ", ".join(
      f"{g}: {c.hbm_bytes_per_s / 1e9:,.0f} GB/s, {c.flops('bfloat16') / 1e12:,.0f} TFLOP/s"
      for g, c in GENERATIONS.items()
    )
    + ". * fused target: a design target that no kernel implements yet."
  )

  report: dict[str, Any] = {
    "config": vars(a) | {"tiles": dataclasses.asdict(tiles)},
    "generations": {
      g: {"hbm_bytes_per_s": c.hbm_bytes_per_s, "bf16_flops_per_s": c.flops("bfloat16")}
      for g, c in GENERATIONS.items()
    },
    "results": {},
  }
  for seq in a.seq:
    shape = Shape(
      batch=a.batch,
      diff_heads=a.diff_heads,
      head_dim=a.head_dim,
      seq=seq,
      itemsize=itemsize,
      causal=a.causal,
      segmented=a.segment_ids,
    )
    text, report["results"][str(seq)] = seq_section(shape, tiles, a.step_overhead_us)
    print(text)
  if a.cross_check:
    shape = Shape(
      batch=a.batch,
      diff_heads=a.diff_heads,
      head_dim=a.head_dim,
      seq=a.cross_check_seq,
      itemsize=itemsize,
      causal=a.causal,
    )
    text, report["cross_check"] = cross_check(shape, tiles)
    print(text)
  if a.json:
    with open(a.json, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=1, default=str)
  return report


if __name__ == "__main__":
  main()
