"""An arm defined outside the package trains, evaluates, decodes and shards through the public
entry points, and the registry's rules hold.

The toy arm is DIFF V1 with a constant lambda, written as a user would write it: one module
that builds an :class:`~diffjax.arms.ArmSpec` and registers it, imported by the run's config
file. The run records that module, so evaluation and generation (fresh processes that never
saw the config file) find the arm again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from helpers import REPO, WAIT_LIMIT_S, read_metrics

import diffjax
from diffjax import arms
from diffjax.arms import spec as arm_spec

pytestmark = pytest.mark.integration

TOY_ARM = '''
"""DIFF V1 with a constant lambda (0.5): an arm of one's own."""
from diffjax import arms
from diffjax.arms import diff_v1
from diffjax.nn import DiffV1Attention
from diffjax.ops import DIFF_V1, DIFF_V1_DECODE


def build(cfg, layer_index, options, rngs):
  return DiffV1Attention(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         layer_index=layer_index, options=options, fixed_lambda=0.5, rngs=rngs)


SPEC = arms.register(arms.ArmSpec(
    name="v1_const", title="DIFF V1, lambda 0.5", build=build, op=DIFF_V1,
    decode_op=DIFF_V1_DECODE, heads="DIFF heads", value_head_dim=lambda cfg: 2 * cfg.head_dim,
    attention_params=diff_v1.SPEC.attention_params, matmul_params=diff_v1.SPEC.matmul_params,
    attention_flops=diff_v1.SPEC.attention_flops,
    match=lambda base, how: diff_v1.match(base, how).replace(attention="v1_const"),
    lambda_report="scalar", layer_constants=diff_v1.SPEC.layer_constants, head_norm=True))
