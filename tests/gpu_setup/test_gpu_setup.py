"""gpu_setup/: the SLURM script (syntax, shellcheck, its dry run), the Kubernetes manifest
against the dry run and the process group it describes, and the preset's XLA flags in a
fresh process of the installed jaxlib (docs/gpu_clusters.md)."""

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import REPO

from diffjax.train import cluster

SETUP = os.path.join(REPO, "gpu_setup")
SCRIPTS = sorted(
  glob.glob(os.path.join(SETUP, "*.sh")) + glob.glob(os.path.join(SETUP, "*.sbatch"))
)
SBATCH = os.path.join(SETUP, "slurm_train.sbatch")
MANIFEST = os.path.join(SETUP, "k8s_train.yaml")
_RANK = re.compile(
  r"^rank (\d+) on (\S+): process (\d+) of (\d+) \((\w+)\), coordinator (\S+), "
  r"local devices (.+)$",
  re.M,
)


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "PYTEST"))}
  for name in (
    "DIFFJAX_COORDINATOR",
    "DIFFJAX_NUM_PROCESSES",
    "DIFFJAX_PROCESS_ID",
    "XLA_FLAGS",
    *cluster.PRESETS["gpu_multinode"].env,
  ):
    env.pop(name, None)
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO, **extra)
  return env


def test_the_scripts_and_the_manifest_exist():
  assert SBATCH in SCRIPTS and os.path.isfile(MANIFEST)
  assert os.path.isfile(os.path.join(SETUP, "README.md"))


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_bash_syntax(script):
  r = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_clean():
  r = subprocess.run(["shellcheck", *SCRIPTS], capture_output=True, text=True, cwd=REPO)
  assert r.returncode == 0, r.stdout[-4000:]


def test_the_sbatch_header_asks_for_one_task_per_gpu():
  with open(SBATCH, encoding="utf-8") as f:
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", f.read(), re.M))
  assert directives["ntasks-per-node"] == directives["gpus-per-node"]
  assert "gpus-per-task" not in directives  # every task sees its node's GPUs
  assert directives["signal"].startswith("TERM@")


def test_the_slurm_dry_run_prints_every_rank():
  r = subprocess.run(
    ["bash", SBATCH, "--dry-run", "--config=configs/tiny.py", "--workdir=/shared/runs/t"],
    capture_output=True,
    text=True,
    cwd=REPO,
    timeout=300,
    env=_env(NODES="2", GPUS_PER_NODE="2", PYTHON=sys.executable),
  )
  assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
  out = r.stdout
  assert "2 node(s) x 2 task(s) = 4 processes, one per GPU; nothing was started" in out
  ranks = _RANK.findall(out)
  port = 61440 + 4242 % 4096
  assert ranks == [
    (str(i), f"gpu00{1 + i // 2}", str(i), "4", "slurm", f"gpu001:{port}", f"[{i % 2}]")
    for i in range(4)
  ], out
  runs = re.findall(r"^  run:  (.+)$", out, re.M)
  assert (
    runs
    == [
      f"{sys.executable} train.py --config.distributed.xla_preset=gpu_multinode "
      "--config=configs/tiny.py --workdir=/shared/runs/t"
    ]
    * 4
  )
  envs = re.findall(r"^  env:  (.+)$", out, re.M)
  assert "SLURM_PROCID=3 SLURM_LOCALID=1" in envs[3]
  sets = re.findall(r"^  sets: (.+)$", out, re.M)
  assert len(sets) == 4 and all("NCCL_DEBUG=WARN" in s for s in sets)
  for flag, value in cluster.PRESETS["gpu_multinode"].xla_flags.items():
    assert f"--{flag}={value}" in sets[0]


def test_the_slurm_dry_run_keeps_the_users_choices():
  r = subprocess.run(
    [
      "bash",
      SBATCH,
      "--dry-run",
      "--config=configs/tiny.py",
      "--config.distributed.xla_preset=none",
    ],
    capture_output=True,
    text=True,
    cwd=REPO,
    timeout=300,
    env=_env(NODES="1", GPUS_PER_NODE="1", PYTHON=sys.executable),
  )
  assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
  assert "sets: nothing  [distributed.xla_preset=none]" in r.stdout
  # One task on one node: one process, no group to form.
  assert "one process (no process group in the environment)" in r.stdout


def test_the_sbatch_script_outside_a_job_says_so():
  r = subprocess.run(["bash", SBATCH], capture_output=True, text=True, cwd=REPO, env=_env())
  assert r.returncode == 2
  assert r.stderr.strip() == (
    "error: not inside a SLURM job; submit with sbatch, or add --dry-run to print the launch."
  )


def _manifest():
  yaml = pytest.importorskip("yaml")
  with open(MANIFEST, encoding="utf-8") as f:
    docs = [d for d in yaml.safe_load_all(f) if d]
  return {d["kind"]: d for d in docs}


