"""Hugging Face tensors <-> diffjax parameters, as numpy arrays (no framework needed).

Each layout (transposes and head splits, DiffLlama's halves, the norm gain folded into
``o_proj``, DIFF V2's ``lambda_proj``, RoPE row order): docs/hf_conversion.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from diffjax.convert.files import ConversionError
from diffjax.convert.hf_config import DIFFJAX_V2, DIFFLLAMA, architecture_of, check_exportable
from diffjax.model import ModelConfig

Params = dict[str, Any]


# DiffLlama's and Motif's per-layer lambda vectors.
LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def _layer(i: int, name: str) -> str:
  return f"model.layers.{i}.{name}"


def _checkpoint_shapes(
  cfg: ModelConfig, attn: Mapping[str, tuple[int, ...]], layer_extra: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
  """The tensor shapes of a Llama-like checkpoint of ``cfg``: the embedding, the final norm, an
  untied head, and in each layer the norms, the attention's tensors ``attn`` (names under
  ``self_attn.``), the MLP's matrices and ``layer_extra`` (names within the layer)."""
  e, f, v = cfg.d_model, cfg.mlp_dim, cfg.vocab_size
  shapes = {"model.embed_tokens.weight": (v, e), "model.norm.weight": (e,)}
  if not cfg.tie_embeddings:
    shapes["lm_head.weight"] = (v, e)
  layer = {
    "input_layernorm.weight": (e,),
    "post_attention_layernorm.weight": (e,),
    **{f"self_attn.{name}": shape for name, shape in attn.items()},
    "mlp.gate_proj.weight": (f, e),
    "mlp.up_proj.weight": (f, e),
    "mlp.down_proj.weight": (e, f),
    **layer_extra,
  }
  for i in range(cfg.num_layers):
    shapes.update({_layer(i, name): shape for name, shape in layer.items()})
  return shapes


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """The tensor names and shapes of the transformers checkpoint for ``cfg``."""
  e, d = cfg.d_model, cfg.head_dim
  arch = architecture_of(cfg)
  diff = arch == DIFFLLAMA
  q_out = (2 if arch in (DIFFLLAMA, DIFFJAX_V2) else 1) * cfg.num_heads * d
  kv_out = (2 if diff else 1) * cfg.num_kv_heads * d
  o_in = (2 if diff else 1) * cfg.num_heads * d
  attn = {
    "q_proj.weight": (q_out, e),
    "k_proj.weight": (kv_out, e),
    "v_proj.weight": (kv_out, e),
    "o_proj.weight": (e, o_in),
  }
  extra = {}
  if diff:
    extra.update({f"self_attn.{lam}": (d,) for lam in LAMBDAS})
  if arch == DIFFJAX_V2:
    extra["self_attn.lambda_proj.weight"] = (cfg.num_heads, e)
  return _checkpoint_shapes(cfg, attn, extra)


def check_tensors(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> None:
  """Raises :class:`ConversionError` for a missing, unexpected or misshapen tensor."""
  want = expected_shapes(cfg)
  _check_names(cfg, want, tensors)
  for name, shape in want.items():
    _check_shape(name, tensors[name], shape)
  for name in want:
    _check_dtype(name, tensors[name])


def _check_names(
  cfg: ModelConfig, want: Mapping[str, tuple[int, ...]], tensors: Mapping[str, np.ndarray]
) -> None:
  """Refuses a checkpoint without a tensor of ``want``, or with one diffjax has no use for."""
  missing = sorted(set(want) - set(tensors))
  if missing:
    raise ConversionError(
      f"The checkpoint has no tensor {missing[0]!r} ({len(missing)} "
      "missing in all), which config.json implies."
    )
  extra = sorted(n for n in set(tensors) - set(want) if not _ignorable(n, cfg, tensors))
  if extra:
    raise ConversionError(
      f"The checkpoint holds {extra[0]!r} ({len(extra)} unexpected in all), "
      "which diffjax has no parameter for (a bias or another layer type)."
    )


def _check_shape(name: str, tensor: np.ndarray, shape: tuple[int, ...]) -> None:
  got = tuple(tensor.shape)
  if got != shape:
    raise ConversionError(
      f"Tensor {name!r} has shape {list(got)}, but config.json implies "
      f"{list(shape)}: the weights do not belong to this config."
    )


def _check_dtype(name: str, tensor: np.ndarray) -> None:
  if tensor.dtype.kind != "f" and tensor.dtype.name != "bfloat16":
    raise ConversionError(
      f"Tensor {name!r} has dtype {tensor.dtype.name}; diffjax imports float weights only."
    )


def _ignorable(name: str, cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> bool:
  """Tensors transformers itself ignores: RoPE buffers, and a tied head equal to the table."""
  if name.endswith("rotary_emb.inv_freq"):
    return True
  if name == "lm_head.weight" and cfg.tie_embeddings:
    table = tensors.get("model.embed_tokens.weight")
    return table is not None and np.array_equal(tensors[name], table)
  return False


def _f32(x: np.ndarray) -> np.ndarray:
  return np.asarray(x, dtype=np.float32)


def _rope_rows(cfg: ModelConfig) -> np.ndarray:
  """Row order within a head that turns diffjax's RoPE layout into the checkpoints' (halves:
  transformers', Motif's)."""
  d = cfg.head_dim
  if cfg.rope_style == "half":
    return np.arange(d)
  return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])


