"""Ahead-of-time compile of the real train step for a TPU topology (needs libtpu)."""

import pytest

pytest.importorskip("libtpu", reason="the [tpu] extra (libtpu) is not installed")


from diffjax.aot import aot_report, hbm_for  # noqa: E402  pylint: disable=wrong-import-position


def _load(path, arg=None):
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("cfg", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config() if arg is None else mod.get_config(arg)


# The arms differ only in attention, whose TPU compiles the kernel and sharding tests cover;
# one arm runs by default.
@pytest.mark.parametrize("arm", [pytest.param("transformer", marks=pytest.mark.slow), "diff_v1",
                                 pytest.param("diff_v2", marks=pytest.mark.slow)])
def test_tiny_configs_compile_for_v5e_2x2(arm):
  cfg = _load("configs/tiny.py", arm)
  cfg.mesh.shape = (2, 2, 1)
  report = aot_report(cfg, "v5e:2x2")
  assert report.num_devices == 4
  assert report.mesh == {"data": 2, "fsdp": 2, "tensor": 1, "context": 1}
  assert report.hbm_gib == 16.0
  assert 0 < report.per_device_gib < 1.0 and report.fits
  assert report.arm == arm
  # "auto" resolves for the TPU: DIFF arms compile the fused Pallas kernels and the
  # Transformer the splash-attention flash kernel.
  assert report.pallas_kernels > 0, report


def test_xla_implementation_compiles_without_kernels():
  cfg = _load("configs/tiny.py", "diff_v2")
  cfg.model.implementation = "xla"
  assert aot_report(cfg, "v5e:2x2").pallas_kernels == 0


def test_hbm_table_and_bad_topology():
  assert hbm_for("TPU v5p") == 95.0 and hbm_for("TPU v5 lite") == 16.0
  with pytest.raises(ValueError, match="v9z"):
    aot_report(_load("configs/tiny.py", "diff_v1"), "v9z:2x2")


def test_cli_compiles_scanned_context_parallel_step_without_libtpu_probe_noise():
  """The command a user runs first: quiet start-up on a machine without TPUs, and the
  scanned, sequence-sharded (ring) step compiles for a real topology."""
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
  env["JAX_PLATFORMS"] = "cpu"
  r = subprocess.run(
      [sys.executable, "-m", "diffjax.aot", "--config=configs/tiny.py:diff_v1",
       "--topology=v5e:2x2", "--config.mesh.shape=(1,1,1,4)", "--config.model.scan_layers=True",
       "--config.seq_len=64"], capture_output=True, text=True, env=env, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "mesh={'data': 1, 'fsdp': 1, 'tensor': 1, 'context': 4}" in r.stdout, r.stdout
  assert "fits" in r.stdout
  for noise in ("could not determine", "host bounds", "INVALID_ARGUMENT", "Traceback"):
    assert noise not in r.stderr, r.stderr[-3000:]
