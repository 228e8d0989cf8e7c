"""Multi-process start-up for TPU pods and multi-node GPU jobs.

``jax.distributed.initialize()`` is called when the environment says this is one of
several processes: on Cloud TPU VMs (their chips appear as /dev/accel* or /dev/vfio/N;
JAX reads the worker list from the VM metadata), on GKE TPU pods
(``TPU_WORKER_HOSTNAMES`` lists more than one worker, or ``MEGASCALE_*`` is set), under SLURM with several tasks, or when
``JAX_COORDINATOR_ADDRESS``/``DIFFJAX_COORDINATOR`` with ``DIFFJAX_NUM_PROCESSES`` and
``DIFFJAX_PROCESS_ID`` are given (multi-node GPU without a scheduler). Setting
``distributed.initialize=True|False`` in the config overrides the detection.
"""

from __future__ import annotations

import glob
import os

import jax

_DONE = False


def _on_tpu_vm() -> bool:
  """A Cloud TPU VM exposes its chips as /dev/accel* (v4, v5e) or /dev/vfio/N (v5p, v6e)."""
  return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def _detected() -> bool:
  # On TPU VMs jax.distributed.initialize() finds the workers from the VM metadata
  # and also works on a single-host slice, so it is always safe to call there.
  if _on_tpu_vm():
    return True
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  if len([h for h in hosts.split(",") if h.strip()]) > 1:
    return True
  if os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
    return True
  if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
    return True
  return bool(os.environ.get("DIFFJAX_COORDINATOR") or os.environ.get("JAX_COORDINATOR_ADDRESS"))


def maybe_initialize(config=None) -> bool:
  """Initialises the distributed runtime once if needed; returns whether it did."""
  global _DONE
  if _DONE:
    return True
  wanted = None
  if config is not None and "distributed" in config:
    wanted = config.distributed.get("initialize")
  if wanted is None:
    wanted = _detected()
  if not wanted:
    return False
  kwargs = {}
  coord = os.environ.get("DIFFJAX_COORDINATOR")
  if coord:
    kwargs = dict(coordinator_address=coord,
                  num_processes=int(os.environ["DIFFJAX_NUM_PROCESSES"]),
                  process_id=int(os.environ["DIFFJAX_PROCESS_ID"]))
  jax.distributed.initialize(**kwargs)
  _DONE = True
  return True