def test_the_manifest_is_an_indexed_job_behind_a_headless_service():
  m = _manifest()
  service, job = m["Service"], m["Job"]
  name, svc = job["metadata"]["name"], service["metadata"]["name"]
  assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
  assert service["spec"]["selector"] == {"job-name": name}
  spec = job["spec"]
  assert spec["completionMode"] == "Indexed"
  pod = spec["template"]["spec"]
  assert pod["subdomain"] == svc and pod["restartPolicy"] == "Never"
  (container,) = pod["containers"]
  env = {e["name"]: e["value"] for e in container["env"]}
  port = service["spec"]["ports"][0]["port"]
  assert [p["containerPort"] for p in container["ports"]] == [port]
  assert env["DIFFJAX_COORDINATOR"] == f"{name}-0.{svc}:{port}"
  assert spec["completions"] == spec["parallelism"] == int(env["DIFFJAX_NUM_PROCESSES"])
  assert "--config.distributed.xla_preset=gpu_multinode" in container["command"]
  rules = spec["podFailurePolicy"]["rules"]
  assert rules[0]["onExitCodes"]["values"] == [75] and rules[0]["action"] == "Ignore"
  # Every pod, with the index Kubernetes gives it, forms its place in one group.
  n = spec["completions"]
  groups = [cluster.process_group({**env, "JOB_COMPLETION_INDEX": str(i)}) for i in range(n)]
  assert [(g.source, g.process_id, g.num_processes) for g in groups] == [
    ("kubernetes", i, n) for i in range(n)
  ]
  assert {g.coordinator for g in groups} == {env["DIFFJAX_COORDINATOR"]}


def test_the_kubernetes_dry_run_matches_the_manifest():
  m = _manifest()
  job = m["Job"]
  (container,) = job["spec"]["template"]["spec"]["containers"]
  env = {e["name"]: e["value"] for e in container["env"]}
  n = job["spec"]["completions"]
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "diffjax.train.launch",
      "--dry-run",
      "kubernetes",
      f"--nodes={n}",
      f"--job-name={job['metadata']['name']}",
      f"--port={m['Service']['spec']['ports'][0]['port']}",
      "--",
      *container["command"][2:],
    ],
    capture_output=True,
    text=True,
    cwd=REPO,
    timeout=300,
    env=_env(),
  )
  assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
  ranks = _RANK.findall(r.stdout)
  name = job["metadata"]["name"]
  assert ranks == [
    (str(i), f"{name}-{i}", str(i), str(n), "kubernetes", env["DIFFJAX_COORDINATOR"], "all visible")
    for i in range(n)
  ], r.stdout
  assert re.findall(r"^  run:  (.+)$", r.stdout, re.M) == [" ".join(container["command"])] * n


def test_the_dry_run_of_this_process_reads_its_environment():
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "diffjax.train.launch",
      "--dry-run",
      "env",
      "--",
      "--config=configs/tiny.py",
    ],
    capture_output=True,
    text=True,
    cwd=REPO,
    timeout=300,
    env=_env(DIFFJAX_COORDINATOR="h0:1234", DIFFJAX_NUM_PROCESSES="3", DIFFJAX_PROCESS_ID="2"),
  )
  assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
  assert (
    "this process on this host: process 2 of 3 (environment), coordinator h0:1234, "
    "local devices all visible"
  ) in r.stdout
  bad = subprocess.run(
    [sys.executable, "-m", "diffjax.train.launch", "--dry-run", "env"],
    capture_output=True,
    text=True,
    cwd=REPO,
    timeout=300,
    env=_env(DIFFJAX_COORDINATOR="h0:1234", DIFFJAX_NUM_PROCESSES="3", DIFFJAX_PROCESS_ID="3"),
  )
  assert bad.returncode == 2
  assert (
    bad.stderr.strip()
    .splitlines()[-1]
    .startswith("error: DIFFJAX_PROCESS_ID=3 must be below DIFFJAX_NUM_PROCESSES=3")
  )


def test_the_presets_flags_parse_on_this_jaxlib():
  """XLA aborts a process whose XLA_FLAGS name a flag it does not know; the GPU flags parse
  (and are ignored) on the CPU backend too, so this checks every installed jaxlib."""
  env = _env()
  cluster.apply_preset("gpu_multinode", env)
  r = subprocess.run(
    [sys.executable, "-c", "import jax; print(jax.jit(lambda x: x + 1)(1.0))"],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.strip() == "2.0"


WHEELHOUSE = os.path.join(SETUP, "wheelhouse.sh")


def _wheelhouse(*args):
  return subprocess.run(
    ["bash", WHEELHOUSE, *args], capture_output=True, text=True, cwd=REPO, timeout=60
  )


def test_the_wheelhouse_fetches_the_pins_of_the_nodes_python():
  r = _wheelhouse("--dry-run", "--python", "3.12", "--dir=w", "Grain", "array-record")
  assert r.returncode == 0, r.stderr
  with open(os.path.join(REPO, "constraints-py312.txt"), encoding="utf-8") as f:
    pins = dict(line.strip().split("==") for line in f if "==" in line)
  lines = r.stdout.splitlines()
  assert lines[0] == "2 wheel(s) for Python 3.12 (pins of constraints-py312.txt) into w"
  command = lines[1].split()
  assert command[-2:] == [f"grain=={pins['grain']}", f"array_record=={pins['array_record']}"]
  assert "--no-deps" in command and "--only-binary=:all:" in command
  assert command[command.index("--python-version") + 1] == "3.12"
  assert command[command.index("-d") + 1] == "w"
  every = _wheelhouse("--dry-run", "--python=3.13")
  with open(os.path.join(REPO, "constraints-py313.txt"), encoding="utf-8") as f:
    count = sum(1 for line in f if "==" in line)
  assert every.stdout.startswith(f"{count} wheel(s) for Python 3.13"), every.stdout


def test_the_wheelhouse_refuses_what_was_not_tested():
  r = _wheelhouse("--dry-run", "no-such-package")
  assert r.returncode == 2
  assert r.stderr.strip() == (
    "error: no-such-package is not pinned in constraints-py312.txt; name a package it pins."
  )
  r = _wheelhouse("--python", "3.10")
  assert r.returncode == 2 and "the tested sets are 3.11, 3.12 and 3.13" in r.stderr
