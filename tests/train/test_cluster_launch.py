"""Process groups from SLURM and Kubernetes variables, and the XLA/NCCL preset
(diffjax/train/cluster.py, diffjax/train/distributed.py; docs/gpu_clusters.md).

The unit tests fake the schedulers' variables; the slow ones start train.py as 2 processes on
127.0.0.1 under them and check the group and the losses against one process of as many
devices.
"""

import os
import socket
import subprocess
import sys

import pytest
from helpers import REPO, WAIT_LIMIT_S, free_port, read_metrics

from diffjax.train import cluster, distributed
from diffjax.train.sections import DistributedConfig

_SCHEDULER_VARS = (
  "DIFFJAX_COORDINATOR",
  "DIFFJAX_NUM_PROCESSES",
  "DIFFJAX_PROCESS_ID",
  "DIFFJAX_COORDINATOR_PORT",
  "DIFFJAX_JOIN_TIMEOUT_S",
  "JAX_COORDINATOR_PORT",
  "JAX_COORDINATOR_ADDRESS",
  "JAX_COORDINATOR_BIND_ADDRESS",
  "JAX_NUM_PROCESSES",
  "JAX_PROCESS_ID",
  "JOB_COMPLETION_INDEX",
  "CUDA_VISIBLE_DEVICES",
  "TPU_WORKER_HOSTNAMES",
  "TPU_WORKER_ID",
  "MEGASCALE_COORDINATOR_ADDRESS",
)


def _clear(monkeypatch):
  for name in list(os.environ):
    if name.startswith("SLURM") or name in _SCHEDULER_VARS:
      monkeypatch.delenv(name)


def _slurm(monkeypatch, **extra):
  _clear(monkeypatch)
  env = dict(
    SLURM_JOB_ID="1234567",
    SLURM_NTASKS="16",
    SLURM_NTASKS_PER_NODE="8",
    SLURM_STEP_NUM_NODES="2",
    SLURM_STEP_NODELIST="gpu[07-08]",
    SLURM_PROCID="11",
    SLURM_LOCALID="3",
  )
  env.update(extra)
  for k, v in env.items():
    if v is None:
      monkeypatch.delenv(k, raising=False)
    else:
      monkeypatch.setenv(k, v)


# ---- the process group ------------------------------------------------------------------------


def test_a_slurm_step_is_detected_and_forms_its_group(monkeypatch):
  _slurm(monkeypatch)
  assert distributed.detected()
  group = cluster.process_group()
  # The port JAX's own SLURM detection derives from the job id.
  assert group == cluster.ProcessGroup("slurm", f"gpu07:{61440 + 1234567 % 4096}", 16, 11, (3,))
  kw = group.initialize_kwargs()
  assert kw["cluster_detection_method"] == "deactivate" and kw["local_device_ids"] == [3]


