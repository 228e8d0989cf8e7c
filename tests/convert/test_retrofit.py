"""Retrofitting a Transformer into DIFF V2 (the source's function at step 0) and DIFF V1.

Sources: a diffjax Transformer with grouped-query attention, unrolled and scanned, and the HF
Llama fixture (4 heads over 2 kv heads, whose logits transformers computed). The V2 model's
logits must equal the source's; its pair's query gradients are the same up to the factor
-sigma(lambda) = -0.5, so training separates the two heads; the V1 start has lambda = 0 in
every layer.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import FIXTURES, read_metrics, tiny_config
from kernel_checks import rel_err

from diffjax.convert import ConversionError, build_model, load_hf, model_params, retrofit_params
from diffjax.convert.command import main as cli_main
from diffjax.model import DecoderLM, ModelConfig, matched_configs
from diffjax.train import load_model

LLAMA = os.path.join(FIXTURES, "hf", "llama")


def _source(scan_layers=False, seed=0) -> DecoderLM:
  cfg = ModelConfig(
    attention="transformer",
    d_model=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=64,
    vocab_size=61,
    scan_layers=scan_layers,
  )
  return DecoderLM(cfg, rngs=nnx.Rngs(params=seed))


def _tokens(vocab, b=2, t=19, seed=1):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, t)), jnp.int32)


def _retrofitted(source: DecoderLM, arm: str, **kw) -> DecoderLM:
  cfg, params = retrofit_params(source.config, model_params(source), arm, **kw)
  if cfg.scan_layers:
    from diffjax.model import layout  # pylint: disable=import-outside-toplevel

    params = layout.convert_layout(params, layout.SCANNED, cfg.num_layers)
  return build_model(cfg, params)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_v2_retrofit_of_a_diffjax_transformer_gives_its_logits(scan_layers):
  source = _source(scan_layers)
  v2 = _retrofitted(source, "diff_v2", init="exact")
  assert v2.config.attention == "diff_v2" and v2.config.num_heads == 4
  assert v2.config.num_kv_heads == 2 and v2.config.mlp_dim == 64
  # The shape train.py builds for model.arm=diff_v2 with v2_match=heads.
  assert v2.config == matched_configs(source.config, v2_match="heads")["diff_v2"]
  x = _tokens(61)
  want, got = source(x), v2(x)
  assert rel_err(got, want) <= 1e-5, rel_err(got, want)


def test_v2_retrofit_of_the_hf_llama_fixture_gives_transformers_logits():
  source = load_hf(LLAMA)
  v2 = _retrofitted(source, "diff_v2", init="exact")
  ids = jnp.asarray(np.load(os.path.join(LLAMA, "input_ids.npy")), jnp.int32)
  hf_logits = np.load(os.path.join(LLAMA, "logits.npy"))
  assert rel_err(v2(ids), source(ids)) <= 1e-5
  assert rel_err(v2(ids), hf_logits) <= 1e-4  # transformers' own float32 logits


def test_v2_pair_gradients_differ_by_minus_sigma_so_training_separates_the_heads():
  v2 = _retrofitted(_source(), "diff_v2", init="exact")
  graphdef, params = nnx.split(v2)
  x = _tokens(61, seed=3)

  def loss(p):
    logits = nnx.merge(graphdef, p)(x[:, :-1])
    return -jnp.mean(
      jax.nn.log_softmax(logits)[..., :, :][jnp.arange(2)[:, None], jnp.arange(18)[None], x[:, 1:]]
    )

  grads = nnx.to_pure_dict(jax.jit(jax.grad(loss))(params))
  for i in range(3):
    g = np.asarray(grads["blocks"][i]["attn"]["q"])  # [E, H, 2, D]
    assert np.max(np.abs(g[:, :, 0])) > 0
    # The second head's map enters with -sigma(lambda) = -0.5.
    np.testing.assert_allclose(
      g[:, :, 1], -0.5 * g[:, :, 0], rtol=1e-4, atol=1e-6 * np.max(np.abs(g))
    )
    # W_lambda = 0 has a gradient too: lambda moves off 0.5 at once.
    assert np.max(np.abs(np.asarray(grads["blocks"][i]["attn"]["w_lambda"]))) > 0


@pytest.mark.parametrize("second,scan_layers", [("copy", False), ("noise", False), ("zeros", True)])
def test_mixed_in_v2_is_the_source_at_step_0_and_plain_v2_after_the_ramp(second, scan_layers):
  source = _source(scan_layers)
  v2 = _retrofitted(source, "diff_v2", init="mixed", second=second, mix_steps=10, seed=4)
  assert v2.config.v2_mix_steps == 10
  x = _tokens(61)
  at0 = v2(x, v2_mix=v2.config.v2_mix(0))
  assert rel_err(at0, source(x)) <= 1e-5, rel_err(at0, source(x))
  q = np.asarray(model_params(v2)["blocks"][1]["attn"]["q"])
  src_q = np.asarray(model_params(source)["blocks"][1]["attn"]["q"])
  np.testing.assert_array_equal(q[:, :, 0], src_q)
  if second == "copy":
    np.testing.assert_array_equal(q[:, :, 1], src_q)
  elif second == "zeros":
    np.testing.assert_array_equal(q[:, :, 1], 0.0)
  else:
    assert 0 < np.std(q[:, :, 1]) < 0.05 * np.std(src_q)
  # Mid-ramp the subtraction is partly in: neither the source nor plain V2.
  mid = v2(x, v2_mix=v2.config.v2_mix(5))
  assert rel_err(mid, source(x)) > 1e-4
  # From step 10 on (and without a step, outside the trainer) it is the plain V2 module with
  # these weights, bitwise.
  params = model_params(v2)
  if scan_layers:
    from diffjax.model import layout  # pylint: disable=import-outside-toplevel

    params = layout.convert_layout(params, layout.SCANNED, v2.config.num_layers)
  plain = build_model(v2.config.replace(v2_mix_steps=0), params)
  for step in (10, 11, 10_000):
    np.testing.assert_array_equal(
      np.asarray(v2(x, v2_mix=v2.config.v2_mix(step))), np.asarray(plain(x))
    )
  np.testing.assert_array_equal(np.asarray(v2(x)), np.asarray(plain(x)))


def test_mixed_in_v2_of_the_hf_llama_fixture_gives_transformers_logits():
  source = load_hf(LLAMA)
  v2 = _retrofitted(source, "diff_v2", init="mixed", second="zeros", mix_steps=5)
  ids = jnp.asarray(np.load(os.path.join(LLAMA, "input_ids.npy")), jnp.int32)
  assert rel_err(v2(ids, v2_mix=v2.config.v2_mix(0)), source(ids)) <= 1e-5


def test_bad_mixed_in_settings_are_named():
  source = _source()
  for kw, needle in (
    (dict(init="mixed", mix_steps=0), "mix_steps >= 1"),
    (dict(init="warm"), "init='warm'"),
    (dict(init="mixed", second="random", mix_steps=3), "second='random'"),
  ):
    with pytest.raises(ConversionError, match=needle):
      retrofit_params(source.config, model_params(source), "diff_v2", **kw)
  # DIFF V1 has one start: the V2 options are refused by name.
  with pytest.raises(ConversionError, match="init='mixed': the diff_v1 retrofit takes no options"):
    retrofit_params(source.config, model_params(source), "diff_v1", init="mixed", mix_steps=3)
  # The default V2 start is mixed in: small noise, a 100-step ramp.
  cfg, params = retrofit_params(source.config, model_params(source), "diff_v2")
  assert cfg.v2_mix_steps == 100
  q = np.asarray(params["blocks"][0]["attn"]["q"])
  assert 0 < np.std(q[:, :, 1]) < 0.05 * np.std(q[:, :, 0])
  with pytest.raises(ValueError, match="v2_mix_steps=-1"):
    source.config.replace(attention="diff_v2", v2_mix_steps=-1)


@pytest.mark.slow  # five training runs; resume itself is checked by tests/train
def test_a_resume_mid_ramp_gives_the_uninterrupted_losses(tmp_path, trained_run):
  """The ramp is applied by step in the train step; a run stopped mid-ramp and resumed trains
  the uninterrupted run's losses bitwise."""
  from diffjax.train.trainer import train_and_evaluate  # pylint: disable=import-outside-toplevel

  source = trained_run("transformer", steps=3)
  retro = str(tmp_path / "retro")
  assert (
    cli_main(
      [
        "retrofit",
        f"--source={source}",
        f"--workdir={retro}",
        "--init=mixed",
        "--second=noise",
        "--mix_steps=6",
      ]
    )
    == 0
  )

  def cont(steps):
    c = tiny_config(arm="diff_v2", steps=steps)
    c.model.v2_match, c.model.v2_mix_steps = "heads", 6
    c.checkpoint.init_from = retro
    c.checkpoint.every = 3
    c.optim.decay_steps = 8  # one schedule for both runs
    return c

  wrong = cont(2)
  wrong.model.v2_mix_steps = 0
  from diffjax.train.integrity import CheckpointError  # pylint: disable=import-outside-toplevel

  with pytest.raises(CheckpointError, match="--config.model.v2_mix_steps=6"):
    train_and_evaluate(wrong, str(tmp_path / "wrong"))
  whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
  train_and_evaluate(cont(8), whole)
  train_and_evaluate(cont(3), split)  # stops at step 3, mid-ramp
  train_and_evaluate(cont(8), split)  # resumes from it
  a, b = read_metrics(whole), read_metrics(split)
  assert sorted(a) == sorted(b) == list(range(1, 9))
  for step in a:
    assert a[step]["train/loss"] == b[step]["train/loss"], step
  # The ramp changed the function: step 1 is the source's loss on its batch, later steps not.
  assert a[1]["train/loss"] != a[8]["train/loss"]


