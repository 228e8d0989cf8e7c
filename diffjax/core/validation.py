"""Shape and dtype checks shared by every implementation of the attention ops.

Each check raises ``ValueError`` naming the values it saw and the rule they break.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp


def _shape(x) -> tuple[int, ...]:
  return tuple(jnp.shape(x))


def _check_rank4(name: str, x) -> None:
  if jnp.ndim(x) != 4:
    raise ValueError(f"{name} must have rank 4 [batch, length, heads, dim]; got shape {_shape(x)}.")


def _check_float(name: str, x) -> None:
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise ValueError(f"{name} must be a floating-point array; got dtype {jnp.result_type(x)}.")


def _check_same_dtype(**arrays) -> None:
  dtypes = {k: jnp.result_type(v) for k, v in arrays.items()}
  if len(set(dtypes.values())) > 1:
    desc = ", ".join(f"{k}={v}" for k, v in dtypes.items())
    raise ValueError(
      f"Inputs must share one dtype; got {desc}. Cast them to one dtype "
      "(e.g. all bfloat16) before calling."
    )


def _check_kv(q_name, q, k_name, k, v_name, v, d_value=None) -> None:
  for n, x in ((q_name, q), (k_name, k), (v_name, v)):
    _check_rank4(n, x)
    _check_float(n, x)
  bq, _, hq, dq = _shape(q)
  bk, sk, hk, dk = _shape(k)
  bv, sv, hv, dv = _shape(v)
  if not bq == bk == bv:
    raise ValueError(f"Batch sizes differ: {q_name} {bq}, {k_name} {bk}, {v_name} {bv}.")
  if sk != sv:
    raise ValueError(f"Key and value lengths differ: {k_name} {sk}, {v_name} {sv}.")
  if hk != hv:
    raise ValueError(f"kv head counts differ: {k_name} {hk}, {v_name} {hv}.")
  if dq != dk:
    raise ValueError(f"Query and key head dims differ: {q_name} {dq}, {k_name} {dk}.")
  if hk == 0 or hq % hk:
    raise ValueError(
      f"Query heads ({q_name}: {hq}) must be a multiple of kv heads "
      f"({k_name}: {hk}) for grouped-query attention."
    )
  if d_value is not None and dv != d_value:
    raise ValueError(f"{v_name} head dim must be {d_value}; got {dv}.")


def check_mha(q, k, v) -> None:
  _check_kv("q", q, "k", k, "v", v)
  _check_same_dtype(q=q, k=k, v=v)


def check_diff_v1(q1, q2, k1, k2, v, lam) -> None:
  _check_kv("q1", q1, "k1", k1, "v", v)
  if _shape(q1) != _shape(q2):
    raise ValueError(f"q1 and q2 shapes differ: {_shape(q1)} vs {_shape(q2)}.")
  if _shape(k1) != _shape(k2):
    raise ValueError(f"k1 and k2 shapes differ: {_shape(k1)} vs {_shape(k2)}.")
  _check_same_dtype(q1=q1, q2=q2, k1=k1, k2=k2, v=v)
  h = _shape(q1)[2]
  if _shape(lam) not in ((), (h,)):
    raise ValueError(
      f"lam must be a scalar or have shape ({h},) (one per head); got shape {_shape(lam)}."
    )


def check_diff_v2(q, k, v, lam) -> None:
  _check_kv("q", q, "k", k, "v", v)
  _check_same_dtype(q=q, k=k, v=v)
  b, t, qh, _ = _shape(q)
  kh = _shape(k)[2]
  if qh % 2:
    raise ValueError(f"DIFF V2 needs an even number of query heads (pairs 2i, 2i+1); got {qh}.")
  h = qh // 2
  if h % kh:
    raise ValueError(
      f"DIFF V2 pairs ({h}) must be a multiple of kv heads ({kh}) so that both "
      "heads of a pair sit in one GQA group."
    )
  if _shape(lam) != (b, t, h):
    raise ValueError(
      f"lam must have shape (batch, length, pairs) = {(b, t, h)}; got {_shape(lam)}."
    )


def _check_groups(signal: int, noise: int, kv: int, what: str) -> None:
  if noise <= 0 or signal % noise:
    raise ValueError(
      f"{what}: the signal heads ({signal}) must be a multiple of the noise heads ({noise}), "
      "r signal heads per noise head."
    )
  if noise % kv:
    raise ValueError(
      f"{what}: the noise heads ({noise}) must be a multiple of the kv heads ({kv}), so that "
      "each group of signal heads and its noise head read one kv group."
    )


def _check_noise_queries(q1, q2, what: str) -> None:
  _check_rank4("q2", q2)
  b, t, _, d = _shape(q1)
  if _shape(q2)[:2] != (b, t) or _shape(q2)[3] != d:
    raise ValueError(
      f"{what}: q2 must be [batch, length, noise heads, dim] with batch, length and dim "
      f"{(b, t, d)} of q1; got {_shape(q2)}."
    )


def check_gda_v1(q1, q2, k1, k2, v, lam) -> None:
  what = "grouped differential attention"
  _check_kv("q1", q1, "k1", k1, "v", v)
  _check_noise_queries(q1, q2, what)
  if _shape(k1) != _shape(k2):
    raise ValueError(f"k1 and k2 shapes differ: {_shape(k1)} vs {_shape(k2)}.")
  h = _shape(q1)[2]
  _check_groups(h, _shape(q2)[2], _shape(k1)[2], what)
  _check_same_dtype(q1=q1, q2=q2, k1=k1, k2=k2, v=v)
  if _shape(lam) not in ((), (h,)):
    raise ValueError(
      f"lam must be a scalar or have shape ({h},) (one per signal head); got shape {_shape(lam)}."
    )


def check_gda_v2(q1, q2, k, v, lam) -> None:
  what = "grouped DIFF V2"
  _check_kv("q1", q1, "k", k, "v", v)
  _check_noise_queries(q1, q2, what)
  _check_groups(_shape(q1)[2], _shape(q2)[2], _shape(k)[2], what)
  _check_same_dtype(q1=q1, q2=q2, k=k, v=v)
  b, t, h, _ = _shape(q1)
  if _shape(lam) != (b, t, h):
    raise ValueError(
      f"lam must have shape (batch, length, signal heads) = {(b, t, h)}; got {_shape(lam)}."
    )


def split_segment_ids(segment_ids, batch: int, q_len: int, kv_len: int):
  """Accepts None, one [B, T] array (self-attention) or a (q [B,T], kv [B,S]) pair."""
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError(
        "segment_ids must be one [batch, length] array or a pair (q_ids, kv_ids); "
        f"got a sequence of {len(segment_ids)}."
      )
    q_seg, kv_seg = segment_ids
  else:
    q_seg = kv_seg = segment_ids
  if _shape(q_seg) != (batch, q_len):
    raise ValueError(f"query segment ids must have shape {(batch, q_len)}; got {_shape(q_seg)}.")
  if _shape(kv_seg) != (batch, kv_len):
    raise ValueError(f"key segment ids must have shape {(batch, kv_len)}; got {_shape(kv_seg)}.")
  return q_seg, kv_seg


def default_scale(scale, head_dim: int) -> float:
  return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def check_decode(q_Bx1xHxD, kv_len_B, op: str, wider: str | None = None) -> None:
  """One query token per row, and an integer [B] valid cache length per row.

  ``op`` names the function in the message; ``wider`` the one to use for T > 1.
  """
  b, t = _shape(q_Bx1xHxD)[:2]
  if t != 1:
    hint = f" Use {wider} for T > 1." if wider else ""
    raise ValueError(
      f"{op} takes one query token per row (shape [B, 1, H, D]); got q shape "
      f"{_shape(q_Bx1xHxD)}.{hint}"
    )
  kv_len_B = jnp.asarray(kv_len_B)
  if kv_len_B.shape != (b,) or not jnp.issubdtype(kv_len_B.dtype, jnp.integer):
    raise ValueError(
      f"kv_len must be an integer array of shape ({b},); got shape "
      f"{tuple(kv_len_B.shape)} and dtype {kv_len_B.dtype}."
    )


def resolve_fields(value: Any, default: Any, cls: type) -> Any:
  """A dataclass option (block sizes): None gives ``default``, an instance of ``cls`` is
  kept, and a dict overrides some fields of ``default``."""
  if value is None:
    return default
  if isinstance(value, cls):
    return value
  if isinstance(value, Mapping):
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - fields)
    if unknown:
      raise ValueError(
        f"Unknown {cls.__name__} fields {unknown}; expected some of {sorted(fields)}."
      )
    return dataclasses.replace(default, **dict(value))
  raise TypeError(
    f"block_sizes must be None, a {cls.__name__} or a dict of its fields; got "
    f"{type(value).__name__}."
  )