@pytest.mark.parametrize(
  "extra, devices",
  [
    (dict(SLURM_NTASKS_PER_NODE="1", SLURM_NTASKS="2", SLURM_LOCALID="0"), None),  # one per node
    (dict(SLURM_NTASKS_PER_NODE=None, SLURM_NTASKS="2", SLURM_LOCALID="0"), None),  # 2 nodes
    (dict(SLURM_NTASKS_PER_NODE=None), (3,)),  # 16 tasks on 2 nodes
    (dict(CUDA_VISIBLE_DEVICES="5"), None),  # SLURM bound the task to one GPU
    (dict(CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"), (3,)),
    (dict(CUDA_VISIBLE_DEVICES="6,7"), None),  # --gpus-per-task=2: the task's own two GPUs
  ],
)
def test_a_slurm_task_drives_its_own_gpu_only_when_it_shares_the_node(monkeypatch, extra, devices):
  _slurm(monkeypatch, **extra, SLURM_PROCID="1")
  assert cluster.process_group().local_device_ids == devices


def test_the_slurm_coordinator_port_can_be_chosen(monkeypatch):
  _slurm(monkeypatch, DIFFJAX_COORDINATOR_PORT="9999")
  assert cluster.process_group().coordinator == "gpu07:9999"


@pytest.mark.parametrize(
  "nodelist, host",
  [
    ("node001", "node001"),
    ("127.0.0.1", "127.0.0.1"),
    ("a1,b2", "a1"),
    ("gpu[01-04,09],cpu1", "gpu01"),
    ("gpu[3,5]", "gpu3"),
    ("rack[1-2]-n[07-09]", "rack1-n07"),
  ],
)
def test_the_first_host_of_a_slurm_node_list(nodelist, host):
  assert cluster.first_host(nodelist) == host


def test_a_kubernetes_indexed_job_forms_its_group(monkeypatch):
  _clear(monkeypatch)
  monkeypatch.setenv("DIFFJAX_COORDINATOR", "diffjax-train-0.diffjax-train:8476")
  monkeypatch.setenv("DIFFJAX_NUM_PROCESSES", "4")
  monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
  assert distributed.detected()
  group = cluster.process_group()
  assert group == cluster.ProcessGroup("kubernetes", "diffjax-train-0.diffjax-train:8476", 4, 2)
  assert "local_device_ids" not in group.initialize_kwargs()
  # DIFFJAX_PROCESS_ID, given by hand, wins over the index; the coordinator over SLURM's.
  monkeypatch.setenv("DIFFJAX_PROCESS_ID", "3")
  monkeypatch.setenv("SLURM_NTASKS", "16")
  assert cluster.process_group().process_id == 3
  assert cluster.process_group().source == "environment"


def test_no_scheduler_is_no_group(monkeypatch):
  _clear(monkeypatch)
  monkeypatch.setenv("SLURM_NTASKS", "1")  # salloc of one task
  assert cluster.process_group() is None and not cluster.group_wanted()


@pytest.mark.parametrize(
  "env, says",
  [
    (dict(DIFFJAX_COORDINATOR="node0", DIFFJAX_NUM_PROCESSES="2"), "DIFFJAX_COORDINATOR='node0'"),
    (dict(DIFFJAX_COORDINATOR="n:1", DIFFJAX_NUM_PROCESSES="two"), "DIFFJAX_NUM_PROCESSES='two'"),
    (dict(DIFFJAX_COORDINATOR="n:1"), "DIFFJAX_NUM_PROCESSES is not set"),
    (dict(DIFFJAX_COORDINATOR="n:1", DIFFJAX_NUM_PROCESSES="2"), "set DIFFJAX_PROCESS_ID"),
    (
      dict(DIFFJAX_COORDINATOR="n:1", DIFFJAX_NUM_PROCESSES="2", JOB_COMPLETION_INDEX="2"),
      "JOB_COMPLETION_INDEX=2 must be below DIFFJAX_NUM_PROCESSES=2",
    ),
    (dict(SLURM_NTASKS="4"), "SLURM_PROCID is not set; start train.py through srun"),
    (
      dict(SLURM_NTASKS="4", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_JOB_ID="1"),
      "SLURM_STEP_NODELIST is not set",
    ),
    (
      dict(SLURM_NTASKS="4", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_STEP_NODELIST="gpu[01"),
      "SLURM node list 'gpu[01' is malformed",
    ),
    (
      dict(SLURM_NTASKS="4", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_STEP_NODELIST="a"),
      "SLURM_JOB_ID is not set; run inside a SLURM job, or set DIFFJAX_COORDINATOR_PORT",
    ),
    # Ports: 1..65535 wherever one is read (port 0 would be any free port, which the other
    # processes cannot know).
    (
      dict(DIFFJAX_COORDINATOR="h:0", DIFFJAX_NUM_PROCESSES="2", DIFFJAX_PROCESS_ID="0"),
      "DIFFJAX_COORDINATOR='h:0' names port 0, which is not a TCP port: use one in 1..65535",
    ),
    (
      dict(DIFFJAX_COORDINATOR="h:65536", DIFFJAX_NUM_PROCESSES="2", DIFFJAX_PROCESS_ID="0"),
      "DIFFJAX_COORDINATOR='h:65536' names port 65536, which is not a TCP port",
    ),
    (
      dict(
        SLURM_NTASKS="4",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_STEP_NODELIST="a",
        DIFFJAX_COORDINATOR_PORT="70000",
      ),
      "DIFFJAX_COORDINATOR_PORT='70000' must be a whole number in 1..65535",
    ),
    (
      dict(
        SLURM_NTASKS="4",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_STEP_NODELIST="a",
        JAX_COORDINATOR_PORT="0",
      ),
      "JAX_COORDINATOR_PORT='0' must be a whole number in 1..65535",
    ),
  ],
)
def test_a_malformed_environment_is_one_clear_error(monkeypatch, env, says):
  _clear(monkeypatch)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  assert distributed.detected()  # detection never raises: the error comes at start-up
  with pytest.raises(ValueError, match=None) as e:
    cluster.process_group()
  assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_join_timeout_is_jaxs_unless_set(monkeypatch):
  _clear(monkeypatch)
  assert cluster.join_timeout_s() == 300
  monkeypatch.setenv("DIFFJAX_JOIN_TIMEOUT_S", "30")
  assert cluster.join_timeout_s() == 30
  monkeypatch.setenv("DIFFJAX_JOIN_TIMEOUT_S", "0")
  with pytest.raises(ValueError, match="DIFFJAX_JOIN_TIMEOUT_S='0' must be a whole number >= 1"):
    cluster.join_timeout_s()


def test_a_group_jax_detects_is_detected_and_described(monkeypatch):
  _clear(monkeypatch)
  assert cluster.jax_group({}, tpu_vm=False) is None
  described = {
    "JAX_COORDINATOR_ADDRESS=h:1 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1": (
      "process 1 of 2 (JAX_COORDINATOR_ADDRESS=h:1; JAX forms the group)"
    ),
    "TPU_WORKER_HOSTNAMES=a,b": "one of 2 processes (TPU_WORKER_HOSTNAMES; JAX forms the group)",
    "TPU_WORKER_HOSTNAMES=a,b TPU_WORKER_ID=1": "process 1 of 2 (TPU_WORKER_HOSTNAMES;",
    "MEGASCALE_COORDINATOR_ADDRESS=m:1": "multislice group (MEGASCALE_COORDINATOR_ADDRESS=m:1;",
  }
  for variables, says in described.items():
    env = dict(v.split("=", 1) for v in variables.split())
    assert says in cluster.jax_group(env, tpu_vm=False), variables
  assert "Cloud TPU VM" in cluster.jax_group({}, tpu_vm=True)
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "a,b")
  assert distributed.detected() and cluster.process_group() is None


# ---- the coordinator's port -------------------------------------------------------------------


def test_a_port_held_by_a_listening_socket_is_taken(monkeypatch):
  with socket.socket() as held:
    # Bound with SO_REUSEADDR, not listening: the coordinator's gRPC server could serve there.
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    assert not cluster.port_taken(port)
    held.listen()
    assert cluster.port_taken(port)
  assert not cluster.port_taken(port)


def test_which_coordinator_hosts_are_this_machine(monkeypatch):
  for host in ("localhost", "127.0.0.1", "127.8.0.1", "::1", "[::1]", "LOCALHOST"):
    assert cluster.is_this_host(host), host
  for host in ("192.0.2.1", "2001:db8::1", "gpu07", "", "node1.cluster"):
    assert not cluster.is_this_host(host), host
  monkeypatch.setattr(cluster.socket, "gethostname", lambda: "diffjax-train-0")
  # A Kubernetes pod and its name through the headless service.
  assert cluster.is_this_host("diffjax-train-0") and cluster.is_this_host("Diffjax-Train-0.svc")
  assert not cluster.is_this_host("diffjax-train-1.diffjax-train")
  monkeypatch.setattr(cluster.socket, "gethostname", lambda: "node0.cluster")
  assert cluster.is_this_host("node0") and not cluster.is_this_host("node01")


def test_process_0_refuses_a_taken_coordinator_port_before_jax_starts(monkeypatch):
  _clear(monkeypatch)
  calls = []
  monkeypatch.setattr(distributed, "_DONE", False)
  monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kw: calls.append(kw))
  with socket.socket() as held:
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    monkeypatch.setenv("DIFFJAX_COORDINATOR", f"127.0.0.1:{port}")
    monkeypatch.setenv("DIFFJAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("DIFFJAX_PROCESS_ID", "0")
    with pytest.raises(ValueError) as e:
      distributed.maybe_initialize(DistributedConfig(initialize=True))
    assert str(e.value).startswith(
      f"port {port} of DIFFJAX_COORDINATOR=127.0.0.1:{port} is already in use on this host"
    )
    assert "give every process another port in DIFFJAX_COORDINATOR" in str(e.value)
    assert not calls
    # Another process does not serve the coordinator; a coordinator elsewhere is not checked.
    monkeypatch.setenv("DIFFJAX_PROCESS_ID", "1")
    cluster.check_coordinator_port(cluster.process_group())
    monkeypatch.setenv("DIFFJAX_PROCESS_ID", "0")
    monkeypatch.setenv("DIFFJAX_COORDINATOR", f"192.0.2.1:{port}")
    cluster.check_coordinator_port(cluster.process_group())


def test_a_taken_port_names_the_setting_it_came_from(monkeypatch):
  _slurm(monkeypatch, SLURM_NTASKS="2", SLURM_PROCID="0", SLURM_LOCALID="0")
  derived = cluster.port_in_use(cluster.process_group())
  assert derived.startswith(
    f"port {61440 + 1234567 % 4096}, which diffjax derives from SLURM_JOB_ID"
  )
  assert "set DIFFJAX_COORDINATOR_PORT to a free port for every task" in derived
  monkeypatch.setenv("DIFFJAX_COORDINATOR_PORT", "9999")
  chosen = cluster.port_in_use(cluster.process_group())
  assert chosen.startswith("port 9999 of DIFFJAX_COORDINATOR_PORT=9999 is already in use")
  assert "set DIFFJAX_COORDINATOR_PORT to a free port" in chosen


def test_the_runtimes_failure_to_serve_on_the_port_is_the_same_error(monkeypatch, capsys):
  _clear(monkeypatch)
  monkeypatch.setenv("DIFFJAX_COORDINATOR", "192.0.2.1:8476")  # not checked before
  monkeypatch.setenv("DIFFJAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("DIFFJAX_PROCESS_ID", "0")
  monkeypatch.setattr(distributed, "_DONE", False)

  def fail(**kw):
    del kw
    raise distributed.jax.errors.JaxRuntimeError("UNKNOWN: Failed to start RPC server")

  monkeypatch.setattr(distributed.jax.distributed, "initialize", fail)
  with pytest.raises(ValueError, match="port 8476 of DIFFJAX_COORDINATOR=192.0.2.1:8476 is"):
    distributed.maybe_initialize(DistributedConfig(initialize=True))


def test_every_process_says_what_it_waits_for_before_it_joins(monkeypatch, capsys):
  _clear(monkeypatch)
  monkeypatch.setenv("DIFFJAX_COORDINATOR", "192.0.2.1:8476")
  monkeypatch.setenv("DIFFJAX_NUM_PROCESSES", "3")
  monkeypatch.setenv("DIFFJAX_JOIN_TIMEOUT_S", "40")
  for process, says in [
    ("2", "diffjax: waiting for the coordinator at 192.0.2.1:8476 (process 2 of 3; up to 40 s)"),
    (
      "0",
      "diffjax: serving the coordinator at 192.0.2.1:8476 (process 0 of 3); waiting up to 40 s "
      "for the other processes to join",
    ),
  ]:
    monkeypatch.setenv("DIFFJAX_PROCESS_ID", process)
    monkeypatch.setattr(distributed, "_DONE", False)
    seen = []

    def initialize(**kw):
      seen.append((capsys.readouterr().out, kw))  # printed before the wait

    monkeypatch.setattr(distributed.jax.distributed, "initialize", initialize)
    distributed.maybe_initialize(DistributedConfig(initialize=True))
    ((out, kw),) = seen
    assert out.splitlines()[-1] == says, out
    assert kw["initialization_timeout"] == 40


class _StuckWatchdog:
  """A watchdog thread that never decides, with a timeout of ``timeout`` s."""

  def __init__(self, timeout):
    import threading  # pylint: disable=import-outside-toplevel

    self.timeout = timeout
    self.thread = threading.Thread(target=threading.Event().wait, args=(30,), daemon=True)
    self.thread.start()


def test_only_an_error_a_lost_peer_can_cause_waits_for_the_watchdog(monkeypatch):
  import time  # pylint: disable=import-outside-toplevel

  from diffjax.errors import UserError  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(distributed, "_WATCHDOG", _StuckWatchdog(timeout=-4.5))  # waits 0.5 s
  runtime = distributed.jax.errors.JaxRuntimeError("INTERNAL: gloo: connection closed by peer")
  wrapped = RuntimeError("the checkpoint could not be written")
  wrapped.__cause__ = runtime
  for error, waits in [
    (UserError("Non-finite loss: 3 skipped updates, more than max_skipped_updates=2"), False),
    (ValueError("a bad shape"), False),
    (TypeError("a bug"), False),
    (runtime, True),
    (wrapped, True),
    (UserError("the restore failed"), False),
    (OSError("DEADLINE_EXCEEDED: Barrier timed out"), True),
    (None, True),  # no error given: as before
  ]:
    start = time.monotonic()
    distributed.wait_for_lost_peer(error)
    waited = time.monotonic() - start
    assert (waited > 0.4) == waits, (error, waited)
    if error is not None:
      assert distributed.may_be_a_lost_peer(error) == waits, error


# ---- the dry run ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "args, preset",
  [
    (["--config.distributed.xla_preset=gpu_multinode"], "gpu_multinode"),
    (["--config.distributed.xla_preset", "gpu_multinode"], "gpu_multinode"),
    (["-config.distributed.xla_preset", "'gpu_multinode'"], "gpu_multinode"),
    (["--config", "configs/tiny.py", "--config.distributed.xla_preset", "x", "--workdir=w"], "x"),
    (["--config.distributed.xla_preset=x", "--config.distributed.xla_preset=none"], "none"),
    (["--config", "configs/tiny.py"], "none"),
    (["--", "--config.distributed.xla_preset=x"], "none"),  # not a flag after --
  ],
)
def test_the_preset_the_dry_run_shows_is_the_one_train_py_takes(args, preset):
  assert cluster.preset_of(args) == preset


def _dry_run(monkeypatch, capsys, *argv):
  from diffjax.train import launch  # pylint: disable=import-outside-toplevel

  status = launch.main(["--dry-run", *argv])
  out, err = capsys.readouterr()
  assert status == 0, err
  return out


def test_the_slurm_dry_run_keeps_the_chosen_port(monkeypatch, capsys):
  _clear(monkeypatch)
  monkeypatch.setenv("DIFFJAX_COORDINATOR_PORT", "9999")
  out = _dry_run(monkeypatch, capsys, "slurm", "--nodes=2", "--tasks-per-node=1")
  assert out.count("coordinator gpu001:9999") == 2, out


def test_the_env_dry_run_shows_a_group_jax_forms(monkeypatch, capsys):
  _clear(monkeypatch)
  monkeypatch.setattr(cluster, "on_tpu_vm", lambda: False)
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "h0:1234")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAX_PROCESS_ID", "1")
  out = _dry_run(monkeypatch, capsys, "env")
  assert (
    "this process on this host: process 1 of 2 (JAX_COORDINATOR_ADDRESS=h0:1234; JAX forms the "
    "group)"
  ) in out, out
  assert "JAX_COORDINATOR_ADDRESS=h0:1234" in out.split("  env:", 1)[1].splitlines()[0]
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name)
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "a,b")
  out = _dry_run(monkeypatch, capsys, "env")
  assert "this process on this host: one of 2 processes (TPU_WORKER_HOSTNAMES" in out, out
  monkeypatch.delenv("TPU_WORKER_HOSTNAMES")
  assert "one process (no process group" in _dry_run(monkeypatch, capsys, "env")