def test_v1_start_has_lambda_zero_and_the_source_layout():
  source = _source()
  v1 = _retrofitted(source, "diff_v1")
  assert (v1.config.num_heads, v1.config.num_kv_heads) == (2, 1)
  summary = v1.lambda_summary(_tokens(61))
  lams = [float(v) for k, v in summary.items() if k.startswith("lambda/")]
  assert len(lams) == 3 and max(abs(l) for l in lams) <= 1e-6, summary
  src = model_params(source)["blocks"][1]["attn"]
  got = model_params(v1)["blocks"][1]["attn"]
  np.testing.assert_array_equal(got["q"][:, :, 0], src["q"][:, 0::2])
  np.testing.assert_array_equal(got["q"][:, :, 1], 0.0)
  np.testing.assert_array_equal(got["v"][..., :8], src["v"][:, 0::2])
  np.testing.assert_array_equal(got["o"][:, 8:], src["o"][1::2])
  logits = v1(_tokens(61))
  assert np.all(np.isfinite(np.asarray(logits)))


def test_sources_that_cannot_be_retrofitted_are_named():
  v1 = DecoderLM(
    ModelConfig(
      attention="diff_v1",
      d_model=32,
      num_layers=1,
      num_heads=2,
      num_kv_heads=1,
      head_dim=8,
      mlp_dim=64,
      vocab_size=61,
    ),
    rngs=nnx.Rngs(0),
  )
  with pytest.raises(ConversionError, match="attention='diff_v1'"):
    retrofit_params(v1.config, model_params(v1), "diff_v2")
  odd = DecoderLM(
    ModelConfig(
      attention="transformer",
      d_model=24,
      num_layers=1,
      num_heads=3,
      num_kv_heads=3,
      head_dim=8,
      mlp_dim=64,
      vocab_size=61,
    ),
    rngs=nnx.Rngs(0),
  )
  with pytest.raises(ConversionError, match="num_heads=3, num_kv_heads=3"):
    retrofit_params(odd.config, model_params(odd), "diff_v1")
  retrofit_params(odd.config, model_params(odd), "diff_v2")  # any head count pairs in V2


