"""What jax's Mosaic GPU interpreter lacks for the Hopper kernels, added for the tests.

jax ships an interpreter for Mosaic GPU kernels (``InterpretGPUParams``, private to
``jax._src`` in jax 0.10.2): it simulates shared memory, warpgroups, TMA copies and
barriers on the host, and the kernels' ``interpret=True`` runs it as jax ships it. In
jax 0.10.2 it lacks four things the kernels use; :func:`install` adds them, once per
process, with the semantics the hardware has:

* ``plgpu.layout_cast`` is the identity on values: a register layout changes where
  elements live, never their values;
* a ``wgmma`` operand may be a transposed view of shared memory (``ref.transpose``);
* the ``wgmma`` A operand may be a register array instead of a shared-memory ref;
* ``plgpu.copy_smem_to_gmem(..., reduction_op="add")`` (a TMA reduce-add: the
  destination becomes destination + source, atomically with respect to other CTAs).

The product is ``acc + a @ b`` in the accumulator's dtype, as the interpreter computes
it for plain shared-memory operands. jax 0.11's interpreter has the first two natively
but neither a register A operand nor the reduce-add copy; there :func:`install` adds
only those two.

``pl.run_state`` accumulators (``plgpu.ACC.init``) run in neither jax 0.10.2's nor
0.11.2's interpreter and are not added here: interpreted, the kernels accumulate through
a zero-initialised ``run_scoped`` accumulator instead
(:func:`diffjax.kernels.gpu.mosaic_common.accumulate`; docs/kernels_gpu.md lists what
the interpreted tests leave to the compiled ones).

A test installs this before it interprets a kernel: :func:`params` does it and returns
the interpreter's parameters; a child process calls :func:`install` before its first
kernel call. Nothing here changes a compiled kernel. The additions are tested on their
own against numpy (``test_kernels_mosaic_gpu.py``).
"""

from __future__ import annotations

import functools
import threading

import jax
import numpy as np
from attention_cases import AttentionCases, mask_kwargs

_LOCK = threading.Lock()
_INSTALLED = False


def params():
  """The interpreter's parameters (``InterpretGPUParams``), with the extension installed."""
  install()
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

  return InterpretGPUParams()


