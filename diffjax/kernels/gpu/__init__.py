"""GPU kernels for differential attention (Pallas, Triton backend) and the stock GPU paths.

The ops run these on GPUs (the table is :data:`diffjax.ops.dispatch.BUILTIN_KERNELS`;
this package imports nothing from :mod:`diffjax.ops`):

* ``("diff_v1", "pallas_gpu")``: :func:`diff_v1_fused`;
* ``("diff_v2", "pallas_gpu")``: :func:`diff_v2_fused`;
* ``("mha" | "diff_v1" | "diff_v2", "stock")`` on GPU: :func:`mha_stock`,
  :func:`diff_v1_stock`, :func:`diff_v2_stock` (``jax.nn.dot_product_attention``
  calls, cuDNN when it accepts them).

Public API:
  diff_v1_fused, diff_v2_fused: fused training kernels (forward + custom VJP).
  diff_v1_decode, diff_v1_decode_reference: one-token decode against a KV cache.
  BlockSizes, DecodeBlockSizes: tiles and launch parameters.
  diff_v1_partition_specs, diff_v2_partition_specs, decode_partition_specs:
    in/out PartitionSpecs to run a kernel per device under ``jax.shard_map`` (one
    copy for every kernel, in :mod:`diffjax.sharding.kernel_specs`).
  mha_stock, diff_v1_stock, diff_v2_stock: the stock peers.

Also here, not in the dispatch table yet: :mod:`diffjax.kernels.gpu.mosaic_pair`, the
DIFF V1/V2 forward kernel for Hopper on Mosaic GPU (no backward yet), and
:mod:`diffjax.kernels.gpu.mosaic_interpret`, which lets jax's Mosaic GPU interpreter
run it on a CPU.
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
