"""Motif-2 checkpoints (``MotifForCausalLM``) in and out, against an independent NumPy forward.

Random checkpoints in Motif's layout are written at two scaled-down shapes: a balanced one
like Motif-2.6B (as many noise heads as signal heads, no ``num_noise_heads`` or ``head_dim``
in config.json, tied embeddings, one file) and a 4:1 grouped one like Motif-2-12.7B (10 heads
of which 2 noise heads, 4 kv heads, head dim 8, untied, sharded with an index). The import's
logits are compared with tests/convert/motif_numpy.py, written from Motif's vLLM port.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from motif_numpy import motif_greedy, motif_logits, polynorm  # noqa: E402  (tests/convert)
from safetensors.numpy import save_file

from diffjax import arms
from diffjax.convert import ConversionError, load_hf, model_params, motif, save_hf
from diffjax.convert.command import main as cli_main
from diffjax.convert.files import read_tensors
from diffjax.model import DecoderLM, ModelConfig, count_params
from diffjax.nn import PolyNormGLU, poly_norm

needs_gda = pytest.mark.skipif(
  "gda_v1" not in arms.names(), reason="the gda_v1 arm is not in this tree yet"
)

# Scaled-down shapes of the two Motif-2 models.
BALANCED = {  # Motif-2.6B-like: r = 1, num_noise_heads and head_dim left to their defaults
  "architectures": ["MotifForCausalLM"],
  "model_type": "motif",
  "vocab_size": 61,
  "hidden_size": 32,
  "intermediate_size": 48,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
  "num_key_value_heads": 4,
  "attn_rms_norm_eps": 1e-5,
  "rms_norm_eps": 1e-6,
  "rope_theta": 500000.0,
  "rope_scaling": None,
  "hidden_act": "poly_norm",
  "max_position_embeddings": 64,
  "tie_word_embeddings": True,
  "bos_token_id": 1,
  "eos_token_id": 2,
}
GROUPED = {  # Motif-2-12.7B-like: 8 signal and 2 noise heads (r = 4), 4 kv heads (2 groups)
  **BALANCED,
  "hidden_size": 32,
  "intermediate_size": 40,
  "num_hidden_layers": 3,
  "num_attention_heads": 10,
  "num_noise_heads": 2,
  "num_key_value_heads": 4,
  "head_dim": 8,
  "k_ratio": 1,
  "rope_theta": 1000000.0,
  "tie_word_embeddings": False,
  "use_sliding_window": False,
  "sliding_window": None,
}
SHAPES = {"balanced": BALANCED, "grouped": GROUPED}
WIDTH = 12  # the token buffer every forward here runs on (one compile per model)


def motif_tensors(hf: dict, seed: int) -> dict[str, np.ndarray]:
  """Random float32 tensors in Motif's layout, from config.json alone."""
  rng = np.random.default_rng(seed)
  e, f, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
  heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
  noise = hf.get("num_noise_heads") or heads // 2
  d = hf.get("head_dim") or e // heads

  def normal(*shape, std=0.15, mean=0.0):
    return (mean + std * rng.standard_normal(shape)).astype(np.float32)

  t = {"model.embed_tokens.weight": normal(v, e, std=0.5), "model.norm.weight": normal(e, mean=1)}
  if not hf["tie_word_embeddings"]:
    t["lm_head.weight"] = normal(v, e, std=0.3)
  for i in range(hf["num_hidden_layers"]):
    p = f"model.layers.{i}."
    t.update(
      {
        p + "input_layernorm.weight": normal(e, mean=1.0),
        p + "post_attention_layernorm.weight": normal(e, mean=1.0),
        p + "self_attn.q_proj.weight": normal(heads * d, e, std=0.3),
        p + "self_attn.k_proj.weight": normal(kv * d, e, std=0.3),
        p + "self_attn.v_proj.weight": normal(kv * d, e),
        p + "self_attn.o_proj.weight": normal(e, 2 * (heads - noise) * d),
        p + "self_attn.subln.weight": normal(2 * d, mean=1.0),
        p + "mlp.gate_proj.weight": normal(f, e, std=0.3),
        p + "mlp.up_proj.weight": normal(f, e),
        p + "mlp.down_proj.weight": normal(e, f),
        p + "mlp.act_fn.weight": normal(3, std=0.1, mean=1 / 3),
        p + "mlp.act_fn.bias": normal(1, std=0.1),
      }
    )
    for lam in motif.LAMBDAS:
      t[p + f"self_attn.{lam}"] = normal(d, std=0.2)
  return t


