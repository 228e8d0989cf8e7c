"""Which function computes an op: per op and platform, the first implementation that takes it.

:data:`BUILTIN_KERNELS` rows take the op's arrays, then ``causal, q_segment_ids, kv_segment_ids,
scale, block_sizes, interpret`` (decode ops: the last three). Design: docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from diffjax import sharding
from diffjax.core import op_specs, validation
from diffjax.core.config import IMPLEMENTATIONS
from diffjax.core.op_specs import OpSpec
from diffjax.core.platform import (
  current_device_kind,
  current_platform,
  gpu_capability,
  target_platform,
)
from diffjax.kernels.gpu import measured as gpu_measured

__all__ = [
  "BUILTIN_KERNELS",
  "IMPLEMENTATIONS",
  "Implementation",
  "check_kernel_split",
  "choose",
  "current_platform",
  "demote",
  "gpu_capability",
  "kernel_axes",
  "markdown_table",
  "register_implementation",
  "register_op",
  "rows",
  "run",
  "target_platform",
]


class _Unavailable:
  """Stands for a kernel module this installation cannot import: its functions are None."""

  def __init__(self, name: str, error: ImportError):
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
  from diffjax.kernels.tpu import blocks as tpu_blocks
except ImportError as e:  # pragma: no cover - depends on the installed jax
  tpu_kernels = tpu_blocks = _Unavailable("diffjax.kernels.tpu", e)
try:
  from diffjax.kernels.gpu import stock as gpu_stock
except ImportError as e:  # pragma: no cover
  gpu_stock = _Unavailable("diffjax.kernels.gpu.stock", e)
try:
  # Mosaic GPU may be missing from a jax; the stock GPU paths stay regardless.
  from diffjax.kernels.gpu import mosaic as gpu_mosaic
  from diffjax.kernels.gpu import mosaic_decode as gpu_mosaic_decode
  from diffjax.kernels.gpu import mosaic_gda as gpu_mosaic_gda
  from diffjax.kernels.gpu import mosaic_ring as gpu_mosaic_ring
except ImportError as e:  # pragma: no cover
  gpu_mosaic = _Unavailable("diffjax.kernels.gpu.mosaic (Mosaic GPU)", e)
  gpu_mosaic_decode = gpu_mosaic_ring = gpu_mosaic
  gpu_mosaic_gda = gpu_mosaic


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One row of the dispatch table.

  Attributes:
    op: the op's name (:attr:`OpSpec.name`).
    name: the ``implementation=`` value that names it.
    fn: the function (see the module docstring for how it is called).
    platforms: where it runs.
    interpretable: a Pallas kernel that runs anywhere with ``interpret=True``.
    ring_blocks: its per-block functions for the context-parallel ring (the protocol of
      :mod:`diffjax.ops.ring_blocks`), or None: the ring then runs XLA blocks.
    ring_options: keyword arguments the ring blocks' ``block_config`` takes for this op.
  """

  op: str
  name: str
  fn: Callable[..., Any]
  platforms: tuple[str, ...]
  interpretable: bool = False
  ring_blocks: Any = None
  ring_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def qualified_name(self) -> str:
    return f"{self.fn.__module__}.{self.fn.__name__}"


def _row(op, name, platform, fn, ring=None, **ring_options) -> Implementation | None:
  if fn is None:
    return None
  return Implementation(op, name, fn, (platform,), name.startswith("pallas_"), ring, ring_options)


