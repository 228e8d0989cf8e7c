"""train.py's command line and the arm it trains: the matched or unmatched model it prints (the
comparison command's beside it), the old way of choosing an arm refused, and ``--help``'s configs
and override grammar. The matching itself: tests/model/test_matching.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from helpers import COMPARE_CONFIGS, REPO, RUN_CONFIGS, WAIT_LIMIT_S

from diffjax import compare
from diffjax.model import ARMS, resolve_model
from diffjax.presets import load_config


def _cli(*args):
  return subprocess.run(
    [sys.executable, *args],
    cwd=REPO,
    capture_output=True,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
    timeout=WAIT_LIMIT_S,
  )


def _train_main():
  """train.py's ``main``, loaded from the script (it is not a module of the package)."""
  spec = importlib.util.spec_from_file_location(
    "diffjax_train_script", os.path.join(REPO, "train.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.main


def _in_process(capsys, main, *argv):
  """(exit status, stdout, stderr) of a command's ``main`` run in this process."""
  status = main(list(argv))
  captured = capsys.readouterr()
  return status, captured.out, captured.err


@pytest.mark.integration
def test_the_command_lines_print_matched_and_unmatched_runs(capsys):
  train = _train_main()
  status, out, err = _in_process(
    capsys, train, "train.py", "--config=configs/tiny.py", "--config.model.arm=diff_v2", "--dry_run"
  )
  assert status == 0, err[-2000:]
  want = resolve_model(
    {**load_config(os.path.join(REPO, "configs", "tiny.py")).model.to_dict(), "arm": "diff_v2"}
  )
  assert "arm=diff_v2 matched to" in out and f"mlp_dim={want.config.mlp_dim}" in out
  status, out, _ = _in_process(
    capsys,
    train,
    "train.py",
    "--config=configs/tiny.py",
    "--config.model.unmatched.head_dim=16",
    "--dry_run",
  )
  assert status == 0 and "arm=diff_v1 UNMATCHED (head_dim=16" in out, out
  status, out, err = _in_process(
    capsys, compare.main, "diffjax.compare", "--config=configs/compare/tiny.py", "--dry_run"
  )
  assert status == 0, err[-2000:]
  assert all(f"[{arm}] model: arm={arm} matched to" in out for arm in ARMS), out
  assert "UNMATCHED" not in out
  # The script itself, as a user runs it: the old way of choosing an arm is refused.
  r = _cli("train.py", "--config.model.attention=diff_v2", "--dry_run")
  assert r.returncode == 2 and "--config.model.arm=" in r.stderr.splitlines()[-1]


def test_help_lists_the_configs_and_the_override_grammar(capsys):
  status, out, _ = _in_process(capsys, _train_main(), "train.py", "--help")
  assert status == 0
  for path in RUN_CONFIGS:
    assert os.path.relpath(path, REPO) in out
  assert "--config.model.arm=diff_v2" in out and "--dry_run" in out
  status, out, _ = _in_process(capsys, compare.main, "diffjax.compare", "--help")
  assert status == 0 and all(os.path.relpath(p, REPO) in out for p in COMPARE_CONFIGS)
