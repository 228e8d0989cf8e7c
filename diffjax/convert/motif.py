"""Motif-2 checkpoints (``MotifForCausalLM``: Motif-2.6B, Motif-2-12.7B) <-> the ``gda_v1`` arm.

Motif-2's layout is diffjax's up to transposes and reshapes, so both directions are exact; each
convention, its source and the memory a real checkpoint needs: docs/motif.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from diffjax.convert.files import ConversionError
from diffjax.convert.hf_config import (
  RUNTIME_FIELDS,
  _check_runtime,
  _head_dim,
  _init_std,
  _positive_float,
  _positive_int,
  _refuse_dropout,
  _refuse_quantized,
  _refuse_true,
  _require_sizes,
  _rope_theta,
  _shared_hf_config,
  _tie_embeddings,
)
from diffjax.convert.weights import (
  LAMBDAS,
  _block_params,
  _block_tensors,
  _check_dtype,
  _check_halves,
  _check_names,
  _check_shape,
  _checkpoint_shapes,
  _f32,
  _layer,
  _model_params,
  _model_tensors,
  _plain_projections,
  _rope_rows,
)
from diffjax.model import ModelConfig
from diffjax.model.sizes import WIDTHS

MOTIF = "MotifForCausalLM"
MODEL_TYPE = "motif"
ARM = "gda_v1"
# Motif counts layers from 1 in lambda_init: 0.8 - 0.6 exp(-0.3 (l - 1)) for 0-based l.
LAMBDA_INIT_OFFSET = -1
# Defaults of the keys a Motif config.json may leave out (those of the Motif loaders).
DEFAULT_RMS_EPS = 1e-6
DEFAULT_ATTN_RMS_EPS = 1e-5
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_MAX_POSITIONS = 8192

Params = dict[str, Any]


def is_motif(hf: Mapping[str, Any]) -> bool:
  """Whether a config.json describes a Motif checkpoint (by class or ``model_type``)."""
  archs = hf.get("architectures")
  if isinstance(archs, list) and archs:
    return MOTIF in archs
  return hf.get("model_type") == MODEL_TYPE


def is_motif_model(cfg: ModelConfig) -> bool:
  """Whether a model exports as Motif: the only checkpoints with a PolyNorm MLP."""
  return cfg.mlp_activation == "polynorm"


# ------------------------------------------------------------------------------- config


def _heads(hf: Mapping[str, Any]) -> tuple[int, int, int, int, int]:
  """(signal heads Hs, noise heads Hn, ratio r, diff kv groups K, head dim d) of a config."""
  hidden = _positive_int(hf, "hidden_size")
  heads = _positive_int(hf, "num_attention_heads")
  kv_heads = _positive_int(hf, "num_key_value_heads", heads)
  if hf.get("num_noise_heads") is None and heads % 2:
    raise ConversionError(
      f"config.json: num_attention_heads={heads} is odd and num_noise_heads is not given "
      "(it defaults to half the heads)."
    )
  noise = _positive_int(hf, "num_noise_heads", heads // 2)
  if heads % noise or heads == noise:
    raise ConversionError(
      f"config.json: num_attention_heads={heads} must be a multiple of num_noise_heads="
      f"{noise} and larger: the heads form {noise} groups of r signal heads and a noise head."
    )
  if kv_heads % 2:
    raise ConversionError(
      f"config.json: num_key_value_heads={kv_heads} must be even: kv heads 2g and 2g + 1 "
      "are the two components of kv group g."
    )
  groups = kv_heads // 2
  if noise % groups:
    raise ConversionError(
      f"config.json: num_noise_heads={noise} must be a multiple of num_key_value_heads / 2 = "
      f"{groups}, so that each group of heads reads one kv group."
    )
  head_dim = _head_dim(hf, hidden, heads)
  signal = heads - noise
  return signal, noise, signal // noise, groups, head_dim


def _refuse_unmodelled(hf: Mapping[str, Any]) -> None:
  """Refuses the Motif settings diffjax does not compute, naming the field."""
  _refuse_quantized(hf)
  act = hf.get("hidden_act", "poly_norm")
  if act != "poly_norm":
    raise ConversionError(
      f"config.json: hidden_act={act!r} cannot be imported: Motif's MLP is PolyNorm-gated "
      "(hidden_act='poly_norm')."
    )
  for key in ("attention_bias", "use_bias", "qkv_bias", "mlp_bias"):
    _refuse_true(hf, key, "diffjax's projections have no bias")
  # A window is inert only where use_sliding_window says false (Qwen2-style configs).
  use_window = hf.get("use_sliding_window")
  if use_window or (use_window is None and hf.get("sliding_window") is not None):
    raise ConversionError(
      f"config.json: sliding_window={hf.get('sliding_window')!r} (use_sliding_window="
      f"{hf.get('use_sliding_window')!r}) cannot be imported: diffjax attends to every "
      "earlier token."
    )
  scaling = hf.get("rope_scaling")
  if scaling is not None:
    raise ConversionError(
      f"config.json: rope_scaling={scaling!r} cannot be imported: diffjax implements only "
      "the default (unscaled) RoPE."
    )
  k_ratio = hf.get("k_ratio", 1)
  if k_ratio not in (1, None):
    raise ConversionError(
      f"config.json: k_ratio={k_ratio!r} cannot be imported: diffjax reads kv heads in pairs "
      "(k_ratio=1)."
    )
  if hf.get("is_causal", True) is False:
    raise ConversionError("config.json: is_causal=false cannot be imported: diffjax is causal.")
  _refuse_dropout(hf)


def model_config_from_hf(hf: Mapping[str, Any], **runtime: Any) -> ModelConfig:
  """The diffjax config (arm ``gda_v1``) of a Motif-2 config.json.

  ``runtime`` sets fields that leave the parameters unchanged (``RUNTIME_FIELDS``). Raises
  :class:`ConversionError` naming the first field that cannot be mapped exactly.
  """
  _check_runtime(runtime)
  _require_sizes(hf, MOTIF)
  _refuse_unmodelled(hf)
  signal, _, ratio, groups, head_dim = _heads(hf)
  tie = _tie_embeddings(hf)
  fields = dict(
    attention=ARM,
    vocab_size=_positive_int(hf, "vocab_size"),
    d_model=_positive_int(hf, "hidden_size"),
    num_layers=_positive_int(hf, "num_hidden_layers"),
    num_heads=signal,
    num_kv_heads=groups,
    head_dim=head_dim,
    mlp_dim=_positive_int(hf, "intermediate_size"),
    gda_ratio=ratio,
    diff_lambda_init_offset=LAMBDA_INIT_OFFSET,
    mlp_activation="polynorm",
    # transformers 5 configs give the base in rope_parameters, earlier ones at the top level.
    rope_theta=_rope_theta({**hf, "rope_theta": hf.get("rope_theta", DEFAULT_ROPE_THETA)}),
    rope_style="half",
    norm_eps=_positive_float(hf, "rms_norm_eps", DEFAULT_RMS_EPS),
    diff_norm_eps=_positive_float(hf, "attn_rms_norm_eps", DEFAULT_ATTN_RMS_EPS),
    tie_embeddings=tie,
    init_std=_init_std(hf),
  )
  try:
    return ModelConfig(**fields, **runtime)
  except (TypeError, ValueError) as e:
    raise ConversionError(f"config.json maps to an invalid diffjax config: {e}") from e


def check_exportable(cfg: ModelConfig) -> None:
  """Raises :class:`ConversionError` naming the first setting Motif's model does not have."""
  if cfg.attention != ARM:
    raise ConversionError(
      f"attention={cfg.attention!r} with mlp_activation='polynorm' cannot be exported: Motif "
      f"checkpoints hold attention={ARM!r}."
    )
  offset = getattr(cfg, "diff_lambda_init_offset", 0)
  if offset != LAMBDA_INIT_OFFSET:
    raise ConversionError(
      f"diff_lambda_init_offset={offset} cannot be exported: Motif's lambda_init is "
      f"0.8 - 0.6 exp(-0.3 (l - 1)) (offset {LAMBDA_INIT_OFFSET})."
    )
  if not cfg.diff_use_norm:
    raise ConversionError(
      "diff_use_norm=False cannot be exported: Motif always applies the per-head norm."
    )
  if cfg.diff_fixed_lambda is not None:
    raise ConversionError(
      f"diff_fixed_lambda={cfg.diff_fixed_lambda} cannot be exported: Motif learns lambda."
    )


