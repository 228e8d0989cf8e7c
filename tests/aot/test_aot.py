"""Ahead-of-time compile of the real train step for a TPU topology (needs libtpu) or a GPU
target (needs the [gpu-compile] extra), and the one-line answer when a step does not fit."""

import os
import subprocess
import sys

import pytest

from diffjax.aot import (
  AotReport,
  DoesNotFit,
  aot_report,
  fit_options,
  hbm_for,
  parse_out_of_memory,
  topology_devices,
)
from diffjax.kernels.gpu import targets
from diffjax.presets import load_config
from diffjax.train.config import RunConfig

pytestmark = pytest.mark.integration

_HAS_LIBTPU = True
try:
  import libtpu  # noqa: F401  pylint: disable=unused-import
except ImportError:
  _HAS_LIBTPU = False
needs_libtpu = pytest.mark.skipif(not _HAS_LIBTPU, reason="the [tpu] extra is not installed")
needs_gpu_compile = pytest.mark.skipif(
  targets.available() is not None and not os.environ.get("CI"), reason=f"{targets.available()}"
)


def _tiny(arm="diff_v1"):
  cfg = load_config("configs/tiny.py")
  cfg.model.arm = arm
  return cfg


def _cli(*args, env_extra=None):
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_") and k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", **(env_extra or {}))
  return subprocess.run(
    [sys.executable, "-m", "diffjax.aot", *args],
    capture_output=True,
    text=True,
    env=env,
    timeout=900,
  )


# The arms differ only in attention, whose TPU compiles the kernel and sharding tests cover;
# one arm runs by default.
@needs_libtpu
@pytest.mark.parametrize(
  "arm",
  [
    pytest.param("transformer", marks=pytest.mark.slow),
    "diff_v1",
    pytest.param("diff_v2", marks=pytest.mark.slow),
  ],
)
def test_tiny_configs_compile_for_v5e_2x2(arm):
  cfg = _tiny(arm)
  cfg.mesh.shape = (2, 2, 1)
  report = aot_report(RunConfig.from_config(cfg), "v5e:2x2")
  assert report.num_devices == 4
  assert report.mesh == {"data": 2, "fsdp": 2, "tensor": 1, "context": 1}
  assert report.hbm_gib == 16.0
  assert 0 < report.per_device_gib < 1.0 and report.fits
  assert report.arm == arm
  # "auto" resolves for the TPU: DIFF arms compile the fused Pallas kernels and the
  # Transformer the splash-attention flash kernel.
  assert report.pallas_kernels > 0, report


@needs_libtpu
@pytest.mark.slow
def test_xla_implementation_compiles_without_kernels():
  cfg = _tiny("diff_v2")
  cfg.model.implementation = "xla"
  assert aot_report(RunConfig.from_config(cfg), "v5e:2x2").pallas_kernels == 0


@needs_libtpu
def test_a_megacore_topology_has_one_device_per_chip():
  # A TPU VM shows a v4 chip (two TensorCores, 32 GiB) as one JAX device; libtpu's own
  # description of the topology has one per TensorCore, which halves the memory per device.
  cfg = _tiny()
  cfg.mesh.shape = (4, 1, 1)
  report = aot_report(RunConfig.from_config(cfg), "v4:2x2x1")
  assert report.num_devices == 4 and report.mesh["data"] == 4
  assert report.hbm_gib == 32.0 and report.fits
  assert len(topology_devices("v5p:2x2x1")) == 4


@needs_libtpu
def test_hbm_table_and_bad_topology():
  assert hbm_for("TPU v5p") == 95.0 and hbm_for("TPU v5 lite") == 16.0
  with pytest.raises(ValueError, match="v9z"):
    aot_report(RunConfig.from_config(_tiny()), "v9z:2x2")


