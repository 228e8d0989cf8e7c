"""Functional attention ops: baseline (MHA/GQA), DIFF V1 and DIFF V2.

Every op takes an ``implementation=`` argument:

  * ``"xla"``: the plain-JAX reference math (:mod:`diffjax.ops.reference`); runs
    everywhere and supports every mask.
  * ``"pallas"``: the fused Pallas kernel for the current backend; ``"pallas_tpu"``
    and ``"pallas_gpu"`` name a backend explicitly (with ``interpret=True`` they run
    in the Pallas interpreter on any machine, which is how CPU tests check them).
  * ``"stock"``: composes existing attention kernels the way the authors' code does
    (several calls of a standard attention kernel), as the peer the fused kernel
    must beat.
  * ``"auto"`` (default): the fused kernel on TPU and GPU when one is registered
    and the call needs no explicit ``mask`` (for the baseline, the stock flash
    kernel of the platform); the XLA path otherwise (and on CPU).

Kernels register themselves with :func:`register_implementation`, so callers never
change when a faster path appears.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

from diffjax.nn import partitioning
from diffjax.ops import reference as ref
from diffjax.ops import validation as _v

IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_tpu", "pallas_gpu", "stock")
_OPS = ("mha", "diff_v1", "diff_v2")


@dataclasses.dataclass(frozen=True)
class _Impl:
  fn: Callable[..., Any]
  platforms: tuple[str, ...]


# (op, implementation) -> the registered _Impls (one per platform set; "stock" has a
# TPU and a GPU entry). "pallas_tpu"/"pallas_gpu" run on their own platform, or
# anywhere in interpret mode.
_REGISTRY: dict[tuple[str, str], list[_Impl]] = {}


def _lookup(op: str, implementation: str, platform: str, interpret: bool) -> _Impl | None:
  entries = _REGISTRY.get((op, implementation), [])
  for impl in entries:
    if platform in impl.platforms:
      return impl
  if interpret and implementation != "stock" and entries:
    return entries[0]
  return None


_TARGET = threading.local()


@contextlib.contextmanager
def target_platform(platform: str) -> Iterator[None]:
  """Resolves implementations for ``platform`` instead of the host backend.

  Used when compiling ahead of time for TPU topologies on a CPU machine, so that
  ``"auto"`` and ``"pallas"`` pick the TPU kernels.
  """
  if platform not in ("cpu", "gpu", "tpu"):
    raise ValueError(f"platform={platform!r} must be 'cpu', 'gpu' or 'tpu'.")
  prev = getattr(_TARGET, "value", None)
  _TARGET.value = platform
  try:
    yield
  finally:
    _TARGET.value = prev


def _platform() -> str:
  return getattr(_TARGET, "value", None) or jax.default_backend()


def register_implementation(op: str, implementation: str, fn: Callable[..., Any],
                            platforms: tuple[str, ...]) -> None:
  """Registers a fast path for ``op`` ("mha", "diff_v1" or "diff_v2").

  ``fn`` receives the op's array arguments positionally and the keywords
  ``causal, q_segment_ids, kv_segment_ids, scale, block_sizes, interpret``.
  """
  if op not in _OPS:
    raise ValueError(f"Unknown op {op!r}; expected one of {_OPS}.")
  if implementation not in ("pallas_tpu", "pallas_gpu", "stock"):
    raise ValueError(f"Cannot register implementation {implementation!r}; expected "
                     "'pallas_tpu', 'pallas_gpu' or 'stock'.")
  entries = [e for e in _REGISTRY.get((op, implementation), [])
             if not set(e.platforms) & set(platforms)]
  _REGISTRY[(op, implementation)] = entries + [_Impl(fn, tuple(platforms))]


def _load_kernels() -> None:
  # Kernels import lazily so that `import diffjax` stays light; a missing kernel
  # module simply leaves its implementation unregistered.
  try:
    import diffjax.kernels  # noqa: F401  pylint: disable=import-outside-toplevel
  except ImportError:
    pass


def _resolve(op: str, implementation: str, *, has_mask: bool, interpret: bool) -> str:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}.")
  if implementation == "xla":
    return "xla"
  _load_kernels()
  platform = _platform()
  if implementation == "auto":
    if platform not in ("tpu", "gpu") or has_mask:
      return "xla"
    if _lookup(op, f"pallas_{platform}", platform, False) is not None:
      return f"pallas_{platform}"
    # The baseline has no kernel of ours: its stock path is the standard flash kernel.
    if op == "mha" and _lookup(op, "stock", platform, False) is not None:
      return "stock"
    return "xla"
  if implementation == "pallas":
    if platform not in ("tpu", "gpu"):
      raise ValueError(
          f"implementation='pallas' picks the kernel of the current backend, but the backend "
          f"is {platform!r}. Use implementation='pallas_tpu' or 'pallas_gpu' with "
          "interpret=True to run a kernel in the interpreter here, or 'xla'.")
    implementation = f"pallas_{platform}"
  if (op, implementation) not in _REGISTRY:
    raise ValueError(f"No {implementation!r} implementation of {op!r} is available.")
  if has_mask:
    raise ValueError(f"implementation={implementation!r} supports causal and segment-id masks "
                     "only; pass mask=None or use implementation='xla'.")
  if _lookup(op, implementation, platform, interpret) is None:
    where = sorted({p for e in _REGISTRY[(op, implementation)] for p in e.platforms})
    raise ValueError(
        f"implementation={implementation!r} for {op!r} runs on {where}, but the "
        f"current backend is {platform!r}. Use 'xla'"
        + (", or interpret=True to run the kernel in the Pallas interpreter." if
           implementation != "stock" else "."))
  return implementation


def _array_specs(op: str, batch, heads) -> tuple:
  """PartitionSpecs of a kernel's arrays: batch and heads split, the rest whole.

  Heads of q (and V2 pairs, which sit next to each other) and their kv heads are
  split by the same mesh axis, so every shard holds whole GQA groups.
  """
  P = jax.sharding.PartitionSpec
  x = P(batch, None, heads, None)
  if op == "mha":
    return (x, x, x)
  if op == "diff_v1":
    return (x, x, x, x, x, P(heads))
  return (x, x, x, P(batch, None, heads))


def _call(op, implementation, arrays, *, causal, segment_ids, scale, block_sizes, interpret):
  impl = _lookup(op, implementation, _platform(), interpret)
  b, t = jnp.shape(arrays[0])[:2]
  s = jnp.shape(arrays[2 if op == "diff_v1" else 1])[1]
  q_seg, kv_seg = _v.split_segment_ids(segment_ids, b, t, s)
  d = jnp.shape(arrays[0])[-1]
  kwargs = dict(causal=causal, scale=_v.default_scale(scale, d), block_sizes=block_sizes,
                interpret=interpret)
  active = partitioning.current()
  if active is None:
    return impl.fn(*arrays, q_segment_ids=q_seg, kv_segment_ids=kv_seg, **kwargs)
  # Under a mesh, kernels run per device inside shard_map: each device gets its batch
  # rows and whole heads with their kv groups.
  mesh, rules = active
  batch = partitioning.logical_to_spec(("batch",), rules)[0]
  heads = partitioning.logical_to_spec(("heads",), rules)[0]
  P = jax.sharding.PartitionSpec
  specs = _array_specs(op, batch, heads)
  seg_spec = P(batch, None)
  has_seg = q_seg is not None

  def per_device(*args):
    if has_seg:
      *xs, qs, ks = args
    else:
      xs, qs, ks = args, None, None
    return impl.fn(*xs, q_segment_ids=qs, kv_segment_ids=ks, **kwargs)

  in_specs = specs + ((seg_spec, seg_spec) if has_seg else ())
  args = tuple(arrays) + ((q_seg, kv_seg) if has_seg else ())
  return jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=specs[0],
                       check_vma=False)(*args)


def dot_product_attention(
    q_BxTxHxD: jax.Array, k_BxSxKxD: jax.Array, v_BxSxKxDv: jax.Array, *,
    causal: bool = True, segment_ids=None, mask: jax.Array | None = None,
    scale: float | None = None, implementation: str = "auto", block_sizes=None,
    interpret: bool = False) -> jax.Array:
  """Baseline multi-head / grouped-query attention.

  Args:
    q_BxTxHxD: queries; H must be a multiple of K.
    k_BxSxKxD, v_BxSxKxDv: keys and values of the K kv heads.
    causal: causal masking (queries are the last T of the S positions).
    segment_ids: None, one int [B, T] array (self-attention, T == S) or a pair
      ``(q_ids [B, T], kv_ids [B, S])``; tokens attend only within their segment.
    mask: optional boolean array broadcastable to [B, H, T, S] (True = attend).
    scale: score scale, default 1/sqrt(D).
  Returns:
    [B, T, H, Dv] in the dtype of q. Softmax runs in float32.
  """
  _v.check_mha(q_BxTxHxD, k_BxSxKxD, v_BxSxKxDv)
  impl = _resolve("mha", implementation, has_mask=mask is not None, interpret=interpret)
  if impl == "xla":
    return ref.mha_reference(q_BxTxHxD, k_BxSxKxD, v_BxSxKxDv, causal=causal,
                             segment_ids=segment_ids, mask=mask, scale=scale)
  return _call("mha", impl, (q_BxTxHxD, k_BxSxKxD, v_BxSxKxDv), causal=causal,
               segment_ids=segment_ids, scale=scale, block_sizes=block_sizes,
               interpret=interpret)


def diff_v1_attention_core(
    q1_BxTxHxD: jax.Array, q2_BxTxHxD: jax.Array, k1_BxSxKxD: jax.Array,
    k2_BxSxKxD: jax.Array, v_BxSxKxDv: jax.Array, lam: jax.Array | float, *,
    causal: bool = True, segment_ids=None, mask: jax.Array | None = None,
    scale: float | None = None, implementation: str = "auto", block_sizes=None,
    interpret: bool = False) -> jax.Array:
  """DIFF V1 differential attention before the per-head norm.

  ``out_h = (softmax(q1_h k1_g^T * scale) - lam * softmax(q2_h k2_g^T * scale)) V_g``
  with g = h // (H // K). Both maps share one value of width Dv (= 2D in the paper).

  Args:
    q1_BxTxHxD, q2_BxTxHxD: the two query components of the H DIFF heads.
    k1_BxSxKxD, k2_BxSxKxD: the two key components of the K kv groups.
    v_BxSxKxDv: the value of each kv group.
    lam: the layer's lambda, a scalar, or one per head ([H]).
    causal, segment_ids, mask, scale: as in :func:`dot_product_attention`.
  Returns:
    [B, T, H, Dv] in the dtype of q1.
  """
  lam = jnp.asarray(lam)
  _v.check_diff_v1(q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam)
  impl = _resolve("diff_v1", implementation, has_mask=mask is not None, interpret=interpret)
  if impl == "xla":
    return ref.diff_v1_reference(q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD,
                                 v_BxSxKxDv, lam, causal=causal, segment_ids=segment_ids,
                                 mask=mask, scale=scale)
  h = q1_BxTxHxD.shape[2]
  lam_H = jnp.broadcast_to(lam.astype(jnp.float32), (h,))
  return _call("diff_v1", impl,
               (q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam_H),
               causal=causal, segment_ids=segment_ids, scale=scale,
               block_sizes=block_sizes, interpret=interpret)


def diff_v1_attention(
    q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD, v_BxSxKxDv, lam, *,
    norm_gain: jax.Array | None, lambda_init: float, eps: float = 1e-5,
    **kwargs) -> jax.Array:
  """DIFF V1 head outputs with the per-head RMSNorm and the (1 - lambda_init) scale.

  ``norm_gain`` has shape [Dv] (shared by the heads of the layer) or is None for a
  gain-free norm. Other arguments as in :func:`diff_v1_attention_core`.
  Returns [B, T, H, Dv] in the dtype of q1.
  """
  out = diff_v1_attention_core(q1_BxTxHxD, q2_BxTxHxD, k1_BxSxKxD, k2_BxSxKxD,
                               v_BxSxKxDv, lam, **kwargs)
  dv = out.shape[-1]
  if norm_gain is not None and tuple(jnp.shape(norm_gain)) != (dv,):
    raise ValueError(f"norm_gain must have shape ({dv},); got {tuple(jnp.shape(norm_gain))}.")
  normed = ref.rms_norm(out, norm_gain, eps)
  return (normed.astype(jnp.float32) * (1.0 - lambda_init)).astype(out.dtype)


def diff_v2_attention(
    q_BxTxQxD: jax.Array, k_BxSxKxD: jax.Array, v_BxSxKxD: jax.Array,
    lam_BxTxH: jax.Array, *, causal: bool = True, segment_ids=None,
    mask: jax.Array | None = None, scale: float | None = None,
    implementation: str = "auto", block_sizes=None, interpret: bool = False) -> jax.Array:
  """DIFF V2 differential attention on paired query heads.

  Args:
    q_BxTxQxD: Q = 2H query heads; heads 2i and 2i+1 form pair i and share kv group
      i // (H // K).
    k_BxSxKxD, v_BxSxKxD: the baseline's keys and values.
    lam_BxTxH: per-token, per-pair lambda (already passed through a sigmoid).
  Returns:
    [B, T, H, D] in the dtype of q:
    ``softmax(q_2i K^T s) V - lam_i * softmax(q_2i+1 K^T s) V``.
  """
  _v.check_diff_v2(q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH)
  impl = _resolve("diff_v2", implementation, has_mask=mask is not None, interpret=interpret)
  if impl == "xla":
    return ref.diff_v2_reference(q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH, causal=causal,
                                 segment_ids=segment_ids, mask=mask, scale=scale)
  return _call("diff_v2", impl, (q_BxTxQxD, k_BxSxKxD, v_BxSxKxD, lam_BxTxH),
               causal=causal, segment_ids=segment_ids, scale=scale,
               block_sizes=block_sizes, interpret=interpret)