def test_maybe_initialize_hands_the_slurm_group_to_jax(monkeypatch, capsys):
  _slurm(monkeypatch, SLURM_NTASKS="2", SLURM_PROCID="0", SLURM_LOCALID="0")
  calls = []
  monkeypatch.setattr(distributed, "_DONE", False)
  monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kw: calls.append(kw))
  assert distributed.maybe_initialize(DistributedConfig())
  (kw,) = calls
  assert kw["coordinator_address"] == f"gpu07:{61440 + 1234567 % 4096}"
  assert (kw["num_processes"], kw["process_id"], kw["local_device_ids"]) == (2, 0, [0])
  assert kw["cluster_detection_method"] == "deactivate"
  assert "diffjax: process 0 of 1 (slurm, coordinator gpu07:" in capsys.readouterr().out


# ---- the preset -------------------------------------------------------------------------------


def test_the_preset_adds_its_flags_and_variables():
  env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
  line = cluster.apply_preset("gpu_multinode", env)
  preset = cluster.PRESETS["gpu_multinode"]
  tokens = env["XLA_FLAGS"].split()
  assert tokens[0] == "--xla_dump_to=/tmp/x"
  assert tokens[1:] == [f"--{k}={v}" for k, v in preset.xla_flags.items()]
  assert env["NCCL_DEBUG"] == "WARN" and env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
  assert line.startswith("diffjax: distributed.xla_preset=gpu_multinode set XLA_FLAGS += --xla")
  assert "kept" not in line and "\n" not in line


