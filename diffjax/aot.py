"""Ahead-of-time compile of the real train step for a TPU topology or a GPU, on any machine.

What ``python -m diffjax.aot`` compiles and prints: docs/scaling.md#check-before-you-rent; GPU
targets (``--target=h100:8``) and how "fits" is judged there: docs/kernels_gpu.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys

import jax

from diffjax import hardware
from diffjax import sharding as shd
from diffjax.data import load_tokenizer
from diffjax.kernels.gpu import targets as gpu_targets
from diffjax.model import resolve_model
from diffjax.ops import target_platform
from diffjax.train.config import RunConfig
from diffjax.train.config_utils import OVERRIDE_HELP, RENAMED_KEYS, resolved_model
from diffjax.train.setup import build_train_setup

GIB = 1024**3


# The custom calls of our kernels in a compiled program, by platform.
KERNEL_CALLS = {
  "tpu": ('custom_call_target="tpu_custom_call"',),
  "gpu": ('custom_call_target="mosaic_gpu_v2"', 'custom_call_target="mosaic_gpu"'),
}


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
  pallas_kernels: int = 0  # Pallas kernel calls (Mosaic TPU or Mosaic GPU) in the program
  platform: str = "tpu"
  usable_fraction: float = 1.0  # of hbm_gib a process may use (GPU: the client's share)
  num_slices: int = 1
  dcn: DcnTraffic | None = None  # what crosses slices (multi-slice compiles only)

  @property
  def per_device_gib(self) -> float:
    return self.argument_gib + self.output_gib + self.temp_gib - self.alias_gib

  @property
  def usable_gib(self) -> float | None:
    return None if self.hbm_gib is None else self.hbm_gib * self.usable_fraction

  @property
  def fits(self) -> bool | None:
    return None if self.hbm_gib is None else self.per_device_gib <= self.usable_gib

  def line(self) -> str:
    fits = "unknown HBM" if self.fits is None else ("fits" if self.fits else "DOES NOT FIT")
    share = (
      ""
      if self.usable_fraction == 1.0 or self.hbm_gib is None
      else f" ({self.usable_fraction:g} of {self.hbm_gib:.1f})"
    )
    usable = f"{self.usable_gib:.2f}" if self.usable_gib is not None else "?"
    kernels = "Mosaic GPU" if self.platform == "gpu" else "Pallas"
    where = self.topology if self.num_slices == 1 else f"{self.num_slices}x {self.topology}"
    return (
      f"{where:<12} {self.arm:<12} devices={self.num_devices:<4} "
      f"mesh={self.mesh} params={self.params / 1e6:,.1f}M per-device: "
      f"args {self.argument_gib:.2f} + out {self.output_gib:.2f} + temp "
      f"{self.temp_gib:.2f} - aliased {self.alias_gib:.2f} = {self.per_device_gib:.2f} GiB"
      f" of {usable}{share} GiB -> {fits}; {self.pallas_kernels} {kernels} kernel calls"
      + ("" if self.dcn is None else "\n" + self.dcn_line())
    )

  def dcn_line(self) -> str:
    """One line: what a device sends to other slices per step."""
    d = self.dcn
    kinds = ", ".join(
      f"{k.lower()} {v / 2**20:,.1f} MiB" for k, v in sorted(d.bytes_by_kind.items())
    )
    return (
      f"{'':<12} {self.arm:<12} DCN per device and step: {d.total_bytes / 2**20:,.1f} MiB over "
      f"{self.num_slices} slices ({kinds or 'nothing'}; {d.transfers} transfers, largest "
      f"{d.largest})"
      + (f"; {d.unknown_loops} loops of unknown length counted once" if d.unknown_loops else "")
    )


# Multi-slice programs: the TPU compiler lowers every collective that leaves a slice to a
# host-transfer ``send`` handed to the DCN runtime, tagged with the collective it carries.
_COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_DCN_SEND = re.compile(
  r"= \((\w+)\[([\d,]*)\](?:\{[^}]*\})?, u32\[\](?:\{[^}]*\})?, token\[\](?:\{[^}]*\})?\) "
  r"send\(.*_xla_megascale_transfer_type=\"(\w+)\""
)
_CALLED = re.compile(r"(?:body|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r"constant\((\d+)\)")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BITS = re.compile(r"[a-z]+(\d+)")


def _dtype_bytes(dtype: str) -> float:
  """Bytes of one element of an HLO element type (f32, bf16, f8e4m3fn, s4, c64, pred, ...)."""
  if dtype == "pred":
    return 1.0
  m = _BITS.match(dtype)
  return int(m.group(1)) / 8 if m else 4.0


@dataclasses.dataclass
class DcnTraffic:
  """What one device sends over the data-centre network in one step, from a compiled
  multi-slice program.

  ``bytes_by_kind``: payload bytes by collective ("ALL_REDUCE", "ALL_GATHER", ...), each
  transfer counted as often as the loops around it run; ``transfers``: how many transfers
  that makes; ``largest``: the largest transfer (dtype[shape] and its kind);
  ``unknown_loops``: loops whose trip count could not be read (counted once).
  """

  bytes_by_kind: dict
  transfers: int
  largest: str
  unknown_loops: int = 0

  @property
  def total_bytes(self) -> int:
    return int(sum(self.bytes_by_kind.values()))


def _trip_count(condition: list[str]) -> int | None:
  """The bound of a loop whose condition is ``i < N`` (the form scans compile to)."""
  if not any("direction=LT" in line for line in condition):
    return None
  counts = [int(m.group(1)) for line in condition for m in _TRIP.finditer(line)]
  return counts[0] if len(counts) == 1 else None


def dcn_traffic(hlo_text: str) -> DcnTraffic:
  """Sums the cross-slice transfers of a compiled program (``compiled.as_text()``) per
  device and step; loops multiply what they contain by their trip counts (the compiler's
  ``known_trip_count``, else the bound of an ``i < N`` condition), and every branch of a
  conditional counts as taken (an upper bound)."""
  comps: dict[str, list[str]] = {}
  entry, name = None, None
  for line in hlo_text.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      name = m.group(2)
      comps[name] = []
      entry = name if m.group(1) else entry
    elif name is not None:
      comps[name].append(line)
  if entry is None:
    raise ValueError("not a compiled HLO module: no ENTRY computation")
  runs = {entry: 1}
  unknown = 0
  order = [entry]
  for comp in order:  # breadth-first over calls; a callee's count is its caller's times trips
    for line in comps.get(comp, ()):
      callees = _CALLED.findall(line)
      for group in _BRANCHES.findall(line):
        callees += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
      if not callees:
        continue
      times = runs[comp]
      if " while(" in line:
        known = _KNOWN_TRIPS.search(line)
        cond = re.search(r"condition=%([\w.\-]+)", line)
        if known:
          trips = int(known.group(1))
        else:
          trips = _trip_count(comps.get(cond.group(1), [])) if cond else None
        if trips is None:
          unknown += 1
        times *= trips or 1
      for c in callees:
        if c in comps and c not in runs:
          runs[c] = times
          order.append(c)
  by_kind: dict[str, int] = {}
  transfers, largest, largest_bytes = 0, "none", -1
  for comp, times in runs.items():
    for line in comps[comp]:
      m = _DCN_SEND.search(line)
      if m is None:
        continue
      dtype, dims, kind = m.groups()
      nbytes = _dtype_bytes(dtype)
      for d in filter(None, dims.split(",")):
        nbytes *= int(d)
      nbytes = int(nbytes)
      by_kind[kind] = by_kind.get(kind, 0) + nbytes * times
      transfers += times
      if nbytes > largest_bytes:
        largest, largest_bytes = f"{kind} {dtype}[{dims}]", nbytes
  return DcnTraffic(by_kind, transfers, largest, unknown)


class DoesNotFit(Exception):
  """A step that needs more memory per device than the target has; ``str`` is one line."""


def fit_options(
  run: RunConfig, *, needs_gib: float, has_gib: float, target: str, batch_devices: int = 1
) -> str:
  """One line: what the step needs, and settings that would make it fit (more accumulation
  steps only when a micro-batch still splits over the ``batch_devices``, data x fsdp)."""
  options = []
  accum, batch = run.grad_accum_steps, run.global_batch_size
  if batch % (2 * accum) == 0 and (batch // (2 * accum)) % batch_devices == 0:
    options.append(
      f"--config.grad_accum_steps={2 * accum} (a microbatch of {batch // (2 * accum)} rows)"
    )
  if resolve_model(run.model).config.remat != "full":
    options.append("--config.model.remat=full")
  if gpu_targets.is_gpu_target(target):
    tgt, count = gpu_targets.parse(target)
    if count < 8:
      options.append(f"more GPUs (--target={tgt.name}:{max(8, 2 * count)})")
    if tgt.name == "h100":
      options.append("--target=h200 (141 GB)")
    options.append("XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 when the run starts")
  else:
    options.append(f"a larger slice (more chips than {target})")
  return (
    f"{target}: the step needs {needs_gib:.1f} GiB of {has_gib:.2f} GiB per device; "
    f"to fit try " + ", ".join(options) + "."
  )


# The TPU compiler's two spellings of "does not fit": "... Used 39.80G of 31.25G hbm" and
# "... required for HLO temporaries (40.24G) exceeds available HBM (15.75G)".
_OOM = (
  re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm"),
  re.compile(
    r"required for [^(]*\(([\d.]+)([KMGT]?)\) exceeds available HBM "
    r"\(([\d.]+)([KMGT]?)\)"
  ),
)
_UNITS = {"": 1 / GIB, "K": 1 / 1024**2, "M": 1 / 1024, "G": 1.0, "T": 1024.0}


def parse_out_of_memory(message: str) -> tuple[float, float] | None:
  """(needed, available) GiB from a compiler's out-of-memory error, or None."""
  for pattern in _OOM:
    m = pattern.search(message)
    if m is not None:
      return (float(m.group(1)) * _UNITS[m.group(2)], float(m.group(3)) * _UNITS[m.group(4)])
  return None


