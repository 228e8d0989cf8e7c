"""What ``ptxas`` and Mosaic GPU say about compiled kernels: registers, spills, shared memory.

Register allocation, spills and the shared-memory size of a Mosaic GPU kernel are
decided when XLA compiles the program for a GPU, not when it is lowered. This module
compiles a lowered program (for real or compile-only devices, see
:mod:`diffjax.kernels.gpu.targets`) and reads back, per Mosaic GPU kernel in it:

* from ``ptxas -v`` (``MOSAIC_GPU_DUMP_PTXAS=1``, printed on the process's standard
  output by the compiler, so it is read from file descriptor 1): registers per thread
  at launch, stack frame, spill stores and spill loads;
* from the kernel's Mosaic GPU module (the custom call's ``backend_config``): the
  dynamic shared memory it is launched with, and a digest of the module, so two
  lowerings that produce the same kernel are compiled once.

Spills are warnings to ptxas: a kernel that spills compiles and runs, slower. A check
has to read the report, which is what :func:`compile_with_report` returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

_KERNEL_SUFFIX = "_mosaic_gpu_kernel"
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")


@dataclasses.dataclass(frozen=True)
class MosaicKernel:
  """A Mosaic GPU kernel found in a lowered program.

  Attributes:
    name: the kernel's name (its module's symbol, e.g. ``diff_v1_bwd_mgpu``).
    digest: sha256 of the kernel's module text: equal digests, equal kernels. (Not of the
      serialized blob, which differs between lowerings of the same kernel; jax 0.12 compiles
      equal kernels once a process, so a second compile of one prints no ptxas report.)
    smem_bytes: dynamic shared memory it is launched with.
  """

  name: str
  digest: str
  smem_bytes: int


@dataclasses.dataclass(frozen=True)
class KernelReport:
  """One compiled kernel: what Mosaic GPU allocated and what ptxas reported."""

  name: str
  digest: str
  smem_bytes: int
  registers: int
  stack_bytes: int
  spill_stores: int
  spill_loads: int

  @property
  def spills(self) -> int:
    return self.spill_stores + self.spill_loads


def _walk(op) -> Iterator:
  for region in op.regions:
    for block in region.blocks:
      for child in block.operations:
        yield child
        yield from _walk(child)


def _launch_smem(module) -> int:
  """The ``dynamicSharedMemorySize`` of the module's ``gpu.launch``."""
  from jaxlib.mlir import ir  # pylint: disable=import-outside-toplevel

  for op in _walk(module.operation):
    if op.operation.name == "gpu.launch":
      # Operands: async deps, grid (3), block (3), cluster (0 or 3), dynamic smem.
      size = op.operation.operands[len(op.operation.operands) - 1]
      return int(ir.IntegerAttr(size.owner.attributes["value"]).value)
  raise ValueError("no gpu.launch in the Mosaic GPU module")


def _deserialize(module_bytes: bytes):
  """The Mosaic GPU module of a custom call, parsed back into MLIR."""
  # pylint: disable=import-outside-toplevel
  from jax._src.interpreters import mlir as jax_mlir
  from jax._src.lib import mosaic_gpu_dialect
  from jax.experimental.mosaic.gpu import core as mgpu_core
  from jaxlib.mlir import ir

  ctx = jax_mlir.make_ir_context()
  mosaic_gpu_dialect.register_dialect(ctx)
  with ctx:
    ctx.allow_unregistered_dialects = True
    module = ir.Module.parse(module_bytes)
    return mgpu_core._run_serde_pass(module, serialize=False)  # pylint: disable=protected-access


def mosaic_kernels(lowered) -> list[MosaicKernel]:
  """The Mosaic GPU kernels of a ``jax.stages.Lowered`` program, in program order."""
  from jaxlib.mlir import ir  # pylint: disable=import-outside-toplevel

  module = lowered.compiler_ir("stablehlo")
  found = []
  for op in _walk(module.operation):
    if op.operation.name != "stablehlo.custom_call":
      continue
    attrs = op.operation.attributes
    if ir.StringAttr(attrs["call_target_name"]).value not in ("mosaic_gpu", "mosaic_gpu_v2"):
      continue
    config = ir.DictAttr(attrs["mhlo.backend_config"])
    blob = ir.StringAttr(config["module"]).value_bytes
    kernel = _deserialize(blob)
    name = ir.StringAttr(kernel.operation.attributes["sym_name"]).value
    found.append(
      MosaicKernel(
        name=name,
        digest=hashlib.sha256(str(kernel).encode()).hexdigest(),
        smem_bytes=_launch_smem(kernel),
      )
    )
  return found


@contextlib.contextmanager
def _stdout_of_this_process(out: list) -> Iterator[None]:
  """Sends file descriptor 1 to a file while inside; appends what it got to ``out``."""
  sys.stdout.flush()
  saved = os.dup(1)
  with tempfile.TemporaryFile() as tmp:
    os.dup2(tmp.fileno(), 1)
    try:
      yield
    finally:
      sys.stdout.flush()
      os.dup2(saved, 1)
      os.close(saved)
      tmp.seek(0)
      out.append(tmp.read().decode(errors="replace"))


def parse_ptxas(text: str) -> dict[str, dict[str, int]]:
  """``ptxas -v`` output -> {entry function: registers, stack, spill stores, spill loads}."""
  found: dict[str, dict[str, int]] = {}
  current = None
  for line in text.splitlines():
    if m := _ENTRY.search(line):
      current = found.setdefault(m.group(1), {})
    elif current is not None and (m := _PROPS.search(line)):
      current.update(
        stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3))
      )
    elif current is not None and (m := _USED.search(line)):
      current["registers"] = int(m.group(1))
  return found


def compile_with_report(lowered):
  """Compiles ``lowered`` and reports each of its Mosaic GPU kernels.

  Returns ``(compiled, reports)``. Raises RuntimeError when ptxas reported nothing for
  a kernel (a ptxas other than the one on ``PATH`` ran, or the kernel came from a
  cache): a check must not pass on a missing report.
  """
  kernels = mosaic_kernels(lowered)
  captured: list[str] = []
  previous = os.environ.get("MOSAIC_GPU_DUMP_PTXAS")
  os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
  try:
    with _stdout_of_this_process(captured):
      compiled = lowered.compile()
  finally:
    if previous is None:
      os.environ.pop("MOSAIC_GPU_DUMP_PTXAS", None)
    else:
      os.environ["MOSAIC_GPU_DUMP_PTXAS"] = previous
  by_entry = parse_ptxas("".join(captured))
  reports = []
  for kernel in kernels:
    entry = by_entry.get(kernel.name + _KERNEL_SUFFIX)
    if entry is None or "registers" not in entry:
      raise RuntimeError(
        f"ptxas printed no report for kernel {kernel.name!r}; got entries {sorted(by_entry)}."
      )
    reports.append(
      KernelReport(
        name=kernel.name,
        digest=kernel.digest,
        smem_bytes=kernel.smem_bytes,
        registers=entry["registers"],
        stack_bytes=entry.get("stack", 0),
        spill_stores=entry.get("spill_stores", 0),
        spill_loads=entry.get("spill_loads", 0),
      )
    )
  return compiled, reports
