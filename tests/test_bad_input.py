"""A user's bad input to any command ends in one ``error:`` line that names the value and what
to do instead, with exit status 2 and no traceback: every command is run as a user runs it, in
its own process, with one mistake."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import REPO, WAIT_LIMIT_S, own_stderr

pytestmark = pytest.mark.integration

# (id, arguments after ``python``, what the line must name: the value, then the fix).
# ``{tmp}`` is a fresh directory; nothing there exists unless a case makes it.
CASES = [
  (
    "train.py",
    ["train.py", "--config=configs/tiny.py", "--config.optim.lr=abc"],
    ("--config.optim.lr=abc", "usage: python train.py"),
  ),
  (
    "compare",
    [
      "-m",
      "diffjax.compare",
      "--config=configs/compare/tiny.py",
      "--workdir={tmp}/compare",
      "--config.seeds=abc",
    ],
    ("'abc'", "must be non-negative integers"),
  ),
  (
    "eval",
    ["-m", "diffjax.eval", "--workdir={tmp}/no_run"],
    ("no_run", "pass a training run's workdir"),
  ),
  (
    "eval.harness",
    ["-m", "diffjax.eval.harness", "--workdir={tmp}/no_run"],
    ("--tasks", "python -m diffjax.eval.harness --help"),
  ),
  (
    "generation",
    ["-m", "diffjax.generation", "--workdir={tmp}/no_run", "--prompt=x", "--max_new_tokens=abc"],
    ("--max_new_tokens", "'abc'"),
  ),
  (
    "convert",
    ["-m", "diffjax.convert", "retrofit", "--source={tmp}/a", "--workdir={tmp}/b", "--arm=diff_v9"],
    ("'diff_v9'", "choose from 'diff_v1', 'diff_v2'"),
  ),
  (
    "data.prepare",
    ["-m", "diffjax.data.prepare", "--input={tmp}/no_corpus", "--output={tmp}/prepared"],
    ("no_corpus", "an existing file, a directory"),
  ),
  (
    "aot",
    ["-m", "diffjax.aot", "--config=configs/default.py", "--topology=v9z:1x1"],
    ("v9z:1x1", "names like v5e:2x2"),
  ),
]
# More mistakes of the same commands: slow, as each is another process start.
MORE_CASES = [
  (
    "train.py-misspelled-key",
    ["train.py", "--config=configs/tiny.py", "--config.modle.arm=diff_v2"],
    ("modle", "did you mean --config.model.arm"),
  ),
  (
    "train.py-negative-steps",
    ["train.py", "--config=configs/tiny.py", "--config.num_steps=-3", "--workdir={tmp}/run"],
    ("num_steps=-3", "must be a positive integer"),
  ),
  (
    "train.py-slices-on-one-slice",
    [
      "train.py",
      "--config=configs/tiny.py",
      "--config.mesh.dcn_shape=(2,1,1)",
      "--workdir={tmp}/r",
    ],
    ("spans 2 slices, but there are 1", "leave it empty"),
  ),
  (
    "train.py-tensor-across-slices",
    [
      "train.py",
      "--config=configs/tiny.py",
      "--config.mesh.dcn_shape=(1,1,2)",
      "--workdir={tmp}/r",
    ],
    ("tensor axis across 2 slices", "mesh.dcn_shape=(-1, 1, 1, 1)"),
  ),
  (
    "eval-override-type",
    ["-m", "diffjax.eval", "--workdir={tmp}/no_run", "--config.samples_per_depth=abc"],
    ("'abc'", "e.g. --config.samples_per_depth="),
  ),
  (
    "generation-no-workdir",
    ["-m", "diffjax.generation", "--workdir={tmp}/no_run", "--prompt=x"],
    ("no_run", "pass the --workdir of a train.py run"),
  ),
  (
    "convert-import-no-dir",
    ["-m", "diffjax.convert", "import", "--hf={tmp}/no_hf", "--workdir={tmp}/imported"],
    ("no_hf", "config.json and *.safetensors"),
  ),
  (
    "data.prepare-shard-tokens",
    ["-m", "diffjax.data.prepare", "--input=stdlib", "--output={tmp}/p", "--shard_tokens=abc"],
    ("--shard_tokens", "'abc'"),
  ),
]


def _run(args: list[str], tmp) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(
    [sys.executable, *(a.format(tmp=tmp) for a in args)],
    capture_output=True,
    text=True,
    cwd=REPO,
    env=env,
    timeout=WAIT_LIMIT_S,
  )


def _check(args, names, tmp_path):
  done = _run(args, tmp_path)
  assert "Traceback" not in done.stderr, done.stderr[-3000:]
  lines = [line for line in own_stderr(done.stderr) if line.strip()]
  assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
  assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-3000:]
  for text in names:
    assert text in lines[0], (text, lines[0])


@pytest.mark.parametrize("args, names", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_input_is_one_line_and_status_2(args, names, tmp_path):
  _check(args, names, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("args, names", [c[1:] for c in MORE_CASES], ids=[c[0] for c in MORE_CASES])
def test_more_bad_inputs_are_one_line_and_status_2(args, names, tmp_path):
  _check(args, names, tmp_path)


def test_every_command_is_in_the_table():
  commands = {c[1][0] if c[1][0] != "-m" else c[1][1] for c in CASES}
  assert commands == {
    "train.py",
    "diffjax.compare",
    "diffjax.eval",
    "diffjax.eval.harness",
    "diffjax.generation",
    "diffjax.convert",
    "diffjax.data.prepare",
    "diffjax.aot",
  }