# Every kernel that ships with diffjax, in order of preference per op and platform: "auto"
# takes the first row of the platform that accepts the inputs, then XLA. On a CPU the
# "xla_cpu" rows (plain XLA laid out for CPU caches); on a TPU the fused Pallas kernels,
# the baseline's splash attention, and the stock DIFF paths for a kernel the preflight
# switched off; on a GPU the Mosaic GPU kernels (a Hopper, bf16/fp16, widths they tile),
# else the stock paths (cuDNN flash attention calls).
_ALL_ROWS = (
  _row("mha", "xla_cpu", "cpu", cpu_kernels.mha_xla_cpu),
  _row("diff_v1", "xla_cpu", "cpu", cpu_kernels.diff_v1_xla_cpu),
  _row("diff_v2", "xla_cpu", "cpu", cpu_kernels.diff_v2_xla_cpu),
  _row("gda_v1", "xla_cpu", "cpu", cpu_kernels.gda_v1_xla_cpu),
  _row("gda_v2", "xla_cpu", "cpu", cpu_kernels.gda_v2_xla_cpu),
  _row("mha", "stock", "tpu", tpu_kernels.mha_stock_tpu),
  _row("diff_v1", "pallas_tpu", "tpu", tpu_kernels.diff_v1_pallas_tpu, tpu_blocks, version=1),
  _row("diff_v1", "stock", "tpu", tpu_kernels.diff_v1_stock_tpu),
  _row("diff_v2", "pallas_tpu", "tpu", tpu_kernels.diff_v2_pallas_tpu, tpu_blocks, version=2),
  _row("diff_v2", "stock", "tpu", tpu_kernels.diff_v2_stock_tpu),
  _row("gda_v1", "pallas_tpu", "tpu", tpu_kernels.gda_v1_pallas_tpu),
  _row("gda_v1", "stock", "tpu", tpu_kernels.gda_v1_stock_tpu),
  _row("gda_v2", "pallas_tpu", "tpu", tpu_kernels.gda_v2_pallas_tpu),
  _row("gda_v2", "stock", "tpu", tpu_kernels.gda_v2_stock_tpu),
  _row("gda_v1_decode", "pallas_tpu", "tpu", tpu_kernels.gda_v1_decode_pallas_tpu),
  _row("mha", "stock", "gpu", gpu_stock.mha_stock_gpu),
  _row("diff_v1", "pallas_gpu", "gpu", gpu_mosaic.diff_v1_pallas_gpu, gpu_mosaic_ring, version=1),
  _row("diff_v1", "stock", "gpu", gpu_stock.diff_v1_stock_gpu),
  _row("diff_v2", "pallas_gpu", "gpu", gpu_mosaic.diff_v2_pallas_gpu, gpu_mosaic_ring, version=2),
  _row("diff_v2", "stock", "gpu", gpu_stock.diff_v2_stock_gpu),
  _row("gda_v1", "pallas_gpu", "gpu", gpu_mosaic_gda.gda_v1_pallas_gpu),
  _row("gda_v1", "stock", "gpu", gpu_stock.gda_v1_stock_gpu),
  _row("gda_v2", "pallas_gpu", "gpu", gpu_mosaic_gda.gda_v2_pallas_gpu),
  _row("gda_v2", "stock", "gpu", gpu_stock.gda_v2_stock_gpu),
  _row("diff_v1_decode", "pallas_tpu", "tpu", tpu_kernels.diff_v1_decode_pallas_tpu),
  _row("diff_v1_decode", "pallas_gpu", "gpu", gpu_mosaic_decode.diff_v1_decode_pallas_gpu),
  _row("gda_v1_decode", "pallas_gpu", "gpu", gpu_mosaic_decode.gda_v1_decode_pallas_gpu),
)
BUILTIN_KERNELS: tuple[Implementation, ...] = tuple(r for r in _ALL_ROWS if r is not None)

# The ops the table serves, by name (an arm with an op of its own registers it).
OPS: dict[str, OpSpec] = {spec.name: spec for spec in op_specs.BUILTIN_OPS}
# op -> its rows, in order of preference.
_TABLE: dict[str, list[Implementation]] = {}
# Names a row may have: what a caller can ask for by name.
_NAMED = tuple(n for n in IMPLEMENTATIONS if n not in ("auto", "xla", "pallas"))


def register_op(spec: OpSpec) -> None:
  """Makes ``spec`` known to the table, so implementations can be registered for it."""
  OPS[spec.name] = spec