def hbm_for(device_kind: str) -> float | None:
  """HBM of one device of ``device_kind`` in GiB (:mod:`diffjax.hardware`), or None."""
  accelerator = hardware.for_device_kind(device_kind)
  return None if accelerator is None else accelerator.hbm_gib


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
  for key, value in (
    ("TPU_SKIP_MDS_QUERY", "1"),
    ("TPU_ACCELERATOR_TYPE", "v5litepod-1"),
    ("TPU_WORKER_HOSTNAMES", "localhost"),
    ("TPU_WORKER_ID", "0"),
  ):
    os.environ.setdefault(key, value)


def topology_devices(topology: str, num_slices: int = 1):
  """The devices of ``num_slices`` TPU slices of ``topology`` (deviceless, through libtpu)."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  _quiet_libtpu_probe()
  options = {} if num_slices == 1 else {"num_slices": num_slices}
  chip = hardware.ACCELERATORS.get(topology.split(":")[0])
  if isinstance(chip, hardware.Tpu) and chip.tensorcores > 1:
    # A megacore chip is one JAX device on a TPU VM (its two TensorCores and all its HBM),
    # while libtpu describes a v4 topology one device per TensorCore unless told.
    options["chip_config_name"] = "megacore"
  try:
    return topologies.get_topology_desc(topology, "tpu", **options).devices
  except Exception as e:
    raise ValueError(
      f"Cannot build TPU topology {topology!r} ({e}). Install libtpu with "
      "pip install -e '.[tpu]' and use names like v5e:2x2, v5p:2x2x2, "
      "v6e:4x4."
    ) from e


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


def compile_train_step(
  run: RunConfig,
  devices,
  *,
  vocab_size: int | None = None,
  platform: str = "tpu",
  gpu_capability: tuple[int, int] | None = None,
):
  """Lowers and compiles the sharded train step of ``run`` for ``devices``.

  The step is the trainer's own (``diffjax.train.setup.build_train_setup``).
  ``platform``/``gpu_capability``: what the attention implementations resolve for.
  Returns ``(compiled, model_config, mesh)``.
  """
  if vocab_size is None:
    # A config that fixes its vocabulary (the paper presets) compiles without the
    # tokenizer file it will train with.
    vocab_size = run.fixed_vocab_size
    if vocab_size is None:
      if run.data is None:
        raise ValueError(
          "model.vocab_size=-1 takes the tokenizer's vocabulary, and the data section names "
          "none yet: set --config.data.tokenizer (with data.paths) or --config.model.vocab_size."
        )
      vocab_size = load_tokenizer(run.data.tokenizer).vocab_size
  model_cfg = resolved_model(run.model, vocab_size).config
  mesh = shd.make_mesh(run.mesh.shape, devices=devices, dcn_shape=run.mesh.dcn_shape)
  setup = build_train_setup(
    model_cfg,
    run.optim,
    seed=run.seed,
    mesh=mesh,
    rules=run.mesh.logical_rules,
    grad_accum_steps=run.grad_accum_steps,
    grad_accum_reduce=run.grad_accum_reduce,
    global_batch_size=run.global_batch_size,
    seq_len=run.seq_len,
    **run.mesh.context_options(),
  )
  batch = setup.abstract_batch(run.global_batch_size, run.seq_len)
  # Kernels resolve when the step is traced, which happens in .lower(): inside this
  # context they are chosen for the target, not for this host's backend.
  with without_persistent_cache(), target_platform(platform, gpu_capability=gpu_capability):
    compiled = setup.train_step.lower(setup.abstract_state, batch).compile()
  return compiled, model_cfg, mesh


def _client_mem_fraction() -> float:
  value = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
  try:
    return float(value)
  except ValueError:
    raise ValueError(
      f"XLA_PYTHON_CLIENT_MEM_FRACTION={value!r} must be a number in (0, 1]."
    ) from None


def aot_report(run: RunConfig, topology: str, num_slices: int = 1) -> AotReport:
  """Compiles the step of ``run`` for a TPU topology ("v5p:4x4x4"; ``num_slices`` of it joined
  by DCN, ``run.mesh.shape`` then being the mesh within a slice) or GPU target ("h100",
  "h100:8").

  Raises :class:`DoesNotFit` (one line, with options) when the compiler refuses the step
  for memory.
  """
  from diffjax.model import count_params  # pylint: disable=import-outside-toplevel

  gpu = gpu_targets.is_gpu_target(topology)
  if num_slices < 1 or (gpu and num_slices != 1):
    raise ValueError(
      f"num_slices={num_slices}: give a positive number of TPU slices (GPU targets are one "
      "node: --target=h100:8)."
    )
  if gpu:
    target, count = gpu_targets.parse(topology)
    devices = gpu_targets.devices(target, count)
    kwargs = dict(platform="gpu", gpu_capability=target.compute_capability)
    capacity, fraction = target.hbm_gib, _client_mem_fraction()
  else:
    devices = topology_devices(topology, num_slices)
    kwargs = dict(platform="tpu")
    capacity, fraction = hbm_for(devices[0].device_kind), 1.0
  try:
    compiled, model_cfg, mesh = compile_train_step(run, devices, **kwargs)
  except Exception as e:  # the compilers raise JaxRuntimeError (XlaRuntimeError before)
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    _, _, tensor, context = shd.resolve_mesh_shape(run.mesh.shape, len(devices) // num_slices)
    options = dict(target=topology, batch_devices=len(devices) // (tensor * context))
    sizes = parse_out_of_memory(str(e))
    if sizes is None:
      raise DoesNotFit(
        f"{topology}: the step does not fit ({str(e).splitlines()[0][:200]}); "
        + fit_options(run, needs_gib=float("nan"), has_gib=float("nan"), **options).split("; ", 1)[
          1
        ]
      ) from None
    raise DoesNotFit(fit_options(run, needs_gib=sizes[0], has_gib=sizes[1], **options)) from None
  mem = compiled.memory_analysis()
  text = compiled.as_text()
  platform = kwargs["platform"]
  return AotReport(
    topology=topology,
    arm=model_cfg.attention,
    num_devices=len(devices),
    mesh=dict(mesh.shape),
    params=count_params(model_cfg),
    argument_gib=mem.argument_size_in_bytes / GIB,
    output_gib=mem.output_size_in_bytes / GIB,
    temp_gib=mem.temp_size_in_bytes / GIB,
    alias_gib=mem.alias_size_in_bytes / GIB,
    hbm_gib=capacity,
    platform=platform,
    usable_fraction=fraction,
    pallas_kernels=sum(text.count(call) for call in KERNEL_CALLS[platform]),
    num_slices=num_slices,
    dcn=dcn_traffic(text) if num_slices > 1 else None,
  )


USAGE = (
  "usage: python -m diffjax.aot --config=configs/<file>.py[:ARG] "
  "[--topology=v5p:4x4x4 [--num_slices=N] | --target=h100[:N]] [--config.<key>=<value> ...]"
)
SUMMARY = """\
Compiles the run's real train step ahead of time for a TPU topology (with libtpu) or a GPU
target (with the [gpu-compile] extra) on this machine, and prints the per-device memory the
compiler plans, whether it fits and how many of diffjax's kernels the step calls."""


