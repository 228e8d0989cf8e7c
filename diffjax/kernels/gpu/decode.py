"""The plain-JAX reference of DIFF V1 decoding, which the GPU and TPU decode kernels match.

One query token per sequence against a KV cache, the positions at or past ``kv_len`` masked.
Design: docs/kernels_gpu.md, "The kernels" (Decode).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from diffjax.core import reference as ref


def diff_v1_decode_reference(
  q1_Bx1xHxD,
  q2_Bx1xHxD,
  k1_BxSxKxD,
  k2_BxSxKxD,
  v_BxSxKxDv,
  lam_H,
  kv_len_B,
  *,
  scale: float | None = None,
) -> jax.Array:
  """Plain-JAX decode: the reference masked by ``kv_len_B`` (clipped to [0, S]).

  Returns [B, 1, H, Dv] in the dtype of q1.
  """
  s = k1_BxSxKxD.shape[1]
  kv_len_B = jnp.clip(jnp.asarray(kv_len_B, jnp.int32), 0, s)
  mask_Bx1x1xS = (jnp.arange(s)[None, :] < kv_len_B[:, None])[:, None, None, :]
  return ref.diff_v1_reference(
    q1_Bx1xHxD,
    q2_Bx1xHxD,
    k1_BxSxKxD,
    k2_BxSxKxD,
    v_BxSxKxDv,
    lam_H,
    causal=False,
    mask=mask_Bx1x1xS,
    scale=scale,
  )
