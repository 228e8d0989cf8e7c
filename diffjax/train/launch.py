"""The dry run of a multi-node launch (``python -m diffjax.train.launch --dry-run``): for every
rank, its process group, scheduler variables, the XLA/NCCL preset's additions and its command;
nothing is started. Every value comes from the trainer's own functions (docs/gpu_clusters.md).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from diffjax.train.cluster import kubernetes_rank_env, rank_lines, slurm_rank_env


def _hosts_of(nodelist: str, nodes: int) -> list[str]:
  """Host names for the dry run: the expanded ``prefix[a-b]`` list, else node0..."""
  m = re.fullmatch(r"([^\[\],]*)\[(\d+)-(\d+)\]", nodelist)
  if m:
    width = len(m.group(2))
    names = [f"{m.group(1)}{i:0{width}d}" for i in range(int(m.group(2)), int(m.group(3)) + 1)]
    if len(names) == nodes:
      return names
  names = [h for h in nodelist.split(",") if h]
  if len(names) == nodes and all("[" not in h for h in names):
    return names
  raise ValueError(
    f"--nodelist={nodelist!r} must name --nodes={nodes} hosts, as prefix[first-last] or "
    "host1,host2,..."
  )


def _scheduler_variable(name: str) -> bool:
  """Whether ``name`` is one of the variables a scheduler sets to place a process in its group
  (each rank of a dry run has its own; DIFFJAX_COORDINATOR_PORT and the like, which the user
  sets for every rank, are not)."""
  return name.startswith("SLURM_") or name in (
    "DIFFJAX_COORDINATOR",
    "DIFFJAX_NUM_PROCESSES",
    "DIFFJAX_PROCESS_ID",
    "JOB_COMPLETION_INDEX",
  )


# What else places this process in a group, shown on the `env` dry run's "env:" line.
_GROUP_VARIABLES = (
  "DIFFJAX_COORDINATOR_PORT",
  "JAX_COORDINATOR_PORT",
  "JAX_COORDINATOR_ADDRESS",
  "JAX_NUM_PROCESSES",
  "JAX_PROCESS_ID",
  "TPU_WORKER_HOSTNAMES",
  "TPU_WORKER_ID",
  "MEGASCALE_COORDINATOR_ADDRESS",
)


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  command_args: list[str] = []
  if "--" in argv:
    cut = argv.index("--")
    argv, command_args = argv[:cut], argv[cut + 1 :]
  parser = argparse.ArgumentParser(
    prog="python -m diffjax.train.launch",
    description="Prints, for every rank of a launch, the process group it forms, the "
    "variables its scheduler gives it, what the run's XLA/NCCL preset adds and the command; "
    "starts nothing. Arguments after -- go to train.py (docs/gpu_clusters.md).",
  )
  parser.add_argument("--dry-run", action="store_true", required=True, help="print, start nothing")
  parser.add_argument("launcher", choices=("slurm", "kubernetes", "env"))
  parser.add_argument("--nodes", type=int, default=2, help="nodes (pods) [2]")
  parser.add_argument(
    "--tasks-per-node", type=int, default=8, help="slurm: tasks (GPUs) per node [8]"
  )
  parser.add_argument("--job-id", type=int, default=4242, help="slurm: the job id [4242]")
  parser.add_argument("--nodelist", default=None, help="slurm: hosts [gpu[001-<nodes>]]")
  parser.add_argument(
    "--job-name", default="diffjax-train", help="kubernetes: Job name [diffjax-train]"
  )
  parser.add_argument("--service", default=None, help="kubernetes: headless service [the Job name]")
  parser.add_argument("--namespace", default=None, help="kubernetes: namespace [the pod's own]")
  parser.add_argument("--port", type=int, default=8476, help="kubernetes: coordinator port [8476]")
  parser.add_argument("--python", default="python", help="the interpreter in the command [python]")
  args = parser.parse_args(argv)
  command = [args.python, "train.py", *command_args]
  # The scheduler's variables of each rank replace whatever this shell has.
  base = {k: v for k, v in os.environ.items() if not _scheduler_variable(k)}
  try:
    if args.nodes < 1 or args.tasks_per_node < 1:
      raise ValueError("--nodes and --tasks-per-node must be at least 1.")
    if args.launcher == "env":
      print("diffjax: dry run of this process, from its environment; nothing was started.")
      own = {k: v for k, v in os.environ.items() if _scheduler_variable(k) or k in _GROUP_VARIABLES}
      rest = {k: v for k, v in os.environ.items() if k not in own}
      ranks = [("this process", own, rest)]
    elif args.launcher == "slurm":
      nodelist = args.nodelist or (f"gpu[{1:03d}-{args.nodes:03d}]" if args.nodes > 1 else "gpu001")
      hosts = _hosts_of(nodelist, args.nodes)
      n = args.nodes * args.tasks_per_node
      print(
        f"diffjax: dry run of a SLURM launch: {args.nodes} node(s) x {args.tasks_per_node} "
        f"task(s) = {n} processes, one per GPU; nothing was started."
      )
      ranks = [
        (
          f"rank {r}",
          slurm_rank_env(r, args.nodes, args.tasks_per_node, args.job_id, nodelist, hosts),
          base,
        )
        for r in range(n)
      ]
    else:
      service = args.service or args.job_name
      print(
        f"diffjax: dry run of a Kubernetes Indexed Job {args.job_name!r}: {args.nodes} pod(s), "
        "one per node, each one process driving all its GPUs; nothing was started."
      )
      ranks = [
        (
          f"rank {r}",
          kubernetes_rank_env(r, args.nodes, args.job_name, service, args.port, args.namespace),
          base,
        )
        for r in range(args.nodes)
      ]
    for label, scheduler_env, env in ranks:
      for line in rank_lines(label, scheduler_env, env, command):
        print(line)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
