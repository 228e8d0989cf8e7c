"""Multi-node GPU launches: the process group a scheduler's variables describe, the named
XLA/NCCL preset the trainer applies, and a dry run that prints what every rank would run.

Nothing here touches JAX, so the trainer, the dry run and the tests share it (docs/gpu_clusters.md).
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import ipaddress
import os
import re
import shlex
import socket
from collections.abc import Mapping, MutableMapping, Sequence
from typing import NamedTuple


class Preset(NamedTuple):
  """XLA flags (name without the dashes -> value) and environment variables of a preset."""

  xla_flags: dict[str, str]
  env: dict[str, str]
  about: str


# The presets `distributed.xla_preset` names. Every flag here parses on jaxlib 0.10.2, 0.11.2
# and 0.12.0.1 (tests/gpu_setup/test_gpu_setup.py starts a process with them): XLA aborts a
# process whose XLA_FLAGS name a flag it does not know.
PRESETS: dict[str, Preset] = {
  "none": Preset({}, {}, "nothing is set"),
  "gpu_multinode": Preset(
    xla_flags={
      # Schedule collectives early and their waits late, so that they overlap computation.
      "xla_gpu_enable_latency_hiding_scheduler": "true",
      # Run the collectives' stream at the highest priority, ahead of queued computation.
      "xla_gpu_enable_highest_priority_async_stream": "true",
      # Combine the many small per-parameter collectives of a step into few large ones
      # (the data-parallel gradient all-reduce, FSDP's gathers and scatters): each NCCL call
      # across nodes pays a network latency, so fewer, larger calls go faster.
      "xla_gpu_all_reduce_combine_threshold_bytes": str(128 << 20),
      "xla_gpu_all_gather_combine_threshold_bytes": str(128 << 20),
      "xla_gpu_reduce_scatter_combine_threshold_bytes": str(64 << 20),
      # Move a scanned layer's collectives into the previous iteration (model.scan_layers).
      "xla_gpu_enable_pipelined_all_gather": "true",
      "xla_gpu_enable_pipelined_reduce_scatter": "true",
      "xla_gpu_enable_pipelined_all_reduce": "true",
      "xla_gpu_enable_while_loop_double_buffering": "true",
    },
    env={
      # JAX takes 75% of each GPU's memory up front by default; leave 10% to NCCL and CUDA.
      "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9",
      # NCCL says nothing by default; at WARN a failing network or topology is named.
      "NCCL_DEBUG": "WARN",
    },
    about="XLA's collective overlap and combining for several GPU nodes, with NCCL warnings",
  ),
}
PRESET_KEY = "distributed.xla_preset"


def check_preset(name: str) -> Preset:
  """The preset called ``name``; ValueError naming the known ones otherwise."""
  if name not in PRESETS:
    raise ValueError(
      f"{PRESET_KEY}={name!r} is not a preset; use one of {', '.join(map(repr, PRESETS))}, "
      f'e.g. --config.{PRESET_KEY}="gpu_multinode" (docs/gpu_clusters.md).'
    )
  return PRESETS[name]


def _flag_name(token: str) -> str:
  return token.lstrip("-").split("=", 1)[0]


def preset_changes(name: str, environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
  """What preset ``name`` changes in ``environ``: ``(new values by variable, what the
  environment already set and so keeps)``. Each XLA flag the user's ``XLA_FLAGS`` already
  names, and each variable already present (even empty), is left as it is."""
  preset = check_preset(name)
  changes: dict[str, str] = {}
  kept: list[str] = []
  current = environ.get("XLA_FLAGS", "")
  named = {_flag_name(t) for t in current.split()}
  added = []
  for flag, value in preset.xla_flags.items():
    if flag in named:
      kept.append(f"--{flag}")
    else:
      added.append(f"--{flag}={value}")
  if added:
    changes["XLA_FLAGS"] = " ".join([current.strip(), *added]).strip()
  for var, value in preset.env.items():
    if var in environ:
      kept.append(var)
    else:
      changes[var] = value
  return changes, kept


def preset_line(name: str, changes: Mapping[str, str], kept: Sequence[str], before: str) -> str:
  """The one line that says what preset ``name`` set (``before``: the XLA_FLAGS it found)."""
  parts = []
  if "XLA_FLAGS" in changes:
    added = changes["XLA_FLAGS"][len(before.strip()) :].strip()
    parts.append(f"XLA_FLAGS += {added}")
  parts += [f"{k}={v}" for k, v in changes.items() if k != "XLA_FLAGS"]
  line = f"diffjax: {PRESET_KEY}={name} set " + ("; ".join(parts) if parts else "nothing")
  if kept:
    line += f" (kept from the environment: {', '.join(kept)})"
  return line


def apply_preset(name: str, environ: MutableMapping[str, str] | None = None) -> str | None:
  """Applies preset ``name`` to ``environ`` (os.environ) as :func:`preset_changes` says, and
  returns the line saying what it did (None for "none"). Call it before JAX starts its
  backends: XLA and NCCL read these variables once, then."""
  environ = os.environ if environ is None else environ
  if check_preset(name) is PRESETS["none"]:
    return None
  before = environ.get("XLA_FLAGS", "")
  changes, kept = preset_changes(name, environ)
  environ.update(changes)
  return preset_line(name, changes, kept, before)


# ---- the process group ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
  """One process's place in the group: what ``jax.distributed.initialize`` is given."""

  source: str  # "slurm", "kubernetes" or "environment" (DIFFJAX_* alone)
  coordinator: str  # host:port of process 0
  num_processes: int
  process_id: int
  # The GPUs (indices among those the process sees) it drives; None: all it sees.
  local_device_ids: tuple[int, ...] | None = None
  # Where the coordinator's port came from: a variable's name, or "SLURM_JOB_ID" (derived).
  port_from: str = dataclasses.field(default="DIFFJAX_COORDINATOR", compare=False)

  @property
  def id_variable(self) -> str:
    """The variable that gave the process id."""
    return {"slurm": "SLURM_PROCID", "kubernetes": "JOB_COMPLETION_INDEX"}.get(
      self.source, "DIFFJAX_PROCESS_ID"
    )

  @property
  def port(self) -> int:
    return int(self.coordinator.rpartition(":")[2])

  def where(self) -> str:
    """The coordinator and what set it: ``gpu01:61586 (port from SLURM_JOB_ID)``."""
    if self.port_from == "DIFFJAX_COORDINATOR":
      return f"{self.coordinator} (DIFFJAX_COORDINATOR)"
    return f"{self.coordinator} (port from {self.port_from})"

  def initialize_kwargs(self) -> dict:
    """Keyword arguments of ``jax.distributed.initialize``; JAX's own cluster detection is
    off, so the group is exactly this one (``local_device_ids``, when set, takes the place of
    JAX_LOCAL_DEVICE_IDS)."""
    kwargs = dict(
      coordinator_address=self.coordinator,
      num_processes=self.num_processes,
      process_id=self.process_id,
      cluster_detection_method="deactivate",
    )
    if self.local_device_ids is not None:
      kwargs["local_device_ids"] = list(self.local_device_ids)
    return kwargs

  def describe(self) -> str:
    devices = "all visible" if self.local_device_ids is None else list(self.local_device_ids)
    return (
      f"process {self.process_id} of {self.num_processes} ({self.source}), coordinator "
      f"{self.coordinator}, local devices {devices}"
    )


