"""The fused DIFF V1 / V2 kernels behind ``implementation="pallas_gpu"``, and V1 decoding.

Two backends implement them: Mosaic GPU (:mod:`diffjax.kernels.gpu.mosaic`: TMA,
warp-specialised ``wgmma`` kernels for Hopper, bf16/fp16, one fused backward) and
Triton (:mod:`diffjax.kernels.gpu.diff_v1`, :mod:`diffjax.kernels.gpu.diff_v2`: any
CUDA GPU and float32, deprecated by jax from 0.11). :func:`backend` picks one per call:

1. ``block_sizes`` names a backend by its type: a
   :class:`~diffjax.kernels.gpu.mosaic_pair.MosaicBlockSizes` runs Mosaic GPU, a
   :class:`~diffjax.kernels.gpu.BlockSizes` runs Triton, and so does a dict that sets
   fields only Triton's class has (any other dict is read as the chosen backend's);
2. ``interpret=True`` runs Triton: jax's Mosaic GPU interpreter needs a CPU thread per
   warpgroup and takes minutes a case (pass a ``MosaicBlockSizes`` to run it anyway);
3. Mosaic GPU runs when jax has it, the inputs are bfloat16 or float16, the widths
   suit it (multiples of 16, a value dim of at least 32, tiles within shared memory) and
   the GPU is a Hopper (compute capability 9.0; with no GPU attached, as when lowering
   ahead of time, Hopper is assumed);
4. otherwise Triton.

DIFF V1 decoding (:func:`diff_v1_decode_gpu`) follows the same rules with its own block
sizes: :class:`~diffjax.kernels.gpu.mosaic_decode.MosaicDecodeBlockSizes` or Triton's
:class:`~diffjax.kernels.gpu.DecodeBlockSizes`, and at most 64 query heads per kv group
for Mosaic GPU (:func:`decode_backend`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

try:
  from diffjax.kernels.gpu import mosaic as _mosaic
  from diffjax.kernels.gpu import mosaic_decode as _md
  from diffjax.kernels.gpu import mosaic_pair as _mp
except ImportError:  # pragma: no cover - a jax without Mosaic GPU
  _mosaic = _md = _mp = None
try:
  from diffjax.kernels.gpu import block_sizes as _bs
  from diffjax.kernels.gpu import decode as _triton_decode
  from diffjax.kernels.gpu import diff_v1 as _triton_v1
  from diffjax.kernels.gpu import diff_v2 as _triton_v2
except ImportError:  # pragma: no cover - a jax without the Triton dialect
  _bs = _triton_decode = _triton_v1 = _triton_v2 = None

_LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def hopper_target() -> bool:
  """Whether the GPU code is for a Hopper: every attached GPU is sm_90, or none is attached."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return True
  return all(str(getattr(dev, "compute_capability", "")) == "9.0" for dev in devices)


def mosaic_fits(variant: str, dtype, d: int, dv: int, segments: bool) -> bool:
  """Whether the Mosaic GPU kernels take these inputs (dtype, widths, shared memory)."""
  if _mosaic is None or dtype is None or jnp.dtype(dtype) not in _LOW_PRECISION:
    return False
  if d % 16 or dv % 16 or dv < 32:
    return False
  itemsize = jnp.dtype(dtype).itemsize
  try:
    _mp.forward_blocks(d, dv, variant, segments, itemsize)
    _mp.backward_blocks(d, dv, variant, segments, itemsize)
  except ValueError:
    return False
  return True


def _named_backend(block_sizes, mosaic_cls, triton_cls) -> str | None:
  """The backend ``block_sizes`` names: by its class, or a dict by the fields it sets
  (a dict both classes take, such as ``{}``, names neither)."""
  if mosaic_cls is not None and isinstance(block_sizes, mosaic_cls):
    return "mosaic"
  if triton_cls is not None and isinstance(block_sizes, triton_cls):
    return "triton"
  if isinstance(block_sizes, dict) and mosaic_cls is not None and triton_cls is not None:
    fields = lambda cls: {f.name for f in dataclasses.fields(cls)}
    if not set(block_sizes) <= fields(mosaic_cls) and set(block_sizes) <= fields(triton_cls):
      return "triton"
  return None


def backend(variant: str, dtype, d: int, dv: int, *, segments: bool, block_sizes=None,
            interpret: bool = False) -> str:
  """"mosaic" or "triton": the backend ``pallas_gpu`` runs (rules in the module docstring)."""
  named = _named_backend(block_sizes, getattr(_mp, "MosaicBlockSizes", None),
                         getattr(_bs, "BlockSizes", None))
  if named is not None:
    return named
  if _triton_v1 is None:
    return "mosaic"
  if interpret:
    return "triton"
  if mosaic_fits(variant, dtype, d, dv, segments) and hopper_target():
    return "mosaic"
  return "triton"


