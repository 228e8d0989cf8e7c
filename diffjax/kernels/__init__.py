"""Fused Pallas kernels for differential attention: :mod:`diffjax.kernels.tpu` and
:mod:`diffjax.kernels.gpu`; and :mod:`diffjax.kernels.cpu`, the same math in plain XLA laid
out for CPU caches.

The kernels are arrays-in, arrays-out functions built on :mod:`diffjax.core` (the
reference math and the argument checks) and :mod:`diffjax.sharding` (their
PartitionSpecs); they import nothing from :mod:`diffjax.ops`. The ops import them
and list which one runs for each ``implementation=`` and platform in
:data:`diffjax.ops.dispatch.BUILTIN_KERNELS`.
"""
