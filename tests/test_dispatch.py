"""The layers import downwards only, and the dispatch table says which kernel runs where."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from diffjax import ops
from diffjax.ops import dispatch

ROOT = pathlib.Path(__file__).resolve().parents[1]

# What each package may import from diffjax (itself always allowed). The ground floor
# (core, sharding) imports nothing else; kernels build on it; the ops choose kernels;
# the modules call the ops; the model builds on the modules.
ALLOWED = {
    "core": set(),
    "kernels": {"core", "sharding"},
    "nn": {"core", "sharding", "ops"},
    "model": {"core", "sharding", "ops", "nn"},
}


def _diffjax_imports(path: pathlib.Path) -> set[str]:
  """Top-level diffjax packages a file imports, at module level or inside functions."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    for name in names:
      parts = name.split(".")
      if parts[0] == "diffjax" and len(parts) > 1:
        found.add(parts[1])
  return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_only_lower_floors(package):
  files = sorted((ROOT / "diffjax" / package).rglob("*.py"))
  assert files, package
  bad = {}
  for f in files:
    # `from diffjax import sharding` names a package too; anything not a floor below
    # (or the package itself) is an upward or sideways import.
    upward = _diffjax_imports(f) - ALLOWED[package] - {package}
    if upward:
      bad[str(f.relative_to(ROOT))] = sorted(upward)
  assert not bad, f"{package} may import only {sorted(ALLOWED[package])}: {bad}"


def test_a_kernel_package_imports_first_in_a_fresh_interpreter():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  code = ("import diffjax.kernels.tpu as kt, diffjax.kernels.gpu as kg\n"
          "from diffjax.ops import dispatch\n"
          "assert dispatch.lookup('diff_v1', 'pallas_tpu', 'tpu', False).fn is "
          "kt.diff_v1_attention_tpu\n"
          "print('OK')\n")
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                        text=True, timeout=300, check=False, cwd=ROOT)
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_every_row_of_the_table_is_what_runs():
  rows = [r for r in dispatch.BUILTIN_KERNELS if r[3] is not None]
  # This installation (jax with Pallas TPU and Triton) has every kernel.
  assert len(rows) == len(dispatch.BUILTIN_KERNELS) == 10
  for op, implementation, platform, fn in rows:
    assert dispatch.lookup(op, implementation, platform, False).fn is fn, (op, implementation)
  # Each (op, implementation, platform) appears once.
  assert len({r[:3] for r in rows}) == len(rows)


@pytest.mark.parametrize("platform,op,want", [
    ("tpu", "mha", "stock"), ("tpu", "diff_v1", "pallas_tpu"), ("tpu", "diff_v2", "pallas_tpu"),
    ("gpu", "mha", "stock"), ("gpu", "diff_v1", "pallas_gpu"), ("gpu", "diff_v2", "pallas_gpu"),
    ("cpu", "mha", "xla"), ("cpu", "diff_v1", "xla"), ("cpu", "diff_v2", "xla"),
])
def test_auto_picks_the_platform_kernel(platform, op, want):
  with ops.target_platform(platform):
    assert dispatch.resolve(op, "auto", has_mask=False, interpret=False) == want
    # An explicit mask needs the XLA path everywhere.
    assert dispatch.resolve(op, "auto", has_mask=True, interpret=False) == "xla"


def test_a_registered_implementation_runs_in_place_of_the_builtin(monkeypatch):
  monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
  calls = []

  def mine(q, k, v, **kwargs):
    calls.append(sorted(kwargs))
    return jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype)

  ops.register_implementation("mha", "stock", mine, platforms=("cpu",))
  q = jnp.ones((1, 4, 2, 8))
  out = ops.dot_product_attention(q, q, q, implementation="stock")
  np.testing.assert_array_equal(out, 0.0)
  assert calls == [["block_sizes", "causal", "interpret", "kv_segment_ids", "q_segment_ids",
                    "scale"]]
  # The GPU and TPU stock entries are kept next to the new CPU one.
  with ops.target_platform("gpu"):
    assert dispatch.lookup("mha", "stock", "gpu", False).fn is dispatch.gpu_stock.mha_stock


def test_register_rejects_unknown_names():
  with pytest.raises(ValueError, match="Unknown op 'attn'"):
    ops.register_implementation("attn", "stock", lambda *a, **k: None, platforms=("cpu",))
  with pytest.raises(ValueError, match="Cannot register implementation 'xla'"):
    ops.register_implementation("mha", "xla", lambda *a, **k: None, platforms=("cpu",))