def register_implementation(
  op: str,
  implementation: str,
  fn: Callable[..., Any],
  platforms: tuple[str, ...],
  *,
  ring_blocks: Any = None,
  ring_options: Mapping[str, Any] | None = None,
) -> None:
  """Registers ``fn`` as ``implementation`` of ``op`` on ``platforms``.

  It replaces what was registered for the same op and implementation on any of
  ``platforms`` (in its place in the order of preference); a new row comes after the
  op's existing rows. ``fn`` is called as the module docstring says, and may raise
  ``NotImplementedError(reason)`` for inputs it does not take.
  """
  if op not in OPS:
    raise ValueError(f"Unknown op {op!r}; expected one of {tuple(OPS)} (or register_op it).")
  if implementation not in _NAMED:
    raise ValueError(
      f"Cannot register implementation {implementation!r}; expected one of {_NAMED}."
    )
  pallas = implementation.startswith("pallas_")
  new = Implementation(
    op, implementation, fn, tuple(platforms), pallas, ring_blocks, dict(ring_options or {})
  )
  rows_ = _TABLE.setdefault(op, [])
  same = [
    i for i, r in enumerate(rows_) if r.name == implementation and set(r.platforms) & set(platforms)
  ]
  if same:
    rows_[same[0]] = new
    for i in reversed(same[1:]):
      del rows_[i]
  else:
    rows_.append(new)


for _r in BUILTIN_KERNELS:
  _TABLE.setdefault(_r.op, []).append(_r)


def rows(op: str) -> list[Implementation]:
  """The rows of ``op``, in order of preference (a copy)."""
  return list(_TABLE.get(op, ()))


def markdown_table() -> str:
  """The built-in rows as the markdown table of docs/architecture.md."""
  lines = ["| op | implementation | platform | function |", "|---|---|---|---|"]
  for r in BUILTIN_KERNELS:
    lines.append(f"| `{r.op}` | `{r.name}` | {r.platforms[0]} | `{r.qualified_name}` |")
  return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# Rows switched off for this process (the preflight), and the record of what ran.

# (op, platform, implementation) -> why it was switched off.
_DEMOTED: dict[tuple[str, str, str], str] = {}
_RECORD = threading.local()


def demote(op: str, implementation: str, reason: str, platform: str | None = None) -> str:
  """Switches ``implementation`` of ``op`` off on ``platform`` (default: the current one)
  for the rest of the process: it refuses every input, so ``"auto"`` (and a call naming
  it) takes the next row. Returns the name of that row ("xla" when none is left).

  :mod:`diffjax.ops.preflight` calls it for a kernel that failed on the real device.
  """
  platform = platform or current_platform()
  _DEMOTED[(op, platform, implementation)] = reason
  left = [r.name for r in _platform_rows(op, platform) if not _demoted(r, platform)]
  return left[0] if left else "xla"


def _demoted(row: Implementation, platform: str) -> str | None:
  return _DEMOTED.get((row.op, platform, row.name))


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
  """Collects the name of every implementation that runs (is traced) in the block."""
  prev = getattr(_RECORD, "names", None)
  _RECORD.names = names = []
  try:
    yield names
  finally:
    _RECORD.names = prev


def _record(name: str) -> None:
  names = getattr(_RECORD, "names", None)
  if names is not None:
    names.append(name)


# ------------------------------------------------------------------------------------------
# Choosing and running.

XLA = "xla"


def _platform_rows(op: str, platform: str) -> list[Implementation]:
  return [r for r in _TABLE.get(op, ()) if platform in r.platforms]


