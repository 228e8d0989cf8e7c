"""Which function runs for an op, an ``implementation=`` and a platform.

The kernel packages know nothing of the ops: this module imports each of them (a
package this installation cannot import is left out with a warning) and lists their
functions in :data:`BUILTIN_KERNELS`, the one table of what runs where. Users add
their own paths with :func:`register_implementation`.

:func:`resolve` turns the ``implementation`` a caller asked for into the one that
runs (the rules are in :mod:`diffjax.ops.attention`); :func:`call_kernel` runs a
registered function, inside ``jax.shard_map`` when a mesh is active.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from diffjax import sharding
from diffjax.core import validation as _v

IMPLEMENTATIONS = ("auto", "xla", "xla_cpu", "pallas", "pallas_tpu", "pallas_gpu", "stock")
OPS = ("mha", "diff_v1", "diff_v2")
# One query token per row against a KV cache with a valid length per row.
DECODE_OPS = ("mha_decode", "diff_v1_decode", "diff_v2_decode")


class _Unavailable:
  """Stands for a kernel module this installation cannot import: its functions are None."""

  def __init__(self, name: str, error: ImportError):
    self.name = name
    self.error = error
    # A missing optional dependency (the Pallas dialect of a backend, libtpu's splash
    # attention) is worth a warning; a stripped-down install without the package is not.
    if not str(error).startswith("No module named 'diffjax"):
      warnings.warn(f"{name} kernels unavailable: {error}", stacklevel=2)

  def __getattr__(self, attr: str) -> None:
    return None


try:
  from diffjax.kernels import cpu as cpu_kernels
except ImportError as e:  # pragma: no cover
  cpu_kernels = _Unavailable("diffjax.kernels.cpu", e)
try:
  from diffjax.kernels import tpu as tpu_kernels
except ImportError as e:  # pragma: no cover - depends on the installed jax
  tpu_kernels = _Unavailable("diffjax.kernels.tpu", e)
try:
  from diffjax.kernels.gpu import stock as gpu_stock
except ImportError as e:  # pragma: no cover
  gpu_stock = _Unavailable("diffjax.kernels.gpu.stock", e)
try:
  # Mosaic GPU may be missing from a jax; the stock GPU paths stay regardless.
  from diffjax.kernels.gpu import mosaic as gpu_mosaic
  from diffjax.kernels.gpu import mosaic_decode as gpu_mosaic_decode
  from diffjax.kernels.gpu import mosaic_tiles as gpu_mosaic_tiles
except ImportError as e:  # pragma: no cover
  gpu_mosaic = _Unavailable("diffjax.kernels.gpu.mosaic (Mosaic GPU)", e)
  gpu_mosaic_decode = gpu_mosaic_tiles = gpu_mosaic

# Every kernel that ships with diffjax. "auto" on a TPU takes the "pallas_tpu" row; on a
# GPU the "pallas_gpu" row when the Mosaic GPU kernels take the inputs (a Hopper,
# bf16/fp16, widths they tile: :func:`mosaic_gpu_takes`), else the "stock" row
# (cuDNN flash attention calls; decoding: XLA); the baseline takes "stock" on both; on a
# CPU "auto" takes the "xla_cpu" row (plain XLA laid out for CPU caches). This table
# and the rules below are the only place a GPU backend is chosen.
BUILTIN_KERNELS: tuple[tuple[str, str, str, Callable[..., Any] | None], ...] = (
  # op        implementation  platform  function
  ("mha", "xla_cpu", "cpu", cpu_kernels.mha_xla_cpu),
  ("diff_v1", "xla_cpu", "cpu", cpu_kernels.diff_v1_xla_cpu),
  ("diff_v2", "xla_cpu", "cpu", cpu_kernels.diff_v2_xla_cpu),
  ("mha", "stock", "tpu", tpu_kernels.mha_stock_tpu),
  ("diff_v1", "pallas_tpu", "tpu", tpu_kernels.diff_v1_pallas_tpu),
  ("diff_v1", "stock", "tpu", tpu_kernels.diff_v1_stock_tpu),
  ("diff_v2", "pallas_tpu", "tpu", tpu_kernels.diff_v2_pallas_tpu),
  ("diff_v2", "stock", "tpu", tpu_kernels.diff_v2_stock_tpu),
  ("mha", "stock", "gpu", gpu_stock.mha_stock_gpu),
  ("diff_v1", "pallas_gpu", "gpu", gpu_mosaic.diff_v1_pallas_gpu),
  ("diff_v1", "stock", "gpu", gpu_stock.diff_v1_stock_gpu),
  ("diff_v2", "pallas_gpu", "gpu", gpu_mosaic.diff_v2_pallas_gpu),
  ("diff_v2", "stock", "gpu", gpu_stock.diff_v2_stock_gpu),
  ("diff_v1_decode", "pallas_tpu", "tpu", tpu_kernels.diff_v1_decode_pallas_tpu),
  ("diff_v1_decode", "pallas_gpu", "gpu", gpu_mosaic_decode.diff_v1_decode_pallas_gpu),
)


@dataclasses.dataclass(frozen=True)
class _Impl:
  fn: Callable[..., Any]
  platforms: tuple[str, ...]


# (op, implementation) -> the registered _Impls (one per platform set; "stock" has a
# TPU and a GPU entry). "pallas_tpu"/"pallas_gpu" run on their own platform, or
# anywhere in interpret mode.
_REGISTRY: dict[tuple[str, str], list[_Impl]] = {}


def register_implementation(
  op: str, implementation: str, fn: Callable[..., Any], platforms: tuple[str, ...]
) -> None:
  """Registers a fast path for ``op`` ("mha", "diff_v1" or "diff_v2").

  ``fn`` receives the op's array arguments positionally and the keywords
  ``causal, q_segment_ids, kv_segment_ids, scale, block_sizes, interpret``. It
  replaces what was registered for the same op and implementation on any of
  ``platforms``.
  """
  if op not in OPS + DECODE_OPS:
    raise ValueError(f"Unknown op {op!r}; expected one of {OPS + DECODE_OPS}.")
  if implementation not in ("xla_cpu", "pallas_tpu", "pallas_gpu", "stock"):
    raise ValueError(
      f"Cannot register implementation {implementation!r}; expected "
      "'xla_cpu', 'pallas_tpu', 'pallas_gpu' or 'stock'."
    )
  entries = [
    e for e in _REGISTRY.get((op, implementation), []) if not set(e.platforms) & set(platforms)
  ]
  _REGISTRY[(op, implementation)] = entries + [_Impl(fn, tuple(platforms))]


for _op, _implementation, _platform_name, _fn in BUILTIN_KERNELS:
  if _fn is not None:
    register_implementation(_op, _implementation, _fn, platforms=(_platform_name,))


def triton_deprecated() -> bool:
  """True: diffjax has no Triton kernels (the Pallas Triton backend is deprecated from
  jax 0.11). Kept for callers that still ask; every GPU kernel is Mosaic GPU."""
  return True


def lookup(op: str, implementation: str, platform: str, interpret: bool) -> _Impl | None:
  """The registered function for ``platform``, or (interpreted kernels) any platform's."""
  entries = _REGISTRY.get((op, implementation), [])
  for impl in entries:
    if platform in impl.platforms:
      return impl
  if interpret and implementation != "stock" and entries:
    return entries[0]
  return None


