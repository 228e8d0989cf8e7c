"""The CPU settings (diffjax.cpu): what the trainer applies and cpu_setup() for a user's loop."""

import json
import platform
import warnings

import pytest
from helpers import run_python

import diffjax
from diffjax import cpu
from diffjax import sharding as shd
from diffjax.train import setup as setup_lib

# The compiled text of a small matmul program, and what cpu_setup() returned, in a fresh process.
_PROBE = """
import json, os, sys
import diffjax
setup = diffjax.cpu_setup() if sys.argv[-1] == "setup" else None
import jax, jax.numpy as jnp
x = jnp.ones((128, 128))
text = jax.jit(lambda a, b: jax.nn.relu(a @ b)).lower(x, x).compile().as_text()
print(json.dumps({"setup": setup, "ynn_fusion": "__ynn_fusion" in text,
                  "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}))
"""


def _probe(with_setup: bool) -> dict:
  code = f"import sys; sys.argv.append({'setup' if with_setup else 'plain'!r})\n" + _PROBE
  return json.loads(run_python(code))


def test_cpu_compiler_options_keep_only_what_the_jaxlib_accepts(monkeypatch):
  accepted = cpu.cpu_compiler_options()
  assert set(accepted) <= set(cpu.CPU_XLA_OPTIONS)
  monkeypatch.setattr(
    cpu, "CPU_XLA_OPTIONS", {**cpu.CPU_XLA_OPTIONS, "xla_cpu_no_such_option_here": True}
  )
  cpu.cpu_compiler_options.cache_clear()
  try:
    assert cpu.cpu_compiler_options() == accepted  # the unknown one is left out
  finally:
    cpu.cpu_compiler_options.cache_clear()
  mesh = shd.make_mesh((-1, 1, 1))
  assert setup_lib.compiler_options_for(mesh) == (accepted or None)


def test_keep_freed_memory_applies_on_glibc_and_respects_the_opt_out(monkeypatch):
  monkeypatch.setenv(cpu.ENV_VAR, "0")
  assert cpu.keep_freed_memory() is False
  assert diffjax.cpu_setup(xla_flags=False) == {"keep_freed_memory": False, "xla_flags": []}
  monkeypatch.setattr(cpu.sys, "platform", "darwin")
  monkeypatch.delenv(cpu.ENV_VAR)
  assert cpu.keep_freed_memory() is False
  monkeypatch.setattr(cpu.sys, "platform", "linux")
  is_glibc = platform.libc_ver()[0] == "glibc"
  assert cpu.keep_freed_memory() is is_glibc


@pytest.mark.integration
def test_cpu_setup_gives_a_users_own_jit_the_trainers_compiler_options():
  if not cpu.cpu_compiler_options():
    pytest.skip("this jaxlib has none of CPU_XLA_OPTIONS")
  plain, setup = _probe(with_setup=False), _probe(with_setup=True)
  expected = [
    f"--{name}=" + (str(v).lower() if isinstance(v, bool) else str(v))
    for name, v in cpu.CPU_XLA_OPTIONS.items()
  ]
  assert setup["setup"]["xla_flags"] == expected
  assert setup["setup"]["keep_freed_memory"] is (platform.libc_ver()[0] == "glibc")
  assert all(flag in setup["XLA_FLAGS"].split() for flag in expected)
  # The option's effect: the matmul, a YNNPACK fusion by default, is not one in the user's own jit.
  if plain["ynn_fusion"] is False:
    pytest.skip("this jaxlib makes no YNNPACK fusion of the probe even by default")
  assert setup["ynn_fusion"] is False


def test_cpu_setup_leaves_out_flags_xla_does_not_know(monkeypatch):
  monkeypatch.setattr(cpu, "backends_started", lambda: False)
  monkeypatch.setattr(cpu, "CPU_XLA_OPTIONS", {"xla_cpu_no_such_flag_here": True})
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nonexistent-dir-for-the-test")
  cpu._flags_accepted.cache_clear()  # pylint: disable=protected-access
  try:
    result = diffjax.cpu_setup(keep_freed_memory=False)
  finally:
    cpu._flags_accepted.cache_clear()  # pylint: disable=protected-access
  assert result == {"keep_freed_memory": False, "xla_flags": []}
  # The user's flags are untouched (a process with an unknown flag would abort).
  assert cpu.os.environ["XLA_FLAGS"] == "--xla_dump_to=/nonexistent-dir-for-the-test"


def test_cpu_setup_after_jax_started_warns_and_changes_nothing(monkeypatch):
  import jax  # pylint: disable=import-outside-toplevel

  jax.devices()  # the test process's backends are up
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  with pytest.warns(UserWarning, match="before the first JAX computation"):
    result = diffjax.cpu_setup(keep_freed_memory=False)
  assert result["xla_flags"] == [] and "XLA_FLAGS" not in cpu.os.environ
  # A flag the user already set is theirs: nothing to add, nothing to warn about.
  name = next(iter(cpu.CPU_XLA_OPTIONS))
  monkeypatch.setenv("XLA_FLAGS", f"--{name}=something")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert diffjax.cpu_setup(keep_freed_memory=False)["xla_flags"] == []
  assert cpu.os.environ["XLA_FLAGS"] == f"--{name}=something"