@pytest.mark.integration  # the whole command
def test_the_command_retrofits_a_workdir_with_one_error_line_for_bad_input(tmp_path, capsys):
  from diffjax.convert.api import write_workdir  # pylint: disable=import-outside-toplevel

  source = str(tmp_path / "transformer")
  write_workdir(source, _source(), {})  # a Transformer run's workdir at step 0
  retro = str(tmp_path / "retro")
  assert cli_main(["retrofit", f"--source={source}", f"--workdir={retro}"]) == 0
  out = capsys.readouterr().out
  assert "--config.checkpoint.init_from=" in out and "--config.model.v2_mix_steps=100" in out
  src_model, _, _ = load_model(source)
  v2_model, cfg, step = load_model(retro)
  assert step == 0 and cfg.attention == "diff_v2"
  x = _tokens(cfg.vocab_size, t=32)
  # The default start is mixed in: the source's function at the ramp's step 0.
  assert cfg.v2_mix_steps == 100
  assert rel_err(v2_model(x, v2_mix=cfg.v2_mix(0)), src_model(x)) <= 1e-5
  # Loaded, it computes what the trainer computes at its step (evaluation, generation).
  assert v2_model.v2_mix_at == 0.0 and rel_err(v2_model(x), src_model(x)) <= 1e-5
  assert rel_err(v2_model(x, v2_mix=1.0), src_model(x)) > 1e-3
  # The same input again refuses to overwrite; a DIFF source is named; nothing is written.
  assert cli_main(["retrofit", f"--source={source}", f"--workdir={retro}"]) == 2
  assert "already holds checkpoints" in capsys.readouterr().err
  assert cli_main(["retrofit", f"--source={retro}", f"--workdir={tmp_path / 'x'}"]) == 2
  assert "attention='diff_v2'" in capsys.readouterr().err
  assert cli_main(["retrofit", f"--source={tmp_path / 'none'}", f"--workdir={tmp_path / 'y'}"]) == 2
  assert "is not a directory" in capsys.readouterr().err
  assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")


