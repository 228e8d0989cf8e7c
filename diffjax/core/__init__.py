"""The ground floor: plain attention math and the argument checks every path shares.

:mod:`diffjax.core.reference` is the arithmetic (published as
:mod:`diffjax.ops.reference`) and :mod:`diffjax.core.validation` the shape and dtype
checks. The ops and the kernels both build on these modules, so this package
imports nothing else from diffjax.
"""
