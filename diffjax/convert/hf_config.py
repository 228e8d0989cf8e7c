"""Hugging Face ``config.json`` <-> :class:`~diffjax.model.ModelConfig`.

A field whose value diffjax does not model (a bias, another activation, a RoPE scaling type,
...) is refused naming it; fields that do not change the function are ignored. The mapping of
each field: docs/hf_conversion.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from diffjax import arms
from diffjax.convert.files import ConversionError
from diffjax.model import ModelConfig

LLAMA, DIFFLLAMA = "LlamaForCausalLM", "DiffLlamaForCausalLM"
# DIFF V2 has no transformers class: its exports carry the project's own code (hf_code/),
# which transformers loads with trust_remote_code=True.
DIFFJAX_V2 = "DiffjaxV2ForCausalLM"
# The Transformer and DIFF V1 exported with the project's code instead of transformers' classes
# (save_hf(remote_code=True)): the same tensors as the Llama and DiffLlama exports.
DIFFJAX_TRANSFORMER, DIFFJAX_V1 = "DiffjaxTransformerForCausalLM", "DiffjaxV1ForCausalLM"
SELF_CONTAINED = {LLAMA: DIFFJAX_TRANSFORMER, DIFFLLAMA: DIFFJAX_V1, DIFFJAX_V2: DIFFJAX_V2}
# The class whose config fields and tensors each class shares.
LAYOUT = {DIFFJAX_TRANSFORMER: LLAMA, DIFFJAX_V1: DIFFLLAMA}
MODEL_TYPE = {
  LLAMA: "llama",
  DIFFLLAMA: "diffllama",
  DIFFJAX_V2: "diffjax_v2",
  DIFFJAX_TRANSFORMER: "diffjax_transformer",
  DIFFJAX_V1: "diffjax_v1",
}


def _remote(files: str, config: str, model: str) -> tuple[tuple[str, str], dict[str, str]]:
  return (
    (f"configuration_{files}.py", f"modeling_{files}.py"),
    {
      "AutoConfig": f"configuration_{files}.{config}",
      "AutoModel": f"modeling_{files}.{model}Model",
      "AutoModelForCausalLM": f"modeling_{files}.{model}ForCausalLM",
    },
  )


# The code files an export of each such class carries, and its auto_map.
REMOTE_CODE = {
  DIFFJAX_V2: _remote("diffjax_v2", "DiffjaxV2Config", "DiffjaxV2"),
  DIFFJAX_TRANSFORMER: _remote("diffjax", "DiffjaxTransformerConfig", "DiffjaxTransformer"),
  DIFFJAX_V1: _remote("diffjax", "DiffjaxV1Config", "DiffjaxV1"),
}
# Settings that leave the parameters unchanged, which a caller may choose when importing.
RUNTIME_FIELDS = ("dtype", "param_dtype", "implementation", "block_sizes", "interpret", "remat")
DEFAULT_MAX_POSITIONS = 2048


def arm_of() -> dict[str, str]:
  """transformers class -> the arm it holds, for every registered arm that has one (its
  transformers class and its class with the project's code). Where several arms name one class,
  the first in :func:`diffjax.arms.names` order holds it: a built-in arm keeps its own class."""
  out: dict[str, str] = {}
  for a in arms.all_arms():
    if a.hf_architecture in MODEL_TYPE:
      out.setdefault(a.hf_architecture, a.name)
      out.setdefault(SELF_CONTAINED[a.hf_architecture], a.name)
  return out


def architecture_of(cfg: ModelConfig) -> str:
  """The transformers class of ``cfg``'s arm; raises for an arm that has none."""
  arch = arms.get(cfg.attention).hf_architecture
  if arch not in MODEL_TYPE:
    raise ConversionError(
      f"attention={cfg.attention!r} has no transformers class; export supports "
      f"{sorted(set(arm_of().values()))}."
    )
  return arch


def architecture(hf: Mapping[str, Any]) -> str:
  """The transformers class named by ``architectures`` (or implied by ``model_type``)."""
  archs = hf.get("architectures")
  if archs is None:
    by_type = {t: a for a, t in MODEL_TYPE.items()}
    if hf.get("model_type") in by_type:
      return by_type[hf["model_type"]]
    archs = [hf.get("model_type")]
  if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in arm_of():
    raise ConversionError(
      f"config.json: architectures={archs!r} cannot be imported; diffjax reads "
      f"{sorted(arm_of())} (into attention={sorted(arm_of().values())}) and "
      "MotifForCausalLM (docs/motif.md)."
    )
  return archs[0]


def _positive_int(hf: Mapping[str, Any], key: str, default: Any = None) -> int:
  value = hf.get(key, default)
  if value is None:
    value = default
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ConversionError(f"config.json: {key}={value!r} must be a positive integer.")
  return value


def _positive_float(hf: Mapping[str, Any], key: str, default: float) -> float:
  value = hf.get(key, default)
  if (
    isinstance(value, bool)
    or not isinstance(value, (int, float))
    or not value > 0
    or not math.isfinite(value)
  ):
    raise ConversionError(f"config.json: {key}={value!r} must be a positive number.")
  return float(value)


def _refuse_true(hf: Mapping[str, Any], key: str, why: str) -> None:
  """A switch diffjax lacks must be off: false, absent or null (transformers reads null as off)."""
  value = hf.get(key)
  if value is not None and value is not False:
    raise ConversionError(f"config.json: {key}={value!r} cannot be imported exactly: {why}.")


def _rope_theta(hf: Mapping[str, Any]) -> float:
  """RoPE base of a default (unscaled, full-width) rotary embedding; anything else refused."""
  params = hf.get("rope_parameters")
  field = "rope_parameters"
  if params is None:
    params, field = hf.get("rope_scaling"), "rope_scaling"
  params = {} if params is None else params
  if not isinstance(params, dict):
    raise ConversionError(f"config.json: {field}={params!r} must be an object.")
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type != "default":
    raise ConversionError(
      f"config.json: {field}.rope_type={rope_type!r} cannot be imported "
      "exactly: diffjax implements only the default (unscaled) RoPE."
    )
  unknown = sorted(set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
  if unknown:
    raise ConversionError(
      f"config.json: {field}.{unknown[0]}={params[unknown[0]]!r} cannot be "
      "imported: diffjax implements only the default (unscaled) RoPE."
    )
  for key, value in (
    ("partial_rotary_factor", params.get("partial_rotary_factor")),
    ("partial_rotary_factor", hf.get("partial_rotary_factor")),
  ):
    if value is not None and value != 1.0:
      raise ConversionError(
        f"config.json: {key}={value!r} cannot be imported exactly: "
        "diffjax rotates the full head dimension."
      )
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  return _positive_float({"rope_theta": theta}, "rope_theta", 10000.0)


def _check_runtime(runtime: Mapping[str, Any]) -> None:
  """Refuses a runtime field that is not one of :data:`RUNTIME_FIELDS`."""
  bad = sorted(set(runtime) - set(RUNTIME_FIELDS))
  if bad:
    raise ConversionError(
      f"{bad[0]}= would change the imported parameters; only "
      f"{list(RUNTIME_FIELDS)} may be set when importing."
    )


def _require_sizes(hf: Mapping[str, Any], arch: str) -> None:
  """Refuses a config.json without one of the sizes every import reads."""
  for key in (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
  ):
    if key not in hf:
      raise ConversionError(f"config.json has no {key!r}, which {arch} needs.")


def _head_dim(hf: Mapping[str, Any], hidden: int, heads: int) -> int:
  """``head_dim``, or hidden_size / num_attention_heads where config.json gives none."""
  if hf.get("head_dim") is None and hidden % heads:
    raise ConversionError(
      f"config.json: hidden_size={hidden} is not a multiple of "
      f"num_attention_heads={heads} and no head_dim is given."
    )
  return _positive_int(hf, "head_dim", hidden // heads)


def _tie_embeddings(hf: Mapping[str, Any]) -> bool:
  tie = hf.get("tie_word_embeddings", False)
  if not isinstance(tie, bool):
    raise ConversionError(f"config.json: tie_word_embeddings={tie!r} must be true or false.")
  return tie


def _init_std(hf: Mapping[str, Any]) -> float:
  """``initializer_range`` (0.02 where absent or not a number)."""
  init_std = hf.get("initializer_range", 0.02)
  return float(init_std) if isinstance(init_std, (int, float)) else 0.02


def _refuse_quantized(hf: Mapping[str, Any]) -> None:
  if "quantization_config" in hf:
    raise ConversionError(
      "config.json: quantization_config is set; diffjax imports only unquantized float weights."
    )


def _refuse_dropout(hf: Mapping[str, Any]) -> None:
  dropout = hf.get("attention_dropout", 0.0)
  if dropout not in (0, 0.0, None):
    raise ConversionError(
      f"config.json: attention_dropout={dropout!r} cannot be imported "
      "exactly: diffjax has no attention dropout."
    )


def _attention_shape(hf: Mapping[str, Any], arch: str) -> tuple[int, int, int, int]:
  """(hidden size, attention heads, kv heads, head width) as config.json counts them."""
  _require_sizes(hf, arch)
  hidden = _positive_int(hf, "hidden_size")
  heads = _positive_int(hf, "num_attention_heads")
  kv_heads = _positive_int(hf, "num_key_value_heads", heads)
  head_dim = _head_dim(hf, hidden, heads)
  if heads % kv_heads:
    raise ConversionError(
      f"config.json: num_attention_heads={heads} is not a multiple of "
      f"num_key_value_heads={kv_heads}."
    )
  return hidden, heads, kv_heads, head_dim


def _refuse_unmodelled(hf: Mapping[str, Any], arch: str) -> None:
  """Refuses what diffjax does not model: quantized weights, another activation, biases,
  attention dropout."""
  _refuse_quantized(hf)
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ConversionError(
      f"config.json: hidden_act={act!r} cannot be imported exactly: "
      "diffjax's MLP is SwiGLU with silu."
    )
  _refuse_true(hf, "attention_bias", "diffjax's projections have no bias")
  if arch != DIFFLLAMA:
    _refuse_true(hf, "mlp_bias", "diffjax's MLP has no bias")
  _refuse_dropout(hf)


def model_config_from_hf(hf: Mapping[str, Any], **runtime: Any) -> ModelConfig:
  """The diffjax config of a ``LlamaForCausalLM`` or ``DiffLlamaForCausalLM`` config.json.

  ``runtime`` sets fields that leave the parameters unchanged (see :data:`RUNTIME_FIELDS`).
  Raises :class:`ConversionError` naming the first field that cannot be mapped exactly.
  """
  _check_runtime(runtime)
  arch = architecture(hf)
  arm = arm_of()[arch]
  arch = LAYOUT.get(arch, arch)
  hidden, heads, kv_heads, head_dim = _attention_shape(hf, arch)
  _refuse_unmodelled(hf, arch)
  eps = _positive_float(hf, "rms_norm_eps", 1e-6 if arch == LLAMA else 1e-5)
  tie = _tie_embeddings(hf)
  if arch == DIFFLLAMA:
    if heads % 2 or kv_heads % 2:
      raise ConversionError(
        f"config.json: num_attention_heads={heads} and num_key_value_heads={kv_heads} must "
        "be even: DiffLlama pairs component heads (i, i + n/2) into DIFF heads."
      )
    heads, kv_heads = heads // 2, kv_heads // 2
  if arch == DIFFJAX_V2:
    if heads % 2:
      raise ConversionError(
        f"config.json: num_attention_heads={heads} must be even: DIFF V2 pairs its query heads."
      )
    heads //= 2
  fields = dict(
    attention=arm,
    vocab_size=_positive_int(hf, "vocab_size"),
    d_model=hidden,
    num_layers=_positive_int(hf, "num_hidden_layers"),
    num_heads=heads,
    num_kv_heads=kv_heads,
    head_dim=head_dim,
    mlp_dim=_positive_int(hf, "intermediate_size"),
    rope_theta=_rope_theta(hf),
    rope_style="half",
    norm_eps=eps,
    diff_norm_eps=eps,
    tie_embeddings=tie,
    init_std=_init_std(hf),
  )
  if arch == DIFFJAX_V2:
    fields.update(
      v2_pairing=hf.get("v2_pairing", "group"), v2_lambda=hf.get("v2_lambda", "sigmoid")
    )
  try:
    return ModelConfig(**fields, **runtime)
  except ValueError as e:
    raise ConversionError(f"config.json maps to an invalid diffjax config: {e}") from e


def _check_token_id(key: str, value: Any, vocab_size: int) -> None:
  """Refuses a special-token id (or list of them, as eos_token_id may be) outside the vocabulary;
  ``pad_token_id=-1``, which some configs write for "no pad token", is kept as it is."""
  if value is None or (key == "pad_token_id" and value == -1):
    return
  for token in value if isinstance(value, list) else [value]:
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
      raise ConversionError(
        f"{key}={value!r} is not a token id of the model: ids run from 0 to "
        f"{vocab_size - 1} (vocab_size={vocab_size})."
      )


def _shared_hf_config(
  cfg: ModelConfig,
  bos_token_id: int | None,
  eos_token_id: int | None,
  pad_token_id: int | None,
  max_position_embeddings: int,
) -> dict[str, Any]:
  """The config.json keys that the Llama-style and the Motif exports write alike for ``cfg``;
  each exporter adds its own. Refuses a context or a token id no model of ``cfg`` can have."""
  if isinstance(max_position_embeddings, bool) or not isinstance(max_position_embeddings, int):
    raise ConversionError(
      f"max_position_embeddings={max_position_embeddings!r} must be an integer: the longest input."
    )
  if max_position_embeddings <= 0:
    raise ConversionError(
      f"max_position_embeddings={max_position_embeddings} must be positive: it is the longest "
      "input evaluators give the model (the context it trained at)."
    )
  for key, value in (
    ("bos_token_id", bos_token_id),
    ("eos_token_id", eos_token_id),
    ("pad_token_id", pad_token_id),
  ):
    _check_token_id(key, value, cfg.vocab_size)
  return {
    "attention_dropout": 0.0,
    "bos_token_id": bos_token_id,
    "eos_token_id": eos_token_id,
    "head_dim": cfg.head_dim,
    "hidden_size": cfg.d_model,
    "initializer_range": cfg.init_std,
    "intermediate_size": cfg.mlp_dim,
    "max_position_embeddings": max_position_embeddings,
    "num_hidden_layers": cfg.num_layers,
    "pad_token_id": pad_token_id,
    "rms_norm_eps": cfg.norm_eps,
    "rope_theta": float(cfg.rope_theta),
    "tie_word_embeddings": cfg.tie_embeddings,
    "use_cache": True,
    "vocab_size": cfg.vocab_size,
  }


def hf_config_from_model(
  cfg: ModelConfig,
  *,
  dtype: str = "float32",
  bos_token_id: int | None = None,
  eos_token_id: int | None = None,
  pad_token_id: int | None = None,
  max_position_embeddings: int = DEFAULT_MAX_POSITIONS,
  remote_code: bool = False,
) -> dict[str, Any]:
  """The config.json transformers writes for the same model (its keys, in its format);
  ``remote_code``: for the class with the project's code (always so for DIFF V2).

  Raises :class:`ConversionError` for a model no transformers class computes exactly.
  """
  check_exportable(cfg)
  arch = architecture_of(cfg)
  named = SELF_CONTAINED[arch] if remote_code else arch
  diff = arch == DIFFLLAMA
  heads = 2 * cfg.num_heads if arch in (DIFFLLAMA, DIFFJAX_V2) else cfg.num_heads
  kv_heads = 2 * cfg.num_kv_heads if diff else cfg.num_kv_heads
  out: dict[str, Any] = {
    **_shared_hf_config(cfg, bos_token_id, eos_token_id, pad_token_id, max_position_embeddings),
    "architectures": [named],
    "attention_bias": False,
    "dtype": dtype,
    "hidden_act": "silu",
    "model_type": MODEL_TYPE[named],
    "num_attention_heads": heads,
    "num_key_value_heads": kv_heads,
    # transformers 5 reads rope_parameters; earlier versions the shared "rope_theta".
    "rope_parameters": {"rope_theta": float(cfg.rope_theta), "rope_type": "default"},
  }
  if diff:
    out["lambda_std_dev"] = 0.1  # diffjax draws the lambda vectors from N(0, 0.1^2)
  else:
    out["mlp_bias"] = False
    out["pretraining_tp"] = 1
  if named in REMOTE_CODE:
    out["auto_map"] = dict(REMOTE_CODE[named][1])
  if arch == DIFFJAX_V2:
    out["v2_pairing"], out["v2_lambda"] = cfg.v2_pairing, cfg.v2_lambda
  return out


def check_exportable(cfg: ModelConfig) -> None:
  """Raises :class:`ConversionError` naming the first setting no transformers class has."""
  arch = architecture_of(cfg)
  if cfg.mlp_activation != "swiglu":
    raise ConversionError(
      f"mlp_activation={cfg.mlp_activation!r} cannot be exported as {arch}: its MLP is SwiGLU."
    )
  if arch == LLAMA and cfg.d_model % cfg.num_heads:
    raise ConversionError(
      f"d_model={cfg.d_model} is not a multiple of num_heads="
      f"{cfg.num_heads}, which LlamaConfig requires of hidden_size."
    )
  if arch == DIFFLLAMA:
    if not cfg.diff_use_norm:
      raise ConversionError(
        "diff_use_norm=False cannot be exported: DiffLlama always applies the per-head RMSNorm."
      )
    if cfg.diff_fixed_lambda is not None:
      raise ConversionError(
        f"diff_fixed_lambda={cfg.diff_fixed_lambda} cannot be exported: "
        "DiffLlama always learns lambda."
      )
    if cfg.diff_lambda_init_offset:
      raise ConversionError(
        f"diff_lambda_init_offset={cfg.diff_lambda_init_offset} cannot be exported: DiffLlama's "
        "lambda_init is 0.8 - 0.6 exp(-0.3 l) at layer l from 0 (offset 0)."
      )
    if cfg.diff_norm_eps != cfg.norm_eps:
      raise ConversionError(
        f"diff_norm_eps={cfg.diff_norm_eps} differs from norm_eps="
        f"{cfg.norm_eps}; DiffLlama uses one rms_norm_eps for both."
      )