@pytest.mark.integration  # the whole command
def test_the_export_of_a_retrofit_carries_what_the_sources_export_carries(tmp_path, capsys):
  from diffjax.convert.api import write_workdir  # pylint: disable=import-outside-toplevel

  # A byte-token train.py run (its run config as train.py saves it) trained at 24 tokens.
  cfg = _source().config.replace(vocab_size=258, num_layers=1)
  source = str(tmp_path / "transformer")
  run_config = {"seq_len": 24, "data": {"tokenizer": "byte"}}
  write_workdir(source, DecoderLM(cfg, rngs=nnx.Rngs(0)), {"config": run_config})
  retro = str(tmp_path / "retro")
  assert cli_main(["retrofit", f"--source={source}", f"--workdir={retro}", "--init=exact"]) == 0
  shutil.rmtree(source)  # what the export needs was recorded by the retrofit
  out = tmp_path / "hf"
  assert cli_main(["export", f"--workdir={retro}", f"--hf={out}"]) == 0
  written = json.loads((out / "config.json").read_text())
  assert (written["eos_token_id"], written["pad_token_id"]) == (256, 257)
  assert written["max_position_embeddings"] == 24
  assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(
    os.listdir(out)
  )
  # From an HF directory: its ids, context and tokenizer files, as an import's export has them.
  hf_source = tmp_path / "llama"
  shutil.copytree(LLAMA, hf_source)
  config = json.loads((hf_source / "config.json").read_text())
  config.update(eos_token_id=2, pad_token_id=3, max_position_embeddings=64)
  (hf_source / "config.json").write_text(json.dumps(config))
  retro_hf = str(tmp_path / "retro_hf")
  argv = ["retrofit", f"--source={hf_source}", f"--workdir={retro_hf}", "--init=exact"]
  assert cli_main(argv) == 0
  capsys.readouterr()
  out = tmp_path / "hf2"
  assert cli_main(["export", f"--workdir={retro_hf}", f"--hf={out}"]) == 0
  written = json.loads((out / "config.json").read_text())
  assert (written["eos_token_id"], written["pad_token_id"]) == (2, 3)
  assert written["max_position_embeddings"] == 64
  assert (out / "generation_config.json").read_text() == (
    hf_source / "generation_config.json"
  ).read_text()


