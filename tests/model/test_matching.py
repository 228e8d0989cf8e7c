"""Every way of choosing an arm trains the matched widths; explicit arm widths are reported
(diffjax.model.matching and diffjax.model.sizes).

The ways: a config file's own ``model.arm``, ``--config.model.arm`` on the command line (train.py
and the ahead-of-time compiler read the same resolution), the arms of a comparison, and another
baseline size or width. Each must give exactly ``matched_configs(baseline)[arm]``. What the
commands print about it: tests/train/test_train_command.py.
"""

from __future__ import annotations

import os

import pytest
from helpers import COMPARE_CONFIGS, RUN_CONFIGS

from diffjax import compare
from diffjax.model import ARMS, ModelConfig, count_params, matched_configs, resolve_model
from diffjax.model.sizes import SIZES, WIDTHS, size_widths
from diffjax.presets import base_config, load_config


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
