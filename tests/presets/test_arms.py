"""Every way of choosing an arm trains the matched widths; explicit arm widths are reported.

The ways: a config file's own ``model.arm``, ``--config.model.arm`` on the command line (train.py
and the ahead-of-time compiler read the same resolution), the arms of a comparison, and another
baseline size or width. Each must give exactly ``matched_configs(baseline)[arm]``.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys

import pytest
from helpers import REPO, WAIT_LIMIT_S  # noqa: E402

from diffjax import compare
from diffjax.model import ARMS, ModelConfig, count_params, matched_configs, resolve_model
from diffjax.model.sizes import SIZES, WIDTHS, size_widths
from diffjax.presets import base_config, load_config
from diffjax.train.config_utils import describe_run

RUN_CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.py")))
COMPARE_CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "compare", "*.py")))


def _expected(section: dict, arm: str) -> ModelConfig:
  """The arm matched to the section's baseline, written out independently of resolve_model."""
  widths = {} if section["size"] == "custom" else size_widths(section["size"])
  widths.update({k: section[k] for k in WIDTHS if section.get(k) is not None})
  rest = {
    k: v for k, v in section.items() if k not in ("arm", "size", "v2_match", "unmatched", *WIDTHS)
  }
  if rest["vocab_size"] == -1:
    rest["vocab_size"] = 258
  base = ModelConfig(attention="transformer", **widths, **rest)
  return matched_configs(base, v2_match=section["v2_match"], names=(arm,))[arm]


def _load(path):
  return load_config(path, "1.4b") if path.endswith("paper_sweep.py") else load_config(path)


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=os.path.basename)
def test_every_shipped_run_config_trains_a_matched_arm_whatever_the_arm(path):
  config = _load(path)
  assert config.model.v2_match == "params", "every config states the one v2_match default"
  for arm in ARMS:
    section = {**config.model.to_dict(), "arm": arm}
    got = resolve_model(section)
    assert got.matched and got.config == _expected(section, arm), (path, arm)


@pytest.mark.parametrize("path", COMPARE_CONFIGS, ids=os.path.basename)
def test_every_comparison_trains_matched_arms(path):
  config = _load(path)
  if config.base.data.kind == "prepared":  # the corpus is named at launch
    config.base.data.paths = ("/data/prepared",)
    config.base.data.tokenizer = config.base.data.tokenizer or "tokenizer.json"
  config = compare.check_comparison_config(config)
  for arm in config.arms:
    run = compare.run_config(config, arm, config.seeds[0])
    section = run.model.to_dict()
    # A named variant (e.g. a DIFF V2 ablation) trains its arm, matched as that arm.
    model_arm = config.base_arm(arm)
    assert section["arm"] == model_arm
    got = resolve_model(section)
    assert got.matched and got.config == _expected(section, model_arm), (path, arm)


def test_another_size_or_baseline_width_keeps_every_arm_matched():
  section = base_config().model.to_dict()
  for size in ("tiny", "small", "3b"):
    for arm in ARMS:
      s = {**section, "arm": arm, "size": size}
      assert resolve_model(s).config == _expected(s, arm)
  # A baseline width changes every arm with it: V1 keeps half the heads, V2 pays by its FFN.
  s = {**section, "size": "tiny", "num_heads": 8, "num_kv_heads": 2}
  arms = {arm: resolve_model({**s, "arm": arm}).config for arm in ARMS}
  assert (arms["diff_v1"].num_heads, arms["diff_v1"].num_kv_heads) == (4, 1)
  assert arms["diff_v2"].num_heads == 8 and arms["diff_v2"].mlp_dim < SIZES["tiny"]["mlp_dim"]
  n = {arm: count_params(c) for arm, c in arms.items()}
  assert abs(n["diff_v2"] - n["transformer"]) <= 0.005 * n["transformer"]


def test_an_explicit_arm_width_is_allowed_and_reported_unmatched():
  section = {**base_config().model.to_dict(), "arm": "diff_v1", "size": "tiny"}
  matched = resolve_model(section)
  assert matched.matched and "UNMATCHED" not in matched.describe()
  # The matched value itself is not an override.
  same = resolve_model({**section, "unmatched": {"num_heads": matched.config.num_heads}})
  assert same.matched
  got = resolve_model({**section, "unmatched": {"num_heads": 4}})
  assert not got.matched and got.config.num_heads == 4
  line = got.describe()
  assert "UNMATCHED" in line and "num_heads=4" in line
  assert f"{count_params(got.config):,}" in line and f"{count_params(matched.config):,}" in line


def test_a_run_config_refuses_model_attention_and_names_model_arm():
  section = {**base_config().model.to_dict(), "attention": "diff_v1"}
  with pytest.raises(ValueError, match="model.arm"):
    resolve_model(section)
  with pytest.raises(ValueError, match="model.arm='gpt'"):
    resolve_model({**base_config().model.to_dict(), "arm": "gpt"})
  with pytest.raises(ValueError, match="model.size='huge'"):
    resolve_model({**base_config().model.to_dict(), "size": "huge"})


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


def test_describe_run_names_the_model_batch_and_data():
  text = describe_run(load_config(os.path.join(REPO, "configs", "default.py")))
  assert "arm=diff_v1 matched to the Transformer of 192 x 3 layers, 6 heads of 32" in text
  assert "global_batch_size=16" in text and "kind=stdlib" in text
