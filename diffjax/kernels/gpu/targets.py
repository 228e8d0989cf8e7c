"""GPUs to compile for without one: H100, H200 and A100 as XLA target descriptions.

With the CUDA plugin installed (``pip install -e '.[gpu-compile]'``: ``jax-cuda12-plugin``
and ``jax-cuda12-pjrt`` at the jax version, ``nvidia-cuda-nvcc-cu12`` for ``ptxas``),
``jax.experimental.topologies.get_topology_desc(platform="cuda", ...)`` turns a
``GpuTargetConfig`` text proto into compile-only devices: compiling for them runs XLA's
GPU pipeline and ``ptxas`` on a machine with no GPU and no driver, so register spills,
shared-memory overflows and ptxas errors show up there. :func:`devices` builds them;
:func:`use_pip_ptxas` puts the pip package's ``ptxas`` first on ``PATH`` (Mosaic GPU
looks for it nowhere else).

The figures are the vendor's (SM count, shared memory per block with opt-in, registers,
memory, bandwidth, clock); cuDNN is not needed to compile and is described only because
the proto asks for a version.
"""

from __future__ import annotations

import dataclasses
import os

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """One GPU model as XLA's compiler sees it.

  Attributes:
    name: the short name used on command lines ("h100").
    device_kind: what ``jax.Device.device_kind`` reports for it.
    compute_capability: (major, minor); 9.0 is Hopper (sm_90a), 8.0 Ampere.
    sms: streaming multiprocessors.
    smem_per_block: shared memory one CTA may opt in to, bytes.
    smem_per_sm: shared memory per SM, bytes.
    memory_bytes: device memory.
    bandwidth: memory bandwidth, bytes/s.
    clock_ghz: boost clock.
    l2_bytes: L2 cache.
  """

  name: str
  device_kind: str
  compute_capability: tuple[int, int]
  sms: int
  smem_per_block: int
  smem_per_sm: int
  memory_bytes: int
  bandwidth: int
  clock_ghz: float
  l2_bytes: int

  @property
  def hopper(self) -> bool:
    return self.compute_capability == (9, 0)

  @property
  def memory_gib(self) -> float:
    return self.memory_bytes / GIB

  def target_config(self) -> str:
    """The ``GpuTargetConfig`` text proto of this GPU."""
    major, minor = self.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.smem_per_sm}
  threads_per_core_limit: 2048
  core_count: {self.sms}
  fpus_per_core: {128 if major >= 9 else 64}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.bandwidth}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: {self.smem_per_block}
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 8
}}
device_description_str: "{self.device_kind}"
"""


TARGETS: dict[str, GpuTarget] = {
  "h100": GpuTarget(
    "h100",
    "NVIDIA H100 80GB HBM3",
    (9, 0),
    sms=132,
    smem_per_block=232_448,
    smem_per_sm=233_472,
    memory_bytes=84_942_979_072,
    bandwidth=3_352_320_000_000,
    clock_ghz=1.98,
    l2_bytes=52_428_800,
  ),
  "h200": GpuTarget(
    "h200",
    "NVIDIA H200",
    (9, 0),
    sms=132,
    smem_per_block=232_448,
    smem_per_sm=233_472,
    memory_bytes=150_754_820_096,
    bandwidth=4_800_000_000_000,
    clock_ghz=1.98,
    l2_bytes=52_428_800,
  ),
  "a100": GpuTarget(
    "a100",
    "NVIDIA A100-SXM4-80GB",
    (8, 0),
    sms=108,
    smem_per_block=166_912,
    smem_per_sm=167_936,
    memory_bytes=85_899_345_920,
    bandwidth=2_039_000_000_000,
    clock_ghz=1.41,
    l2_bytes=41_943_040,
  ),
}


def get(name: str) -> GpuTarget:
  """The target called ``name`` (case-insensitive), or a ValueError listing the names."""
  key = name.lower()
  if key not in TARGETS:
    raise ValueError(f"Unknown GPU target {name!r}; use one of {sorted(TARGETS)}.")
  return TARGETS[key]


def is_gpu_target(name: str) -> bool:
  """Whether ``name`` (e.g. "h100" or "h100:8") names a GPU target."""
  return name.split(":")[0].lower() in TARGETS


def parse(spec: str) -> tuple[GpuTarget, int]:
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
  """The ``bin`` folder of the pip package ``nvidia-cuda-nvcc-cu12``, if installed."""
  try:
    import nvidia.cuda_nvcc  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  for root in list(getattr(nvidia.cuda_nvcc, "__path__", [])):
    path = os.path.join(root, "bin")
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
  try:
    import jax_plugins.xla_cuda12  # noqa: F401  pylint: disable=import-outside-toplevel
  except ImportError:
    return (
      "the CUDA plugin is not installed (pip install -e '.[gpu-compile]': "
      "jax-cuda12-plugin and jax-cuda12-pjrt at the jax version)"
    )
  if ptxas_dir() is None:
    return "ptxas is not installed (pip install -e '.[gpu-compile]': nvidia-cuda-nvcc-cu12)"
  return None


def devices(target: GpuTarget | str, num_devices: int = 1):
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
    platform="cuda", topology=f"1x1x{num_devices}", target_config=target.target_config()
  )
  return topology.devices