def main(argv=None) -> int:
  from diffjax import cli  # pylint: disable=import-outside-toplevel
  from diffjax.errors import run_guarded  # pylint: disable=import-outside-toplevel

  parsed = cli.parse(
    list(argv or sys.argv),
    usage=USAGE,
    summary=SUMMARY,
    overrides_help=OVERRIDE_HELP,
    renamed=RENAMED_KEYS,
    flags=(
      cli.Flag(
        "topology",
        None,
        "TPU topology, e.g. v5e:2x2, v5p:4x4x4 [default: v5e:2x2 when no --target is given]",
      ),
      cli.Flag(
        "target", None, "GPU target: h100, h200 or a100, ':N' for N GPUs of one node (h100:8)"
      ),
      cli.Flag(
        "num_slices",
        1,
        "TPU slices of --topology joined by DCN; mesh.shape is then the mesh within one slice "
        "and mesh.dcn_shape how many slices each axis spans",
      ),
    ),
  )
  if isinstance(parsed, int):
    return parsed
  config, values, _ = parsed

  topology, target, num_slices = values["topology"], values["target"], values["num_slices"]
  if topology and target:
    return cli.usage_error("give --topology (TPU) or --target (GPU), not both")
  if num_slices < 1 or (target and num_slices != 1):
    return cli.usage_error(
      f"--num_slices={num_slices} must be a positive number of TPU slices of "
      "--topology (a GPU --target is one node)"
    )
  where = target or topology or "v5e:2x2"
  if target and not gpu_targets.is_gpu_target(target):
    return cli.usage_error(
      f"--target={target!r} is not a GPU target; use one of "
      f"{sorted(gpu_targets.TARGETS)} (TPU topologies go to --topology)"
    )

  def run():
    # A compile reads no data: a corpus named at launch need not be named here.
    spec = RunConfig.from_config(config, data_at_launch=True)
    try:
      report = aot_report(spec, where, num_slices)
    except DoesNotFit as e:
      print(str(e))
      raise SystemExit(1) from None
    print(report.line())
    if report.fits is False:
      print(
        fit_options(
          spec,
          needs_gib=report.per_device_gib,
          has_gib=report.usable_gib,
          target=where,
          batch_devices=report.mesh["data"] * report.mesh["fsdp"],
        )
      )
      raise SystemExit(1)

  return run_guarded(run)


if __name__ == "__main__":
  sys.exit(main())