def write_motif(path: str, hf: dict, tensors: dict, *, shards: int = 1) -> str:
  """A checkpoint directory as Motif publishes them: config.json, one file or shards + index."""
  os.makedirs(path)
  with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
    json.dump(hf, f)
  names = sorted(tensors)
  if shards == 1:
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path
  weight_map = {}
  for s in range(shards):
    fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    part = {n: tensors[n] for n in names[s::shards]}
    save_file(part, os.path.join(path, fname), metadata={"format": "pt"})
    weight_map.update({n: fname for n in part})
  with open(os.path.join(path, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """{shape: (directory, config.json, tensors)}."""
  root = tmp_path_factory.mktemp("motif")
  out = {}
  for seed, (name, hf) in enumerate(SHAPES.items()):
    tensors = motif_tensors(hf, seed)
    path = write_motif(str(root / name), hf, tensors, shards=1 if name == "balanced" else 3)
    out[name] = (path, hf, tensors)
  return out


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens_BxT):
  return nnx.merge(graphdef, state)(tokens_BxT)


def logits_of(model: DecoderLM, ids) -> np.ndarray:
  """float32 logits of ids [B<=2, T<=WIDTH], computed on a [2, WIDTH] buffer (causal, so the
  padding after a row's tokens leaves its logits unchanged)."""
  buf = np.zeros((2, WIDTH), np.int32)
  buf[: ids.shape[0], : ids.shape[1]] = ids
  graphdef, state = nnx.split(model)
  out = np.asarray(_forward(graphdef, state, jnp.asarray(buf)), np.float32)
  return out[: ids.shape[0], : ids.shape[1]]


def _ids(vocab: int, seed: int = 7) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab, (2, WIDTH))


# ------------------------------------------------------------------------------ PolyNorm


def test_polynorm_mlp_is_motifs_formula_in_float32():
  rng = np.random.default_rng(0)
  mlp = PolyNormGLU(8, 12, init_std=0.3, rngs=nnx.Rngs(0))
  # Motif's initial PolyNorm: weights 1/3 each, bias 0.
  np.testing.assert_allclose(np.asarray(mlp.poly_weight[...]), np.full(3, 1 / 3), rtol=1e-7)
  np.testing.assert_array_equal(np.asarray(mlp.poly_bias[...]), np.zeros(1))
  mlp.poly_weight[...] = jnp.asarray([0.5, -0.2, 0.9])
  mlp.poly_bias[...] = jnp.asarray([0.1])
  x = rng.standard_normal((2, 5, 8)).astype(np.float32)
  w = {k: np.asarray(getattr(mlp, k)[...], np.float64) for k in ("w_gate", "w_up", "w_down")}
  x64 = x.astype(np.float64)
  gate = x64 @ w["w_gate"]
  want = (polynorm(gate, [0.5, -0.2, 0.9], [0.1]) * (x64 @ w["w_up"])) @ w["w_down"]
  got = np.asarray(mlp(jnp.asarray(x), jnp.float32))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  # In bfloat16 compute the activation still runs in float32 (only its inputs are rounded).
  g16 = jnp.asarray(gate, jnp.bfloat16)
  act = poly_norm(g16, jnp.asarray([0.5, -0.2, 0.9]), jnp.asarray([0.1]))
  assert act.dtype == jnp.float32
  np.testing.assert_allclose(
    np.asarray(act), polynorm(np.asarray(g16, np.float64), [0.5, -0.2, 0.9], [0.1]), rtol=1e-5
  )


# ---------------------------------------------------------------------------- config


def test_parameter_count_of_a_config_is_its_tensors(checkpoints):
  for path, hf, tensors in checkpoints.values():
    assert motif.parameter_count(hf) == sum(t.size for t in tensors.values()), path


