"""The platform attention code is traced for: the host's backend, or a compile target.

Compiling ahead of time for a TPU topology or a GPU on a CPU machine traces the program
here, so the kernels and the dispatcher must ask which platform the program is *for*, not
which one runs the tracing: :func:`target_platform` says so for a block of code.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import jax

from diffjax.hardware import HOPPER  # the compute capability the Mosaic GPU kernels are for

_TARGET = threading.local()


@contextlib.contextmanager
def target_platform(
  platform: str, gpu_capability: tuple[int, int] | None = None, device_kind: str | None = None
) -> Iterator[None]:
  """Resolves implementations for ``platform`` instead of the host backend.

  Used when compiling ahead of time for TPU topologies or GPU targets on a CPU machine,
  so that ``"auto"`` and ``"pallas"`` pick that platform's kernels. ``gpu_capability``:
  the compute capability of the target GPU ((9, 0) for an H100/H200, (8, 0) for an
  A100); None means the attached GPUs', or a Hopper when none is attached.
  ``device_kind``: the device's name as jax gives it (e.g. ``"NVIDIA H200"``), which
  selects measured figures (:mod:`diffjax.kernels.gpu.measured`); None means the attached
  device's, or none.
  """
  if platform not in ("cpu", "gpu", "tpu"):
    raise ValueError(f"platform={platform!r} must be 'cpu', 'gpu' or 'tpu'.")
  prev = getattr(_TARGET, "value", None)
  _TARGET.value = (platform, gpu_capability, device_kind)
  try:
    yield
  finally:
    _TARGET.value = prev


def current_device_kind() -> str | None:
  """The device kind code is traced for: a :func:`target_platform`'s, else the attached
  device's when it is the platform's (none while compiling for a target without one)."""
  target = getattr(_TARGET, "value", None)
  if target and target[2] is not None:
    return target[2]
  if target and target[0] != jax.default_backend():
    return None
  try:
    return jax.devices()[0].device_kind
  except RuntimeError:
    return None


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