def test_the_users_flags_and_variables_win():
  env = {
    "XLA_FLAGS": "--xla_gpu_all_reduce_combine_threshold_bytes=1024 "
    "--xla_gpu_enable_latency_hiding_scheduler=false",
    "NCCL_DEBUG": "INFO",
    "XLA_PYTHON_CLIENT_MEM_FRACTION": "",  # set, even empty: left alone
  }
  line = cluster.apply_preset("gpu_multinode", env)
  flags = env["XLA_FLAGS"].split()
  assert flags[:2] == [
    "--xla_gpu_all_reduce_combine_threshold_bytes=1024",
    "--xla_gpu_enable_latency_hiding_scheduler=false",
  ]
  names = [f.split("=")[0] for f in flags]
  assert len(names) == len(set(names)) == len(cluster.PRESETS["gpu_multinode"].xla_flags)
  assert env["NCCL_DEBUG"] == "INFO" and env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == ""
  assert (
    "(kept from the environment: --xla_gpu_enable_latency_hiding_scheduler, "
    "--xla_gpu_all_reduce_combine_threshold_bytes, XLA_PYTHON_CLIENT_MEM_FRACTION, NCCL_DEBUG)"
  ) in line
  # Applying it again changes nothing.
  before = dict(env)
  cluster.apply_preset("gpu_multinode", env)
  assert env == before


