"""The ground floor: plain attention math and the argument checks every path shares.

:mod:`~diffjax.core.reference` (published as :mod:`diffjax.ops.reference`) is the arithmetic,
:mod:`~diffjax.core.validation` the checks; it imports no other diffjax (docs/architecture.md).
"""