def _int(
  environ: Mapping[str, str], name: str, fix: str, low: int = 0, high: int | None = None
) -> int:
  value = environ.get(name)
  if value is None:
    raise ValueError(f"{name} is not set; {fix}")
  try:
    number = int(value.strip())
  except ValueError:
    number = None
  if number is None or number < low or (high is not None and number > high):
    bound = f">= {low}" if high is None else f"in {low}..{high}"
    raise ValueError(f"{name}={value!r} must be a whole number {bound}; {fix}")
  return number


MAX_PORT = 65535
# How long jax.distributed.initialize waits for every process to join (its own default).
JOIN_TIMEOUT_S = 300


def join_timeout_s(environ: Mapping[str, str] | None = None) -> int:
  """How long each process waits for all of the group to join before the runtime ends it:
  DIFFJAX_JOIN_TIMEOUT_S (seconds), else JAX's default of 300 s."""
  environ = os.environ if environ is None else environ
  if not environ.get("DIFFJAX_JOIN_TIMEOUT_S", "").strip():
    return JOIN_TIMEOUT_S
  fix = (
    f"set it to the seconds each process waits for the others to join (default {JOIN_TIMEOUT_S})."
  )
  return _int(environ, "DIFFJAX_JOIN_TIMEOUT_S", fix, low=1)