def hf_config_from_model(
  cfg: ModelConfig,
  *,
  dtype: str = "float32",
  bos_token_id: int | None = None,
  eos_token_id: int | None = None,
  pad_token_id: int | None = None,
  max_position_embeddings: int = DEFAULT_MAX_POSITIONS,
) -> dict[str, Any]:
  """The config.json of a Motif checkpoint of ``cfg`` (the keys the Motif loaders read).

  ``num_noise_heads`` is written only for grouped models (r > 1): without it the loaders
  take half the heads, which is the balanced (Motif-2.6B) layout.
  """
  check_exportable(cfg)
  ratio = cfg.gda_ratio
  noise = cfg.num_heads // ratio
  out: dict[str, Any] = {
    **_shared_hf_config(cfg, bos_token_id, eos_token_id, pad_token_id, max_position_embeddings),
    "architectures": [MOTIF],
    "attn_rms_norm_eps": cfg.diff_norm_eps,
    "hidden_act": "poly_norm",
    "model_type": MODEL_TYPE,
    "num_attention_heads": cfg.num_heads + noise,
    "num_key_value_heads": 2 * cfg.num_kv_heads,
    "rope_scaling": None,
    "torch_dtype": dtype,
    "use_bias": False,
  }
  if ratio > 1:
    out["num_noise_heads"] = noise
  return out