def common_dtype(*arrays):
  """The arrays' dtype when they share one, else None (which rules Mosaic GPU out)."""
  dtypes = {jnp.dtype(x.dtype) for x in arrays}
  return dtypes.pop() if len(dtypes) == 1 else None


def _require(name: str, module) -> None:
  if module is None:
    raise ValueError(f"The {name} GPU kernels are not available with jax "
                     f"{jax.__version__}; pass block_sizes=None to let the other backend run.")


def diff_v1_gpu(q1, q2, k1, k2, v, lam_H, *, q_segment_ids=None, kv_segment_ids=None,
                **kwargs):
  """Fused DIFF V1 on a GPU: Mosaic GPU or Triton by :func:`backend`; arguments as in
  :func:`diffjax.kernels.gpu.diff_v1_fused`."""
  which = backend("v1", common_dtype(q1, q2, k1, k2, v), q1.shape[-1], v.shape[-1],
                  segments=q_segment_ids is not None,
                  block_sizes=kwargs.get("block_sizes"),
                  interpret=kwargs.get("interpret", False))
  if which == "mosaic":
    _require("Mosaic", _mosaic)
    return _mosaic.diff_v1_mosaic(q1, q2, k1, k2, v, lam_H, q_segment_ids=q_segment_ids,
                                  kv_segment_ids=kv_segment_ids, **kwargs)
  _require("Triton", _triton_v1)
  return _triton_v1.diff_v1_fused(q1, q2, k1, k2, v, lam_H, q_segment_ids=q_segment_ids,
                                  kv_segment_ids=kv_segment_ids, **kwargs)


def diff_v2_gpu(q, k, v, lam_BxTxH, *, q_segment_ids=None, kv_segment_ids=None, **kwargs):
  """Fused DIFF V2 on a GPU: Mosaic GPU or Triton by :func:`backend`; arguments as in
  :func:`diffjax.kernels.gpu.diff_v2_fused`."""
  which = backend("v2", common_dtype(q, k, v), q.shape[-1], v.shape[-1],
                  segments=q_segment_ids is not None,
                  block_sizes=kwargs.get("block_sizes"),
                  interpret=kwargs.get("interpret", False))
  if which == "mosaic":
    _require("Mosaic", _mosaic)
    return _mosaic.diff_v2_mosaic(q, k, v, lam_BxTxH, q_segment_ids=q_segment_ids,
                                  kv_segment_ids=kv_segment_ids, **kwargs)
  _require("Triton", _triton_v2)
  return _triton_v2.diff_v2_fused(q, k, v, lam_BxTxH, q_segment_ids=q_segment_ids,
                                  kv_segment_ids=kv_segment_ids, **kwargs)


def decode_backend(dtype, d: int, dv: int, group: int, *, block_sizes=None,
                   interpret: bool = False) -> str:
  """"mosaic" or "triton" for DIFF V1 decoding (rules in the module docstring)."""
  named = _named_backend(block_sizes, getattr(_md, "MosaicDecodeBlockSizes", None),
                         getattr(_bs, "DecodeBlockSizes", None))
  if named is not None:
    return named
  if _triton_decode is None:
    return "mosaic"
  if interpret or _md is None or dtype is None:
    return "triton"
  fits = (jnp.dtype(dtype) in _LOW_PRECISION and not d % 16 and not dv % 16
          and group <= _md.ROWS)
  if fits:
    try:
      _md.decode_stages(d, dv, jnp.dtype(dtype).itemsize)
    except ValueError:
      fits = False
  return "mosaic" if fits and hopper_target() else "triton"


def diff_v1_decode_gpu(q1, q2, k1, k2, v, lam_H, kv_len, **kwargs):
  """DIFF V1 decoding on a GPU: Mosaic GPU or Triton by :func:`decode_backend`;
  arguments as in :func:`diffjax.kernels.gpu.diff_v1_decode`."""
  which = decode_backend(common_dtype(q1, q2, k1, k2, v), q1.shape[-1], v.shape[-1],
                         q1.shape[2] // max(k1.shape[2], 1),
                         block_sizes=kwargs.get("block_sizes"),
                         interpret=kwargs.get("interpret", False))
  if which == "mosaic":
    _require("Mosaic", _md)
    return _md.diff_v1_decode_mosaic(q1, q2, k1, k2, v, lam_H, kv_len, **kwargs)
  _require("Triton", _triton_decode)
  return _triton_decode.diff_v1_decode(q1, q2, k1, k2, v, lam_H, kv_len, **kwargs)