def first_host(nodelist: str) -> str:
  """The first host of a SLURM host list: ``gpu[01-04,09],cpu1`` -> ``gpu01``,
  ``rack[1-2]-n[3-4]`` -> ``rack1-n3``."""
  out, i, text = [], 0, nodelist.strip()
  while i < len(text) and text[i] != ",":
    if text[i] == "[":
      end = text.find("]", i)
      first = re.split(r"[,-]", text[i + 1 : end])[0] if end > i else ""
      if not first:
        raise ValueError(
          f"SLURM node list {nodelist!r} is malformed (an unclosed or empty [...]); it should "
          "look like gpu[01-04],cpu1, as SLURM writes it."
        )
      out.append(first)
      i = end + 1
    else:
      out.append(text[i])
      i += 1
  if not out:
    raise ValueError(f"SLURM node list {nodelist!r} names no host; run train.py through srun.")
  return "".join(out)


def _slurm_port(environ: Mapping[str, str]) -> tuple[int, str]:
  for name in ("DIFFJAX_COORDINATOR_PORT", "JAX_COORDINATOR_PORT"):
    if environ.get(name):
      fix = "set it to a free TCP port, e.g. 8476."
      return _int(environ, name, fix, low=1, high=MAX_PORT), name
  job = _int(
    environ,
    "SLURM_JOB_ID",
    "run inside a SLURM job, or set DIFFJAX_COORDINATOR_PORT to a free TCP port.",
  )
  return 65536 - 4096 + job % 4096, "SLURM_JOB_ID"


def slurm_port(environ: Mapping[str, str]) -> int:
  """The coordinator's port: DIFFJAX_COORDINATOR_PORT or JAX_COORDINATOR_PORT (1..65535), else
  one in 61440..65535 from the job id (the port JAX's own SLURM detection picks)."""
  return _slurm_port(environ)[0]