@needs_libtpu
def test_cli_compiles_scanned_context_parallel_step_without_libtpu_probe_noise():
  """The command a user runs first: quiet start-up on a machine without TPUs, and the
  scanned, sequence-sharded (ring) step compiles for a real topology."""
  r = _cli(
    "--config=configs/tiny.py",
    "--config.model.arm=diff_v1",
    "--topology=v5e:2x2",
    "--config.mesh.shape=(1,1,1,4)",
    "--config.model.scan_layers=True",
    "--config.seq_len=64",
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert "mesh={'data': 1, 'fsdp': 1, 'tensor': 1, 'context': 4}" in r.stdout, r.stdout
  assert "fits" in r.stdout
  for noise in ("could not determine", "host bounds", "INVALID_ARGUMENT", "Traceback"):
    assert noise not in r.stderr, r.stderr[-3000:]


@needs_libtpu
def test_a_tpu_step_that_does_not_fit_is_one_line_with_options():
  # The compiler refuses it (RESOURCE_EXHAUSTED); what the command prints is this one
  # line (and exit status 1).
  cfg = _tiny()
  cfg.global_batch_size, cfg.seq_len = 2048, 4096
  with pytest.raises(DoesNotFit) as caught:
    aot_report(RunConfig.from_config(cfg), "v5e:2x2")
  line = str(caught.value)
  assert line.startswith("v5e:2x2: the step needs ") and "GiB of 15.75 GiB per device" in line
  assert "--config.grad_accum_steps=2" in line and "--config.model.remat=full" in line
  assert "\n" not in line and "RESOURCE_EXHAUSTED" not in line


def test_out_of_memory_messages_and_options():
  assert parse_out_of_memory("... Used 39.80G of 31.25G hbm. Exceeded hbm capacity") == (
    39.8,
    31.25,
  )
  assert parse_out_of_memory(
    "the total memory required for HLO temporaries (40.24G) exceeds available HBM (15.75G)."
  ) == (40.24, 15.75)
  assert parse_out_of_memory("INTERNAL: something else") is None
  cfg = load_config("configs/paper_3b.py")
  cfg.global_batch_size = 256
  line = fit_options(
    RunConfig.from_config(cfg, data_at_launch=True), needs_gib=39.8, has_gib=31.25, target="v6e:8x8"
  )
  assert line.startswith("v6e:8x8: the step needs 39.8 GiB of 31.25 GiB per device; to fit try")
  assert "--config.grad_accum_steps=2 (a microbatch of 128 rows)" in line
  assert "--config.model.remat=full" in line and "a larger slice" in line and "\n" not in line
  # Not when a micro-batch would no longer split over the batch's devices.
  split = fit_options(
    RunConfig.from_config(cfg, data_at_launch=True),
    needs_gib=39.8,
    has_gib=31.25,
    target="v6e:16x16",
    batch_devices=256,
  )
  assert "grad_accum_steps" not in split and "--config.model.remat=full" in split
  gpu = fit_options(
    RunConfig.from_config(cfg, data_at_launch=True), needs_gib=95.2, has_gib=59.3, target="h100"
  )
  assert "--target=h100:8" in gpu and "--target=h200" in gpu
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in gpu


@needs_gpu_compile
@pytest.mark.parametrize(
  "target,mosaic",
  [
    ("h100", True),
    # about 35 s: the dispatch test checks an A100's choice of the stock path cheaply
    pytest.param("a100", False, marks=pytest.mark.slow),
  ],
)
def test_tiny_step_compiles_for_a_gpu_target(target, mosaic):
  # bf16, head dim 32 (V1's value 64): the Mosaic GPU kernels take it on an H100; an
  # A100 (sm_80) takes the stock path, which compiles none of ours.
  cfg = _tiny("diff_v1")
  cfg.model.dtype = "bfloat16"
  cfg.seq_len = 128
  report = aot_report(RunConfig.from_config(cfg), target)
  assert report.platform == "gpu" and report.num_devices == 1
  assert report.hbm_gib == pytest.approx(targets.get(target).hbm_gib)
  assert report.usable_fraction == 0.75 and report.fits
  assert (report.pallas_kernels > 0) == mosaic, report
  assert "Mosaic GPU kernel calls" in report.line()


@needs_gpu_compile
@pytest.mark.slow  # about 35 s; the TPU case above covers the one-line answer by default
def test_a_gpu_step_that_does_not_fit_is_one_line_with_options():
  r = _cli(
    "--config=configs/tiny.py",
    "--target=h200",
    "--config.model.dtype=bfloat16",
    env_extra={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.000001"},
  )
  assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
  report, advice = [l for l in r.stdout.splitlines() if l.strip()]
  assert report.startswith("h200") and "DOES NOT FIT" in report
  assert advice.startswith("h200: the step needs ") and "--target=h200:8" in advice
  assert "Traceback" not in r.stderr


def test_cli_refuses_a_tpu_name_as_gpu_target_and_both_flags():
  r = _cli("--config=configs/tiny.py", "--target=v5e:2x2")
  assert r.returncode == 2 and "not a GPU target" in r.stderr.splitlines()[-1]
  r = _cli("--config=configs/tiny.py", "--target=h100", "--topology=v5e:2x2")
  assert r.returncode == 2 and "not both" in r.stderr.splitlines()[-1]


def _two_slice_report(arm: str, accum: int = 2, reduce: str = "micro_batch", **mesh) -> AotReport:
  cfg = _tiny(arm)
  cfg.mesh.shape = (1, -1, 1)  # the mesh within one slice: fsdp over its 8 chips
  cfg.mesh.update(mesh)
  cfg.model.scan_layers = True
  cfg.grad_accum_steps = accum
  cfg.grad_accum_reduce = reduce
  cfg.global_batch_size = 32
  return aot_report(RunConfig.from_config(cfg), "v5p:2x2x2", num_slices=2)


@needs_libtpu
def test_two_slices_send_only_the_gradient_reduction_over_dcn():
  """Data parallelism across 2 slices: what leaves a slice is the gradients' all-reduce, the
  same bytes for DIFF V1 as for the Transformer of the same parameters (DIFF's two maps, λ
  and the per-head norm stay inside the slice), and no activations; once per micro-batch by
  default, once per step with grad_accum_reduce="step"."""
  reports = {arm: _two_slice_report(arm) for arm in ("transformer", "diff_v1")}
  for arm, r in reports.items():
    assert r.num_devices == 16 and r.num_slices == 2
    assert r.mesh == {"data": 2, "fsdp": 8, "tensor": 1, "context": 1}
    assert set(r.dcn.bytes_by_kind) == {"ALL_REDUCE"}, r.dcn
    # Each micro-batch's gradients are reduced across slices: at least a device's f32 shard
    # of them, and at most the whole f32 gradient (the compiler reduces the embedding's
    # scatter-added gradient whole), twice.
    shard = 4 * r.params / 8
    assert 2 * shard <= r.dcn.total_bytes <= 2 * 4 * r.params, (arm, r.dcn, shard)
    assert r.dcn.unknown_loops == 0
    assert "DCN per device and step" in r.line() and "2x v5p:2x2x2" in r.line()
  t, v1 = reports["transformer"], reports["diff_v1"]
  assert abs(v1.params - t.params) / t.params < 0.01
  assert v1.dcn.total_bytes <= 1.02 * t.dcn.total_bytes, (v1.dcn, t.dcn)
  # Reduced once per step: at least a device's shard, no more than a step without
  # accumulation sends, and less than the default's two reductions. (The tiny DIFF V1's
  # per-slice sums of its 16-wide heads are padded to the TPU's 128 lanes, so the arms are
  # compared at full width, in docs/results/aot_multislice.md.)
  for arm, r in reports.items():
    once = _two_slice_report(arm, reduce="step")
    one = _two_slice_report(arm, accum=1)
    assert set(once.dcn.bytes_by_kind) == {"ALL_REDUCE"}, once.dcn
    shard = 4 * once.params / 8
    assert shard <= once.dcn.total_bytes <= one.dcn.total_bytes, (arm, once.dcn, one.dcn)
    assert once.dcn.total_bytes < r.dcn.total_bytes, (arm, once.dcn, r.dcn)


@needs_libtpu
def test_fsdp_across_slices_gathers_parameters_over_dcn():
  r = _two_slice_report("diff_v1", dcn_shape=(1, 2, 1))
  assert r.mesh == {"data": 1, "fsdp": 16, "tensor": 1, "context": 1}
  assert "ALL_GATHER" in r.dcn.bytes_by_kind, r.dcn


@needs_libtpu
def test_cli_refuses_context_across_slices_in_one_line():
  r = _cli(
    "--config=configs/tiny.py",
    "--topology=v5p:2x2x2",
    "--num_slices=2",
    "--config.mesh.shape=(1,-1,1,1)",
    "--config.mesh.dcn_shape=(1,1,1,2)",
  )
  lines = [l for l in r.stderr.splitlines() if l.startswith("error")]
  assert r.returncode != 0 and len(lines) == 1, r.stderr[-3000:]
  assert "context axis across 2 slices" in lines[0], lines
  r = _cli("--config=configs/tiny.py", "--target=h100", "--num_slices=2")
  assert r.returncode == 2 and "--num_slices=2" in r.stderr, r.stderr[-2000:]