@needs_gda
@pytest.mark.parametrize("name", list(SHAPES))
def test_config_maps_to_gda_v1_with_motifs_conventions(name):
  hf = SHAPES[name]
  cfg = motif.model_config_from_hf(hf)
  heads, noise = hf["num_attention_heads"], hf.get("num_noise_heads", 2)
  assert cfg.attention == "gda_v1" and cfg.mlp_activation == "polynorm"
  assert (cfg.num_heads, cfg.gda_ratio) == (heads - noise, (heads - noise) // noise)
  assert cfg.num_kv_heads == hf["num_key_value_heads"] // 2 and cfg.head_dim == 8
  assert cfg.diff_lambda_init_offset == -1 and cfg.rope_style == "half"
  assert (cfg.norm_eps, cfg.diff_norm_eps) == (hf["rms_norm_eps"], hf["attn_rms_norm_eps"])
  assert cfg.rope_theta == hf["rope_theta"]
  assert cfg.tie_embeddings == hf["tie_word_embeddings"]
  assert count_params(cfg) == motif.parameter_count(hf)


@needs_gda
def test_the_rope_base_is_read_from_rope_parameters_and_a_scaled_one_refused():
  hf = {k: v for k, v in GROUPED.items() if k != "rope_theta"}
  params = {"rope_type": "default", "rope_theta": 250000.0}
  assert motif.model_config_from_hf({**hf, "rope_parameters": params}).rope_theta == 250000.0
  # Without a base anywhere, Motif's default.
  for no_base in ({**hf, "rope_parameters": {"rope_type": "default"}}, hf):
    assert motif.model_config_from_hf(no_base).rope_theta == motif.DEFAULT_ROPE_THETA
  yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 250000.0}
  with pytest.raises(ConversionError, match="rope_parameters.rope_type='yarn'"):
    motif.model_config_from_hf({**hf, "rope_parameters": yarn})
  with pytest.raises(ConversionError, match="partial_rotary_factor"):
    motif.model_config_from_hf({**hf, "partial_rotary_factor": 0.5})


# ---------------------------------------------------------------------- parity, import


@pytest.fixture(scope="module")
def imported(checkpoints):
  return {name: load_hf(path) for name, (path, _, _) in checkpoints.items()}


@needs_gda
@pytest.mark.parametrize("name", list(SHAPES))
def test_import_gives_the_numpy_motif_forwards_logits(name, checkpoints, imported):
  _, hf, tensors = checkpoints[name]
  ids = _ids(hf["vocab_size"])
  want = motif_logits(tensors, hf, ids)
  got = logits_of(imported[name], ids)
  err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
  assert err <= 1e-5, f"{name}: max |diffjax - numpy| / max |numpy| = {err:.2e}"


@needs_gda
@pytest.mark.parametrize("name", list(SHAPES))
def test_greedy_tokens_are_the_numpy_forwards(name, checkpoints, imported):
  from diffjax.generation import generate  # pylint: disable=import-outside-toplevel

  _, hf, tensors = checkpoints[name]
  prompt = _ids(hf["vocab_size"], seed=3)[:, :5]
  want = motif_greedy(tensors, hf, prompt, steps=4)
  # The plain forward, token by token, and the KV-cache decoder agree with it.
  tokens = np.zeros((2, WIDTH), np.int64)
  tokens[:, :5] = prompt
  for t in range(5, 9):
    tokens[:, t] = np.argmax(logits_of(imported[name], tokens)[:, t - 1], axis=-1)
  np.testing.assert_array_equal(tokens[:, :9], want)
  out = generate(imported[name], [list(r) for r in prompt], max_new_tokens=4)
  np.testing.assert_array_equal(np.asarray(out.tokens)[:, :4], want[:, 5:])


# ----------------------------------------------------------------------------- export


