"""Exports with the project's own transformers code (``trust_remote_code=True``): DIFF V2
always, the Transformer and DIFF V1 with ``remote_code=True``.

Without torch: the export carries the code files and an ``auto_map``, imports back to the same
function, and refuses a model inside its retrofit ramp. With torch and transformers (the
``bench-torch`` extra; ``slow``): transformers loads the export from its directory, offline,
and gives diffjax's logits and greedy tokens, through the eager and sdpa attention functions.
"""

from __future__ import annotations

import filecmp
import json
import os
import tempfile

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax.convert
from diffjax.convert import ConversionError, load_hf, save_hf
from diffjax.generation import generate
from diffjax.model import DecoderLM, ModelConfig

HF_CODE = os.path.join(os.path.dirname(diffjax.convert.__file__), "hf_code")
CODE_FILES = ("configuration_diffjax_v2.py", "modeling_diffjax_v2.py")
IDS = np.array([[5, 17, 3, 250, 9, 9, 42, 1, 77, 120, 8, 64, 2]], np.int32)


def _v2(pairing: str = "group", lambda_fn: str = "sigmoid", seed: int = 0) -> DecoderLM:
  cfg = ModelConfig(
    attention="diff_v2",
    vocab_size=258,
    d_model=48,
    num_layers=2,
    num_heads=3,
    num_kv_heads=3 if pairing == "across_groups" else 1,
    head_dim=16,
    mlp_dim=80,
    v2_pairing=pairing,
    v2_lambda=lambda_fn,
  )
  model = DecoderLM(cfg, rngs=nnx.Rngs(params=seed))
  # Larger lambda projections than the init's, so the subtraction moves the logits.
  for block in model.blocks:
    block.attn.w_lambda[...] = 4 * block.attn.w_lambda[...]
  return model


def _other(arm: str, seed: int = 0) -> DecoderLM:
  """A Transformer or DIFF V1 model with grouped kv heads."""
  cfg = ModelConfig(
    attention=arm,
    vocab_size=258,
    d_model=48,
    num_layers=3,
    num_heads=4 if arm == "transformer" else 2,
    num_kv_heads=2 if arm == "transformer" else 1,
    head_dim=12 if arm == "transformer" else 8,
    mlp_dim=80,
  )
  return DecoderLM(cfg, rngs=nnx.Rngs(params=seed))


SELF_CONTAINED = {
  "transformer": (
    "DiffjaxTransformerForCausalLM",
    "diffjax_transformer",
    "DiffjaxTransformerModel",
  ),
  "diff_v1": ("DiffjaxV1ForCausalLM", "diffjax_v1", "DiffjaxV1Model"),
}


def _logits(model: DecoderLM, ids=IDS) -> np.ndarray:
  return np.asarray(model(jnp.asarray(ids)), np.float64)