_TARGET = threading.local()
HOPPER = (9, 0)


@contextlib.contextmanager
def target_platform(platform: str, gpu_capability: tuple[int, int] | None = None) -> Iterator[None]:
  """Resolves implementations for ``platform`` instead of the host backend.

  Used when compiling ahead of time for TPU topologies or GPU targets on a CPU machine,
  so that ``"auto"`` and ``"pallas"`` pick that platform's kernels. ``gpu_capability``:
  the compute capability of the target GPU ((9, 0) for an H100/H200, (8, 0) for an
  A100); None means the attached GPUs', or a Hopper when none is attached.
  """
  if platform not in ("cpu", "gpu", "tpu"):
    raise ValueError(f"platform={platform!r} must be 'cpu', 'gpu' or 'tpu'.")
  prev = getattr(_TARGET, "value", None)
  _TARGET.value = (platform, gpu_capability)
  try:
    yield
  finally:
    _TARGET.value = prev


def current_platform() -> str:
  """The platform implementations resolve for: a :func:`target_platform`, or the backend."""
  target = getattr(_TARGET, "value", None)
  return target[0] if target else jax.default_backend()


def gpu_capability() -> tuple[int, int]:
  """The compute capability the GPU code is for: a :func:`target_platform`'s, else the
  attached GPUs' lowest, else a Hopper's (lowering ahead of time with no GPU attached)."""
  target = getattr(_TARGET, "value", None)
  if target and target[1] is not None:
    return tuple(target[1])
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return HOPPER
  found = []
  for dev in devices:
    major, _, minor = str(getattr(dev, "compute_capability", "9.0")).partition(".")
    found.append((int(major), int(minor or 0)))
  return min(found) if found else HOPPER


