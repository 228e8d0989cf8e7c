"""Former home of the activation-sharding context; it lives in :mod:`diffjax.sharding`.

Kept so that ``from diffjax.nn.partitioning import activation_sharding`` still works.
"""

from diffjax.sharding.rules import activation_sharding, constrain, current, logical_to_spec

__all__ = ["activation_sharding", "constrain", "current", "logical_to_spec"]
