"""TPU (Mosaic) Pallas kernels for DIFF V1 / V2 attention and their grouped forms (GDA).

:mod:`.diff_attention`, :mod:`.gda_attention`, :mod:`.decode`, :mod:`.block_sizes` and the
splash peers (:mod:`.stock`); the dispatch table chooses among them. Design: docs/kernels_tpu.md.
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
