"""What every layer asks of an attention op, in one frozen :class:`OpSpec` per op.

Its arrays' roles and logical axes, reference math, input checks and softmax maps, read by the
dispatcher, the kernel sharding, the ring and the preflight (docs/architecture.md, "Dispatch").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from diffjax.core import reference as ref
from diffjax.core import validation
from diffjax.core.dtypes import accumulation_dtype

# Logical axes of a [B, T, heads, D] array (queries, keys, values alike).
TOKENS = ("batch", "length", "heads", None)


def _same(xs):
  return tuple(xs)


def _join_same(dqs, qs):
  del qs
  return tuple(dqs)


@dataclasses.dataclass(frozen=True)
class OpSpec:
  """One attention op.

  Attributes:
    name: the op's name in the dispatch table (``"diff_v1"``).
    arrays: the names of its positional arrays, in order.
    axes: each array's logical axes (``"batch"``, ``"length"``, ``"heads"`` or None).
    reference: the plain-JAX math, ``reference(*arrays, causal=, segment_ids=, mask=,
      scale=)``; decode ops take ``(*arrays, scale=)`` with the cache lengths last.
    check: ``check(*arrays)`` raises ValueError naming a bad shape or dtype.
    queries, keys: the indices of the query and key arrays.
    value: the index of the value array.
    lam: the index of lambda, or None (one softmax map).
    map_keys: for each softmax map, the position in ``keys`` of the keys it reads.
    split_maps: the query arrays -> each map's queries [B, T, H, D] (H: output heads).
    join_maps: ``(each map's query gradient, the query arrays)`` -> the query arrays'
      gradients.
    lam_per_token: ``(lam, batch, length, heads) -> [B, T, H]`` lambda in float32 (float64).
    to_kernel: the arrays as the kernels take them (DIFF V1: lambda as float32 [H]).
    example: ``(dtype, head_dim, group, length) -> arrays``: a small valid input with one kv
      group of ``group`` output heads (the preflight and the tests use it).
    decode: one query token per row against a cache; the int [B] lengths come last.
  """

  name: str
  arrays: tuple[str, ...]
  axes: tuple[tuple[str | None, ...], ...]
  reference: Callable[..., Any]
  check: Callable[..., None]
  queries: tuple[int, ...]
  keys: tuple[int, ...]
  value: int
  lam: int | None = None
  map_keys: tuple[int, ...] = (0,)
  split_maps: Callable[[tuple], list] = _same
  join_maps: Callable[[list, tuple], tuple] = _join_same
  lam_per_token: Callable[..., jax.Array] | None = None
  to_kernel: Callable[[tuple], tuple] = _same
  example: Callable[..., tuple] | None = None
  decode: bool = False

  @property
  def maps(self) -> int:
    """Softmax maps per output head: 1 (the baseline) or 2 (DIFF)."""
    return len(self.map_keys)

  def query(self, arrays):
    return arrays[self.queries[0]]

  def key(self, arrays):
    return arrays[self.keys[0]]


def _normal(dtype):
  keys = jax.random.split(jax.random.key(0), 8)
  return lambda i, shape: jax.random.normal(keys[i], shape, jnp.float32).astype(dtype)


# ------------------------------------------------------------------------------------------
# The baseline: multi-head / grouped-query attention.


def _mha_example(dtype, d: int, group: int, t: int):
  n = _normal(dtype)
  return (n(0, (1, t, group, d)), n(1, (1, t, 1, d)), n(2, (1, t, 1, d)))


MHA = OpSpec(
  name="mha",
  arrays=("q", "k", "v"),
  axes=(TOKENS,) * 3,
  reference=ref.mha_reference,
  check=validation.check_mha,
  queries=(0,),
  keys=(1,),
  value=2,
  example=_mha_example,
)


# ------------------------------------------------------------------------------------------
# DIFF V1: two query and key components per head, one lambda per head (or layer).


def _v1_lam_per_token(lam, b: int, t: int, h: int):
  lam = jnp.asarray(lam)
  acc = accumulation_dtype(lam.dtype)
  return jnp.broadcast_to(jnp.broadcast_to(lam.astype(acc), (h,))[None, None, :], (b, t, h))


def _v1_to_kernel(arrays):
  *rest, lam = arrays
  acc = accumulation_dtype(rest[0].dtype)  # float32 for the kernels' inputs
  return (*rest, jnp.broadcast_to(jnp.asarray(lam).astype(acc), (rest[0].shape[2],)))


def _v1_example(dtype, d: int, group: int, t: int, noise: int | None = None):
  n = _normal(dtype)
  return (
    n(0, (1, t, group, d)),
    n(1, (1, t, noise or group, d)),
    n(2, (1, t, 1, d)),
    n(3, (1, t, 1, d)),
    n(4, (1, t, 1, 2 * d)),
    jnp.linspace(0.2, 0.8, group).astype(jnp.float32),
  )


DIFF_V1 = OpSpec(
  name="diff_v1",
  arrays=("q1", "q2", "k1", "k2", "v", "lam"),
  axes=(TOKENS,) * 5 + (("heads",),),
  reference=ref.diff_v1_reference,
  check=validation.check_diff_v1,
  queries=(0, 1),
  keys=(2, 3),
  value=4,
  lam=5,
  map_keys=(0, 1),
  lam_per_token=_v1_lam_per_token,
  to_kernel=_v1_to_kernel,
  example=_v1_example,
)


# ------------------------------------------------------------------------------------------
# DIFF V2: query heads 2i and 2i+1 form pair i over the baseline's keys; lambda per token.


def _v2_split(qs):
  return list(ref.split_pairs(qs[0]))


def _v2_join(dqs, qs):
  del qs
  b, t, h, d = dqs[0].shape
  return (jnp.stack(dqs, axis=3).reshape(b, t, 2 * h, d),)


def _v2_lam_per_token(lam, b: int, t: int, h: int):
  del b, t, h
  return lam.astype(accumulation_dtype(lam.dtype))


def _v2_example(dtype, d: int, group: int, t: int):
  n = _normal(dtype)
  keys = jax.random.split(jax.random.key(0), 8)
  return (
    n(0, (1, t, 2 * group, d)),
    n(1, (1, t, 1, d)),
    n(2, (1, t, 1, d)),
    jax.nn.sigmoid(jax.random.normal(keys[5], (1, t, group))),
  )


DIFF_V2 = OpSpec(
  name="diff_v2",
  arrays=("q", "k", "v", "lam"),
  axes=(TOKENS,) * 3 + (("batch", "length", "heads"),),
  reference=ref.diff_v2_reference,
  check=validation.check_diff_v2,
  queries=(0,),
  keys=(1,),
  value=2,
  lam=3,
  map_keys=(0, 0),
  split_maps=_v2_split,
  join_maps=_v2_join,
  lam_per_token=_v2_lam_per_token,
  example=_v2_example,
)


# ------------------------------------------------------------------------------------------
# Grouped differential attention: r signal heads share one noise head (r = 1: DIFF V1/V2).
# The ring and the stock paths run the noise map once per signal head (split_maps repeats
# it, join_maps sums its gradient over the group); the reference and the kernels that take
# the grouped form run it once per group.


def _split_grouped(qs):
  """(signal [B, T, H, D], noise [B, T, N, D]) -> each map's queries: the noise heads
  repeated over their groups of r = H / N signal heads."""
  q1, q2 = qs
  return [q1, jnp.repeat(q2, q1.shape[2] // q2.shape[2], axis=2)]


def _join_grouped(dqs, qs):
  """The repeated noise heads' gradients summed over each group."""
  dq1, dq2_rep = dqs
  b, t, h, d = dq2_rep.shape
  n = qs[1].shape[2]
  return (dq1, dq2_rep.reshape(b, t, n, h // n, d).sum(axis=3))


def _example_noise(group: int) -> int:
  """The noise heads of an example with ``group`` signal heads per kv group (r <= 4)."""
  return group // next(r for r in (4, 3, 2, 1) if group % r == 0)


def _gda_v1_example(dtype, d: int, group: int, t: int):
  return _v1_example(dtype, d, group, t, noise=_example_noise(group))


# DIFF V1's arrays, with q2 of N heads.
GDA_V1 = dataclasses.replace(
  DIFF_V1,
  name="gda_v1",
  reference=ref.gda_v1_reference,
  check=validation.check_gda_v1,
  split_maps=_split_grouped,
  join_maps=_join_grouped,
  example=_gda_v1_example,
)


def _gda_v2_example(dtype, d: int, group: int, t: int):
  n = _normal(dtype)
  keys = jax.random.split(jax.random.key(0), 8)
  return (
    n(0, (1, t, group, d)),
    n(1, (1, t, _example_noise(group), d)),
    n(2, (1, t, 1, d)),
    n(3, (1, t, 1, d)),
    jax.nn.sigmoid(jax.random.normal(keys[5], (1, t, group))),
  )


GDA_V2 = OpSpec(
  name="gda_v2",
  arrays=("q1", "q2", "k", "v", "lam"),
  axes=(TOKENS,) * 4 + (("batch", "length", "heads"),),
  reference=ref.gda_v2_reference,
  check=validation.check_gda_v2,
  queries=(0, 1),
  keys=(2,),
  value=3,
  lam=4,
  map_keys=(0, 0),
  split_maps=_split_grouped,
  join_maps=_join_grouped,
  lam_per_token=_v2_lam_per_token,
  example=_gda_v2_example,
)


# ------------------------------------------------------------------------------------------
# Decoding: one new token per row against a cache of S slots, of which the first kv_len[b]
# are valid (the new token's own key and value included).


def length_mask(kv_len_B: jax.Array, s: int) -> jax.Array:
  """[B, 1, 1, S]: slot j of row b is visible when j < kv_len[b]."""
  kv_len_B = jnp.asarray(kv_len_B, jnp.int32)
  return (jnp.arange(s, dtype=jnp.int32)[None, :] < kv_len_B[:, None])[:, None, None, :]


def _decode_of(spec: OpSpec) -> OpSpec:
  """The decode op of a training op: its arrays plus the cache lengths."""

  def reference(*arrays, scale=None):
    *xs, kv_len_B = arrays
    s = xs[spec.keys[0]].shape[1]
    return spec.reference(*xs, causal=False, mask=length_mask(kv_len_B, s), scale=scale)

  def check(*arrays):
    *xs, kv_len_B = arrays
    spec.check(*xs)
    validation.check_decode(xs[spec.queries[0]], kv_len_B, "decode attention")

  def example(dtype, d: int, group: int, s: int):
    # The training op's input over S positions, its per-token arrays but the keys and value
    # cut to the first query token.
    cache = set(spec.keys) | {spec.value}
    arrays = [
      x if i in cache or "length" not in axes else x[:, :1]
      for i, (x, axes) in enumerate(zip(spec.example(dtype, d, group, s), spec.axes))
    ]
    return (*arrays, jnp.array([s - 7], jnp.int32))

  return dataclasses.replace(
    spec,
    name=f"{spec.name}_decode",
    arrays=(*spec.arrays, "kv_len"),
    axes=(*spec.axes, ("batch",)),
    reference=reference,
    check=check,
    to_kernel=lambda arrays: (*spec.to_kernel(tuple(arrays[:-1])), arrays[-1]),
    example=example,
    decode=True,
  )


MHA_DECODE = _decode_of(MHA)
DIFF_V1_DECODE = _decode_of(DIFF_V1)
DIFF_V2_DECODE = _decode_of(DIFF_V2)
GDA_V1_DECODE = _decode_of(GDA_V1)
GDA_V2_DECODE = _decode_of(GDA_V2)

BUILTIN_OPS = (
  MHA,
  DIFF_V1,
  DIFF_V2,
  GDA_V1,
  GDA_V2,
  MHA_DECODE,
  DIFF_V1_DECODE,
  DIFF_V2_DECODE,
  GDA_V1_DECODE,
  GDA_V2_DECODE,
)