@pytest.mark.integration  # the whole command
def test_the_command_refuses_in_one_line_what_it_would_ignore_or_overwrite(tmp_path, capsys):
  from diffjax.convert.api import write_workdir  # pylint: disable=import-outside-toplevel

  source = str(tmp_path / "transformer")
  write_workdir(source, _source(), {})
  busy = tmp_path / "busy"
  busy.mkdir()
  (busy / "notes.txt").write_text("mine")
  refused = [
    ([f"--source={source}", f"--workdir={source}"], "is the source directory"),
    ([f"--source={LLAMA}", f"--workdir={LLAMA}"], "is the source directory"),
    ([f"--source={LLAMA}", f"--workdir={LLAMA}/retro"], "inside the source"),
    ([f"--source={source}", f"--workdir={busy}"], "is not empty (it holds notes.txt)"),
    ([f"--source={LLAMA}", f"--workdir={tmp_path / 'a'}", "--step=3"], "leave --step out"),
    (
      [f"--source={source}", f"--workdir={tmp_path / 'b'}", "--init=exact", "--second=copy"],
      "second='copy' applies to init='mixed' only",
    ),
    (
      [f"--source={source}", f"--workdir={tmp_path / 'c'}", "--init=exact", "--mix_steps=5"],
      "leave --mix_steps out or use --init=mixed",
    ),
    (
      [f"--source={source}", f"--workdir={tmp_path / 'd'}", "--arm=diff_v1", "--second=copy"],
      "the diff_v1 retrofit takes no options",
    ),
  ]
  for args, said in refused:
    assert cli_main(["retrofit", *args]) == 2, args
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and said in err[0], (args, err)
  assert sorted(os.listdir(tmp_path)) == ["busy", "transformer"]
  assert os.listdir(busy) == ["notes.txt"] and not os.path.exists(os.path.join(LLAMA, "retro"))

  # A retrofit stopped while writing leaves its partial copy beside the workdir (never the
  # workdir itself): the next attempt clears it and writes the whole workdir.
  partial = tmp_path / ".retro.retrofit-partial"
  (partial / "checkpoints" / "0.orbax-checkpoint-tmp-1").mkdir(parents=True)
  retro = tmp_path / "retro"
  assert cli_main(["retrofit", f"--source={source}", f"--workdir={retro}"]) == 0
  assert not partial.exists() and sorted(os.listdir(retro)) == ["checkpoints", "model_config.json"]
  assert load_model(str(retro))[2] == 0


@pytest.mark.slow  # two training runs; the retrofit itself is checked above
def test_train_py_continues_a_retrofitted_run(tmp_path, trained_run):
  from diffjax.train.trainer import train_and_evaluate  # pylint: disable=import-outside-toplevel

  source = trained_run("transformer", steps=3)
  retro = str(tmp_path / "retro")
  assert cli_main(["retrofit", f"--source={source}", f"--workdir={retro}"]) == 0
  c = tiny_config(arm="diff_v2", steps=2)
  c.model.v2_match, c.model.v2_mix_steps = "heads", 100  # the default start's ramp
  c.checkpoint.init_from = retro
  cont = str(tmp_path / "continued")
  train_and_evaluate(c, cont)
  rows = read_metrics(cont)
  assert sorted(rows) == [1, 2] and np.isfinite(rows[2]["train/loss"])
