"""GPU kernels for differential attention: Mosaic GPU (Hopper) and the stock paths.

The dispatch table (:data:`diffjax.ops.dispatch.BUILTIN_KERNELS`) chooses among them.
Design: docs/kernels_gpu.md, "What runs where".
"""

from diffjax.kernels.gpu.decode import diff_v1_decode_reference
from diffjax.kernels.gpu.stock import (
  diff_v1_stock_gpu,
  diff_v2_stock_gpu,
  gda_v1_stock_gpu,
  gda_v2_stock_gpu,
  mha_stock_gpu,
)
from diffjax.sharding.kernel_specs import (
  decode_partition_specs,
  diff_v1_partition_specs,
  diff_v2_partition_specs,
)

__all__ = [
  "decode_partition_specs",
  "diff_v1_decode_reference",
  "diff_v1_partition_specs",
  "diff_v2_partition_specs",
  "diff_v1_stock_gpu",
  "diff_v2_stock_gpu",
  "gda_v1_stock_gpu",
  "gda_v2_stock_gpu",
  "mha_stock_gpu",
]

try:
  from diffjax.kernels.gpu.mosaic import diff_v1_pallas_gpu, diff_v2_pallas_gpu
  from diffjax.kernels.gpu.mosaic_decode import (
    MosaicDecodeBlockSizes,
    diff_v1_decode_pallas_gpu,
    gda_v1_decode_pallas_gpu,
  )
  from diffjax.kernels.gpu.mosaic_gda import gda_v1_pallas_gpu, gda_v2_pallas_gpu
  from diffjax.kernels.gpu.mosaic_tiles import MosaicBlockSizes
except ImportError:  # pragma: no cover - a jax without Mosaic GPU
  pass
else:
  __all__ += [
    "MosaicBlockSizes",
    "MosaicDecodeBlockSizes",
    "diff_v1_decode_pallas_gpu",
    "diff_v1_pallas_gpu",
    "diff_v2_pallas_gpu",
    "gda_v1_decode_pallas_gpu",
    "gda_v1_pallas_gpu",
    "gda_v2_pallas_gpu",
  ]
