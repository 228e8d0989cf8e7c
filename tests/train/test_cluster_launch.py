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
from helpers import REPO, WAIT_LIMIT_S, read_metrics

from diffjax.train import cluster, distributed
from diffjax.train.sections import DistributedConfig

_SCHEDULER_VARS = (
  "DIFFJAX_COORDINATOR",
  "DIFFJAX_NUM_PROCESSES",
  "DIFFJAX_PROCESS_ID",
  "DIFFJAX_COORDINATOR_PORT",
  "JAX_COORDINATOR_PORT",
  "JAX_COORDINATOR_ADDRESS",
  "JOB_COMPLETION_INDEX",
  "CUDA_VISIBLE_DEVICES",
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


def _free_port(candidates=None) -> int:
  for port in candidates or [0]:
    with socket.socket() as s:
      try:
        s.bind(("127.0.0.1", port))
      except OSError:
        continue
      return s.getsockname()[1]
  raise RuntimeError("no free port")


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
  port = _free_port(range(61440 + os.getpid() % 4096, 65536))
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
  coordinator = f"127.0.0.1:{_free_port()}"
  common = dict(DIFFJAX_COORDINATOR=coordinator, DIFFJAX_NUM_PROCESSES="2")
  wd = str(tmp_path / "wd")
  results = _train(wd, 2, [{**common, "JOB_COMPLETION_INDEX": str(i)} for i in range(2)])
  _check_two(wd, results, "kubernetes", coordinator, one_process_losses)