def candidates(op: str, implementation: str, interpret: bool) -> list[Implementation | str]:
  """What ``implementation`` may run for ``op`` here, in the order tried (``"xla"``: the
  reference math). Raises ValueError when the choice names nothing that can run here."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}.")
  platform = current_platform()
  if implementation == XLA:
    return [XLA]
  if implementation == "auto":
    return [*_platform_rows(op, platform), XLA]
  if implementation == "pallas":
    if platform not in ("tpu", "gpu"):
      raise ValueError(
        "implementation='pallas' picks the kernel of the current backend, but the backend "
        f"is {platform!r}. Use implementation='pallas_tpu' or 'pallas_gpu' with "
        "interpret=True to run a kernel in the interpreter here, or 'xla'."
      )
    implementation = f"pallas_{platform}"
  named = [r for r in _TABLE.get(op, ()) if r.name == implementation]
  if not named:
    raise ValueError(f"No {implementation!r} implementation of {op!r} is available.")
  here = [r for r in named if platform in r.platforms]
  if not here and interpret and named[0].interpretable:
    here = named[:1]
  if not here:
    where = sorted({p for r in named for p in r.platforms})
    raise ValueError(
      f"implementation={implementation!r} for {op!r} runs on {where}, but the current "
      f"backend is {platform!r}. Use 'xla'"
      + (
        ", or interpret=True to run the kernel in the Pallas interpreter."
        if named[0].interpretable
        else "."
      )
    )
  if all(_demoted(r, platform) for r in here):
    # The preflight switched the kernel off: the call takes what "auto" takes instead.
    return [*_platform_rows(op, platform), XLA]
  return here


def refusal(row: Implementation, query, mask) -> str | None:
  """Why ``row`` cannot take this call before it is asked (the calling convention)."""
  demoted_ = _demoted(row, current_platform())
  if demoted_ is not None:
    return f"switched off on this device by the preflight ({demoted_})"
  if mask is not None:
    return "it takes causal and segment-id masks only, not an explicit mask"
  if jnp.result_type(query) == jnp.float64:
    return "it computes in float32; float64 inputs run on the XLA path"
  return None


def _measured_slower(
  implementation: str, row, later, spec: OpSpec, arrays, pass_: str = "forward+backward"
) -> str | None:
  """For ``"auto"`` on a GPU: why ``row`` gives way to a later candidate that this device
  measured faster at this shape in ``pass_`` (:mod:`diffjax.kernels.gpu.measured`), or None."""
  if implementation != "auto" or current_platform() != "gpu":
    return None
  q = spec.query(arrays)
  seq = jnp.shape(arrays[spec.keys[0]])[1] if spec.decode else jnp.shape(q)[1]
  return gpu_measured.slower(
    spec.name,
    row.name,
    current_device_kind(),
    seq,
    jnp.dtype(q.dtype).name,
    jnp.shape(q)[-1],
    tuple(r.name for r in later if r != XLA),
    pass_=pass_,
  )


def _forward_only(spec: OpSpec, implementation: str, rows_, chosen, arrays, call, mask):
  """For ``"auto"`` on a GPU whose figures include forward calls: the candidate a call that is
  not differentiated takes when it is not ``chosen`` (what a differentiated call takes), else
  None."""
  if implementation != "auto" or current_platform() != "gpu":
    return None
  if not gpu_measured.rows_for(spec.name, current_device_kind(), "forward"):
    return None
  row = _choice(spec, implementation, rows_, arrays, call, mask, "forward")[0]
  return None if row in (XLA, chosen) else row


def _traced(row, spec: OpSpec, arrays, call):
  out = _call(row, spec, arrays, *call)
  _record(row.name)
  return out


def _by_pass(spec: OpSpec, forward, train, arrays, call):
  """The op's value from ``forward``; differentiated, its value and gradients from ``train``
  (a custom VJP: each pass runs the implementation measured faster at it)."""
  causal, segment_ids, *rest = call

  @jax.custom_vjp
  def op(xs, segs):
    return _traced(forward, spec, xs, (causal, segs, *rest))

  def op_fwd(xs, segs):
    return jax.vjp(lambda a, b: _traced(train, spec, a, (causal, b, *rest)), xs, segs)

  op.defvjp(op_fwd, lambda pullback, g: pullback(g))
  return op(tuple(arrays), segment_ids)


def run(
  spec: OpSpec,
  implementation: str,
  arrays: tuple,
  *,
  causal: bool = True,
  segment_ids=None,
  mask=None,
  scale: float | None = None,
  block_sizes=None,
  interpret: bool = False,
) -> jax.Array:
  """Computes ``spec`` on ``arrays`` (checked already) with the first of the candidates of
  ``implementation`` that accepts them."""
  call = (causal, segment_ids, scale, block_sizes, interpret)
  rows_ = candidates(spec.name, implementation, interpret)

  def attempt(row):
    forward = _forward_only(spec, implementation, rows_, row, arrays, call, mask)
    if forward is None:
      return _traced(row, spec, arrays, call)
    jax.eval_shape(lambda *a: _call(row, spec, a, *call), *arrays)  # a refusal: here
    return _by_pass(spec, forward, row, arrays, call)

  row, out, tried = _first(spec, implementation, rows_, arrays, mask, "forward+backward", attempt)
  if row == XLA:
    _record(XLA)
    if spec.decode:
      return spec.reference(*arrays, scale=scale)
    return spec.reference(*arrays, causal=causal, segment_ids=segment_ids, mask=mask, scale=scale)
  if row is None:
    raise _refused(spec, implementation, tried)
  return out


def choose(
  spec: OpSpec,
  implementation: str,
  arrays: tuple,
  *,
  mask=None,
  segment_ids=None,
  pass_: str = "forward+backward",
  **kwargs,
) -> str:
  """The name of what :func:`run` runs for these arrays (``"xla"`` for the reference math),
  found by tracing the candidates abstractly: in a call that is differentiated, or with
  ``pass_="forward"`` in one that is not (they differ only where a GPU's measured figures
  favour different paths). A candidate that accepts the inputs but then fails to trace is
  the one chosen (its failure is the caller's to report)."""
  if pass_ not in gpu_measured.PASSES:
    raise ValueError(f"pass_={pass_!r} is not one of {gpu_measured.PASSES}.")
  interpret = kwargs.get("interpret", False)
  call = (kwargs.get("causal", True), segment_ids, kwargs.get("scale"))
  call += (kwargs.get("block_sizes"), interpret)
  rows_ = candidates(spec.name, implementation, interpret)
  row, tried = _choice(spec, implementation, rows_, arrays, call, mask, "forward+backward")
  if pass_ == "forward":
    row = _forward_only(spec, implementation, rows_, row, arrays, call, mask) or row
  if row is None:
    raise _refused(spec, implementation, tried)
  return row if row == XLA else row.name


def _choice(spec: OpSpec, implementation: str, rows_, arrays, call, mask, pass_: str):
  """(what :func:`_first` finds when each candidate is traced abstractly, or None; the
  refusals before it). A candidate that takes the inputs but then fails to trace is chosen."""

  def attempt(row):
    try:
      jax.eval_shape(lambda *a: _call(row, spec, a, *call), *arrays)
    except NotImplementedError:
      raise
    except Exception:  # noqa: BLE001  (it took the inputs; running it is what fails)
      pass

  row, _, tried = _first(spec, implementation, rows_, arrays, mask, pass_, attempt)
  return row, tried


def _first(spec: OpSpec, implementation: str, rows_, arrays, mask, pass_: str, attempt):
  """(row, what ``attempt(row)`` returned, the refusals before it) for the first of ``rows_``
  that takes the inputs, is not measured slower in ``pass_`` than a later one and whose
  ``attempt`` does not raise ``NotImplementedError``; ``(XLA, None, ...)`` when the candidates
  end with the reference math, ``(None, None, ...)`` when none takes them."""
  tried = []
  for i, row in enumerate(rows_):
    if row == XLA:
      return XLA, None, tried
    reason = refusal(row, spec.query(arrays), mask) or _measured_slower(
      implementation, row, rows_[i + 1 :], spec, arrays, pass_
    )
    if reason is None:
      try:
        return row, attempt(row), tried
      except NotImplementedError as e:
        reason = str(e) or type(e).__name__
    tried.append(f"{row.name} refuses: {reason}")
  return None, None, tried


def _refused(spec: OpSpec, implementation: str, tried: list[str]) -> ValueError:
  return ValueError(
    f"implementation={implementation!r} cannot compute {spec.name!r} on these inputs ("
    + "; ".join(tried)
    + "). Use implementation='auto' (it takes what can run) or 'xla'."
  )


def _call(row, spec, arrays, causal, segment_ids, scale, block_sizes, interpret):
  """``row.fn`` on the op's arrays, per device under ``shard_map`` when a mesh is active."""
  arrays = spec.to_kernel(tuple(arrays))
  q, k = arrays[spec.queries[0]], arrays[spec.keys[0]]
  kwargs = dict(
    scale=validation.default_scale(scale, jnp.shape(q)[-1]),
    block_sizes=block_sizes,
    interpret=interpret,
  )
  segs = ()
  if not spec.decode:
    b, t = jnp.shape(q)[:2]
    segs = validation.split_segment_ids(segment_ids, b, t, jnp.shape(k)[1])
    kwargs["causal"] = causal
    if segs[0] is None:
      segs = ()

  def per_device(*args):
    n = len(args) - len(segs)
    seg_kw = dict(zip(("q_segment_ids", "kv_segment_ids"), args[n:]))
    if not spec.decode:
      seg_kw = {"q_segment_ids": None, "kv_segment_ids": None, **seg_kw}
    return row.fn(*args[:n], **seg_kw, **kwargs)

  active = sharding.current()
  if active is None:
    return per_device(*arrays, *segs)
  mesh, rules = active
  batch_axis, head_axis = kernel_axes(mesh, rules)
  check_kernel_split(spec, (*arrays, *segs), mesh, batch_axis, head_axis)
  in_specs, out_spec = sharding.kernel_partition_specs(
    spec.axes, batch_axis, head_axis, segment_ids=bool(segs)
  )
  return jax.shard_map(
    per_device, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False
  )(*arrays, *segs)


def kernel_axes(mesh, rules) -> tuple[Any, Any]:
  """(the mesh axes that split the batch, those that split the heads) of the kernels under
  ``mesh`` and ``rules``, as the activations' sharding constraints place them: the rules'
  axes for ``batch`` and ``heads`` that ``mesh`` has, ``heads`` never reusing one of
  ``batch``'s."""
  placed = sharding.spec_for_mesh(sharding.logical_to_spec(("batch", "heads"), rules), mesh)
  return placed[0], placed[1]


def check_kernel_split(spec: OpSpec, arrays: tuple, mesh, batch_axis, head_axis) -> None:
  """Refuses (one line, with the fix) kernel arrays (``spec.axes`` order, segment ids [B, T]
  after them) whose batch or head axis the mesh axes do not split evenly; ``shard_map``
  would otherwise fail with a message that names neither the setting nor the fix."""
  names = (*spec.axes, *((("batch", None),) * (len(arrays) - len(spec.axes))))
  splits = {"batch": batch_axis, "heads": head_axis}
  for i, (x, axes) in enumerate(zip(arrays, names)):
    for size, name in zip(jnp.shape(x), axes):
      entry = splits.get(name)
      n = sharding.shards_of(entry, mesh)
      if entry is None or size % n == 0:
        continue
      what = spec.arrays[i] if i < len(spec.arrays) else "segment_ids"
      on = f"the {n} devices of mesh axes {sharding.mesh_axes_of(entry)}"
      if name == "batch":
        raise ValueError(
          f"{spec.name}: a batch of {size} rows does not split over {on} that the "
          f"'batch' rule maps it to. Use a batch that is a multiple of {n}, or a mesh with "
          "fewer devices on those axes (mesh.shape)."
        )
      raise ValueError(
        f"{spec.name}: {what} has {size} heads, which do not split over {on} that the "
        f"'heads' rule maps them to; every shard must hold whole kv groups with the query "
        f"heads that read them. Use a mesh whose head axes span a divisor of {size} devices "
        "(mesh.shape), or rules that map 'heads' elsewhere."
      )
