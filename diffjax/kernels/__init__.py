"""Fused Pallas kernels for differential attention (:mod:`.tpu`, :mod:`.gpu`) and the CPU path.

Arrays-in, arrays-out functions built on :mod:`diffjax.core` (the reference math and the
argument checks) and :mod:`diffjax.sharding` (their PartitionSpecs). They import nothing
from :mod:`diffjax.ops`, whose dispatch table chooses among them (docs/architecture.md).
"""
