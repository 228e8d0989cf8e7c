"""The run config: resolved once into typed sections, each value checked where it is built, and
the ConfigDict that config files edit generated from those sections without changing a key.

``base_config()`` is what every config file and every checkpoint's saved config builds on, so its
JSON and the type of every key are pinned to tests/fixtures/base_config.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
from helpers import FIXTURES, REPO  # noqa: E402

from diffjax import cli
from diffjax.model import ModelConfig
from diffjax.model.sizes import WIDTHS
from diffjax.presets import base_config, load_config, model_section
from diffjax.sharding import DEFAULT_RULES
from diffjax.train.config import RunConfig
from diffjax.train.config_utils import OVERRIDE_HELP, RENAMED_KEYS, describe_run
from diffjax.train.sections import (
  CheckpointConfig,
  DistributedConfig,
  MeshConfig,
  OptimConfig,
  ProfileConfig,
  TaskMixConfig,
)


def _fields(c, prefix: str = "") -> dict[str, list[str]]:
  """{dotted key: [its type, how the ConfigDict holds it]} of every value key of ``c``."""
  out = {}
  for k in c.keys():
    v = c[k]
    if hasattr(v, "keys") and not isinstance(v, dict):
      out.update(_fields(v, f"{prefix}{k}."))
    else:
      out[prefix + k] = [c.get_type(k).__name__, type(c._fields[k]).__name__]  # pylint: disable=protected-access
  return out


def test_base_config_keeps_every_key_type_and_value():
  with open(os.path.join(FIXTURES, "base_config.json"), encoding="utf-8") as f:
    pinned = json.load(f)
  c = base_config()
  # The JSON checkpoints save (key order included) and the keys' types: a key that holds a
  # placeholder stays one, so a config may set it to None and a flag may set it again.
  assert c.to_json_best_effort() == pinned["json"]
  assert _fields(c) == pinned["fields"]


def test_the_model_sections_defaults_are_the_model_configs():
  section, defaults = model_section().to_dict(), ModelConfig()
  for f in dataclasses.fields(ModelConfig):
    if f.name not in ("attention", "vocab_size", *WIDTHS):
      assert section[f.name] == getattr(defaults, f.name), f.name
  assert section["arm"] == defaults.attention
  assert all(section[k] is None and section["unmatched"][k] is None for k in WIDTHS)


@pytest.mark.parametrize("name", ["default.py", "small.py", "tiny.py"])
def test_a_shipped_config_resolves_and_round_trips(name):
  c = load_config(os.path.join(REPO, "configs", name))
  run = RunConfig.from_config(c)
  assert run.to_json() == c.to_json_best_effort()
  assert run.to_config_dict().to_json_best_effort() == c.to_json_best_effort()
  assert RunConfig.from_config(run) is run
  assert run.optim == OptimConfig.from_config(c.optim)


def test_a_corpus_named_at_launch_waits_for_the_launch():
  c = load_config(os.path.join(REPO, "configs", "paper_3b.py"))
  with pytest.raises(ValueError, match="data.kind='prepared' needs data.paths"):
    RunConfig.from_config(c)
  run = RunConfig.from_config(c, data_at_launch=True)
  assert run.data is None and run.fixed_vocab_size == c.model.vocab_size
  c.data.paths, c.data.tokenizer = ("/data/prepared",), "tokenizer.json"
  assert RunConfig.from_config(c).data.paths == ("/data/prepared",)


def test_sections_given_as_mappings_are_resolved_and_checked():
  run = RunConfig(optim={"lr": 1e-3}, checkpoint={"every": 7})
  assert run.optim == OptimConfig(lr=1e-3) and run.checkpoint == CheckpointConfig(every=7)
  with pytest.raises(ValueError, match=r"optim\.lr=nan must be a finite number, > 0"):
    RunConfig(optim={"lr": math.nan})
  with pytest.raises(ValueError, match=r"optim.min_lr=0.5 must be <= optim.lr=0.1"):
    OptimConfig(lr=0.1, min_lr=0.5)


@pytest.mark.parametrize(
  "key,value,message",
  [
    ("seq_len", 1.5, "seq_len=1.5 must be an integer"),
    ("seq_len", 0, "seq_len=0 must be a positive integer"),
    ("seed", -1, "seed=-1 must be an integer >= 0"),
    ("tensorboard", "yes", "tensorboard='yes' must be True or False"),
    ("max_skipped_updates", True, "max_skipped_updates=True must be an integer >= 0"),
    ("grad_accum_reduce", "once", "grad_accum_reduce='once' is not one of"),
    ("optim.schedule", "step", "optim.schedule='step' is not one of"),
    ("optim.warmup_steps", 2000, "Need 0 <= optim.warmup_steps <= decay steps"),
    ("checkpoint.keep", 0, "checkpoint.every=500 and checkpoint.keep=0 must be positive"),
    ("mesh.context_strategy", "tree", "mesh.context_strategy='tree' is not one of"),
    ("mesh.rules", [["embed", "nowhere"]], "names unknown mesh axes"),
    ("mesh.num_devices", -1, r"mesh.num_devices=-1 must be 0 \(every device\) or a device count"),
    ("profile.steps", (5, 2), r"profile.steps=\(5, 2\) must be \(first, last\)"),
    ("distributed.peer_timeout_s", 0.0, "distributed.peer_timeout_s=0.0 must be a finite"),
    ("distributed.heartbeat_timeout_s", 60.0, "must exceed distributed.peer_timeout_s=60"),
    ("distributed.heartbeat_timeout_s", -1.0, "distributed.heartbeat_timeout_s=-1.0 must be"),
    ("task_mix.task", "sorting", "task_mix.task='sorting' is not one of"),
    ("model.arm", "gpt", "model.arm='gpt' is not one of"),
  ],
)
def test_a_bad_value_is_named_with_its_key(key, value, message):
  c = base_config().to_dict()
  section, _, name = key.rpartition(".")
  (c[section] if section else c)[name] = value
  with pytest.raises(ValueError, match=message):
    RunConfig.from_config(c)


def test_a_key_the_run_config_lacks_is_refused_with_the_nearest_one():
  c = base_config().to_dict()
  c["num_step"] = 5
  with pytest.raises(ValueError, match="num_step is not a run config key; did you mean num_steps"):
    RunConfig.from_config(c)
  c = base_config().to_dict()
  c["optim"]["lrr"] = 1e-3
  with pytest.raises(ValueError, match="optim.lrr is not a run config key; did you mean optim.lr"):
    RunConfig.from_config(c)
  c = base_config().to_dict()
  del c["optim"]
  with pytest.raises(ValueError, match=r"missing keys \['optim'\]"):
    RunConfig.from_config(c)


def test_a_key_named_as_other_trainers_name_it_suggests_the_key_that_holds_it():
  config = base_config()
  for arg, first in (
    ("--config.optim.learning_rate=1e-3", "--config.optim.lr"),
    ("--config.learning_rate=1e-3", "--config.optim.lr"),
    ("--config.max_steps=10", "--config.num_steps"),
    ("--config.batch_size=8", "--config.global_batch_size"),
  ):
    line = cli.unknown_override_message(config, [arg])
    said = line.split("did you mean ", 1)[1]
    assert said.startswith(first), line
    assert said.count(first + " ") + said.count(first + "?") == 1, line  # named once


def test_a_decay_that_ends_before_the_run_is_noted_with_the_setting_that_spreads_it():
  optim = OptimConfig(decay_steps=500)
  note = optim.decay_note(2000)
  assert "steps 501-2000 train at min_lr" in note and "--config.optim.decay_steps=2000" in note
  assert optim.decay_note(500) is None and optim.decay_note(400) is None
  assert OptimConfig(schedule="constant", decay_steps=500).decay_note(2000) is None
  c = load_config(os.path.join(REPO, "configs/tiny.py"))
  c.num_steps = 2000
  assert describe_run(c).splitlines()[-1] == note
  c.optim.decay_steps = 2000
  assert "note:" not in describe_run(c)


def test_sections_a_config_lacks_keep_their_defaults():
  c = base_config().to_dict()
  for name in ("task_mix", "distributed", "profile", "kernels", "peak_flops", "tensorboard"):
    del c[name]
  run = RunConfig.from_config(c)
  assert run.task_mix == TaskMixConfig() and run.distributed == DistributedConfig()
  assert run.profile == ProfileConfig() and run.tensorboard is True and run.peak_flops is None


def test_a_task_mix_is_checked_only_for_the_task_it_names():
  assert TaskMixConfig(context_len=0, num_needles=0).task == "none"
  with pytest.raises(ValueError, match="set task_mix.num_examples"):
    TaskMixConfig(task="associative_recall", fraction=1.0)
  with pytest.raises(ValueError, match="fraction below 1"):
    TaskMixConfig(task="multi_needle", fraction=1.0, num_examples=4)
  mix = TaskMixConfig(task="associative_recall", fraction=1.0, num_examples=3, grid=[[4, 0]])
  assert mix.task_only and mix.grid == ((4, 0),)


def test_mesh_rules_and_context_options():
  mesh = MeshConfig(shape=[1, 2, 1, 4], rules=[["embed", ["fsdp", "context"]]])
  assert mesh.shape == (1, 2, 1, 4) and mesh.context == 4
  # A table names the rules it changes; the others keep their defaults.
  assert mesh.rules == tuple(
    (n, ("fsdp", "context") if n == "embed" else a) for n, a in DEFAULT_RULES
  )
  assert mesh.context_options() == {"context_strategy": "ring", "context_load_balance": True}
  c = base_config().to_dict()
  c["mesh"]["shape"], c["seq_len"] = (1, 1, 1, 4), 100
  with pytest.raises(ValueError, match="seq_len=100 must be a multiple of 8"):
    RunConfig.from_config(c)


def test_mesh_num_devices_takes_the_first_devices():
  import jax  # pylint: disable=import-outside-toplevel

  from diffjax import sharding  # pylint: disable=import-outside-toplevel

  # The test process has 8 CPU devices (tests/conftest.py).
  assert MeshConfig().devices() is None
  assert MeshConfig(num_devices=3).devices() == jax.devices()[:3]
  mesh = sharding.make_mesh((-1, 1, 1), devices=MeshConfig(num_devices=2).devices())
  assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 1, "context": 1}
  with pytest.raises(ValueError, match=r"mesh.num_devices=9, but this process sees 8 cpu"):
    MeshConfig(num_devices=9).devices()


def _parse(*argv):
  return cli.parse(
    ["train.py", *argv],
    usage="usage",
    summary="summary",
    overrides_help=OVERRIDE_HELP,
    renamed=RENAMED_KEYS,
  )


def test_a_key_a_config_set_to_none_takes_a_flag_again():
  config, _, _ = _parse(
    "--config=configs/paper_3b_64k.py", "--config.checkpoint.init_from=/runs/3b", "--config.seed=3"
  )
  run = RunConfig.from_config(config, data_at_launch=True)
  assert run.checkpoint.init_from == "/runs/3b" and run.seed == 3


def test_a_renamed_key_names_its_successor(capsys):
  assert _parse("--config=configs/tiny.py", "--config.model.attention=diff_v2") == 2
  line = capsys.readouterr().err.strip()
  assert line.startswith("error: unknown config key 'model.attention'")
  assert "a run's arm is --config.model.arm=<transformer|diff_v1|diff_v2|gda_v1|gda_v2>" in line


def test_describe_run_names_the_model_batch_and_data():
  text = describe_run(load_config(os.path.join(REPO, "configs", "default.py")))
  assert "arm=diff_v1 matched to the Transformer of 192 x 3 layers, 6 heads of 32" in text
  assert "global_batch_size=16" in text and "kind=stdlib" in text