'''

CONFIG = """
import toy_arm  # registers the arm
from diffjax.presets import base_config


def get_config():
  c = base_config()
  c.model.update(dict(arm="v1_const", size="tiny", d_model=64, num_layers=1, mlp_dim=128,
                      head_dim=16))
  c.seq_len, c.global_batch_size, c.num_steps = 32, 4, 4
  c.log_every, c.eval_every, c.eval_batches, c.tensorboard = 1, 0, 1, False
  c.data.max_documents = 40
  c.optim.update(dict(warmup_steps=1, decay_steps=4))
  c.checkpoint.update(dict(every=4, keep=1, async_save=False))
  c.mesh.shape = (2, 1, 2)  # batch over 2 devices, the arm's heads over 2
  return c
"""


def _run(args, env, timeout=WAIT_LIMIT_S):
  return subprocess.run(
    [sys.executable, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout
  )


def test_a_user_arm_trains_evaluates_decodes_and_shards(tmp_path):
  (tmp_path / "toy_arm.py").write_text(textwrap.dedent(TOY_ARM))
  (tmp_path / "toy_config.py").write_text(textwrap.dedent(CONFIG))
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p),
    XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
  )
  run = str(tmp_path / "run")
  train = _run(["train.py", f"--config={tmp_path / 'toy_config.py'}", f"--workdir={run}"], env)
  assert train.returncode == 0, train.stderr[-3000:]
  out = train.stdout + train.stderr
  assert "arm=v1_const" in out and "'tensor': 2" in out, out[-2000:]
  losses = [r["train/loss"] for r in read_metrics(run).values()]
  assert len(losses) == 4 and all(0 < x < 10 for x in losses)
  final = json.load(open(os.path.join(run, "final_metrics.json"), encoding="utf-8"))
  assert final["lambda/layer_0"] == pytest.approx(0.5)  # the arm's lambda, logged as a scalar

  # Evaluation and generation in a fresh process that imports nothing of the toy arm itself.
  eval_json = str(tmp_path / "eval.json")
  code = (
    "import sys\n"
    "from diffjax.eval.command import main as evaluate\n"
    "from diffjax.generation.command import main as generate\n"
    f"assert evaluate(['--workdir', {run!r}, '--out', {eval_json!r}, '--quick', '--sections',"
    " 'validation,text', '--config.val_batches=1']) == 0\n"
    f"sys.exit(generate(['--workdir', {run!r}, '--prompt', 'def ', '--max_new_tokens', '4']))\n"
  )
  rest = _run(["-c", code], env)
  assert rest.returncode == 0, rest.stderr[-3000:]
  assert "[v1_const, step 4]" in rest.stderr and rest.stdout.endswith("\n"), rest.stderr[-2000:]
  result = json.load(open(eval_json, encoding="utf-8"))
  assert result["meta"]["arm"] == "v1_const"
  # The arm's lambda, with the per-layer constants it passes (lambda_init of layer 0).
  lam = result["sections"]["text"]["lambda"]
  assert lam == {"kind": "scalar", "layers": [0.5], "lambda_init": [pytest.approx(0.2)]}
  assert result["sections"]["text"]["correlation"]["kind"] == "a1_a2"  # two maps per head

  # Without the arm's module on the path, loading the run says which module it needs.
  env.pop("PYTHONPATH")
  lost = _run(["-m", "diffjax.generation", f"--workdir={run}", "--prompt=x"], env)
  assert lost.returncode != 0
  assert "'toy_arm'" in lost.stderr and "PYTHONPATH" in lost.stderr, lost.stderr[-2000:]


@pytest.fixture
def registry(monkeypatch):
  """The registry as it is, restored after the test."""
  monkeypatch.setattr(arm_spec, "_ARMS", dict(arm_spec._ARMS))
  monkeypatch.setattr(arm_spec, "_MODULES", dict(arm_spec._MODULES))


def test_the_registry_names_arms_and_refuses_clashes(registry):
  assert arms.names()[:3] == ("transformer", "diff_v1", "diff_v2") == diffjax.ARMS
  assert arms.get("diff_v1").op is diffjax.ops.DIFF_V1 and arms.BASELINE == "transformer"
  assert arms.module_of("diff_v2") == "diffjax.arms.diff_v2"
  mine = arms.ArmSpec(**{**arms.get("diff_v1").__dict__, "name": "mine"})
  assert arms.register(mine) is mine and arms.names()[-1] == "mine"
  assert arms.module_of("mine") == __name__  # the module that registered it
  with pytest.raises(ValueError, match="'mine' is registered already"):
    arms.register(arms.ArmSpec(**{**mine.__dict__, "title": "another"}))
  with pytest.raises(ValueError, match="Unknown arm 'nope'; the arms are .*'mine'"):
    arms.get("nope")
  with pytest.raises(ValueError, match="module 'no_such_module'.*PYTHONPATH"):
    arms.get("nope", module="no_such_module")
  with pytest.raises(ValueError, match="lambda_report='per_head'"):
    arms.ArmSpec(**{**mine.__dict__, "lambda_report": "per_head"})


def test_an_arm_whose_layers_differ_outside_its_layer_constants_is_not_scanned(registry):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from diffjax.model import ModelConfig  # pylint: disable=import-outside-toplevel

  # DIFF V1's module scales by (1 - lambda_init), which differs by layer.
  without = arms.ArmSpec(
    **{**arms.get("diff_v1").__dict__, "name": "no_constants", "layer_constants": lambda cfg: {}}
  )
  arms.register(without)
  base = ModelConfig(
    attention="no_constants", vocab_size=64, d_model=32, num_layers=3, num_heads=2,
    num_kv_heads=2, head_dim=8, mlp_dim=64, scan_layers=True,
  )  # fmt: skip
  with pytest.raises(ValueError, match=r"'lambda_init' differs by layer .*layer_constants"):
    diffjax.DecoderLM(base, rngs=nnx.Rngs(0))
  unrolled = diffjax.DecoderLM(base.replace(scan_layers=False), rngs=nnx.Rngs(0))
  # With the constants passed, the scanned model computes the unrolled one's function.
  cfg = base.replace(attention="diff_v1")
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 64
  scanned = diffjax.DecoderLM(cfg, rngs=nnx.Rngs(0))(tokens)
  same = diffjax.DecoderLM(cfg.replace(scan_layers=False), rngs=nnx.Rngs(0))(tokens)
  assert jnp.allclose(scanned, same, atol=1e-5) and unrolled(tokens).shape == same.shape