@needs_gda
@pytest.mark.parametrize("name", list(SHAPES))
def test_export_writes_motifs_layout_back_bit_for_bit(name, checkpoints, imported, tmp_path):
  path, hf, tensors = checkpoints[name]
  out = os.path.join(tmp_path, "out")
  save_hf(imported[name], out, max_shard_size="8KB", bos_token_id=1, eos_token_id=2)
  exported = read_tensors(out)
  assert sorted(exported) == sorted(tensors)
  for n, value in tensors.items():
    np.testing.assert_array_equal(exported[n], value, err_msg=n)
  with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
    written = json.load(f)
  assert written["architectures"] == ["MotifForCausalLM"] and written["model_type"] == "motif"
  keys = set(hf) - {"k_ratio", "use_sliding_window", "sliding_window", "max_position_embeddings"}
  if name == "balanced":  # left to their defaults in the source; written explicitly
    assert written["head_dim"] == 8 and "num_noise_heads" not in written
  for k in keys:
    assert written[k] == hf[k], k
  assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
  # ... and it imports as the same model.
  again = load_hf(out)
  assert again.config == imported[name].config
  jax.tree.map(np.testing.assert_array_equal, model_params(again), model_params(imported[name]))


@needs_gda
def test_export_of_an_interleaved_rope_model_keeps_its_function(tmp_path):
  cfg = motif.model_config_from_hf(GROUPED).replace(rope_style="interleaved")
  model = DecoderLM(cfg, rngs=nnx.Rngs(3))
  out = os.path.join(tmp_path, "out")
  save_hf(model, out)
  ids = _ids(cfg.vocab_size)
  again = load_hf(out)
  assert again.config.rope_style == "half"
  np.testing.assert_allclose(logits_of(again, ids), logits_of(model, ids), rtol=1e-5, atol=1e-5)
  with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
    hf = json.load(f)
  np.testing.assert_allclose(
    motif_logits(read_tensors(out), hf, ids), logits_of(model, ids), rtol=1e-4, atol=1e-5
  )


