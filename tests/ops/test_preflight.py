"""Kernel preflight: a fused kernel that fails on the device is switched off, said, recorded.

No GPU or TPU here, so the failing kernels are injected: registered in place of the
TPU kernel (under ``target_platform("tpu")``, which makes "auto" choose it, while the
injected function itself runs on the CPU), or, for a whole training run, in place of
the CPU path with the preflight told to check the CPU too.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import pytest

from diffjax import arms, ops
from diffjax.ops import attention as attn
from diffjax.ops import dispatch, preflight


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
  monkeypatch.setattr(dispatch, "_TABLE", {k: list(v) for k, v in dispatch._TABLE.items()})
  monkeypatch.setattr(dispatch, "_DEMOTED", {})
  monkeypatch.setattr(preflight, "_DONE", {})


def _chosen(op, implementation="auto"):
  spec = dispatch.OPS[op]
  return dispatch.choose(spec, implementation, spec.example(jnp.float32, 16, 2, 128))


def _xla_v1(q1, q2, k1, k2, v, lam, **kw):
  return attn.diff_v1_attention_core(
    q1, q2, k1, k2, v, lam, causal=kw["causal"], implementation="xla"
  )


def _raises(*args, **kwargs):
  raise RuntimeError("INTERNAL: ptxas exited with status 255 (injected)")


def _off_by_a_tenth(*args, **kwargs):
  return 1.1 * _xla_v1(*args, **kwargs)


@pytest.mark.parametrize(
  "kernel,ok,reason",
  [
    (_xla_v1, True, None),
    (_raises, False, "RuntimeError: INTERNAL: ptxas exited"),
    (_off_by_a_tenth, False, "differs from XLA by 1.00e-01"),
  ],
)
def test_a_failing_kernel_is_switched_to_the_stock_path(kernel, ok, reason):
  ops.register_implementation("diff_v1", "pallas_tpu", kernel, platforms=("tpu",))
  with ops.target_platform("tpu"):
    assert _chosen("diff_v1") == "pallas_tpu"
    check = preflight.check_op("diff_v1", dtype=jnp.float32, head_dim=16, group=2)
    after = _chosen("diff_v1")
    named = _chosen("diff_v1", "pallas_tpu")
  assert check.ok == ok and check.implementation == "pallas_tpu"
  assert check.device.startswith("cpu:")
  if ok:
    assert check.reason is None and after == named == "pallas_tpu"
    return
  assert reason in check.reason, check.reason
  assert check.fallback == "stock" and after == named == "stock"
  line = check.line()
  assert line.startswith("preflight: diff_v1 (pallas_tpu) on cpu:") and "\n" not in line
  assert "runs on the stock path" in line
  # The other ops keep their kernels.
  with ops.target_platform("tpu"):
    assert _chosen("diff_v2") == "pallas_tpu"


def test_nothing_is_checked_on_a_cpu_or_when_switched_off():
  from diffjax.model import ModelConfig

  cfg = ModelConfig(attention="diff_v1", head_dim=16, num_heads=2, num_kv_heads=1)
  ops.register_implementation("diff_v1", "pallas_tpu", _raises, platforms=("tpu",))
  assert arms.preflight(cfg) == []  # the CPU: plain XLA, nothing to check
  with ops.target_platform("tpu"):
    assert arms.preflight(cfg, enabled=False) == []
    lines = []
    (check,) = arms.preflight(cfg, log=lines.append)
    # Checked once per process: a second call returns the first result.
    assert arms.preflight(cfg, log=lines.append) == [check]
    # The arm's decode op is checked too when asked: DIFF V1 decodes with a TPU kernel.
    assert [c.op for c in arms.preflight(cfg, decode=True, log=None)] == [
      "diff_v1",
      "diff_v1_decode",
    ]
  assert not check.ok and lines == [check.line()]


def _tiny(tmp, preflight_on: bool):
  from helpers import tiny_config  # pylint: disable=import-outside-toplevel

  c = tiny_config("diff_v1", steps=2)
  c.model.num_layers = 1
  c.global_batch_size, c.eval_batches, c.data.max_documents = 2, 1, 20
  c.optim.warmup_steps = 1
  c.checkpoint.update(dict(every=2, keep=1))
  c.kernels.preflight = preflight_on
  return c


@pytest.mark.integration  # whole training runs
@pytest.mark.parametrize("preflight_on", [True, False])
def test_a_training_run_goes_on_with_the_stock_path_and_says_so(
  tmp_path, monkeypatch, capsys, preflight_on
):
  from diffjax.train import train_and_evaluate

  calls = []

  def wrong_cpu_kernel(*args, **kwargs):
    calls.append(1)
    return jnp.zeros_like(_xla_v1(*args, **kwargs))

  # The CPU path stands in for a fused kernel: checked like one, and broken.
  monkeypatch.setattr(preflight, "PLATFORMS", ("cpu",))
  monkeypatch.setattr(preflight, "FUSED", ("xla_cpu",))
  ops.register_implementation("diff_v1", "xla_cpu", wrong_cpu_kernel, platforms=("cpu",))
  workdir = str(tmp_path / "run")
  result = train_and_evaluate(_tiny(tmp_path, preflight_on), workdir)
  out = capsys.readouterr()
  record = os.path.join(workdir, "preflight.json")
  if not preflight_on:
    assert not os.path.exists(record) and "preflight/fallbacks" not in result
    assert calls, "with the preflight off, the (broken) kernel is what the run used"
    return
  (check,) = json.load(open(record, encoding="utf-8"))
  assert check["op"] == "diff_v1" and check["implementation"] == "xla_cpu"
  assert not check["ok"] and check["fallback"] == "xla"
  assert "differs from XLA" in check["reason"]
  assert result["preflight/fallbacks"] == 1 and result["step"] == 2
  assert jnp.isfinite(result["train/loss"])
  printed = out.out + out.err
  assert "preflight: diff_v1 (xla_cpu) on cpu" in printed and "runs on the xla path" in printed
  # Only the preflight traced the broken kernel (once to see that it takes the inputs, once
  # under its jit): the steps took XLA.
  assert len(calls) == 2
  assert jax.default_backend() == "cpu"