def _check_halves(cfg: ModelConfig, whose: str) -> None:
  """Refuses a config whose RoPE does not rotate halves, as ``whose`` checkpoints do."""
  if cfg.rope_style != "half":
    raise ConversionError(
      f"rope_style={cfg.rope_style!r}: {whose} checkpoints rotate halves; "
      "build the config with model_config_from_hf."
    )


def _block_params(attn: Params, w: Callable[[str], np.ndarray]) -> Params:
  """A block's parameters: ``attn``, the norms' gains and the MLP's matrices, of the layer's
  float32 tensors ``w(name)``."""
  return {
    "attn": attn,
    "attn_norm": {"scale": w("input_layernorm.weight")},
    "mlp": {
      "w_gate": np.ascontiguousarray(w("mlp.gate_proj.weight").T),
      "w_up": np.ascontiguousarray(w("mlp.up_proj.weight").T),
      "w_down": np.ascontiguousarray(w("mlp.down_proj.weight").T),
    },
    "mlp_norm": {"scale": w("post_attention_layernorm.weight")},
  }


def _model_params(cfg: ModelConfig, blocks: dict, tensor: Callable[[str], np.ndarray]) -> Params:
  """The model's parameters: ``blocks``, the embedding, the final norm and an untied head, of
  the float32 tensors ``tensor(name)``."""
  params: Params = {
    "blocks": blocks,
    "embed": {"embedding": tensor("model.embed_tokens.weight")},
    "final_norm": {"scale": tensor("model.norm.weight")},
  }
  if not cfg.tie_embeddings:
    params["lm_head"] = np.ascontiguousarray(tensor("lm_head.weight").T)
  return params