def _common_dtype(arrays):
  dtypes = {jnp.dtype(x.dtype) for x in arrays}
  return dtypes.pop() if len(dtypes) == 1 else None


def mosaic_gpu_refusal(op: str, arrays, *, segments: bool) -> str | None:
  """Why the Mosaic GPU kernels do not take these arrays of ``op`` (None: they do).

  They take bf16 or fp16 arrays of one dtype, head and value dims that are multiples of
  16 whose tiles fit an H100's shared memory, on a Hopper (sm_90).
  """
  if getattr(gpu_mosaic_tiles, "fits", None) is None:
    return f"this jax ({jax.__version__}) has no Mosaic GPU"
  decode = op.endswith("_decode")
  if decode:
    q, k, v = arrays[0], arrays[2], arrays[4]
    dtype = _common_dtype(arrays[:5])
  else:
    q, v = arrays[0], arrays[4 if op == "diff_v1" else 2]
    dtype = _common_dtype(arrays[: 5 if op == "diff_v1" else 3])
  if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return (
      "the inputs are not all bfloat16 or all float16 (got "
      f"{sorted({jnp.dtype(x.dtype).name for x in arrays[: 5 if op != 'diff_v2' else 3]})})"
    )
  d, dv = q.shape[-1], v.shape[-1]
  if decode:
    group = q.shape[2] // max(k.shape[2], 1)
    if d % 16 or dv % 16 or group > gpu_mosaic_decode.ROWS:
      return (
        f"head dims ({d}, {dv}) must be multiples of 16 and at most "
        f"{gpu_mosaic_decode.ROWS} query heads may share a kv group (got {group})"
      )
  elif not gpu_mosaic_tiles.fits(op[-2:], dtype, d, dv, segments):
    return (
      f"head dims ({d}, {dv}) must be multiples of 16 (value dim at least 32) whose "
      "tiles fit one CTA's shared memory"
    )
  capability = gpu_capability()
  if capability != HOPPER:
    return f"the GPU is sm_{capability[0]}{capability[1]}, not a Hopper (sm_90)"
  return None


def mosaic_gpu_takes(
  op: str, arrays, *, segments: bool, block_sizes=None, interpret: bool = False
) -> bool:
  """Whether ``pallas_gpu`` runs on these arrays of ``op`` ("diff_v1"/"diff_v2"); False
  off a GPU platform (where "auto" does not ask), True in interpret mode for inputs the
  kernels take wherever they would run."""
  del block_sizes
  if op not in ("diff_v1", "diff_v2") or (current_platform() != "gpu" and not interpret):
    return False
  return mosaic_gpu_refusal(op, arrays, segments=segments) is None


def mosaic_gpu_decodes(arrays, block_sizes=None, interpret: bool = False) -> bool:
  """Whether ``pallas_gpu`` decodes DIFF V1 (q1, q2, k1, k2, v, ...) on these arrays
  (False off a GPU platform)."""
  del block_sizes
  if current_platform() != "gpu" and not interpret:
    return False
  return mosaic_gpu_refusal("diff_v1_decode", arrays, segments=False) is None