# ------------------------------------------------------------------------------ tensors


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """The tensor names and shapes of the Motif checkpoint of ``cfg``."""
  e, d = cfg.d_model, cfg.head_dim
  signal = cfg.num_heads
  heads = signal + signal // cfg.gda_ratio
  kv_heads = 2 * cfg.num_kv_heads
  attn = {
    "q_proj.weight": (heads * d, e),
    "k_proj.weight": (kv_heads * d, e),
    "v_proj.weight": (kv_heads * d, e),
    "o_proj.weight": (e, 2 * signal * d),
    "subln.weight": (2 * d,),
  }
  extra = {
    "mlp.act_fn.weight": (3,),
    "mlp.act_fn.bias": (1,),
    **{f"self_attn.{lam}": (d,) for lam in LAMBDAS},
  }
  return _checkpoint_shapes(cfg, attn, extra)


def check_tensors(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> None:
  """Raises :class:`ConversionError` for a missing, unexpected or misshapen tensor."""
  want = expected_shapes(cfg)
  _check_names(cfg, want, tensors)
  for name, shape in want.items():
    _check_shape(name, tensors[name], shape)
    _check_dtype(name, tensors[name])


def params_from_hf(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> Params:
  """diffjax parameters (float32 numpy, the DecoderLM state's pure-dict layout) of Motif
  tensors; checks names and shapes first. ``cfg`` comes from :func:`model_config_from_hf`."""
  check_tensors(cfg, tensors)
  _check_halves(cfg, "Motif")
  e, d = cfg.d_model, cfg.head_dim
  signal, groups = cfg.num_heads, cfg.num_kv_heads
  ratio = cfg.gda_ratio

  def w(i: int, name: str) -> np.ndarray:
    return _f32(tensors[_layer(i, name)])

  def c(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x)

  blocks = {}
  for i in range(cfg.num_layers):
    attn = {
      # Rows: groups of r signal heads then their noise head; kv heads 2g + s.
      "q": c(w(i, "self_attn.q_proj.weight").T.reshape(e, signal // ratio, ratio + 1, d)),
      "k": c(w(i, "self_attn.k_proj.weight").T.reshape(e, groups, 2, d)),
      "v": c(w(i, "self_attn.v_proj.weight").T.reshape(e, groups, 2 * d)),
      "o": c(w(i, "self_attn.o_proj.weight").T.reshape(signal, 2 * d, e)),
      "norm_scale": w(i, "self_attn.subln.weight"),
    }
    for lam in LAMBDAS:
      attn[lam] = w(i, f"self_attn.{lam}")
    blocks[i] = _block_params(attn, functools.partial(w, i))
    blocks[i]["mlp"].update(
      poly_weight=w(i, "mlp.act_fn.weight"), poly_bias=w(i, "mlp.act_fn.bias")
    )
  return _model_params(cfg, blocks, lambda name: _f32(tensors[name]))


def hf_from_params(cfg: ModelConfig, params: Params, dtype: Any = np.float32) -> dict:
  """Motif tensors (``dtype``, contiguous) of diffjax parameters (the DecoderLM state as a
  pure dict, per-layer ``blocks``). An interleaved-RoPE model's q/k rows are reordered to
  halves within each head, which keeps every q.k."""
  check_exportable(cfg)
  e = cfg.d_model
  rows = _rope_rows(cfg)
  out = _model_tensors(cfg, params)
  for i in range(cfg.num_layers):
    blk = params["blocks"][i]
    a = {name: _f32(x) for name, x in blk["attn"].items()}
    out.update(_block_tensors(i, blk, *_plain_projections(a, rows, e)))
    out[_layer(i, "self_attn.subln.weight")] = a["norm_scale"]
    out[_layer(i, "mlp.act_fn.weight")] = _f32(blk["mlp"]["poly_weight"])
    out[_layer(i, "mlp.act_fn.bias")] = _f32(blk["mlp"]["poly_bias"])
    for lam in LAMBDAS:
      out[_layer(i, f"self_attn.{lam}")] = a[lam]
  return {name: np.ascontiguousarray(x.astype(dtype)) for name, x in sorted(out.items())}


# ------------------------------------------------------------------------------- sizes


def parameter_count(hf: Mapping[str, Any]) -> int:
  """Parameters of the Motif checkpoint a config.json describes (its tensors' sizes)."""
  _refuse_unmodelled(hf)
  signal, noise, _, groups, d = _heads(hf)
  e = _positive_int(hf, "hidden_size")
  f = _positive_int(hf, "intermediate_size")
  v = _positive_int(hf, "vocab_size")
  layers = _positive_int(hf, "num_hidden_layers")
  attn = e * (signal + noise) * d + 2 * e * 2 * groups * d + 2 * signal * d * e + 6 * d
  per_layer = attn + 3 * e * f + 4 + 2 * e
  head = 0 if hf.get("tie_word_embeddings", False) else v * e
  return v * e + layers * per_layer + e + head


# ---------------------------------------------------------------------------- training


def train_overrides(cfg: ModelConfig) -> dict[str, Any]:
  """The ``model`` section keys with which ``train.py`` builds ``cfg`` again (to continue an
  imported checkpoint with ``checkpoint.init_from``); keys are relative to ``config.model``.

  The baseline widths are the checkpoint's own counts (``num_attention_heads`` = signal +
  noise heads, ``num_key_value_heads`` = 2 K), which the arm's matching "by heads" turns
  into ``cfg``'s; a width it derives otherwise is set as the arm's own (``unmatched``). Every
  other field that differs from its default is set as well.
  """
  from diffjax.model.matching import resolve_model  # pylint: disable=import-outside-toplevel

  base: dict[str, Any] = {"arm": cfg.attention, "size": "custom", "v2_match": "heads"}
  for w in WIDTHS:
    base[w] = getattr(cfg, w)
  defaults = ModelConfig()
  for f in dataclasses.fields(ModelConfig):
    if f.name in ("attention", *WIDTHS, *RUNTIME_FIELDS):
      continue
    value = getattr(cfg, f.name)
    if f.name == "vocab_size" or value != getattr(defaults, f.name):
      base[f.name] = value
  # Baseline head counts to try: Motif's own (which "heads" matching inverts), then the same
  # query heads with fewer kv heads where a Transformer cannot have Motif's (40 and 16).
  candidates = [(cfg.num_heads, cfg.num_kv_heads)]
  if cfg.attention == ARM:
    heads = cfg.num_heads + cfg.num_heads // cfg.gda_ratio
    kv = [2 * cfg.num_kv_heads] + [k for k in range(heads, 1, -1) if heads % k == 0 and k % 2 == 0]
    candidates = [(heads, k) for k in kv] + candidates
  out = dict(base)
  derived = None
  for heads, kv_heads in candidates:
    trial = {**base, "num_heads": heads, "num_kv_heads": kv_heads}
    try:
      derived = resolve_model(trial).config
    except ValueError:
      continue
    out = trial
    break
  for w in WIDTHS:
    if derived is None or getattr(derived, w) != getattr(cfg, w):
      out[f"unmatched.{w}"] = getattr(cfg, w)
  return out


def train_flags(cfg: ModelConfig) -> str:
  """:func:`train_overrides` as ``train.py`` flags."""
  return " ".join(f"--config.model.{k}={v}" for k, v in train_overrides(cfg).items())
