"""TPU (Mosaic) Pallas kernels for DIFF V1 and DIFF V2 attention and their grouped forms
(GDA), and their stock peers.

The fused forward and backward (:mod:`.diff_attention`; grouped: :mod:`.gda_attention`),
the V1 decode kernel and its grouped form (:mod:`.decode`), their tiles
(:mod:`.block_sizes`) and the splash-attention peers (:mod:`.stock`). Which one runs for an op is the dispatch table's choice
(docs/architecture.md; this package imports nothing from :mod:`diffjax.ops`); how they
work: docs/kernels_tpu.md.
"""

from diffjax.kernels.tpu.block_sizes import BlockSizes, DecodeBlockSizes, resolve_block_sizes
from diffjax.kernels.tpu.decode import (
  cache_length_multiple,
  diff_v1_decode_pallas_tpu,
  gda_v1_decode_pallas_tpu,
)
from diffjax.kernels.tpu.diff_attention import diff_v1_pallas_tpu, diff_v2_pallas_tpu
from diffjax.kernels.tpu.gda_attention import gda_v1_pallas_tpu, gda_v2_pallas_tpu
from diffjax.kernels.tpu.stock import (
  diff_v1_stock_tpu,
  diff_v2_stock_tpu,
  gda_v1_stock_tpu,
  gda_v2_stock_tpu,
  mha_stock_tpu,
)
from diffjax.sharding.kernel_specs import (
  check_head_sharding,
  diff_v1_partition_specs,
  diff_v2_partition_specs,
)

__all__ = [
  "BlockSizes",
  "check_head_sharding",
  "resolve_block_sizes",
  "diff_v1_pallas_tpu",
  "diff_v2_pallas_tpu",
  "diff_v1_partition_specs",
  "diff_v2_partition_specs",
  "diff_v1_stock_tpu",
  "diff_v2_stock_tpu",
  "mha_stock_tpu",
  "DecodeBlockSizes",
  "cache_length_multiple",
  "diff_v1_decode_pallas_tpu",
  "gda_v1_pallas_tpu",
  "gda_v2_pallas_tpu",
  "gda_v1_stock_tpu",
  "gda_v2_stock_tpu",
  "gda_v1_decode_pallas_tpu",
]
