"""The command ``retrofit`` prints runs as printed (from a workdir and from an HF directory, whose
RoPE and norm settings differ from the defaults), and ``init_from`` refuses a run whose model
settings would change what the retrofitted weights compute."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import REPO, WAIT_LIMIT_S, own_stderr, tiny_config

from diffjax.convert.command import main as convert_main
from diffjax.train import train_and_evaluate
from diffjax.train.integrity import CheckpointError

pytestmark = pytest.mark.integration

# Not the defaults (interleaved, 10000, 1e-5): the printed command must carry them.
SOURCE_MODEL = dict(rope_style="half", rope_theta=2000.0, norm_eps=1e-6)
# Appended to the printed command: a run of two small steps.
SHORT = [
  "--config.num_steps=2",
  "--config.global_batch_size=4",
  "--config.eval_batches=1",
  "--config.data.max_documents=40",
  "--config.tensorboard=False",
]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  """A trained Transformer workdir with non-default RoPE and norm settings."""
  wd = str(tmp_path_factory.mktemp("source") / "transformer")
  c = tiny_config(arm="transformer", steps=2)
  c.model.update(SOURCE_MODEL)
  train_and_evaluate(c, wd)
  return wd


def _retrofit(args, cwd, capsys, monkeypatch) -> str:
  monkeypatch.chdir(cwd)
  assert convert_main(["retrofit", *args]) == 0
  out = capsys.readouterr().out.strip().splitlines()
  assert out[-2].endswith("continue it with:"), out
  return out[-1].strip()


def _run_printed(command: str, cwd) -> subprocess.CompletedProcess:
  """The printed command through a shell, as pasted, with the short run's overrides after it."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
  return subprocess.run(
    command + " " + " ".join(SHORT),
    shell=True,
    capture_output=True,
    text=True,
    cwd=cwd,
    env=env,
    timeout=WAIT_LIMIT_S,
  )


@pytest.mark.slow  # a fresh training process; the same path is checked by a default test
def test_the_printed_command_continues_a_workdir_retrofit(source, tmp_path, capsys, monkeypatch):
  command = _retrofit([f"--source={source}", "--workdir=retro"], tmp_path, capsys, monkeypatch)
  for setting in ("rope_style=half", "rope_theta=2000.0", "norm_eps=1e-06", "--config="):
    assert setting in command, command
  r = _run_printed(command, tmp_path)
  assert r.returncode == 0, r.stderr[-3000:]
  assert (tmp_path / "retro_continued" / "DONE").read_text().strip() == "2"
  assert "Initialised the parameters from step 0 of retro" in r.stdout, r.stdout[-2000:]


def test_the_printed_command_continues_an_hf_retrofit(source, tmp_path, capsys, monkeypatch):
  assert convert_main(["export", f"--workdir={source}", f"--hf={tmp_path / 'hf'}"]) == 0
  command = _retrofit(
    [f"--source={tmp_path / 'hf'}", "--workdir=retro_v1", "--arm=diff_v1"],
    tmp_path,
    capsys,
    monkeypatch,
  )
  r = _run_printed(command + " --config.seq_len=32", tmp_path)
  assert r.returncode == 0, r.stderr[-3000:]
  assert (tmp_path / "retro_v1_continued" / "DONE").read_text().strip() == "2"


def test_init_from_refuses_a_setting_that_changes_the_function(source, tmp_path, capsys):
  assert convert_main(["retrofit", f"--source={source}", f"--workdir={tmp_path / 'r'}"]) == 0
  capsys.readouterr()
  c = tiny_config(arm="diff_v2", steps=2)
  c.model.update(dict(SOURCE_MODEL, v2_match="heads", v2_mix_steps=100, rope_theta=10000.0))
  c.checkpoint.init_from = str(tmp_path / "r")
  with pytest.raises(CheckpointError, match=r"--config\.model\.rope_theta=2000\.0") as e:
    train_and_evaluate(c, str(tmp_path / "changed"))
  assert "init_changes" in str(e.value) and "\n" not in str(e.value)
  assert not (tmp_path / "changed" / "checkpoints" / "0").exists()
  c.checkpoint.init_changes = ("rope_thet",)
  with pytest.raises(ValueError, match="'rope_thet', which is not one of"):
    train_and_evaluate(c, str(tmp_path / "changed"))


@pytest.mark.slow  # a fresh training process; the same path is checked by a default test
def test_the_refusal_is_one_error_line_in_train_py(source, tmp_path, capsys):
  assert convert_main(["retrofit", f"--source={source}", f"--workdir={tmp_path / 'r'}"]) == 0
  capsys.readouterr()
  r = subprocess.run(
    [
      sys.executable,
      os.path.join(REPO, "train.py"),
      "--config=" + os.path.join(REPO, "configs", "tiny.py"),
      f"--workdir={tmp_path / 'changed'}",
      "--config.model.arm=diff_v2",
      "--config.model.v2_match=heads",
      "--config.model.v2_mix_steps=100",
      "--config.model.num_layers=1",
      "--config.model.d_model=64",
      "--config.model.mlp_dim=128",
      "--config.model.head_dim=16",
      "--config.model.rope_style=half",
      "--config.model.norm_eps=1e-6",
      f"--config.checkpoint.init_from={tmp_path / 'r'}",
      *SHORT,
    ],
    capture_output=True,
    text=True,
    cwd=REPO,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    timeout=WAIT_LIMIT_S,
  )
  lines = [line for line in own_stderr(r.stderr) if line.strip()]
  assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-3000:])
  assert "model.rope_theta=2000.0" in lines[0] and "--config.model.rope_theta=2000.0" in lines[0]
