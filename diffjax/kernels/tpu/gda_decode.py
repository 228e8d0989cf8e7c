"""Grouped differential attention (V1 style) decoding on TPUs: the DIFF V1 decode kernel
(:mod:`.decode`) with the noise heads in its second map.

The kernel takes the query rows of each kv group as one block per map: map 1 holds the
group's G = H / K signal heads (on K1), map 2 its N / K noise heads (on K2), padded to the
G rows of map 1. Each cache tile (K1, K2, V) is read once per kv group and serves every
signal and noise head of the group; each noise map is computed once, and lambda combines
it with its r signal heads after the splits are merged. r = 1 is the DIFF V1 decode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from diffjax.core import validation as _v
from diffjax.kernels.tpu._core import Interpret, interpret_mode
from diffjax.kernels.tpu.block_sizes import DecodeBlockSizes, resolve_decode_block_sizes
from diffjax.kernels.tpu.decode import _decode_maps, diff_v1_decode_pallas_tpu


@functools.partial(jax.jit, static_argnames=("scale", "blocks", "interpret"))
def _gda_decode(q1, q2, k1, k2, v, lam_H, kv_len, *, scale, blocks, interpret):
  b, _, h, d = q1.shape
  n, kh, dv = q2.shape[2], k1.shape[2], v.shape[3]
  g, nk = h // kh, n // kh  # signal and noise heads per kv group
  # Noise head m of group k goes to row m of the group's G rows; the rest are zeros.
  q2_rows = jnp.pad(q2.reshape(b, 1, kh, nk, d), ((0, 0),) * 3 + ((0, g - nk), (0, 0)))
  o = _decode_maps(
    q1, q2_rows.reshape(b, 1, h, d), k1, k2, v, kv_len, scale=scale, blocks=blocks,
    interpret=interpret,
  )  # fmt: skip
  # Signal head c of group k (c < G) takes noise row c // r of that group.
  noise_KxGxDv = jnp.repeat(o[:, 1, :, :nk], h // n, axis=2)
  lam_KxG = lam_H.astype(jnp.float32).reshape(kh, g)
  out = o[:, 0] - lam_KxG[None, :, :, None] * noise_KxGxDv
  return out.reshape(b, 1, h, dv).astype(q1.dtype)


def gda_v1_decode_pallas_tpu(
  q1_Bx1xHxD: jax.Array,
  q2_Bx1xNxD: jax.Array,
  k1_BxSxKxD: jax.Array,
  k2_BxSxKxD: jax.Array,
  v_BxSxKxDv: jax.Array,
  lam_H: jax.Array | float,
  kv_len_B: jax.Array,
  *,
  scale: float | None = None,
  block_sizes: DecodeBlockSizes | dict | None = None,
  interpret: Interpret = False,
) -> jax.Array:
  """Grouped differential attention (V1 style) of one new token per sequence against a KV
  cache, on a TPU.

  Args:
    q1_Bx1xHxD: the new token's H signal query heads; q2_Bx1xNxD: its N = H / r noise
      heads (noise head n serves signal heads n r .. n r + r - 1); N a multiple of K.
    k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H, kv_len_B, scale, block_sizes, interpret:
      as :func:`diffjax.kernels.tpu.diff_v1_decode_pallas_tpu`.
  Returns:
    [B, 1, H, Dv] in the dtype of q1; a row with ``kv_len == 0`` is zero. No gradient.
  """
  lam_H = jnp.asarray(lam_H)
  _v.check_gda_v1(q1_Bx1xHxD, q2_Bx1xNxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H)
  _v.check_decode(q1_Bx1xHxD, kv_len_B, "gda_v1_decode_pallas_tpu", wider="gda_v1_pallas_tpu")
  b, _, h, d = q1_Bx1xHxD.shape
  kw = dict(scale=scale, block_sizes=block_sizes, interpret=interpret)
  if q2_Bx1xNxD.shape[2] == h:
    return diff_v1_decode_pallas_tpu(
      q1_Bx1xHxD, q2_Bx1xNxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H, kv_len_B, **kw
    )
  blocks = resolve_decode_block_sizes(
    block_sizes,
    head_dim=d,
    value_dim=v_BxSxKxDv.shape[3],
    kv_heads=k1_BxSxKxD.shape[2],
    itemsize=k1_BxSxKxD.dtype.itemsize,
  )
  return _gda_decode(
    q1_Bx1xHxD,
    q2_Bx1xNxD,
    k1_BxSxKxD,
    k2_BxSxKxD,
    v_BxSxKxDv,
    jnp.broadcast_to(lam_H, (h,)),
    jnp.asarray(kv_len_B),
    scale=_v.default_scale(scale, d),
    blocks=blocks,
    interpret=interpret_mode(interpret),
  )