def test_the_none_preset_and_an_unknown_one():
  env = {}
  assert cluster.apply_preset("none", env) is None and env == {}
  with pytest.raises(ValueError, match="distributed.xla_preset='fast' is not a preset; use one of"):
    cluster.apply_preset("fast", env)
  with pytest.raises(ValueError, match="'none', 'gpu_multinode'"):
    DistributedConfig(xla_preset="fast")


def test_the_trainer_applies_the_preset_before_jax_starts(monkeypatch, capsys):
  _clear(monkeypatch)
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")
  for name in ("NCCL_DEBUG", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
    monkeypatch.setenv(name, "")  # so that monkeypatch removes what the preset sets
    monkeypatch.delenv(name)
  monkeypatch.setattr(distributed, "_PRESET_DONE", False)
  monkeypatch.setattr(distributed, "_DONE", False)
  monkeypatch.setattr("diffjax.cpu.backends_started", lambda: False)
  section = DistributedConfig(xla_preset="gpu_multinode", initialize=False)
  assert not distributed.maybe_initialize(section)
  out = capsys.readouterr().out.splitlines()
  assert len(out) == 1 and out[0].startswith("diffjax: distributed.xla_preset=gpu_multinode set")
  assert os.environ["NCCL_DEBUG"] == "WARN"
  assert "--xla_gpu_enable_latency_hiding_scheduler=false" in os.environ["XLA_FLAGS"]
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in os.environ["XLA_FLAGS"]
  # Once a process: the second call (a second run in it) leaves everything as it is.
  assert distributed.apply_preset(section) is None


def test_after_jax_started_the_preset_changes_nothing_and_says_so(monkeypatch, capsys):
  _clear(monkeypatch)
  monkeypatch.setattr(distributed, "_PRESET_DONE", False)
  monkeypatch.setattr("diffjax.cpu.backends_started", lambda: True)
  monkeypatch.setenv("NCCL_DEBUG", "")
  monkeypatch.delenv("NCCL_DEBUG")
  line = distributed.apply_preset(DistributedConfig(xla_preset="gpu_multinode"))
  assert "was not applied: JAX had already started its backends" in line
  assert "NCCL_DEBUG" not in os.environ
  assert capsys.readouterr().out.strip() == line


# ---- train.py as 2 processes under faked SLURM and Kubernetes variables ----------------------

_STEPS = 3


def _train(wd, devices: int, per_process: list[dict]) -> list[tuple[int, str, str]]:
  """train.py on the tiny config, one process per entry of ``per_process`` (its variables),
  each with ``devices`` CPU devices; (status, stdout, stderr) of each."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
  for name in list(env):
    if name.startswith("SLURM") or name in _SCHEDULER_VARS:
      env.pop(name)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
  env.update(
    JAX_PLATFORMS="cpu",
    PYTHONPATH=REPO,
    XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
  )
  args = [
    sys.executable,
    "train.py",
    "--config=configs/tiny.py",
    f"--workdir={wd}",
    f"--config.num_steps={_STEPS}",
    "--config.log_every=1",
    "--config.eval_every=0",
    "--config.checkpoint.every=1000",
    "--config.global_batch_size=4",
    "--config.seq_len=32",
  ]
  procs = [
    subprocess.Popen(
      args,
      cwd=REPO,
      env={**env, **extra},
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for extra in per_process
  ]
  try:
    outs = [p.communicate(timeout=WAIT_LIMIT_S) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory):
  wd = str(tmp_path_factory.mktemp("one-process") / "wd")
  ((status, out, err),) = _train(wd, devices=4, per_process=[{}])
  assert status == 0, (out + err)[-3000:]
  assert "diffjax: process" not in out  # one process: no group
  return [read_metrics(wd)[s]["train/loss"] for s in range(1, _STEPS + 1)]


def _check_two(wd, results, source, coordinator, want):
  for i, (status, out, err) in enumerate(results):
    assert status == 0, (out + err)[-3000:]
    line = f"diffjax: process {i} of 2 ({source}, coordinator {coordinator}): 2 of 4 cpu devices"
    assert line in out, out[-3000:]
  got = [read_metrics(wd)[s]["train/loss"] for s in range(1, _STEPS + 1)]
  assert got == pytest.approx(want, rel=1e-5), (got, want)


# Each: 2 supervised train.py processes of 3 tiny steps (the one-process reference is shared),
# about a minute on 2 cores.
@pytest.mark.slow
def test_two_processes_under_slurm_train_as_one(tmp_path, one_process_losses):
  # A job id whose derived coordinator port (61440 + id % 4096) is free here.
  port = free_port(range(61440 + os.getpid() % 4096, 65536))
  job = str(port - 61440 + 4096 * 7)
  common = dict(
    SLURM_JOB_ID=job,
    SLURM_NTASKS="2",
    SLURM_NTASKS_PER_NODE="2",
    SLURM_STEP_NUM_NODES="1",
    SLURM_STEP_NODELIST="127.0.0.1",
  )
  wd = str(tmp_path / "wd")
  results = _train(
    wd, 2, [{**common, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)} for i in range(2)]
  )
  _check_two(wd, results, "slurm", f"127.0.0.1:{port}", one_process_losses)


@pytest.mark.slow
def test_two_processes_of_a_kubernetes_indexed_job_train_as_one(tmp_path, one_process_losses):
  coordinator = f"127.0.0.1:{free_port()}"
  common = dict(DIFFJAX_COORDINATOR=coordinator, DIFFJAX_NUM_PROCESSES="2")
  wd = str(tmp_path / "wd")
  results = _train(wd, 2, [{**common, "JOB_COMPLETION_INDEX": str(i)} for i in range(2)])
  _check_two(wd, results, "kubernetes", coordinator, one_process_losses)
