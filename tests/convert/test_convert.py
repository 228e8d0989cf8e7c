"""Import and export of Hugging Face checkpoints (diffjax.convert) against transformers' outputs.

The fixtures under tests/fixtures/hf/ were written by make_fixtures.py with torch and
transformers: a tiny random LlamaForCausalLM (one safetensors file) and DiffLlamaForCausalLM
(sharded, tied embeddings), each with transformers' float32 logits for a fixed input and
its greedy ``generate`` tokens for a prompt. Nothing here needs torch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from helpers import FIXTURES as TESTS_FIXTURES  # noqa: E402
from safetensors import safe_open
from safetensors.numpy import save_file

from diffjax import arms
from diffjax.convert import (
  ConversionError,
  build_model,
  expected_shapes,
  hf_config,
  load_hf,
  model_config_from_hf,
  model_params,
  save_hf,
)
from diffjax.convert.command import main as cli_main
from diffjax.convert.files import read_tensors
from diffjax.model import DecoderLM, ModelConfig

FIXTURES = os.path.join(TESTS_FIXTURES, "hf")
KINDS = ("llama", "diffllama")
ARM = {"llama": "transformer", "diffllama": "diff_v1"}
# transformers stamps the version that wrote the file; it carries no model information.
INFORMATIONAL_KEYS = {"transformers_version"}
WIDTH = 21  # covers the fixtures' inputs (20 tokens) and prompt + greedy tokens (21)


def fixture(kind: str) -> str:
  return os.path.join(FIXTURES, kind)


def fixture_config(kind: str) -> dict:
  with open(os.path.join(fixture(kind), "config.json"), encoding="utf-8") as f:
    return json.load(f)


def npy(kind: str, name: str) -> np.ndarray:
  return np.load(os.path.join(fixture(kind), f"{name}.npy"))


@pytest.fixture(scope="module", params=KINDS)
def imported(request):
  """(kind, model imported from the fixture)."""
  return request.param, load_hf(fixture(request.param))


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens_BxT):
  return nnx.merge(graphdef, state)(tokens_BxT)


def logits_of(model: DecoderLM, ids) -> np.ndarray:
  """float32 logits [B, T, V]; one compile per model config and input shape."""
  graphdef, state = nnx.split(model)
  return np.asarray(_forward(graphdef, state, jnp.asarray(ids)), np.float32)


def random_model(cfg: ModelConfig, seed: int) -> DecoderLM:
  """A model of ``cfg`` with every parameter random, norm gains drawn away from 1.

  Built from numpy draws (no eager Flax init, which compiles every initializer).
  """
  rng = np.random.default_rng(seed)
  with nnx.use_eager_sharding(False):
    abstract = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))
  shapes = nnx.to_pure_dict(nnx.state(abstract))

  def draw(path, leaf):
    if "scale" in str(path[-1]):
      return (1.0 + 0.3 * rng.standard_normal(leaf.shape)).astype(np.float32)
    return (cfg.init_std * rng.standard_normal(leaf.shape)).astype(np.float32)

  return build_model(cfg, jax.tree_util.tree_map_with_path(draw, shapes))


def copy_fixture(kind: str, tmp_path, name: str = "src") -> str:
  dst = os.path.join(tmp_path, name)
  shutil.copytree(fixture(kind), dst)
  return dst


def edit_config(path: str, **changes) -> None:
  cfg_path = os.path.join(path, "config.json")
  with open(cfg_path, encoding="utf-8") as f:
    cfg = json.load(f)
  for k, v in changes.items():
    if v is _DELETE:
      cfg.pop(k, None)
    else:
      cfg[k] = v
  with open(cfg_path, "w", encoding="utf-8") as f:
    json.dump(cfg, f)


_DELETE = object()


# ---------------------------------------------------------------- parity with transformers


def padded_logits(model: DecoderLM, ids) -> np.ndarray:
  """Logits of ``ids`` [B<=2, T<=WIDTH], computed on a [2, WIDTH] buffer.

  Every forward of a fixture model has this one shape, so each config compiles once (the
  CPU budget of these tests is mostly compiles). Attention is causal, so the padding after
  a row's tokens cannot change the logits of the positions before it.
  """
  buf = np.zeros((2, WIDTH), np.int32)
  buf[: ids.shape[0], : ids.shape[1]] = ids
  return logits_of(model, buf)[: ids.shape[0], : ids.shape[1]]


def test_import_reproduces_transformers_logits(imported):
  kind, model = imported
  assert model.config.attention == ARM[kind]
  logits = padded_logits(model, npy(kind, "input_ids"))
  expected = npy(kind, "logits")
  assert logits.shape == expected.shape
  err = float(np.max(np.abs(logits - expected)))
  assert err <= 1e-4, f"{kind}: max |diffjax - transformers| = {err:.2e}"


def test_greedy_decoding_reproduces_transformers_generate(imported):
  kind, model = imported
  prompt, expected = npy(kind, "prompt_ids"), npy(kind, "greedy_ids")
  tokens = np.zeros_like(expected)
  tokens[:, : prompt.shape[1]] = prompt
  for t in range(prompt.shape[1], expected.shape[1]):
    tokens[:, t] = np.argmax(padded_logits(model, tokens)[:, t - 1], axis=-1)
  np.testing.assert_array_equal(tokens, expected)


def test_import_accepts_the_older_config_format(tmp_path):
  # transformers 4.x wrote rope_theta at the top level and rope_scaling: null.
  src = copy_fixture("llama", tmp_path)
  theta = fixture_config("llama")["rope_parameters"]["rope_theta"]
  edit_config(
    src,
    rope_parameters=_DELETE,
    rope_theta=theta,
    rope_scaling=None,
    dtype=_DELETE,
    torch_dtype="float32",
    transformers_version="4.46.0",
    mlp_bias=None,
    _name_or_path="local/llama",
  )
  model = load_hf(src)
  assert model.config.rope_theta == theta
  err = np.max(np.abs(padded_logits(model, npy("llama", "input_ids")) - npy("llama", "logits")))
  assert err <= 1e-4


def test_import_reads_bfloat16_tensors(tmp_path):
  src = copy_fixture("llama", tmp_path)
  tensors = read_tensors(src)
  bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
  save_file(bf16, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
  params = model_params(load_hf(src))
  np.testing.assert_array_equal(
    params["embed"]["embedding"], bf16["model.embed_tokens.weight"].astype(np.float32)
  )


# ------------------------------------------------------------------------------ export


def test_export_then_import_is_the_identity(imported, tmp_path):
  kind, model = imported
  out = os.path.join(tmp_path, "out")
  save_hf(model, out, max_shard_size="40KB")  # several shards and an index
  again = load_hf(out)
  assert again.config == model.config
  jax.tree.map(np.testing.assert_array_equal, model_params(again), model_params(model))
  # The imported fixture's tensors come back bit for bit.
  exported, original = read_tensors(out), read_tensors(fixture(kind))
  assert sorted(exported) == sorted(original)
  for name, value in original.items():
    np.testing.assert_array_equal(exported[name], value, err_msg=name)
  # The index has the layout transformers writes (the DiffLlama fixture is sharded).
  with open(os.path.join(out, "model.safetensors.index.json"), encoding="utf-8") as f:
    index = json.load(f)
  assert set(index["weight_map"]) == set(original)
  assert index["metadata"]["total_size"] == sum(v.nbytes for v in original.values())
  if kind == "diffllama":
    with open(os.path.join(fixture(kind), "model.safetensors.index.json"), encoding="utf-8") as f:
      assert set(index["metadata"]) == set(json.load(f)["metadata"])


@pytest.mark.parametrize("kind", KINDS)
def test_export_has_the_names_shapes_and_config_keys_transformers_writes(kind, tmp_path):
  # A freshly initialised diffjax model with the fixture's config, in diffjax's default
  # interleaved RoPE layout, exported: the files must look like transformers' own.
  cfg = model_config_from_hf(fixture_config(kind)).replace(rope_style="interleaved")
  out = os.path.join(tmp_path, "out")
  files = save_hf(random_model(cfg, 0), out)
  assert files == ["config.json", "model.safetensors"]
  with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
    exported_cfg = json.load(f)
  want_cfg = fixture_config(kind)
  # rope_theta, at the top level too, is what transformers before 5 reads.
  assert set(exported_cfg) == (set(want_cfg) - INFORMATIONAL_KEYS) | {"rope_theta"}
  assert exported_cfg["rope_theta"] == want_cfg["rope_parameters"]["rope_theta"]
  for key in (
    "architectures",
    "model_type",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "vocab_size",
    "intermediate_size",
    "num_hidden_layers",
  ):
    assert exported_cfg[key] == want_cfg[key], key
  exported, original = read_tensors(out), read_tensors(fixture(kind))
  assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in original.items()}
  assert all(v.dtype == np.float32 for v in exported.values())
  with safe_open(os.path.join(out, "model.safetensors"), framework="np") as f:
    assert f.metadata() == {"format": "pt"}  # transformers' loader checks this tag


@pytest.mark.parametrize("arm,tie", [("transformer", False), ("diff_v1", True)])
def test_export_of_a_trained_layout_keeps_the_function(arm, tie, tmp_path):
  # diffjax's default interleaved RoPE is reordered to halves and DIFF V1's per-head gain
  # is folded into o_proj; importing the export must compute the same logits.
  cfg = ModelConfig(
    attention=arm,
    vocab_size=64,
    d_model=32,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=48,
    rope_style="interleaved",
    tie_embeddings=tie,
    init_std=0.15,
    implementation="xla",
  )
  model = random_model(cfg, 3)
  out = os.path.join(tmp_path, "out")
  save_hf(model, out)
  again = load_hf(out, implementation="xla")
  assert again.config.rope_style == "half"
  ids = np.random.default_rng(0).integers(0, 64, (2, 12))
  err = np.max(np.abs(logits_of(again, ids) - logits_of(model, ids)))
  assert err <= 1e-5, f"max |import(export(m)) - m| = {err:.2e}"
  if arm == "diff_v1":
    assert np.all(model_params(again)["blocks"][0]["attn"]["norm_scale"] == 1.0)


def test_export_in_bfloat16_rounds_each_tensor(imported, tmp_path):
  kind, model = imported
  out = os.path.join(tmp_path, "out")
  save_hf(model, out, dtype="bfloat16")
  with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
    assert json.load(f)["dtype"] == "bfloat16"
  exported, original = read_tensors(out), read_tensors(fixture(kind))
  for name, value in original.items():
    assert exported[name].dtype == ml_dtypes.bfloat16, name
    np.testing.assert_array_equal(exported[name], value.astype(ml_dtypes.bfloat16), name)


def test_export_refuses_what_transformers_cannot_compute(tmp_path):
  base = dict(
    vocab_size=32, d_model=16, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=32
  )
  cases = {
    "'gda_v2'": ModelConfig(attention="gda_v2", gda_ratio=2, **{**base, "num_kv_heads": 1}),
    "diff_use_norm": ModelConfig(attention="diff_v1", diff_use_norm=False, **base),
    "diff_norm_eps": ModelConfig(attention="diff_v1", diff_norm_eps=1e-6, **base),
    "diff_lambda_init_offset": ModelConfig(attention="diff_v1", diff_lambda_init_offset=-1, **base),
  }
  for field, cfg in cases.items():
    out = os.path.join(tmp_path, "out")
    with pytest.raises(ConversionError, match=field) as refused:
      save_hf(random_model(cfg, 0), out)
    assert not os.path.exists(out)
    if field == "'gda_v2'":  # the arms that do export, each named once
      assert str(refused.value).endswith("['diff_v1', 'diff_v2', 'transformer'].")


# -------------------------------------------------------------------------- workdirs (CLI)


def test_cli_import_writes_a_workdir_that_load_model_reads_and_export_restores(tmp_path):
  from diffjax.train import load_model  # pylint: disable=import-outside-toplevel

  workdir, out = os.path.join(tmp_path, "run"), os.path.join(tmp_path, "out")
  assert cli_main(["import", "--hf", fixture("diffllama"), "--workdir", workdir]) == 0
  # export reads the workdir with load_model: the fixture's tensors must come back exactly.
  assert cli_main(["export", "--workdir", workdir, "--hf", out]) == 0
  exported, original = read_tensors(out), read_tensors(fixture("diffllama"))
  assert sorted(exported) == sorted(original)
  for name, value in original.items():
    np.testing.assert_array_equal(exported[name], value, err_msg=name)
  _, cfg, step = load_model(workdir)
  assert (cfg, step) == (load_hf(fixture("diffllama")).config, 0)
  with open(os.path.join(workdir, "model_config.json"), encoding="utf-8") as f:
    assert ModelConfig.from_dict(json.load(f)) == cfg


# ------------------------------------------------------------------------------- bad input


def _bad_input(tmp_path, capsys, argv) -> str:
  """Runs the CLI on bad input: exit 2, exactly one error line, nothing written."""
  target = (
    argv[argv.index("--workdir") + 1] if argv[0] == "import" else argv[argv.index("--hf") + 1]
  )
  assert cli_main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: "), err
  assert not os.path.exists(target), f"{target} was written"
  return err[0]


def test_bad_directories_give_one_error_line_and_write_nothing(tmp_path, capsys):
  run = os.path.join(tmp_path, "run")
  line = _bad_input(tmp_path, capsys, ["import", "--hf", str(tmp_path / "nope"), "--workdir", run])
  assert "nope" in line and "not a directory" in line
  empty = tmp_path / "empty"
  empty.mkdir()
  assert "config.json" in _bad_input(
    tmp_path, capsys, ["import", "--hf", str(empty), "--workdir", run]
  )
  src = copy_fixture("llama", tmp_path)
  with open(os.path.join(src, "config.json"), "w", encoding="utf-8") as f:
    f.write('{"architectures": ["LlamaForCausalLM"], ')
  assert "not valid JSON" in _bad_input(tmp_path, capsys, ["import", "--hf", src, "--workdir", run])
  src = copy_fixture("llama", tmp_path, "noweights")
  os.remove(os.path.join(src, "model.safetensors"))
  assert "model.safetensors" in _bad_input(
    tmp_path, capsys, ["import", "--hf", src, "--workdir", run]
  )
  src = copy_fixture("diffllama", tmp_path, "noshard")
  os.remove(os.path.join(src, "model-00002-of-00003.safetensors"))
  assert "model-00002-of-00003" in _bad_input(
    tmp_path, capsys, ["import", "--hf", src, "--workdir", run]
  )
  line = _bad_input(
    tmp_path,
    capsys,
    ["export", "--workdir", str(tmp_path / "norun"), "--hf", os.path.join(tmp_path, "out")],
  )
  assert "norun" in line


@pytest.mark.parametrize(
  "kind,changes,named",
  [
    ("llama", {"architectures": ["MistralForCausalLM"]}, "MistralForCausalLM"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    (
      "llama",
      {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
      "rope_type",
    ),
    (
      "llama",
      {"rope_parameters": _DELETE, "rope_scaling": {"type": "linear", "factor": 2.0}},
      "rope_scaling.rope_type='linear'",
    ),
    ("llama", {"hidden_size": "48"}, "hidden_size"),
    ("llama", {"intermediate_size": 96}, "mlp.gate_proj.weight"),  # shapes no longer fit
    ("diffllama", {"num_key_value_heads": 8}, "self_attn.k_proj.weight"),
    ("diffllama", {"num_attention_heads": 6, "num_key_value_heads": 3}, "even"),
    ("diffllama", {"tie_word_embeddings": False}, "lm_head.weight"),
  ],
)
def test_unmappable_configs_are_refused_naming_the_field(kind, changes, named, tmp_path, capsys):
  src = copy_fixture(kind, tmp_path)
  edit_config(src, **changes)
  line = _bad_input(
    tmp_path, capsys, ["import", "--hf", src, "--workdir", os.path.join(tmp_path, "run")]
  )
  assert named in line, line


def test_unexpected_or_misshapen_tensors_are_refused(tmp_path, capsys):
  src = copy_fixture("llama", tmp_path)
  path = os.path.join(src, "model.safetensors")
  tensors = dict(read_tensors(src))
  tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
  save_file(tensors, path, metadata={"format": "pt"})
  line = _bad_input(tmp_path, capsys, ["import", "--hf", src, "--workdir", str(tmp_path / "r")])
  assert "q_proj.bias" in line
  del tensors["model.layers.0.self_attn.q_proj.bias"]
  tensors["model.layers.1.self_attn.o_proj.weight"] = np.zeros((48, 30), np.float32)
  save_file(tensors, path, metadata={"format": "pt"})
  line = _bad_input(tmp_path, capsys, ["import", "--hf", src, "--workdir", str(tmp_path / "r")])
  assert "model.layers.1.self_attn.o_proj.weight" in line and "[48, 30]" in line
  assert set(expected_shapes(model_config_from_hf(fixture_config("llama")))) == set(
    read_tensors(fixture("llama"))
  )


def test_export_refuses_a_context_or_token_id_the_model_cannot_have(tmp_path, capsys):
  run, out = str(tmp_path / "run"), str(tmp_path / "out")
  assert cli_main(["import", "--hf", fixture("llama"), "--workdir", run]) == 0
  vocab = fixture_config("llama")["vocab_size"]
  for flag, named in (
    ("--max_position_embeddings=-5", "max_position_embeddings=-5"),
    ("--max_position_embeddings=0", "max_position_embeddings=0"),
    (f"--eos_token_id={vocab}", f"eos_token_id={vocab} is not a token id"),
    ("--pad_token_id=-2", "pad_token_id=-2 is not a token id"),
    (f"--bos_token_id={vocab + 7}", f"bos_token_id={vocab + 7} is not a token id"),
  ):
    line = _bad_input(tmp_path, capsys, ["export", "--workdir", run, "--hf", out, flag])
    assert named in line, (flag, line)
  model = load_hf(fixture("llama"))
  with pytest.raises(ConversionError, match=r"eos_token_id=\[1, 2, -3\]"):
    save_hf(model, out, eos_token_id=[1, 2, -3])
  assert not os.path.exists(out)
  # A list of end ids (as Llama 3 configs have) inside the vocabulary is written as it is, and
  # so is the pad id -1 some configs give for "no pad token".
  save_hf(model, out, eos_token_id=[1, vocab - 1], pad_token_id=-1, max_position_embeddings=7)
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert (written["eos_token_id"], written["pad_token_id"]) == ([1, vocab - 1], -1)
  assert written["max_position_embeddings"] == 7


def _edit_index(src: str, edit) -> None:
  path = os.path.join(src, "model.safetensors.index.json")
  with open(path, encoding="utf-8") as f:
    index = json.load(f)
  edit(index)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(index, f)


def test_a_corrupt_index_or_an_unreadable_dtype_is_one_error_line(tmp_path, capsys):
  run = str(tmp_path / "run")
  src = copy_fixture("diffllama", tmp_path, "as_list")  # sharded, with an index
  _edit_index(src, lambda index: index.update(weight_map=list(index["weight_map"])))
  line = _bad_input(tmp_path, capsys, ["import", "--hf", src, "--workdir", run])
  assert "weight_map is a list" in line
  src = copy_fixture("diffllama", tmp_path, "null_file")
  _edit_index(src, lambda index: index["weight_map"].update({"model.norm.weight": None}))
  line = _bad_input(tmp_path, capsys, ["import", "--hf", src, "--workdir", run])
  assert "weight_map['model.norm.weight'] = None" in line
  # FP8 weights: safetensors' NumPy reader has no such dtype.
  src = copy_fixture("llama", tmp_path, "fp8")
  tensors = dict(read_tensors(src))
  tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(ml_dtypes.float8_e4m3fn)
  save_file(tensors, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
  line = _bad_input(tmp_path, capsys, ["import", "--hf", src, "--workdir", run])
  assert "'model.norm.weight'" in line and "F8_E4M3" in line and "BF16" in line, line


def test_a_tied_checkpoint_may_repeat_the_table_as_lm_head_but_not_differ(tmp_path, capsys):
  src = copy_fixture("diffllama", tmp_path)  # tie_word_embeddings: true, no lm_head.weight
  table = read_tensors(src)["model.embed_tokens.weight"]
  extra = os.path.join(src, "model-00004-of-00004.safetensors")
  index_path = os.path.join(src, "model.safetensors.index.json")
  with open(index_path, encoding="utf-8") as f:
    index = json.load(f)
  index["weight_map"]["lm_head.weight"] = os.path.basename(extra)
  with open(index_path, "w", encoding="utf-8") as f:
    json.dump(index, f)
  save_file({"lm_head.weight": table.copy()}, extra, metadata={"format": "pt"})
  assert load_hf(src).config.tie_embeddings
  save_file({"lm_head.weight": table + 1.0}, extra, metadata={"format": "pt"})
  line = _bad_input(tmp_path, capsys, ["import", "--hf", src, "--workdir", str(tmp_path / "r")])
  assert "lm_head.weight" in line


def test_existing_outputs_are_not_overwritten(tmp_path, capsys):
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("mine")
  with pytest.raises(ConversionError, match="not an empty directory"):
    save_hf(load_hf(fixture("llama")), str(out))
  assert os.listdir(out) == ["keep.txt"]
  run = tmp_path / "run"
  (run / "checkpoints" / "7").mkdir(parents=True)
  assert cli_main(["import", "--hf", fixture("llama"), "--workdir", str(run)]) == 2
  assert "already holds checkpoints" in capsys.readouterr().err
  assert os.listdir(run / "checkpoints") == ["7"]


def test_an_export_through_a_link_to_an_empty_directory_lands_where_it_points(tmp_path):
  (tmp_path / "real").mkdir()
  (tmp_path / "link").symlink_to(tmp_path / "real")
  save_hf(load_hf(fixture("llama")), str(tmp_path / "link"))
  assert (tmp_path / "link").is_symlink() and "config.json" in os.listdir(tmp_path / "real")
  assert load_hf(str(tmp_path / "link")).config == load_hf(fixture("llama")).config


def test_a_user_arm_naming_a_built_in_class_leaves_its_imports_to_the_built_in_arm(monkeypatch):
  mine = dataclasses.replace(arms.get("transformer"), name="my_llama")
  registered = arms.all_arms()
  monkeypatch.setattr(arms, "all_arms", lambda: (*registered, mine))
  assert hf_config.arm_of()["LlamaForCausalLM"] == "transformer"
  assert hf_config.arm_of()["DiffjaxTransformerForCausalLM"] == "transformer"
  assert model_config_from_hf(fixture_config("llama")).attention == "transformer"


def test_ids_given_to_the_export_of_an_imported_workdir_reach_its_generation_config(tmp_path):
  src = copy_fixture("llama", tmp_path)
  edit_config(src, bos_token_id=1, eos_token_id=2)
  source_generation = {"bos_token_id": 1, "eos_token_id": [2, 3], "temperature": 0.7}
  (tmp_path / "src" / "generation_config.json").write_text(json.dumps(source_generation))
  run = str(tmp_path / "run")
  assert cli_main(["import", "--hf", src, "--workdir", run]) == 0
  # Without ids the source's file is copied as it is.
  assert cli_main(["export", "--workdir", run, "--hf", str(tmp_path / "same")]) == 0
  copied = json.loads((tmp_path / "same" / "generation_config.json").read_text())
  assert copied == source_generation
  out = tmp_path / "out"
  assert cli_main(["export", "--workdir", run, "--hf", str(out), "--eos_token_id=5"]) == 0
  assert json.loads((out / "config.json").read_text())["eos_token_id"] == 5
  # generate reads generation_config.json: the given id replaces the source's, the rest stays.
  assert json.loads((out / "generation_config.json").read_text()) == {
    **source_generation,
    "eos_token_id": 5,
  }
