"""GPU kernels for differential attention: Mosaic GPU (Hopper) and the stock paths.

The ops run these on GPUs (the table is :data:`diffjax.ops.dispatch.BUILTIN_KERNELS`,
which also decides which inputs each takes; this package imports nothing from
:mod:`diffjax.ops`):

* ``("diff_v1" | "diff_v2", "pallas_gpu")``: :func:`diff_v1_pallas_gpu`,
  :func:`diff_v2_pallas_gpu` (:mod:`~diffjax.kernels.gpu.mosaic`: the fused forward
  of :mod:`~diffjax.kernels.gpu.mosaic_fwd` and the one fused backward of
  :mod:`~diffjax.kernels.gpu.mosaic_bwd`; Hopper, bf16/fp16);
* ``("diff_v1_decode", "pallas_gpu")``: :func:`diff_v1_decode_pallas_gpu`
  (:mod:`~diffjax.kernels.gpu.mosaic_decode`);
* ``("mha" | "diff_v1" | "diff_v2", "stock")``: :func:`mha_stock_gpu`,
  :func:`diff_v1_stock_gpu`, :func:`diff_v2_stock_gpu` (``jax.nn.dot_product_attention``
  calls, cuDNN when it accepts them): every other GPU, dtype and width.

Tiles and budgets: :mod:`~diffjax.kernels.gpu.mosaic_tiles` (:class:`MosaicBlockSizes`).
Compiling for a GPU on a machine without one: :mod:`~diffjax.kernels.gpu.targets`
(the GPUs of :mod:`diffjax.hardware` as XLA target descriptions and compile-only devices).
"""

from diffjax.kernels.gpu.decode import diff_v1_decode_reference
from diffjax.kernels.gpu.stock import diff_v1_stock_gpu, diff_v2_stock_gpu, mha_stock_gpu
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
  "mha_stock_gpu",
]

try:
  from diffjax.kernels.gpu.mosaic import diff_v1_pallas_gpu, diff_v2_pallas_gpu
  from diffjax.kernels.gpu.mosaic_decode import MosaicDecodeBlockSizes, diff_v1_decode_pallas_gpu
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
  ]
