"""Content digests of checkpointed state, computed where the arrays live, and SHA-256 of the
JSON-able records: docs/training.md#checkpoints-and-resume.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def leaf_name(path) -> str:
  """A tree path as "a/b/0": dict keys, attribute names and sequence indices."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def dtype_name(x: Any) -> str:
  """The dtype of a leaf (an array, a ShapeDtypeStruct or a Python scalar) as a string."""
  return str(x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype)


def named_leaves(tree: Any) -> tuple[list[str], list[Any]]:
  """The leaves of ``tree`` with their ``leaf_name``s, in flattening order."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [leaf_name(p) for p, _ in flat], [x for _, x in flat]


def _fmix32(h_X: jax.Array) -> jax.Array:
  """MurmurHash3's finaliser: a bijection of uint32 that spreads every input bit."""
  h_X = h_X ^ (h_X >> np.uint32(16))
  h_X = h_X * np.uint32(0x85EBCA6B)
  h_X = h_X ^ (h_X >> np.uint32(13))
  h_X = h_X * np.uint32(0xC2B2AE35)
  return h_X ^ (h_X >> np.uint32(16))


def _as_words(x: jax.Array) -> jax.Array:
  """The bits of ``x`` as uint32 words (8-byte types gain a trailing axis of 2)."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size in (1, 2):
    small = jnp.uint8 if size == 1 else jnp.uint16
    return jax.lax.bitcast_convert_type(x, small).astype(jnp.uint32)
  if size == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  raise TypeError(f"Cannot digest a leaf of dtype {x.dtype}.")


def _leaf_digest(x: jax.Array) -> jax.Array:
  """Two independent uint32 sums over elements of mix(bits, global flat index)."""
  words = _as_words(jnp.asarray(x))
  shape = words.shape
  # The flat index from per-axis iotas rather than a reshape, which would make XLA
  # gather a sharded array; uint32 arithmetic wraps, which a hash does not mind.
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride % 2**32)
    stride *= shape[axis]
  # For a fixed index each lane is a bijection of the element's bits, so changing any one
  # element always changes both sums.
  lane_a = _fmix32(words ^ _fmix32(index ^ np.uint32(0x9E3779B9)))
  lane_b = _fmix32(words + _fmix32(index + np.uint32(0x7F4A7C15)))
  return jnp.stack([jnp.sum(lane_a, dtype=jnp.uint32), jnp.sum(lane_b, dtype=jnp.uint32)])


@jax.jit
def _scan_leaves(leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
  """Per leaf: its digest (uint32[N, 2]) and whether all its values are finite (bool[N])."""
  digests_Nx2 = jnp.stack([_leaf_digest(x) for x in leaves])
  finite_N = jnp.stack(
    [
      jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
      for x in leaves
    ]
  )
  return digests_Nx2, finite_N


def _to_host(x: jax.Array) -> np.ndarray:
  if x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def scan(leaves: list[Any]) -> tuple[list[str], np.ndarray]:
  """Hex digests and finite flags of ``leaves``, computed where the leaves live."""
  if not leaves:
    return [], np.zeros((0,), bool)
  digests_Nx2, finite_N = _scan_leaves(list(leaves))
  digests_Nx2 = _to_host(digests_Nx2)
  return [f"{int(a):08x}{int(b):08x}" for a, b in digests_Nx2], _to_host(finite_N)


def sha256(obj: Any) -> str:
  """Hex SHA-256 of bytes, or of a JSON-able object in a canonical form (sorted keys)."""
  blob = (
    obj
    if isinstance(obj, bytes)
    else json.dumps(json.loads(json.dumps(obj)), sort_keys=True).encode()
  )
  return hashlib.sha256(blob).hexdigest()


def per_process(hexdigest: str) -> dict[str, str]:
  """Every process's digest (each process writes its own iterator state)."""
  if jax.process_count() == 1:
    return {"0": hexdigest}
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  rows = np.asarray(
    multihost_utils.process_allgather(np.frombuffer(bytes.fromhex(hexdigest), np.uint8))
  )
  return {str(i): bytes(row.astype(np.uint8)).hex() for i, row in enumerate(rows)}


def all_processes_agree(ok: bool) -> bool:
  """Whether ``ok`` holds on every process."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  return bool(np.asarray(multihost_utils.process_allgather(np.int32(ok))).min())
