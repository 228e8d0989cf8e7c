"""GPU kernels for differential attention (Pallas: Mosaic GPU and Triton) and the stock paths.

The ops run these on GPUs (the table is :data:`diffjax.ops.dispatch.BUILTIN_KERNELS`;
this package imports nothing from :mod:`diffjax.ops`):

* ``("diff_v1" | "diff_v2", "pallas_gpu")``: :func:`diffjax.kernels.gpu.fused.diff_v1_gpu`
  / ``diff_v2_gpu``, which run the Mosaic GPU kernels (:mod:`diffjax.kernels.gpu.mosaic`:
  Hopper, bf16/fp16, fused forward and one fused backward) where they apply and the
  Triton kernels (:func:`diff_v1_fused`, :func:`diff_v2_fused`) elsewhere
  (:func:`diffjax.kernels.gpu.fused.backend`);
* ``("diff_v1_decode", "pallas_gpu")``: :func:`diff_v1_decode` (Triton);
* ``("mha" | "diff_v1" | "diff_v2", "stock")`` on GPU: :func:`mha_stock`,
  :func:`diff_v1_stock`, :func:`diff_v2_stock` (``jax.nn.dot_product_attention``
  calls, cuDNN when it accepts them).

Public API:
  diff_v1_fused, diff_v2_fused: fused training kernels on Triton (forward + custom VJP).
  diff_v1_mosaic, diff_v2_mosaic: the same on Mosaic GPU (Hopper; bf16/fp16).
  diff_v1_decode, diff_v1_decode_reference: one-token decode against a KV cache.
  BlockSizes, DecodeBlockSizes: tiles and launch parameters of the Triton kernels
    (the Mosaic GPU tiles: :class:`diffjax.kernels.gpu.mosaic_pair.MosaicBlockSizes`).
  diff_v1_partition_specs, diff_v2_partition_specs, decode_partition_specs:
    in/out PartitionSpecs to run a kernel per device under ``jax.shard_map`` (one
    copy for every kernel, in :mod:`diffjax.sharding.kernel_specs`).
  mha_stock, diff_v1_stock, diff_v2_stock: the stock peers.

:mod:`diffjax.kernels.gpu.mosaic_interpret` lets jax's Mosaic GPU interpreter run the
Mosaic GPU kernels on a CPU.
"""

from diffjax.kernels.gpu.block_sizes import BlockSizes, DecodeBlockSizes
from diffjax.kernels.gpu.stock import diff_v1_stock, diff_v2_stock, mha_stock
from diffjax.sharding.kernel_specs import (
    decode_partition_specs,
    diff_v1_partition_specs,
    diff_v2_partition_specs,
)

__all__ = [
    "BlockSizes", "DecodeBlockSizes", "decode_partition_specs", "diff_v1_partition_specs",
    "diff_v2_partition_specs", "diff_v1_stock", "diff_v2_stock", "mha_stock",
]

try:
  # The Triton dialect of Pallas is deprecated from jax 0.11; should a jax drop it, the
  # stock paths above stay available (the ops' dispatch table warns that the fused
  # kernels are missing).
  from diffjax.kernels.gpu.decode import diff_v1_decode, diff_v1_decode_reference
  from diffjax.kernels.gpu.diff_v1 import diff_v1_fused
  from diffjax.kernels.gpu.diff_v2 import diff_v2_fused
except ImportError:  # pragma: no cover - depends on the installed jax
  pass
else:
  __all__ += ["diff_v1_decode", "diff_v1_decode_reference", "diff_v1_fused", "diff_v2_fused"]

try:
  from diffjax.kernels.gpu.mosaic import diff_v1_mosaic, diff_v2_mosaic
except ImportError:  # pragma: no cover - a jax without Mosaic GPU
  pass
else:
  __all__ += ["diff_v1_mosaic", "diff_v2_mosaic"]
