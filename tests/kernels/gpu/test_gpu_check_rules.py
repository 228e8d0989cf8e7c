"""What makes the GPU check fail rather than look complete, and the CUDA 13 packages.

On a CPU the suite's own default backend is the CPU, where every ``gpu``-marked test skips;
the check therefore starts its test child with ``JAX_PLATFORMS=cuda`` and counts a skip as a
failure. Parts that the time budget leaves out are rows saying so, and the exit status says
the table is incomplete. The compile tools find CUDA 13's plugin and ptxas as well as CUDA 12's.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import pytest
from helpers import REPO

from diffjax.kernels.gpu import targets


def _gpu_check():
  spec = importlib.util.spec_from_file_location(
    "diffjax_gpu_check", os.path.join(REPO, "benchmarks", "gpu_check.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def gpu_check():
  return _gpu_check()


@pytest.mark.parametrize(
  "summary, dry, failed",
  [
    ("10 passed in 41.2s", False, False),
    ("10 passed, 38 deselected in 41.2s", False, False),
    ("8 passed, 2 skipped in 30.0s", False, True),
    ("10 skipped in 2.0s", False, True),
    ("1 failed, 9 passed in 40.0s", False, True),
    ("9 passed, 1 error in 40.0s", False, True),
    ("38 deselected in 1.0s", False, True),
    ("no output", False, True),
    ("10/48 tests collected (38 deselected) in 1.2s", True, False),
    ("1 error in 1.2s", True, True),
  ],
)
def test_a_skip_or_no_test_run_fails_the_test_row(gpu_check, summary, dry, failed):
  assert gpu_check.tests_failed(summary, dry) is failed


def test_the_test_child_runs_on_the_gpu_backend_and_a_skipped_test_fails_its_row(
  gpu_check, monkeypatch
):
  seen = {}

  def fake_run(cmd, **kw):
    seen.update(kw)
    out = "ss........\nSKIPPED [2] tests/kernels/gpu/test_kernels_gpu.py:40: needs a GPU\n"
    return subprocess.CompletedProcess(cmd, 0, out + "8 passed, 2 skipped in 9.0s\n", "")

  monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # what tests/conftest.py leaves behind
  monkeypatch.setattr(gpu_check.subprocess, "run", fake_run)
  ((check, _, result),) = gpu_check.run_tests(dry=False, timeout_s=5)
  assert seen["env"]["JAX_PLATFORMS"] == "cuda" and seen["timeout"] == 5
  assert check == "gpu-marked tests"
  assert result.startswith("FAILED: 8 passed, 2 skipped") and "needs a GPU" in result


def test_parts_past_the_budget_are_rows_that_fail_the_check(gpu_check, monkeypatch, capsys):
  monkeypatch.setattr(
    gpu_check, "run_tests", lambda dry, timeout_s: [("gpu-marked tests", "t", "10 passed")]
  )
  ran = []
  for name in ("run_attention", "run_decode", "run_train"):
    monkeypatch.setattr(gpu_check, name, lambda dry, name=name: ran.append(name) or [])
  assert gpu_check.main(["--dry-run", "--budget_s=0"]) == 1
  assert not ran
  table = capsys.readouterr().out
  for part in ("attention", "decode", "train step"):
    assert f"| {part} | not run | FAILED: the budget of 0 s was spent |" in table
  assert gpu_check.main(["--dry-run", "--budget_s=600"]) == 0
  assert ran == ["run_attention", "run_decode", "run_train"]


def test_cuda_13_plugin_and_ptxas_are_found(monkeypatch, tmp_path):
  real = importlib.util.find_spec

  def find_spec(name, *a):
    if name == "jax_plugins.xla_cuda12":
      return None
    if name == "jax_plugins.xla_cuda13":
      return importlib.machinery.ModuleSpec(name, None)
    return real(name, *a)

  monkeypatch.setattr(targets.importlib.util, "find_spec", find_spec)
  assert targets.cuda_plugin() == "xla_cuda13"
  bin_dir = tmp_path / "cu13" / "bin"
  bin_dir.mkdir(parents=True)
  (bin_dir / "ptxas").write_text("")
  fake = types.ModuleType("nvidia")
  fake.__path__ = [str(tmp_path)]
  monkeypatch.setitem(sys.modules, "nvidia", fake)
  assert targets.ptxas_dir() == str(bin_dir)
  assert targets.available() is None
  (bin_dir / "ptxas").unlink()
  assert "ptxas is not installed" in targets.available()
  monkeypatch.setattr(targets.importlib.util, "find_spec", lambda name, *a: None)
  assert targets.cuda_plugin() is None and "CUDA plugin" in targets.available()


def test_a_peer_without_a_backward_keeps_its_forward_and_does_not_fail_the_check(
  gpu_check, monkeypatch
):
  bench = gpu_check.attention_bench

  @jax.custom_vjp
  def no_causal_backward(q, k, v):
    return q * 2.0

  def refuse(q, k, v):
    raise NotImplementedError("Causal attention not supported in the backwards pass yet.")

  no_causal_backward.defvjp(refuse, lambda res, g: (g, g, g))

  def ours(q, k, v):
    return q + k * v

  def broken(q, k, v):
    raise ValueError("Mixed input dtypes for matrix multiplication unsupported")

  def rows(inputs, heads, interpret):
    mha = inputs["mha"]
    return [
      bench.Row("baseline", ours, mha, 8, 28, heads),
      bench.Row("peer: causal forward only", no_causal_backward, mha, 8, 28, heads),
      bench.Row("V1 fused", no_causal_backward, mha, 12, 32, heads),  # ours must not refuse
      bench.Row("peer: broken here", broken, mha, 8, 28, heads),
    ]

  monkeypatch.setattr(bench, "_rows", rows)
  got = bench.measure(8, 1, 1, 4, jnp.float32, interpret=True, warmup=0, iters=1)
  base, peer, fused, broken_peer = got
  assert base["fb_ms"] > 0 and base["no_backward"] is None
  assert peer["fwd_ms"] > 0 and peer["fb_ms"] is None and peer["fb_x"] is None
  assert "Causal attention not supported" in peer["no_backward"]
  assert fused["error"].startswith("NotImplementedError")
  assert broken_peer["error"].startswith("ValueError: Mixed input dtypes")
  monkeypatch.setattr(bench, "measure", lambda *a, **k: got)
  b, p, f, x = [r[2] for r in gpu_check.run_attention(dry=True)]
  assert b.startswith("fwd ") and "fwd+bwd" in b
  assert p.startswith("fwd ") and "no fwd+bwd (NotImplementedError" in p
  assert f.startswith("error: NotImplementedError")  # which fails the check's exit status
  assert x.startswith("not measured: ValueError")  # a peer's failure does not


def test_recorded_rows_pair_each_fused_kernel_with_its_stock_path(gpu_check, tmp_path):
  bench = gpu_check.attention_bench
  ok = lambda path, f, fb: dict(path=path, fwd_ms=f, fb_ms=fb)  # noqa: E731
  results = [
    ok("baseline flash (cudnn)", 1.0, 3.5),
    ok("V1 stock (4 calls)", 1.95, 6.64),
    ok("V1 fused Mosaic GPU", 1.69, 6.47),
    ok("V2 stock (1 call)", 1.87, 6.48),
    {"path": "V2 fused Mosaic GPU", "error": "ValueError: no"},  # V2 gets no row
  ]
  rows = bench.measured_rows(results, "NVIDIA H200", 4096, "bfloat16", 128, "test")
  assert [(r["op"], r["pass"]) for r in rows] == [
    ("diff_v1", "forward"),
    ("diff_v1", "forward+backward"),
  ]
  assert rows[1]["ms"] == {"pallas_gpu": 6.47, "stock": 6.64}
  path = str(tmp_path / "m.json")
  bench.measured.record(rows, path)
  assert bench.measured.slower(
    "diff_v1",
    "stock",
    "NVIDIA H200",
    4096,
    "bfloat16",
    128,
    ("pallas_gpu",),
    bench.measured.load(path),
  )
  with pytest.raises(SystemExit):
    bench.main(["--quick", "--record", path])  # no GPU here: refused before timing