@needs_gda
def test_export_refuses_what_motif_does_not_compute(tmp_path):
  cfg = motif.model_config_from_hf(BALANCED)
  for change, named in (
    ({"diff_lambda_init_offset": 0}, "diff_lambda_init_offset"),
    ({"diff_use_norm": False}, "diff_use_norm"),
    ({"diff_fixed_lambda": 0.5}, "diff_fixed_lambda"),
  ):
    model = DecoderLM(cfg.replace(**change), rngs=nnx.Rngs(0))
    with pytest.raises(ConversionError, match=named):
      save_hf(model, str(tmp_path / "out"))
  # A PolyNorm model of another arm has no Motif or transformers class.
  other = DecoderLM(ModelConfig(**{**_small(), "mlp_activation": "polynorm"}), rngs=nnx.Rngs(0))
  with pytest.raises(ConversionError, match="polynorm"):
    save_hf(other, str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out")


def _small() -> dict:
  return dict(
    attention="diff_v1",
    vocab_size=61,
    d_model=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=48,
  )


def test_a_swiglu_export_refuses_apolynorm_mlp(tmp_path):
  model = DecoderLM(ModelConfig(**{**_small(), "mlp_activation": "polynorm"}), rngs=nnx.Rngs(0))
  with pytest.raises(ConversionError, match="polynorm"):
    save_hf(model, str(tmp_path / "out"))


# ----------------------------------------------------------------------- command, refusals


@needs_gda
def test_cli_import_writes_a_workdir_that_export_turns_back_into_the_checkpoint(
  checkpoints, tmp_path, capsys
):
  from diffjax.train import load_model  # pylint: disable=import-outside-toplevel

  path, hf, tensors = checkpoints["grouped"]
  run, out = str(tmp_path / "run"), str(tmp_path / "out")
  assert cli_main(["import", f"--hf={path}", f"--workdir={run}"]) == 0
  printed = capsys.readouterr().out
  assert "gda_v1" in printed
  model, cfg, step = load_model(run)
  assert step == 0 and cfg == motif.model_config_from_hf(hf)
  assert cli_main(["export", f"--workdir={run}", f"--hf={out}"]) == 0
  exported = read_tensors(out)
  for n, value in tensors.items():
    np.testing.assert_array_equal(exported[n], value, err_msg=n)
  with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
    written = json.load(f)
  # The token ids and max_position_embeddings kept from the source come back.
  assert (written["bos_token_id"], written["eos_token_id"]) == (1, 2)
  assert written["max_position_embeddings"] == hf["max_position_embeddings"]


@pytest.mark.parametrize(
  "changes,named",
  [
    ({"use_sliding_window": True, "sliding_window": 16}, "sliding_window=16"),
    ({"use_sliding_window": None, "sliding_window": 16}, "sliding_window=16"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"attention_bias": True}, "attention_bias"),
    ({"use_bias": True}, "use_bias"),
    ({"hidden_act": "silu"}, "hidden_act"),
    ({"k_ratio": 2}, "k_ratio"),
    ({"num_key_value_heads": 3, "num_attention_heads": 6}, "num_key_value_heads=3"),
    ({"num_noise_heads": 3}, "num_noise_heads=3"),
    ({"num_noise_heads": 1}, "num_noise_heads=1"),  # 2 kv groups, one noise head
    ({"quantization_config": {"bits": 4}}, "quantization_config"),
    ({"intermediate_size": 44}, "mlp.gate_proj.weight"),  # the tensors no longer fit
  ],
)
def test_unsupported_motif_configs_are_one_error_line_naming_the_field(
  changes, named, checkpoints, tmp_path, capsys
):
  path, hf, tensors = checkpoints["grouped"]
  src = write_motif(str(tmp_path / "src"), {**hf, **changes}, tensors, shards=1)
  run = str(tmp_path / "run")
  if changes == {"intermediate_size": 44} and "gda_v1" not in arms.names():
    pytest.skip("the gda_v1 arm is not in this tree yet")
  assert cli_main(["import", f"--hf={src}", f"--workdir={run}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and named in err[0], err
  assert not os.path.exists(run)


# --------------------------------------------------------------------------- training


@needs_gda
@pytest.mark.slow  # one training run (about 30 s on 2 cores, mostly compiling)
def test_train_py_continues_an_imported_motif_checkpoint(tmp_path, capsys):
  from diffjax.model.matching import resolve_model  # pylint: disable=import-outside-toplevel
  from diffjax.presets import base_config  # pylint: disable=import-outside-toplevel
  from diffjax.train import load_model  # pylint: disable=import-outside-toplevel
  from diffjax.train.trainer import train_and_evaluate  # pylint: disable=import-outside-toplevel

  hf = {**GROUPED, "vocab_size": 258, "num_hidden_layers": 2}  # the byte tokenizer's vocabulary
  src = write_motif(str(tmp_path / "src"), hf, motif_tensors(hf, 5))
  run = str(tmp_path / "imported")
  assert cli_main(["import", f"--hf={src}", f"--workdir={run}"]) == 0
  printed = capsys.readouterr().out
  imported, cfg, _ = load_model(run)
  assert motif.train_flags(cfg) in printed
  c = base_config()
  for key, value in motif.train_overrides(cfg).items():
    if key.startswith("unmatched."):
      c.model.unmatched[key.split(".", 1)[1]] = value
    else:
      c.model[key] = value
  assert resolve_model(c.model.to_dict()).config == cfg  # the flags rebuild the imported model
  c.seq_len, c.global_batch_size, c.num_steps = 16, 2, 2
  c.log_every, c.eval_every, c.eval_batches, c.tensorboard = 1, 0, 1, False
  c.data.max_documents = 20
  c.checkpoint.update(dict(every=2, keep=1, async_save=False, init_from=run))
  c.mesh.num_devices = 1
  out = str(tmp_path / "continued")
  result = train_and_evaluate(c, out)
  assert f"Initialised the parameters from step 0 of {run}" in capsys.readouterr().out
  assert result["step"] == 2
  trained, _, _ = load_model(out)
  before, after = model_params(imported), model_params(trained)
  assert jax.tree.structure(before) == jax.tree.structure(after)
  # Training moved the attention and PolyNorm's own parameters too.
  for name in ("q", "lambda_q1", "norm_scale"):
    assert not np.array_equal(before["blocks"][0]["attn"][name], after["blocks"][0]["attn"][name])
  assert not np.array_equal(
    before["blocks"][0]["mlp"]["poly_weight"], after["blocks"][0]["mlp"]["poly_weight"]
  )
