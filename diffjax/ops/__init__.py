"""Arrays-in, arrays-out attention math: the reference and the dispatching ops."""

from diffjax.core.op_specs import (
  DIFF_V1,
  DIFF_V1_DECODE,
  DIFF_V2,
  DIFF_V2_DECODE,
  MHA,
  MHA_DECODE,
  OpSpec,
)
from diffjax.ops.attention import (
  diff_v1_attention,
  diff_v1_attention_core,
  diff_v1_attention_decode,
  diff_v2_attention,
  diff_v2_attention_decode,
  dot_product_attention,
  dot_product_attention_decode,
  run_decode_op,
  run_op,
)
from diffjax.ops.dispatch import (
  IMPLEMENTATIONS,
  register_implementation,
  register_op,
  target_platform,
)
from diffjax.ops.reference import (
  diff_v1_lambda,
  diff_v1_reference,
  diff_v2_reference,
  lambda_init_for_layer,
  mha_reference,
  rms_norm,
)

__all__ = [
  "DIFF_V1",
  "DIFF_V1_DECODE",
  "DIFF_V2",
  "DIFF_V2_DECODE",
  "MHA",
  "MHA_DECODE",
  "OpSpec",
  "run_op",
  "run_decode_op",
  "register_op",
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
