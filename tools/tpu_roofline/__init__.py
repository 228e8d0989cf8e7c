"""HBM traffic and MXU FLOPs of the TPU attention kernels, and the time they bound.

This is a MODEL, not a timing: nothing runs on a TPU. For one attention layer at a
given shape and tile sizes it counts the bytes every kernel and every XLA op around it
moves in HBM and the matmul FLOPs the MXU executes, and the roofline lower bound per TPU
generation, sum over ops of max(bytes / HBM bandwidth, FLOPs / bf16 peak). Real kernels
are slower (pipeline bubbles, VPU and EUP work, the exp of every score, DMA
descriptors); the bound says how far apart two designs must be at best.
``python benchmarks/tpu_roofline.py`` (from the repository root) prints the tables; a
tool beside the package, not part of it, it reads the kernels' own code and the chips of
:mod:`diffjax.hardware`.

Arms, for B sequences of T tokens and DIFF heads H of component width d (d_model =
2 H d): the Transformer has 2H heads of width d; DIFF V1 has H heads (Q1, Q2, K1, K2
of width d, V of width 2d); DIFF V2 has 2H pairs (2 query heads of width d sharing one
key and one value of width d). Self-attention (S = T), kv heads equal to heads.

  Transformer, splash   ``mha_stock_tpu``: one splash-attention call over 2H heads.
  V1 / V2 stock         ``diff_v1_stock_tpu`` (two splash calls with the 2d-wide value)
                        and ``diff_v2_stock_tpu`` (one call over the 4H query heads),
                        then the lambda combination in XLA (:mod:`.splash`).
  V1 / V2 fused         ``diff_v1_pallas_tpu`` / ``diff_v2_pallas_tpu`` (:mod:`.fused`).
  V1 / V2 fused target  a design target that no kernel implements yet (:mod:`.fused`).

What is counted (from the code in ``diffjax/kernels/tpu`` and jax's splash attention):

  * A Pallas kernel moves a block between HBM and VMEM only when the block index of an
    operand changes from one grid step to the next (the pipeline skips the copy of an
    unchanged block). The fetch counts come from walking each kernel's index maps over
    its grid, the causal clamps and splash's shrunk mask tables included, so a masked
    step that keeps the previous block moves nothing.
  * Grid steps are counted separately: every step costs a fixed overhead even when it
    skips its compute (an assumed figure, 0.35 us in the benchmark, not a measured
    one). The per-generation columns leave it out; the ``step us`` column is steps x
    overhead, serial (a megacore chip splits parallel grid axes over its two cores).
  * MXU FLOPs are the matmuls executed per visited tile, at tile granularity (a diagonal
    tile of a causal mask computes all of its scores), 2 FLOPs per multiply-add.
  * Every XLA op around the kernels is one pass that reads its inputs and writes its
    output once in HBM (XLA fuses element-wise chains; it may also fold a transpose
    into a producer's layout or keep a small buffer in VMEM, which only lowers the
    real figure).
  * A float32 array whose minor dimension is small is stored with that dimension padded
    to 128 lanes (the (8, 128) tiling the TPU compiler gives an array like splash's
    logsumexp); a DMA of a ``(block, 8)`` tile of such an array moves ``block x 128``
    words. The fused kernels' lane-dense slabs ``[B, H, T / block, R, block]`` are
    counted with R rounded up to 8 sublanes and the block to 128 lanes (the cross-check
    prints the layouts the compiler chose). V2's lambda argument [B, T, H] is counted
    lane-dense: the compiler chose such a layout for it in the cross-check.
  * Tiles: the fused kernels' defaults for the head width (``BlockSizes.get_default``,
    what ``block_sizes=None`` resolves to: 512 x 512 forward, 512 x 256 backward at
    d = 128; the dataclass's own field defaults, all 512, are not what runs), shrunk to
    the sequence as ``_layout.make_plan`` does (:class:`Tiles` overrides them).

Generations: per-chip HBM bandwidth and dense bf16 peak FLOP/s as Google publishes
them (:mod:`diffjax.hardware`, the v5e, v5p and v6e). A float32 model still divides by the bf16 peak, so its compute bound stays a
lower bound.

Modules: :mod:`.model` (the chips, shapes, tiles, ops and the counts they are built from),
:mod:`.splash` and :mod:`.fused` (each arm's ops), :mod:`.tables` (rows, ratios, the
markdown), :mod:`.cross_check` (the model against the TPU compiler, ahead of time with
libtpu).
"""

from tools.tpu_roofline.cross_check import compiled_bytes, cross_check
from tools.tpu_roofline.fused import (
  bwd_chunks,
  flavour,
  fused_bwd_kernel,
  fused_fwd_kernel,
  fused_ops,
  target_ops,
)
from tools.tpu_roofline.model import (
  GENERATIONS,
  KERNEL,
  LAYOUT,
  PARTS,
  XLA,
  Op,
  Shape,
  Tiles,
  count_fetches,
  fused_tiles,
  splash_cols,
  splash_rows,
  splash_tiles,
  tiles_with_visible_keys,
  visited_tiles,
)
from tools.tpu_roofline.splash import transformer_ops, v1_stock_ops, v2_stock_ops
from tools.tpu_roofline.tables import (
  ARMS,
  TRANSFORMER,
  V1_FUSED,
  V1_STOCK,
  V1_TARGET,
  V2_FUSED,
  V2_STOCK,
  V2_TARGET,
  Row,
  arm_ops,
  arm_rows,
  markdown_table,
  ratios,
  seq_section,
)

__all__ = [
  "ARMS",
  "GENERATIONS",
  "KERNEL",
  "LAYOUT",
  "PARTS",
  "TRANSFORMER",
  "V1_FUSED",
  "V1_STOCK",
  "V1_TARGET",
  "V2_FUSED",
  "V2_STOCK",
  "V2_TARGET",
  "XLA",
  "Op",
  "Row",
  "Shape",
  "Tiles",
  "arm_ops",
  "arm_rows",
  "bwd_chunks",
  "compiled_bytes",
  "count_fetches",
  "cross_check",
  "flavour",
  "fused_bwd_kernel",
  "fused_fwd_kernel",
  "fused_ops",
  "fused_tiles",
  "markdown_table",
  "ratios",
  "seq_section",
  "splash_cols",
  "splash_rows",
  "splash_tiles",
  "target_ops",
  "tiles_with_visible_keys",
  "transformer_ops",
  "v1_stock_ops",
  "v2_stock_ops",
  "visited_tiles",
]
