"""The plain-JAX reference math, published here for users of the ops.

The code lives in :mod:`diffjax.core.reference`, below both the ops and the kernels
(which test against it); this module is its public name.
"""

from diffjax.core.reference import (
  attention_probs,
  build_mask,
  diff_v1_lambda,
  diff_v1_reference,
  diff_v2_reference,
  gda_v1_reference,
  gda_v2_reference,
  lambda_init_for_layer,
  masked_softmax,
  merge_partials,
  mha_reference,
  rms_norm,
  split_groups,
)

__all__ = [
  "attention_probs",
  "build_mask",
  "diff_v1_lambda",
  "diff_v1_reference",
  "diff_v2_reference",
  "gda_v1_reference",
  "gda_v2_reference",
  "lambda_init_for_layer",
  "split_groups",
  "masked_softmax",
  "merge_partials",
  "mha_reference",
  "rms_norm",
]
