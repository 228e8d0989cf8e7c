"""Ahead-of-time compile of the real train step for a TPU topology, on any machine.

  python -m diffjax.aot --config=configs/paper_3b.py:diff_v1 --topology=v5p:4x4x4 \
      [--config.mesh.shape="(1,-1,1)" --config.global_batch_size=256 ...]

With libtpu installed (``pip install -e '.[tpu]'``) this runs the TPU compiler on a
CPU machine (``jax.experimental.topologies``): it lowers and compiles the jitted,
sharded train step (parameters, optimizer state, batch shardings and donation as in
training) for the devices of the topology, then prints the per-device memory the
compiler reports and whether it fits in the chip's HBM. Nothing is allocated.
Set ``JAX_PLATFORMS=cpu`` to keep start-up quiet on a machine without TPUs.
Attention implementations resolve for the TPU: ``implementation="auto"`` compiles
the fused Pallas TPU kernels (inside ``shard_map``), ``"xla"`` the plain path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import jax

from diffjax import sharding as shd
from diffjax.data import load_tokenizer
from diffjax.ops import target_platform
from diffjax.train.config_utils import check_config, mesh_context_options, resolved_model
from diffjax.train.setup import build_train_setup

GIB = 1024 ** 3
# HBM per chip (GiB) by device kind prefix.
HBM_GIB = {"TPU v5 lite": 16, "TPU v5e": 16, "TPU v5p": 95, "TPU v5": 95, "TPU v6 lite": 32,
           "TPU v6e": 32, "TPU v4": 32}


@dataclasses.dataclass
class AotReport:
  topology: str
  arm: str
  num_devices: int
  mesh: dict
  params: int
  argument_gib: float
  output_gib: float
  temp_gib: float
  alias_gib: float
  hbm_gib: float | None
  pallas_kernels: int = 0  # Mosaic (Pallas TPU) custom calls in the compiled program

  @property
  def per_device_gib(self) -> float:
    return self.argument_gib + self.output_gib + self.temp_gib - self.alias_gib

  @property
  def fits(self) -> bool | None:
    return None if self.hbm_gib is None else self.per_device_gib <= self.hbm_gib

  def line(self) -> str:
    fits = "unknown HBM" if self.fits is None else ("fits" if self.fits else "DOES NOT FIT")
    return (f"{self.topology:<12} {self.arm:<12} devices={self.num_devices:<4} "
            f"mesh={self.mesh} params={self.params/1e6:,.1f}M per-device: "
            f"args {self.argument_gib:.2f} + out {self.output_gib:.2f} + temp "
            f"{self.temp_gib:.2f} - aliased {self.alias_gib:.2f} = {self.per_device_gib:.2f} GiB"
            f" of {self.hbm_gib if self.hbm_gib is not None else '?'} GiB -> {fits}; "
            f"{self.pallas_kernels} Pallas kernel calls")


def hbm_for(device_kind: str) -> float | None:
  for prefix in sorted(HBM_GIB, key=len, reverse=True):
    if device_kind.startswith(prefix):
      return float(HBM_GIB[prefix])
  return None


def _quiet_libtpu_probe() -> None:
  """On a machine without TPU chips, tell libtpu it is a lone host before it loads.

  Otherwise libtpu's start-up probe looks for the VM's accelerator type and worker
  hostnames, finds none and prints errors that read like failures (the compile itself
  is unaffected). On a TPU VM nothing is set: the real values are discovered there.
  """
  try:
    from jax._src import hardware_utils  # pylint: disable=import-outside-toplevel
    chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
  except Exception:  # pragma: no cover - private API moved: keep libtpu's own behaviour
    return
  if chips:
    return
  for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_ACCELERATOR_TYPE", "v5litepod-1"),
                     ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_WORKER_ID", "0")):
    os.environ.setdefault(key, value)


def topology_devices(topology: str):
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  _quiet_libtpu_probe()
  try:
    return topologies.get_topology_desc(topology, "tpu").devices
  except Exception as e:
    raise ValueError(f"Cannot build TPU topology {topology!r} ({e}). Install libtpu with "
                     "pip install -e '.[tpu]' and use names like v5e:2x2, v5p:2x2x2, "
                     "v6e:4x4.") from e


@contextlib.contextmanager
def without_persistent_cache():
  """Keeps JAX's persistent compilation cache out of a topology compile.

  Such a compile has no client to load a cached executable into, so reading the cache
  (``JAX_COMPILATION_CACHE_DIR``) would only print a warning per program. JAX decides
  once per process whether the cache is in use, hence the resets on entry and exit.
  """
  from jax.experimental.compilation_cache import compilation_cache as jax_cc  # pylint: disable=import-outside-toplevel
  was = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  jax_cc.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", was)
    jax_cc.reset_cache()


def compile_train_step(config, devices, *, vocab_size: int | None = None,
                       platform: str = "tpu"):
  """Lowers and compiles the sharded train step of ``config`` for ``devices``.

  The step is the trainer's own (``diffjax.train.setup.build_train_setup``).
  Returns ``(compiled, model_config, mesh)``.
  """
  check_config(config)
  if vocab_size is None:
    # A config that fixes its vocabulary (the paper presets) compiles without the
    # tokenizer file it will train with.
    fixed = int(config.model.get("vocab_size", -1))
    vocab_size = fixed if fixed > 0 else load_tokenizer(config.data.tokenizer).vocab_size
  model_cfg = resolved_model(config, vocab_size).config
  mesh = shd.make_mesh(tuple(config.mesh.shape), devices=devices)
  setup = build_train_setup(model_cfg, config.optim, seed=config.seed, mesh=mesh,
                            rules=shd.rules_from_config(config.mesh.get("rules")),
                            grad_accum_steps=config.grad_accum_steps,
                            global_batch_size=config.global_batch_size,
                            **mesh_context_options(config))
  batch = setup.abstract_batch(config.global_batch_size, config.seq_len)
  # Kernels resolve when the step is traced, which happens in .lower(): inside this
  # context they are chosen for the target (TPU), not for this host's backend.
  with without_persistent_cache(), target_platform(platform):
    compiled = setup.train_step.lower(setup.abstract_state, batch).compile()
  return compiled, model_cfg, mesh


def aot_report(config, topology: str) -> AotReport:
  from diffjax.model import count_params  # pylint: disable=import-outside-toplevel
  devices = topology_devices(topology)
  compiled, model_cfg, mesh = compile_train_step(config, devices)
  mem = compiled.memory_analysis()
  return AotReport(
      topology=topology, arm=model_cfg.attention, num_devices=len(devices),
      mesh=dict(mesh.shape), params=count_params(model_cfg),
      argument_gib=mem.argument_size_in_bytes / GIB, output_gib=mem.output_size_in_bytes / GIB,
      temp_gib=mem.temp_size_in_bytes / GIB, alias_gib=mem.alias_size_in_bytes / GIB,
      hbm_gib=hbm_for(devices[0].device_kind),
      pallas_kernels=compiled.as_text().count('custom_call_target="tpu_custom_call"'))


def main(argv=None) -> int:
  from absl import flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  from diffjax.errors import run_guarded  # pylint: disable=import-outside-toplevel
  from diffjax.train.config_utils import explain_flag_error  # pylint: disable=import-outside-toplevel
  cfg_flag = config_flags.DEFINE_config_file("config", None, "A configs/*.py file.",
                                             lock_config=True)
  topo = flags.DEFINE_string("topology", "v5e:2x2", "TPU topology, e.g. v5e:2x2, v5p:4x4x4.")
  argv = list(argv or sys.argv)
  try:
    flags.FLAGS(argv)
    config = cfg_flag.value
    _ = config is not None and "model" in config
  except Exception as e:  # absl and ml_collections raise several types for bad flags
    detail = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    print(f"error: {explain_flag_error(argv) or 'invalid command line: ' + detail}",
          file=sys.stderr)
    return 2
  if config is None:
    print("error: --config is required", file=sys.stderr)
    return 2

  def run():
    report = aot_report(config, topo.value)
    print(report.line())
    if report.fits is False:
      raise SystemExit(1)

  return run_guarded(run)


if __name__ == "__main__":
  sys.exit(main())
