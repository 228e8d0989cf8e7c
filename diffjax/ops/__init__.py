"""Arrays-in, arrays-out attention math: the reference and the dispatching ops."""

from diffjax.ops.attention import (
  diff_v1_attention,
  diff_v1_attention_core,
  diff_v1_attention_decode,
  diff_v2_attention,
  diff_v2_attention_decode,
  dot_product_attention,
  dot_product_attention_decode,
)
from diffjax.ops.dispatch import IMPLEMENTATIONS, register_implementation, target_platform
from diffjax.ops.reference import (
  diff_v1_lambda,
  diff_v1_reference,
  diff_v2_reference,
  lambda_init_for_layer,
  mha_reference,
  rms_norm,
)

__all__ = [
  "IMPLEMENTATIONS",
  "diff_v1_attention",
  "diff_v1_attention_core",
  "diff_v1_attention_decode",
  "diff_v2_attention",
  "diff_v2_attention_decode",
  "dot_product_attention",
  "dot_product_attention_decode",
  "register_implementation",
  "target_platform",
  "diff_v1_lambda",
  "diff_v1_reference",
  "diff_v2_reference",
  "lambda_init_for_layer",
  "mha_reference",
  "rms_norm",
]
