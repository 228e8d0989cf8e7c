"""The arms: one module per attention variant, each defining one :class:`ArmSpec`.

:mod:`diffjax.arms.spec` holds the registry; ``diffjax.arms.get(cfg.attention)`` answers every
question the rest of the package has about an arm (docs/model.md#an-arm-of-your-own).
"""

# They register the arms, in this order.
from diffjax.arms import diff_v1, diff_v2, gda_v1, gda_v2, transformer  # noqa: F401
from diffjax.arms.spec import (
  BASELINE,
  LAMBDA_REPORTS,
  ArmSpec,
  Retrofit,
  all_arms,
  default_names,
  get,
  module_of,
  names,
  register,
)
from diffjax.ops import preflight as _preflight


def preflight(model_cfg, *, decode: bool = False, **kwargs):
  """Preflights the fused kernels of ``model_cfg``'s arm (its op, and its decode op with
  ``decode``): :func:`diffjax.ops.preflight.preflight_model`."""
  arm = get(model_cfg.attention)
  ops = (arm.op, arm.decode_op) if decode else (arm.op,)
  return _preflight.preflight_model(model_cfg, ops, **kwargs)


__all__ = [
  "BASELINE",
  "LAMBDA_REPORTS",
  "ArmSpec",
  "Retrofit",
  "all_arms",
  "default_names",
  "get",
  "module_of",
  "names",
  "preflight",
  "register",
]
