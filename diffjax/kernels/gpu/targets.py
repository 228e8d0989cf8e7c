"""GPUs to compile for without one: the GPUs of :mod:`diffjax.hardware` as XLA targets.

:func:`target_config`, :func:`devices` (compile-only) and :func:`use_pip_ptxas`. Design:
docs/kernels_gpu.md, "Through XLA and ptxas (registers, spills, shared memory)".
"""

from __future__ import annotations

import importlib.util
import os

from diffjax import hardware

# jax's CUDA plugin packages (``jax_plugins.<name>``), either of which compiles for a GPU.
CUDA_PLUGINS = ("xla_cuda12", "xla_cuda13")


def cuda_plugin() -> str | None:
  """The installed CUDA plugin's package name, or None."""
  for name in CUDA_PLUGINS:
    try:
      if importlib.util.find_spec(f"jax_plugins.{name}") is not None:
        return name
    except ImportError:  # no jax_plugins namespace at all
      return None
  return None


# The GPUs of the hardware table, by name ("h100"): what ``--target`` accepts.
TARGETS: dict[str, hardware.Gpu] = {name: hardware.get(name) for name in hardware.names("gpu")}


def target_config(gpu: hardware.Gpu) -> str:
  """The ``GpuTargetConfig`` text proto of ``gpu`` (compiling needs no cuDNN; the proto
  names a version only because it asks for one)."""
  major, minor = gpu.compute_capability
  return f"""gpu_device_info {{
  threads_per_block_limit: {hardware.MAX_THREADS_PER_BLOCK}
  threads_per_warp: {hardware.WARP_THREADS}
  shared_memory_per_block: {hardware.DEFAULT_SMEM_PER_BLOCK}
  shared_memory_per_core: {gpu.smem_per_sm}
  threads_per_core_limit: {hardware.MAX_THREADS_PER_SM}
  core_count: {gpu.sms}
  fpus_per_core: {gpu.fp32_cores_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(gpu.hbm_bytes_per_s)}
  l2_cache_size: {gpu.l2_bytes}
  clock_rate_ghz: {gpu.clock_ghz}
  device_memory_size: {gpu.hbm_bytes}
  shared_memory_per_block_optin: {gpu.smem_per_block}
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
  }}
  registers_per_core_limit: {gpu.registers_per_sm}
  registers_per_block_limit: {gpu.registers_per_block}
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 8
}}
device_description_str: "{gpu.device_description}"
"""


def get(name: str) -> hardware.Gpu:
  """The target called ``name`` (case-insensitive), or a ValueError listing the names."""
  key = name.lower()
  if key not in TARGETS:
    raise ValueError(f"Unknown GPU target {name!r}; use one of {sorted(TARGETS)}.")
  return TARGETS[key]


def is_gpu_target(name: str) -> bool:
  """Whether ``name`` (e.g. "h100" or "h100:8") names a GPU target."""
  return name.split(":")[0].lower() in TARGETS


def parse(spec: str) -> tuple[hardware.Gpu, int]:
  """ "h100" -> (H100, 1); "h100:8" -> (H100, 8 devices, one node)."""
  name, _, count = spec.partition(":")
  target = get(name)
  if not count:
    return target, 1
  if not count.isdigit() or int(count) < 1:
    raise ValueError(
      f"GPU target {spec!r}: the device count after ':' must be a positive "
      "integer, e.g. h100:8 for an 8-GPU node."
    )
  return target, int(count)


def ptxas_dir() -> str | None:
  """The ``bin`` folder holding ``ptxas`` of NVIDIA's pip packages, if installed: CUDA 12's
  ``nvidia-cuda-nvcc-cu12`` (``nvidia/cuda_nvcc/bin``) or CUDA 13's (``nvidia/cu13/bin``)."""
  try:
    import nvidia  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  for root in list(getattr(nvidia, "__path__", [])):
    for sub in ("cuda_nvcc", "cu13"):
      path = os.path.join(root, sub, "bin")
      if os.path.exists(os.path.join(path, "ptxas")):
        return path
  return None


def use_pip_ptxas() -> str:
  """Puts the pip package's ``ptxas`` first on ``PATH``; returns its folder.

  Mosaic GPU runs the first ``ptxas`` on ``PATH``; an older one from a system CUDA
  would give other register counts (or reject sm_90a).
  """
  path = ptxas_dir()
  if path is None:
    raise RuntimeError(
      "ptxas not found: install the GPU compile extra with "
      "pip install -e '.[gpu-compile]' (nvidia-cuda-nvcc-cu12)."
    )
  entries = os.environ.get("PATH", "").split(os.pathsep)
  if not entries or entries[0] != path:
    os.environ["PATH"] = os.pathsep.join([path] + [e for e in entries if e != path])
  return path


def available() -> str | None:
  """None when deviceless GPU compiles can run here, else the reason they cannot."""
  if cuda_plugin() is None:
    return (
      "the CUDA plugin is not installed (pip install -e '.[gpu-compile]': "
      "jax-cuda12-plugin and jax-cuda12-pjrt at the jax version; CUDA 13's work too)"
    )
  if ptxas_dir() is None:
    return "ptxas is not installed (pip install -e '.[gpu-compile]': nvidia-cuda-nvcc-cu12)"
  return None


def devices(target: hardware.Gpu | str, num_devices: int = 1):
  """Compile-only devices of ``num_devices`` GPUs of ``target`` in one node.

  Raises ValueError naming the fix when the CUDA plugin or ptxas is missing.
  """
  if isinstance(target, str):
    target = get(target)
  missing = available()
  if missing is not None:
    raise ValueError(f"Cannot compile for {target.name}: {missing}.")
  # Without JAX_PLATFORMS=cpu the plugin checks the CUDA libraries of a GPU machine.
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  use_pip_ptxas()
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  topology = topologies.get_topology_desc(
    platform="cuda", topology=f"1x1x{num_devices}", target_config=target_config(target)
  )
  return topology.devices