def _slurm_group(environ: Mapping[str, str]) -> ProcessGroup:
  fix = "start train.py through srun inside the job (gpu_setup/slurm_train.sbatch)."
  count = _int(environ, "SLURM_NTASKS", fix, low=1)
  process = _int(environ, "SLURM_PROCID", fix)
  local = _int(environ, "SLURM_LOCALID", fix)
  nodelist = next(
    (environ[k] for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if environ.get(k)), None
  )
  if nodelist is None:
    raise ValueError(f"SLURM_NTASKS={count}, but SLURM_STEP_NODELIST is not set; {fix}")
  if process >= count:
    raise ValueError(f"SLURM_PROCID={process} must be below SLURM_NTASKS={count}; {fix}")
  host = first_host(nodelist)
  port, port_from = _slurm_port(environ)
  coordinator = f"{host}:{port}"
  # One task per GPU (several tasks on a node): task i drives the node's GPU i, as JAX's own
  # SLURM detection assumes. One task per node, or a task SLURM bound to its own GPUs
  # (--gpus-per-task=N): all the GPUs it sees.
  per_node = environ.get("SLURM_NTASKS_PER_NODE", "")
  nodes = next(
    (
      environ[k]
      for k in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
      if k in environ
    ),
    "",
  )
  if per_node.strip().isdigit():
    tasks_here = int(per_node)
  elif nodes.strip().isdigit() and int(nodes) > 0:
    tasks_here = -(-count // int(nodes))
  else:
    tasks_here = count
  # A task that sees fewer GPUs than its node has tasks was given its own (--gpus-per-task=N,
  # CUDA_VISIBLE_DEVICES of N entries): it drives all it sees.
  visible = [v for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
  pinned = tasks_here > 1 and (not visible or len(visible) >= tasks_here)
  devices = (local,) if pinned else None
  return ProcessGroup("slurm", coordinator, count, process, devices, port_from)


def _env_group(environ: Mapping[str, str]) -> ProcessGroup:
  coordinator = environ["DIFFJAX_COORDINATOR"].strip()
  host, _, port = coordinator.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(
      f"DIFFJAX_COORDINATOR={coordinator!r} must be HOST:PORT of process 0, e.g. node0:8476 "
      "(in Kubernetes: <job>-0.<service>:8476)."
    )
  if not 1 <= int(port) <= MAX_PORT:
    raise ValueError(
      f"DIFFJAX_COORDINATOR={coordinator!r} names port {port}, which is not a TCP port: use "
      f"one in 1..{MAX_PORT} that is free on process 0's host, e.g. {host}:8476."
    )
  fix = "set DIFFJAX_NUM_PROCESSES to the number of processes, the same on every one."
  count = _int(environ, "DIFFJAX_NUM_PROCESSES", fix, low=1)
  if environ.get("DIFFJAX_PROCESS_ID", "").strip():
    name, source = "DIFFJAX_PROCESS_ID", "environment"
  elif environ.get("JOB_COMPLETION_INDEX", "").strip():
    name, source = "JOB_COMPLETION_INDEX", "kubernetes"
  else:
    raise ValueError(
      "DIFFJAX_COORDINATOR is set, but neither DIFFJAX_PROCESS_ID nor JOB_COMPLETION_INDEX "
      f"(a Kubernetes Indexed Job's) is: set DIFFJAX_PROCESS_ID to 0..{count - 1}, one per process."
    )
  process = _int(environ, name, f"it must be 0..{count - 1}, one per process.")
  if process >= count:
    raise ValueError(
      f"{name}={process} must be below DIFFJAX_NUM_PROCESSES={count}: the processes are "
      f"0..{count - 1} (a Kubernetes Job's completions and DIFFJAX_NUM_PROCESSES must agree)."
    )
  return ProcessGroup(source, coordinator, count, process)


def _several(value: str | None) -> bool:
  value = (value or "").strip()
  return bool(value) and value not in ("0", "1")


def group_wanted(environ: Mapping[str, str] | None = None) -> bool:
  """Whether the environment describes a process group diffjax forms itself (a coordinator in
  DIFFJAX_COORDINATOR, or a SLURM step of several tasks); never raises."""
  environ = os.environ if environ is None else environ
  return bool(environ.get("DIFFJAX_COORDINATOR", "").strip()) or _several(
    environ.get("SLURM_NTASKS")
  )


def process_group(environ: Mapping[str, str] | None = None) -> ProcessGroup | None:
  """The group the environment describes, or None (JAX's own detection, or one process).

  ``DIFFJAX_COORDINATOR`` comes first: with ``DIFFJAX_NUM_PROCESSES`` and the process id from
  ``DIFFJAX_PROCESS_ID`` or else ``JOB_COMPLETION_INDEX`` (a Kubernetes Indexed Job). Then a
  SLURM step of several tasks: ``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``, the
  first host of ``SLURM_STEP_NODELIST`` as the coordinator. A malformed value raises
  ValueError naming it and the fix.
  """
  environ = os.environ if environ is None else environ
  if environ.get("DIFFJAX_COORDINATOR", "").strip():
    return _env_group(environ)
  if _several(environ.get("SLURM_NTASKS")):
    return _slurm_group(environ)
  return None


def on_tpu_vm() -> bool:
  """A Cloud TPU VM exposes its chips as /dev/accel* (v4, v5e) or /dev/vfio/N (v5p, v6e)."""
  return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def jax_group(environ: Mapping[str, str] | None = None, tpu_vm: bool | None = None) -> str | None:
  """What makes this process one of a group that JAX finds itself (not one diffjax forms), in
  words: several ``TPU_WORKER_HOSTNAMES``, ``MEGASCALE_COORDINATOR_ADDRESS``,
  ``JAX_COORDINATOR_ADDRESS``, a Cloud TPU VM (``tpu_vm``; None: look at /dev). None when
  nothing does; never raises."""
  environ = os.environ if environ is None else environ
  hosts = [h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
  if len(hosts) > 1:
    worker = environ.get("TPU_WORKER_ID", "").strip()
    who = (
      f"process {worker} of {len(hosts)}" if worker.isdigit() else f"one of {len(hosts)} processes"
    )
    return f"{who} (TPU_WORKER_HOSTNAMES; JAX forms the group)"
  if environ.get("MEGASCALE_COORDINATOR_ADDRESS", "").strip():
    address = environ["MEGASCALE_COORDINATOR_ADDRESS"].strip()
    return f"one process of a multislice group (MEGASCALE_COORDINATOR_ADDRESS={address}; JAX forms the group)"
  if environ.get("JAX_COORDINATOR_ADDRESS", "").strip():
    address = environ["JAX_COORDINATOR_ADDRESS"].strip()
    count = environ.get("JAX_NUM_PROCESSES", "").strip()
    me = environ.get("JAX_PROCESS_ID", "").strip()
    who = f"process {me} of {count}" if count and me else "one of several processes"
    return f"{who} (JAX_COORDINATOR_ADDRESS={address}; JAX forms the group)"
  if on_tpu_vm() if tpu_vm is None else tpu_vm:
    return "one process of a Cloud TPU VM's group (JAX reads the workers from the VM's metadata)"
  return None


# ---- the coordinator's port -------------------------------------------------------------------


def is_this_host(host: str) -> bool:
  """Whether ``host`` (a coordinator's) names this machine, as far as that can be told without
  asking DNS: localhost, a loopback address, an address this machine can bind, or its host
  name (or the first label of either: ``node0`` and ``node0.cluster``, a Kubernetes pod and
  ``<pod>.<service>``)."""
  host = host.strip().strip("[]").lower()
  if not host:
    return False
  if host == "localhost":
    return True
  try:
    address = ipaddress.ip_address(host)
  except ValueError:
    address = None
  if address is not None:
    if address.is_loopback:
      return True
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
      with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))  # only an address of this machine can be bound
    except OSError:
      return False
    return True
  name = socket.gethostname().strip().lower()
  if not name:
    return False
  return host in (name, name.split(".")[0]) or host.split(".")[0] == name


def port_taken(port: int) -> bool:
  """Whether ``port`` is held on this machine so that the coordinator could not serve on it.

  The coordinator's gRPC server binds ``[::]:port`` (``0.0.0.0:port`` without IPv6) with
  SO_REUSEADDR, so this binds the same way, and closes the socket at once: a port whose last
  connections are in TIME_WAIT is free, a listening socket holds it. gRPC also sets
  SO_REUSEPORT, which would let it share the port with another server that set it (an old
  coordinator still running) and lose its connections to it; this does not, so such a port is
  taken. A bind refused for another reason (no IPv6, a port below 1024) tells nothing: False.
  """
  for family, address in ((socket.AF_INET6, ("::", port)), (socket.AF_INET, ("0.0.0.0", port))):
    try:
      s = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
      continue  # no IPv6 on this machine
    with s:
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      if family == socket.AF_INET6:
        try:
          s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        except (OSError, AttributeError):
          pass
      try:
        s.bind(address)
      except OSError as e:
        if e.errno == errno.EADDRINUSE:
          return True
        continue
      return False
  return False


def port_in_use(group: ProcessGroup | None, coordinator: str | None = None) -> str:
  """The message (no ``error:``) for a coordinator port already in use on process 0's host,
  naming the setting the port came from and the fix."""
  coordinator = group.coordinator if group else (coordinator or "")
  port = coordinator.rpartition(":")[2] or "?"
  taken = (
    f"is already in use on this host (another run's coordinator, or an old process still "
    f"holding it), so process 0 cannot serve the coordinator {coordinator} there"
  )
  if group is None:
    return (
      f"the coordinator's port {port} {taken}: stop that process, or choose another port in "
      "JAX_COORDINATOR_ADDRESS, the same for every process."
    )
  if group.port_from == "DIFFJAX_COORDINATOR":
    return (
      f"port {port} of DIFFJAX_COORDINATOR={coordinator} {taken}: stop that process, or give "
      "every process another port in DIFFJAX_COORDINATOR."
    )
  if group.port_from == "SLURM_JOB_ID":
    return (
      f"port {port}, which diffjax derives from SLURM_JOB_ID (61440 + job id mod 4096; "
      f"jobs 4096 apart share it), {taken}: set DIFFJAX_COORDINATOR_PORT to a free port "
      "for every task (e.g. DIFFJAX_COORDINATOR_PORT=8476 sbatch ...)."
    )
  return (
    f"port {port} of {group.port_from}={port} {taken}: stop that process, or set "
    f"{group.port_from} to a free port for every task."
  )


def check_coordinator_port(group: ProcessGroup, environ: Mapping[str, str] | None = None) -> None:
  """On process 0, before it starts the coordinator: ValueError (:func:`port_in_use`) when the
  coordinator's host is this machine and its port is taken (:func:`port_taken`); the runtime's
  own failure there is a crash or a traceback, and every other process waits for it in vain.
  Nothing is checked on other processes, for a host that may be another machine, or with
  ``JAX_COORDINATOR_BIND_ADDRESS`` (the service binds there)."""
  environ = os.environ if environ is None else environ
  if group.process_id != 0 or environ.get("JAX_COORDINATOR_BIND_ADDRESS", "").strip():
    return
  if is_this_host(group.coordinator.rpartition(":")[0]) and port_taken(group.port):
    raise ValueError(port_in_use(group))


# ---- the dry run ------------------------------------------------------------------------------


def slurm_rank_env(
  rank: int, nodes: int, tasks_per_node: int, job_id: int, nodelist: str, hosts: Sequence[str]
) -> dict[str, str]:
  """The SLURM variables srun gives task ``rank`` of ``nodes x tasks_per_node`` (block
  distribution, as srun's default)."""
  node = rank // tasks_per_node
  return {
    "SLURM_JOB_ID": str(job_id),
    "SLURM_NTASKS": str(nodes * tasks_per_node),
    "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
    "SLURM_STEP_NUM_NODES": str(nodes),
    "SLURM_STEP_NODELIST": nodelist,
    "SLURMD_NODENAME": hosts[node],
    "SLURM_NODEID": str(node),
    "SLURM_PROCID": str(rank),
    "SLURM_LOCALID": str(rank % tasks_per_node),
  }


def kubernetes_rank_env(
  rank: int, pods: int, job: str, service: str, port: int, namespace: str | None
) -> dict[str, str]:
  """The variables pod ``rank`` of the Indexed Job gets: its index from Kubernetes, the
  coordinator (pod 0 through the headless service) and the count from the manifest."""
  domain = f"{service}.{namespace}.svc" if namespace else service
  return {
    "JOB_COMPLETION_INDEX": str(rank),
    "HOSTNAME": f"{job}-{rank}",
    "DIFFJAX_COORDINATOR": f"{job}-0.{domain}:{port}",
    "DIFFJAX_NUM_PROCESSES": str(pods),
  }


def _flag_values(args: Sequence[str], name: str) -> list[str]:
  """The values given to the flag ``name`` in ``args``, in order, in every form train.py's
  parser (absl) takes: ``--name=v``, ``-name=v``, ``--name v``, ``-name v``; nothing after a
  bare ``--``."""
  values, i = [], 0
  while i < len(args) and args[i] != "--":
    arg = args[i]
    for dashes in ("--", "-"):
      if arg.startswith(f"{dashes}{name}="):
        values.append(arg.split("=", 1)[1])
      elif arg == f"{dashes}{name}" and i + 1 < len(args):
        values.append(args[i + 1])
        i += 1
      else:
        continue
      break
    i += 1
  return values


def preset_of(train_args: Sequence[str]) -> str:
  """The preset train.py will apply for ``train_args``: the last ``--config.distributed.
  xla_preset`` override, else the config file's value, else "none"."""
  chosen = _flag_values(train_args, f"config.{PRESET_KEY}")
  if chosen:
    return chosen[-1].strip().strip("'\"")
  config = next(reversed(_flag_values(train_args, "config")), None)
  if config:
    from diffjax import cli  # pylint: disable=import-outside-toplevel

    path, _, arg = config.partition(":")
    loaded = cli.load_config(path, arg or None)
    section = loaded.get("distributed") if hasattr(loaded, "get") else None
    if section is not None and section.get("xla_preset") is not None:
      return str(section.get("xla_preset"))
  return "none"


def _quote_env(env: Mapping[str, str]) -> str:
  return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())


def rank_lines(
  label: str, scheduler_env: Mapping[str, str], base_env: Mapping[str, str], command: Sequence[str]
) -> list[str]:
  """The dry run's lines for one rank: the group it forms, the scheduler's variables, what
  the preset adds, and the command (all through the functions the trainer itself calls)."""
  env = {**base_env, **scheduler_env}
  group = process_group(env)
  preset = preset_of(command)
  changes, kept = preset_changes(preset, env)
  where = scheduler_env.get("SLURMD_NODENAME") or scheduler_env.get("HOSTNAME") or "this host"
  if group:
    what = group.describe()
  else:
    what = jax_group(env) or "one process (no process group in the environment)"
  lines = [f"{label} on {where}: {what}"]
  lines.append(f"  env:  {_quote_env(scheduler_env) or '(nothing from a scheduler)'}")
  added = _quote_env(changes) or "nothing"
  lines.append(
    f"  sets: {added}  [{PRESET_KEY}={preset}"
    + (f"; kept from the environment: {', '.join(kept)}" if kept else "")
    + "]"
  )
  lines.append(f"  run:  {' '.join(shlex.quote(c) for c in command)}")
  return lines