def reset():
  """Clears the interpreter's simulated memory (needed after a kernel raised)."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

  gpu_callbacks.reset_gpu_interpret_mode_state()


def install() -> None:
  """Adds layout casts and transposed/register wgmma operands to the interpreter."""
  global _INSTALLED
  with _LOCK:
    if _INSTALLED:
      return
    if needs_extension():
      _install_layout_cast()
      _install_wgmma()
    else:
      _install_register_wgmma_011()
    _install_reduce_add()
    _INSTALLED = True


def _install_layout_cast():
  from jax._src.interpreters import mlir
  from jax._src.pallas.mosaic_gpu import core as gpu_core

  mlir.register_lowering(gpu_core.layout_cast_p, lambda ctx, x, **_: [x], platform="cpu")


def _read_operand(shared_memory, key_array, transforms, thread, logging_info):
  """A shared-memory operand after its indexers and transposes, as a numpy array."""
  from jax._src.pallas.mosaic.interpret import utils as interpret_utils
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  from jax._src.state import indexing
  from jax._src.state import types as state_types

  key = gpu_callbacks.HostAllocationKey.from_array(key_array)
  transforms = list(gpu_callbacks._remove_noop_transforms(tuple(transforms)))
  leading = []
  while transforms and isinstance(transforms[0], indexing.NDIndexer):
    leading.append(transforms.pop(0))
  value, _, _ = shared_memory.get_buffer_content(
    key, interpret_utils.to_range(leading), thread, logging_info=logging_info
  )
  value = np.asarray(value)
  for t in transforms:
    if isinstance(t, state_types.TransposeTransform):
      value = np.transpose(value, t.permutation)
    elif isinstance(t, indexing.NDIndexer):
      value = value[tuple(interpret_utils._transform_slice_or_index(i) for i in t.indices)]
    else:
      raise NotImplementedError(f"wgmma operand transform {t} in the GPU interpreter")
  return value


def _wgmma_callback(
  *,
  device_id,
  grid_point_coords,
  thread_id,
  acc_key,
  acc_transforms,
  acc_dtype,
  a_key,
  a_value,
  a_transforms,
  b_key,
  b_transforms,
  source_info=None,
):
  from jax._src.pallas.mosaic.interpret import utils as interpret_utils
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

  device_id, thread_id = int(device_id), int(thread_id)
  shared_memory = gpu_callbacks._get_shared_memory()
  thread = shared_memory.get_global_thread_id(device_id, thread_id)
  info = interpret_utils.GPULoggingInfo(
    device_id=device_id,
    grid_point_coords=tuple(int(x) for x in grid_point_coords),
    thread_id=thread_id,
    source_info=source_info,
  )
  to_int = lambda ts: jax.tree.map(int, ts)
  a = (
    np.asarray(a_value)
    if a_key is None
    else _read_operand(shared_memory, a_key, to_int(a_transforms), thread, info)
  )
  b = _read_operand(shared_memory, b_key, to_int(b_transforms), thread, info)
  acc_key = gpu_callbacks.HostAllocationKey.from_array(acc_key)
  acc_range = interpret_utils.to_range(
    to_int(gpu_callbacks._remove_noop_transforms(tuple(acc_transforms)))
  )
  acc, _, _ = shared_memory.get_buffer_content(acc_key, acc_range, thread, logging_info=info)
  shared_memory.store_buffer_content(
    acc_key, acc_range, acc + np.matmul(a, b, dtype=acc_dtype), thread, logging_info=info
  )


def _operand_transforms(eqn, leaves):
  """The (acc, a, b) transforms of a ``wgmma_ref_p`` equation from its flat leaves."""
  empty = jax.tree.structure([])
  return jax.tree.unflatten(
    jax.tree_util.treedef_tuple(
      tuple(eqn.params[f"{name}_transforms_tree"] or empty for name in ("acc", "a", "b"))
    ),
    leaves,
  )


def _install_wgmma():
  from jax._src import callback
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret
  from jax._src.state import types as state_types

  def interpret_wgmma(self, eqn, token, get_invals):
    acc, a, b, *leaves = get_invals()
    acc_t, a_t, b_t = _operand_transforms(eqn, leaves)
    a_is_ref = isinstance(eqn.invars[1].aval, state_types.AbstractRef)

    def run(token, device_id, grid_point_coords, thread_id, acc, a, b, acc_t, a_t, b_t):
      _wgmma_callback(
        device_id=device_id,
        grid_point_coords=grid_point_coords,
        thread_id=thread_id,
        acc_key=acc,
        acc_transforms=acc_t,
        acc_dtype=eqn.invars[0].aval.dtype,
        a_key=a if a_is_ref else None,
        a_value=None if a_is_ref else a,
        a_transforms=a_t,
        b_key=b,
        b_transforms=b_t,
        source_info=eqn.source_info,
      )
      return token

    return callback.io_callback(
      run,
      gpu_callbacks.TOKEN_SHAPE_DTYPE,
      token,
      self.device_info.device_id,
      self.grid_point_coords,
      self.thread_id,
      acc,
      a,
      b,
      acc_t,
      a_t,
      b_t,
      ordered=True,
    ), []

  jaxpr_interpret.JaxprInterpreter._interpret_wgmma_ref_p = interpret_wgmma


_REDUCE_LOCK = threading.Lock()


def _install_reduce_add():
  """TMA reduce-add copies (``reduction_op="add"``), for jax 0.10.2 and 0.11.

  The interpreter performs copies eagerly; a reduce-add reads the source and the
  destination and stores their sum under one lock, so CTAs adding into the same rows
  never lose an update (the hardware's reduce-adds are element-wise atomic).
  """
  from jax._src.pallas.mosaic.interpret import utils as interpret_utils
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

  native = gpu_callbacks.copy_smem_to_gmem
  if getattr(native, "_diffjax_reduce_add", False):
    return
  ints = lambda ts: jax.tree.map(int, gpu_callbacks._remove_noop_transforms(ts))

  def copy(**kw):
    op = kw.get("reduction_op")
    if op is None:
      return native(**kw)
    if op != "add":
      raise NotImplementedError(f"reduction_op={op!r} in the GPU interpreter (only 'add').")
    if kw.get("predicate") is not None:
      raise NotImplementedError("predicated reduce-add copies in the GPU interpreter")
    shared = gpu_callbacks._get_shared_memory()
    src = gpu_callbacks.HostAllocationKey.from_array(kw["src_allocation_key_as_array"])
    dst = gpu_callbacks.HostAllocationKey.from_array(kw["dst_allocation_key_as_array"])
    if "mesh_location" in kw:  # jax 0.11
      from jax._src.pallas.mosaic_gpu.interpret import shared_memory as memory

      thread = kw["thread"]
      info = memory.GPULoggingInfo(kw["mesh_location"], thread, kw["source_info"])
      src_range = shared.access(src, ints(kw["src_transforms"]))
      dst_range = shared.access(dst, ints(kw["dst_transforms"]))
    else:  # jax 0.10
      thread_id = int(kw["thread_id"])
      thread = shared.get_global_thread_id(int(kw["device_id"]), thread_id)
      info = interpret_utils.GPULoggingInfo(
        device_id=int(kw["device_id"]),
        grid_point_coords=tuple(int(x) for x in kw["grid_point_coords"]),
        thread_id=thread_id,
        source_info=kw["source_info"],
      )
      src_range = interpret_utils.to_range(ints(kw["src_transforms"]))
      dst_range = interpret_utils.to_range(ints(kw["dst_transforms"]))
    with _REDUCE_LOCK:
      val, _, _ = shared.get_buffer_content(src, src_range, thread, logging_info=info)
      old, _, _ = shared.get_buffer_content(dst, dst_range, thread, logging_info=info)
      shared.store_buffer_content(
        dst, dst_range, np.asarray(old) + np.asarray(val), thread, logging_info=info
      )
    return kw["token"]

  copy._diffjax_reduce_add = True
  gpu_callbacks.copy_smem_to_gmem = copy


def needs_extension() -> bool:
  """Whether this jax's interpreter lacks layout casts and transposed operands (< 0.11)."""
  return jax.__version_info__ < (0, 11)


def _install_register_wgmma_011():
  """jax 0.11: a register A operand for the interpreter's wgmma (the rest is native)."""
  from jax._src import callback
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret
  from jax._src.pallas.mosaic_gpu.interpret import shared_memory as memory
  from jax._src.state import types as state_types

  native = jaxpr_interpret.JaxprInterpreter._interpret_wgmma_ref_p

  def run(
    *,
    token,
    mesh_location,
    thread,
    acc_key,
    acc_transforms,
    a_value,
    b_key,
    b_transforms,
    source_info=None,
  ):
    shared = gpu_callbacks._get_shared_memory()
    info = memory.GPULoggingInfo(mesh_location, thread, source_info)
    ints = lambda ts: jax.tree.map(int, gpu_callbacks._remove_noop_transforms(ts))
    b_key = gpu_callbacks.HostAllocationKey.from_array(b_key)
    acc_key = gpu_callbacks.HostAllocationKey.from_array(acc_key)
    b, _, _ = shared.get_buffer_content(
      b_key, shared.access(b_key, ints(b_transforms)), thread, logging_info=info
    )
    acc_range = shared.access(acc_key, ints(acc_transforms))
    acc, _, _ = shared.get_buffer_content(acc_key, acc_range, thread, logging_info=info)
    shared.store_buffer_content(
      acc_key,
      acc_range,
      acc + np.matmul(np.asarray(a_value), b, dtype=acc.dtype),
      thread,
      logging_info=info,
    )
    return token

  def interpret_wgmma(self, eqn, token, get_invals):
    if isinstance(eqn.invars[1].aval, state_types.AbstractRef):
      return native(self, eqn, token, get_invals)
    acc, a, b, *leaves = get_invals()
    acc_t, _, b_t = _operand_transforms(eqn, leaves)
    acc, acc_t = jaxpr_interpret.resolve_ref(eqn.invars[0].aval, acc, acc_t)
    b, b_t = jaxpr_interpret.resolve_ref(eqn.invars[2].aval, b, b_t)
    return callback.io_callback(
      functools.partial(run, source_info=eqn.source_info),
      gpu_callbacks.TOKEN_SHAPE_DTYPE,
      token=token,
      mesh_location=self.mesh_location,
      thread=self.thread,
      acc_key=acc,
      acc_transforms=acc_t,
      a_value=a,
      b_key=b,
      b_transforms=b_t,
      ordered=True,
    ), []

  jaxpr_interpret.JaxprInterpreter._interpret_wgmma_ref_p = interpret_wgmma


class InterpretedCases(AttentionCases):
  """What the Mosaic GPU kernels' classes of the attention test base share: bfloat16 and
  float16, no documents or a one-token first one, the row measure (allowing for the row terms
  the kernels form from their stored output and O2) and its broken-row self-check, none in
  the unit tier (tens of seconds a case) and only the named ones beyond it. Subclasses set
  ``kernels`` (op -> kernel function) and their cases."""

  kernels: dict = {}
  dtypes = ("bfloat16", "float16")
  segments = ("none", "single")
  rows = True
  broken_rows = True
  stored_residuals = True  # out and O2 in the input dtype (mosaic.py, mosaic_gda.py)
  sampled = 0
  integration_sampled = 0

  @property
  def ops(self):
    return tuple(self.kernels)

  def call(self, case, *arrays):
    install()
    return self.kernels[case.op](*arrays, interpret=True, **mask_kwargs(case))