def _model_tensors(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
  """The float32 tensors outside the layers: the embedding, the final norm, an untied head."""
  out: dict[str, np.ndarray] = {
    "model.embed_tokens.weight": _f32(params["embed"]["embedding"]),
    "model.norm.weight": _f32(params["final_norm"]["scale"]),
  }
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = _f32(params["lm_head"]).T
  return out


def _plain_projections(a: Params, rows: np.ndarray, e: int) -> tuple[np.ndarray, ...]:
  """Llama's q, k, v and o rows of diffjax's float32 attention ``a``: each projection's heads
  flattened and transposed, q and k reordered by ``rows`` within each head."""
  q = a["q"][..., rows].reshape(e, -1).T
  k = a["k"][..., rows].reshape(e, -1).T
  return q, k, a["v"].reshape(e, -1).T, a["o"].reshape(-1, e).T


def _block_tensors(i: int, blk: Params, q, k, v, o) -> dict[str, np.ndarray]:
  """Layer ``i``'s float32 tensors of the projections ``q, k, v, o`` and of ``blk``'s norms
  and MLP matrices."""
  return {
    _layer(i, "self_attn.q_proj.weight"): q,
    _layer(i, "self_attn.k_proj.weight"): k,
    _layer(i, "self_attn.v_proj.weight"): v,
    _layer(i, "self_attn.o_proj.weight"): o,
    _layer(i, "input_layernorm.weight"): _f32(blk["attn_norm"]["scale"]),
    _layer(i, "post_attention_layernorm.weight"): _f32(blk["mlp_norm"]["scale"]),
    _layer(i, "mlp.gate_proj.weight"): _f32(blk["mlp"]["w_gate"]).T,
    _layer(i, "mlp.up_proj.weight"): _f32(blk["mlp"]["w_up"]).T,
    _layer(i, "mlp.down_proj.weight"): _f32(blk["mlp"]["w_down"]).T,
  }


def _to_pairs(w_out_x_in: np.ndarray, n: int, d: int) -> np.ndarray:
  """transformers rows [component s, head, d] x E -> diffjax [E, head, s, d]."""
  return w_out_x_in.reshape(2, n, d, -1).transpose(3, 1, 0, 2)


def _to_halves(w_ExNx2xD: np.ndarray) -> np.ndarray:
  """diffjax [E, head, s, d] -> transformers rows [component s, head, d] x E."""
  return w_ExNx2xD.transpose(2, 1, 3, 0).reshape(-1, w_ExNx2xD.shape[0])


def params_from_hf(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> Params:
  """diffjax parameters (float32 numpy, the DecoderLM state's pure-dict layout) of a checkpoint.

  ``cfg`` comes from :func:`~diffjax.convert.hf_config.model_config_from_hf` (so its
  ``rope_style`` is ``"half"``). Checks names and shapes first.
  """
  check_tensors(cfg, tensors)
  _check_halves(cfg, "imported")
  t = {name: _f32(x) for name, x in tensors.items()}
  e, d = cfg.d_model, cfg.head_dim
  h, k = cfg.num_heads, cfg.num_kv_heads
  blocks = {}
  arch = architecture_of(cfg)
  for i in range(cfg.num_layers):
    w = functools.partial(lambda i_, name: t[_layer(i_, name)], i)
    if arch != DIFFLLAMA:
      # Llama; DIFF V2's query heads are pairs [h, 2] (heads 2i+s), its lambda projection E -> h.
      q_heads = (h, 2) if arch == DIFFJAX_V2 else (h,)
      attn = {
        "q": w("self_attn.q_proj.weight").T.reshape(e, *q_heads, d),
        "k": w("self_attn.k_proj.weight").T.reshape(e, k, d),
        "v": w("self_attn.v_proj.weight").T.reshape(e, k, d),
        "o": w("self_attn.o_proj.weight").T.reshape(h, d, e),
      }
      if arch == DIFFJAX_V2:
        attn["w_lambda"] = w("self_attn.lambda_proj.weight").T
    else:
      attn = {
        "q": _to_pairs(w("self_attn.q_proj.weight"), h, d),
        "k": _to_pairs(w("self_attn.k_proj.weight"), k, d),
        "v": _to_pairs(w("self_attn.v_proj.weight"), k, d).reshape(e, k, 2 * d),
        "o": w("self_attn.o_proj.weight").T.reshape(h, 2 * d, e),
        "norm_scale": np.ones((2 * d,), np.float32),
      }
      for lam in LAMBDAS:
        attn[lam] = w(f"self_attn.{lam}")
    blocks[i] = _block_params({name: np.ascontiguousarray(x) for name, x in attn.items()}, w)
  return _model_params(cfg, blocks, t.__getitem__)


def hf_from_params(
  cfg: ModelConfig, params: Params, dtype: Any = np.float32
) -> dict[str, np.ndarray]:
  """transformers tensors (``dtype``, contiguous) of diffjax parameters ``params``.

  ``params`` is the DecoderLM state as a pure dict (arrays of any kind). Raises
  :class:`ConversionError` for an arm without a transformers class.
  """
  check_exportable(cfg)
  e, d = cfg.d_model, cfg.head_dim
  rows = _rope_rows(cfg)
  out = _model_tensors(cfg, params)
  arch = architecture_of(cfg)
  for i in range(cfg.num_layers):
    blk = params["blocks"][i]
    a = {name: _f32(x) for name, x in blk["attn"].items()}
    if arch != DIFFLLAMA:
      q, k, v, o = _plain_projections(a, rows, e)
      if arch == DIFFJAX_V2:
        out[_layer(i, "self_attn.lambda_proj.weight")] = a["w_lambda"].T
    else:
      q = _to_halves(a["q"][..., rows])
      k = _to_halves(a["k"][..., rows])
      v = _to_halves(a["v"].reshape(e, cfg.num_kv_heads, 2, d))
      o = (a["o"] * a["norm_scale"][None, :, None]).reshape(-1, e).T
      for lam in LAMBDAS:
        out[_layer(i, f"self_attn.{lam}")] = a[lam]
    out.update(_block_tensors(i, blk, q, k, v, o))
  return {name: np.ascontiguousarray(x.astype(dtype)) for name, x in sorted(out.items())}