# (op, platform) -> why its fused kernel is off for this process (see demote).
_DEMOTED: dict[tuple[str, str], str] = {}


def demote(op: str, reason: str, platform: str | None = None) -> str:
  """Turns ``op``'s fused kernel off on ``platform`` (default: the current one) for the
  rest of the process: "auto", "pallas" and the named fused implementation then resolve
  to the stock path, or to XLA where the platform has none. Returns that fallback.

  :mod:`diffjax.ops.preflight` calls it for a kernel that failed on the real device.
  """
  platform = platform or current_platform()
  _DEMOTED[(op, platform)] = reason
  return _fallback(op, platform)


def demoted() -> dict[tuple[str, str], str]:
  """The (op, platform) pairs turned off by :func:`demote`, with their reasons."""
  return dict(_DEMOTED)


def clear_demotions() -> None:
  _DEMOTED.clear()


def _fallback(op: str, platform: str) -> str:
  return "stock" if lookup(op, "stock", platform, False) is not None else "xla"


def resolve(
  op: str,
  implementation: str,
  *,
  has_mask: bool,
  interpret: bool,
  float64: bool = False,
  mosaic: bool = False,
) -> str:
  """The implementation that runs: "xla", "xla_cpu", "pallas_tpu", "pallas_gpu" or
  "stock".

  ``float64``: the inputs are float64, which only the XLA path computes in float64
  (the kernels accumulate in float32), so "auto" takes it and a named kernel refuses.
  ``mosaic``: the Mosaic GPU kernels take these inputs (:func:`mosaic_gpu_takes`,
  :func:`mosaic_gpu_decodes`); on a GPU "auto" then takes ``pallas_gpu``, and
  otherwise the stock path (XLA for decoding).
  Raises ValueError, naming what can run instead, when the choice cannot run here.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}.")
  if implementation == "xla":
    return "xla"
  platform = current_platform()
  if (
    (op, platform) in _DEMOTED
    and not interpret
    and implementation in ("auto", "pallas", f"pallas_{platform}", "xla_cpu")
  ):
    return "xla" if (has_mask or float64) else _fallback(op, platform)
  if implementation == "auto":
    if has_mask or float64:
      return "xla"
    if platform == "cpu":
      return "xla_cpu" if lookup(op, "xla_cpu", platform, False) is not None else "xla"
    if platform not in ("tpu", "gpu"):
      return "xla"
    if lookup(op, f"pallas_{platform}", platform, False) is not None and (
      platform == "tpu" or mosaic
    ):
      return f"pallas_{platform}"
    # The baseline has no kernel of ours: its stock path is the standard flash kernel.
    # On a GPU, inputs the Mosaic GPU kernels do not take (float32, widths they do not
    # tile, a GPU other than a Hopper) run the DIFF ops' stock paths (cuDNN flash
    # attention calls), and decoding runs XLA.
    if (op == "mha" or platform == "gpu") and lookup(op, "stock", platform, False) is not None:
      return "stock"
    return "xla"
  if implementation == "pallas":
    if platform not in ("tpu", "gpu"):
      raise ValueError(
        f"implementation='pallas' picks the kernel of the current backend, but the backend "
        f"is {platform!r}. Use implementation='pallas_tpu' or 'pallas_gpu' with "
        "interpret=True to run a kernel in the interpreter here, or 'xla'."
      )
    implementation = f"pallas_{platform}"
  if (op, implementation) not in _REGISTRY:
    raise ValueError(f"No {implementation!r} implementation of {op!r} is available.")
  if has_mask:
    raise ValueError(
      f"implementation={implementation!r} supports causal and segment-id masks "
      "only; pass mask=None or use implementation='xla'."
    )
  if float64:
    raise ValueError(
      f"implementation={implementation!r} computes in float32; float64 inputs "
      "need implementation='xla' (or 'auto', which picks it)."
    )
  if lookup(op, implementation, platform, interpret) is None:
    where = sorted({p for e in _REGISTRY[(op, implementation)] for p in e.platforms})
    raise ValueError(
      f"implementation={implementation!r} for {op!r} runs on {where}, but the "
      f"current backend is {platform!r}. Use 'xla'"
      + (
        ", or interpret=True to run the kernel in the Pallas interpreter."
        if implementation != "stock"
        else "."
      )
    )
  if (
    implementation == "pallas_gpu"
    and platform == "gpu"
    and not interpret
    and gpu_capability() != HOPPER
  ):
    major, minor = gpu_capability()
    raise ValueError(
      f"implementation='pallas_gpu' runs Mosaic GPU kernels for Hopper "
      f"(sm_90); this GPU is sm_{major}{minor}. Use implementation='auto' "
      "or 'stock' (cuDNN flash attention calls)."
    )
  return implementation


def call_kernel(
  op: str,
  implementation: str,
  arrays: tuple[jax.Array, ...],
  *,
  causal: bool,
  segment_ids,
  scale: float | None,
  block_sizes,
  interpret: bool,
) -> jax.Array:
  """Runs the registered ``implementation`` of ``op`` on ``arrays`` (resolved already).

  Under :func:`diffjax.sharding.activation_sharding` the kernel runs per device
  inside ``jax.shard_map``: each device gets its batch rows and whole heads with their
  kv groups (:mod:`diffjax.sharding.kernel_specs`).
  """
  impl = lookup(op, implementation, current_platform(), interpret)
  b, t = jnp.shape(arrays[0])[:2]
  s = jnp.shape(arrays[2 if op == "diff_v1" else 1])[1]
  q_seg, kv_seg = _v.split_segment_ids(segment_ids, b, t, s)
  d = jnp.shape(arrays[0])[-1]
  kwargs = dict(
    causal=causal, scale=_v.default_scale(scale, d), block_sizes=block_sizes, interpret=interpret
  )
  active = sharding.current()
  if active is None:
    return impl.fn(*arrays, q_segment_ids=q_seg, kv_segment_ids=kv_seg, **kwargs)
  mesh, rules = active
  batch_axis = sharding.logical_to_spec(("batch",), rules)[0]
  head_axis = sharding.logical_to_spec(("heads",), rules)[0]
  has_seg = q_seg is not None
  in_specs, out_spec = sharding.partition_specs(op, batch_axis, head_axis, segment_ids=has_seg)

  def per_device(*args):
    if has_seg:
      *xs, qs, ks = args
    else:
      xs, qs, ks = args, None, None
    return impl.fn(*xs, q_segment_ids=qs, kv_segment_ids=ks, **kwargs)

  args = tuple(arrays) + ((q_seg, kv_seg) if has_seg else ())
  return jax.shard_map(
    per_device, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False
  )(*args)


def call_decode_kernel(
  op: str,
  implementation: str,
  arrays: tuple[jax.Array, ...],
  *,
  scale: float | None,
  block_sizes,
  interpret: bool,
) -> jax.Array:
  """Runs the registered ``implementation`` of a decode op (resolved already).

  ``arrays`` are the op's arrays with the int [B] cache lengths last. Under
  :func:`diffjax.sharding.activation_sharding` the kernel runs per device inside
  ``jax.shard_map``: batch rows over the batch axes, whole kv groups over ``tensor``.
  """
  impl = lookup(op, implementation, current_platform(), interpret)
  kwargs = dict(
    scale=_v.default_scale(scale, jnp.shape(arrays[0])[-1]),
    block_sizes=block_sizes,
    interpret=interpret,
  )
  active = sharding.current()
  if active is None:
    return impl.fn(*arrays, **kwargs)
  if op != "diff_v1_decode":
    raise ValueError(f"No PartitionSpecs for {op!r} under a mesh; use implementation='xla'.")
  mesh, rules = active
  batch_axis = sharding.logical_to_spec(("batch",), rules)[0]
  head_axis = sharding.logical_to_spec(("heads",), rules)[0]
  in_specs, out_spec = sharding.decode_partition_specs(batch_axis, head_axis)
  return jax.shard_map(
    lambda *a: impl.fn(*a, **kwargs),
    mesh=mesh,
    in_specs=in_specs,
    out_specs=out_spec,
    check_vma=False,
  )(*arrays)
