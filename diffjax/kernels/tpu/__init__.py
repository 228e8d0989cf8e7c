"""TPU (Mosaic) Pallas kernels for DIFF V1 and DIFF V2 attention.

The ops run these for the TPU platform (the table is
:data:`diffjax.ops.dispatch.BUILTIN_KERNELS`):

  * ``("diff_v1", "pallas_tpu")`` and ``("diff_v2", "pallas_tpu")``: the fused
    kernels of :mod:`diffjax.kernels.tpu.diff_attention`;
  * ``("diff_v1", "stock")`` and ``("diff_v2", "stock")``: the authors' composition
    of standard attention calls, here jax's splash attention
    (:mod:`diffjax.kernels.tpu.stock`), as the peer the fused kernels must beat;
  * ``("mha", "stock")``: one splash call, the baseline's flash kernel (what
    ``implementation="auto"`` runs for the Transformer arm on a TPU);
  * ``("diff_v1_decode", "pallas_tpu")``: one new token against a KV cache
    (:mod:`diffjax.kernels.tpu.decode`), reading K1, K2 and V once.
This package imports nothing from :mod:`diffjax.ops`.

Public API: :func:`diff_v1_pallas_tpu`, :func:`diff_v2_pallas_tpu`,
:class:`BlockSizes`, :func:`diff_v1_partition_specs`, :func:`diff_v2_partition_specs`
(with :func:`check_head_sharding`; one copy for every kernel, in
:mod:`diffjax.sharding.kernel_specs`),
:func:`diff_v1_stock_tpu`, :func:`diff_v2_stock_tpu`, the baseline peer
:func:`mha_stock_tpu` (one splash call), and the decode kernel
:func:`diff_v1_decode_pallas_tpu` with its :class:`DecodeBlockSizes` and
:func:`cache_length_multiple`.
"""

from diffjax.kernels.tpu.block_sizes import BlockSizes, DecodeBlockSizes, resolve_block_sizes
from diffjax.kernels.tpu.decode import cache_length_multiple, diff_v1_decode_pallas_tpu
from diffjax.kernels.tpu.diff_attention import diff_v1_pallas_tpu, diff_v2_pallas_tpu
from diffjax.kernels.tpu.stock import diff_v1_stock_tpu, diff_v2_stock_tpu, mha_stock_tpu
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
]