@pytest.mark.parametrize("pairing,lambda_fn", [("group", "sigmoid"), ("across_groups", "identity")])
def test_a_v2_export_carries_its_code_and_imports_back_to_the_same_function(
  pairing, lambda_fn, tmp_path
):
  model = _v2(pairing, lambda_fn)
  names = save_hf(model, str(tmp_path / "hf"))
  for name in CODE_FILES:
    assert name in names and filecmp.cmp(tmp_path / "hf" / name, os.path.join(HF_CODE, name))
  hf = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert hf["architectures"] == ["DiffjaxV2ForCausalLM"] and hf["model_type"] == "diffjax_v2"
  assert hf["auto_map"]["AutoModelForCausalLM"] == "modeling_diffjax_v2.DiffjaxV2ForCausalLM"
  assert (hf["num_attention_heads"], hf["v2_pairing"], hf["v2_lambda"]) == (6, pairing, lambda_fn)
  back = load_hf(str(tmp_path / "hf"))
  assert back.config.attention == "diff_v2" and back.config.rope_style == "half"
  assert (back.config.v2_pairing, back.config.v2_lambda) == (pairing, lambda_fn)
  want = _logits(model)
  np.testing.assert_allclose(_logits(back), want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("arm", ["transformer", "diff_v1"])
def test_remote_code_exports_the_transformer_and_v1_with_the_projects_code(arm, tmp_path):
  model = _other(arm)
  names = save_hf(model, str(tmp_path / "hf"), remote_code=True)
  for name in ("configuration_diffjax.py", "modeling_diffjax.py"):
    assert name in names and filecmp.cmp(tmp_path / "hf" / name, os.path.join(HF_CODE, name))
  cls, model_type, base = SELF_CONTAINED[arm]
  hf = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert hf["architectures"] == [cls] and hf["model_type"] == model_type
  assert hf["auto_map"]["AutoModelForCausalLM"] == f"modeling_diffjax.{cls}"
  assert hf["auto_map"]["AutoModel"] == f"modeling_diffjax.{base}"
  # The same tensors as the export to transformers' own class.
  plain = save_hf(model, str(tmp_path / "plain"))
  assert "modeling_diffjax.py" not in plain
  for name in ("model.safetensors",):
    assert filecmp.cmp(tmp_path / "hf" / name, tmp_path / "plain" / name, shallow=False)
  back = load_hf(str(tmp_path / "hf"))
  assert back.config.attention == arm
  want = _logits(model)
  np.testing.assert_allclose(_logits(back), want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_a_model_inside_its_retrofit_ramp_is_refused_and_nothing_is_written(tmp_path):
  model = _v2()
  model.v2_mix_at = 0.25
  with pytest.raises(ConversionError, match="inside its retrofit ramp"):
    save_hf(model, str(tmp_path / "hf"))
  assert not os.path.exists(tmp_path / "hf")


# --------------------------------------------------------- transformers on the export

# transformers copies remote code into its modules cache; keep it out of the user's home.
os.environ.setdefault(
  "HF_MODULES_CACHE", os.path.join(tempfile.gettempdir(), f"diffjax-tests-hf-modules-{os.getuid()}")
)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _transformers():
  torch = pytest.importorskip("torch", reason="needs torch (its CPU build)")
  transformers = pytest.importorskip("transformers", reason="needs transformers")
  return torch, transformers


@pytest.mark.slow
@pytest.mark.parametrize("pairing", ["group", "across_groups"])
def test_transformers_loads_the_export_with_diffjax_logits_and_greedy_tokens(pairing, tmp_path):
  torch, transformers = _transformers()
  model = _v2(pairing)
  save_hf(model, str(tmp_path / "hf"))
  want = _logits(model)
  greedy = generate(model, [IDS[0, :5].tolist()], max_new_tokens=8).tokens[0]
  for impl in ("eager", "sdpa"):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "hf"), trust_remote_code=True, attn_implementation=impl
    ).eval()
    assert type(hf).__name__ == "DiffjaxV2ForCausalLM" and hf.config._attn_implementation == impl
    assert hf.config.base_model_tp_plan is None  # a head pair is not split by Llama's plan
    with torch.no_grad():
      got = hf(torch.tensor(IDS, dtype=torch.long)).logits.double().numpy()
      err = np.abs(got - want).max() / np.abs(want).max()
      assert err <= 1e-4, f"{impl}: relative max |transformers - diffjax| = {err:.2e}"
      out = hf.generate(
        torch.tensor(IDS[:, :5], dtype=torch.long),
        max_new_tokens=8,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
      )
    assert out[0, 5:].tolist() == list(greedy), impl
  # What vLLM's Transformers backend reads: AutoModel in the auto_map gives the base model,
  # which declares that its attention goes through the registry.
  base = transformers.AutoModel.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)
  assert type(base).__name__ == "DiffjaxV2Model" and base._supports_attention_backend


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["transformer", "diff_v1"])
def test_transformers_runs_the_projects_transformer_and_v1_code_as_diffjax(arm, tmp_path):
  torch, transformers = _transformers()
  model = _other(arm)
  save_hf(model, str(tmp_path / "hf"), remote_code=True)
  save_hf(model, str(tmp_path / "plain"))
  want = _logits(model)
  greedy = generate(model, [IDS[0, :5].tolist()], max_new_tokens=8).tokens[0]
  cls, _, base_cls = SELF_CONTAINED[arm]
  ids = torch.tensor(IDS, dtype=torch.long)
  for impl in ("eager", "sdpa"):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "hf"), trust_remote_code=True, attn_implementation=impl
    ).eval()
    assert type(hf).__name__ == cls and hf.config._attn_implementation == impl
    assert (hf.config.base_model_tp_plan is None) == (arm == "diff_v1")
    with torch.no_grad():
      got = hf(ids).logits.double().numpy()
      err = np.abs(got - want).max() / np.abs(want).max()
      assert err <= 1e-4, f"{impl}: relative max |transformers - diffjax| = {err:.2e}"
      out = hf.generate(
        ids[:, :5], max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0
      )
    assert out[0, 5:].tolist() == list(greedy), impl
  # transformers' own class on the plain export computes the same function.
  plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "plain")).eval()
  with torch.no_grad():
    theirs = plain(ids).logits.double().numpy()
  assert np.abs(theirs - want).max() / np.abs(want).max() <= 1e-4
  base = transformers.AutoModel.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)
  assert type(base).__name__ == base_cls and base._supports_attention_backend


@pytest.mark.slow
@pytest.mark.parametrize(
  "arm, flags",
  [("diff_v2", []), ("diff_v1", ["--remote_code"]), ("transformer", ["--remote_code"])],
)
def test_a_trained_run_exported_by_the_command_loads_in_transformers(
  arm, flags, trained_run, tmp_path
):
  torch, transformers = _transformers()
  from diffjax.convert.command import main as convert_main  # pylint: disable=import-outside-toplevel
  from diffjax.train import load_model  # pylint: disable=import-outside-toplevel

  workdir = trained_run(arm, small=True)
  assert convert_main(["export", f"--workdir={workdir}", f"--hf={tmp_path / 'hf'}", *flags]) == 0
  model, _, _ = load_model(workdir)
  ids = IDS % model.config.vocab_size
  want = _logits(model, ids)
  hf = transformers.AutoModelForCausalLM.from_pretrained(
    str(tmp_path / "hf"), trust_remote_code=True
  ).eval()
  assert type(hf).__name__.startswith("Diffjax"), type(hf)  # the project's code, not transformers'
  with torch.no_grad():
    got = hf(torch.tensor(ids, dtype=torch.long)).logits.double().numpy()
  assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4
  greedy = generate(model, [ids[0, :5].tolist()], max_new_tokens=6).tokens[0]
  with torch.no_grad():
    out = hf.generate(
      torch.tensor(ids[:, :5], dtype=torch.long), max_new_tokens=6, do_sample=False, pad_token_id=0
    )
  assert out[0, 5:].tolist() == list(greedy)
