"""Fused Pallas kernels for differential attention.

Importing this package registers every kernel that can be imported on this
installation with :func:`diffjax.ops.register_implementation`; the ops then pick
them through ``implementation=``. A backend whose Pallas dialect is missing from
the installed jax simply stays unregistered.
"""

import importlib
import warnings

for _name in ("diffjax.kernels.tpu", "diffjax.kernels.gpu"):
  try:
    importlib.import_module(_name)
  except ImportError as _e:  # pragma: no cover - depends on the installed jax
    if not str(_e).startswith("No module named 'diffjax"):
      warnings.warn(f"{_name} kernels unavailable: {_e}")
