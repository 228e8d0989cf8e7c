"""Motif-2's forward pass in NumPy, read off the checkpoint's own tensors and config.json.

Written from Motif's vLLM port (its model file and its grouped differential attention
backend), independently of diffjax's conversion: heads are split the way that backend splits
them (query heads in groups of r signal heads and a noise head, kv heads 2g + s), each map is
a plain causal softmax with GQA (query head i reads kv head i // (heads / kv heads)), and the
four value products A1 V1, A1 V2, A2 V1, A2 V2 are computed separately as the backend does.
Computed in float64; the caller compares diffjax's float32 logits with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np


def _rms(x, weight, eps):
  y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
  return y if weight is None else y * weight


def polynorm(x, weight, bias, eps=1e-6):
  def n(y):
    return y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps)

  return weight[0] * n(x**3) + weight[1] * n(x**2) + weight[2] * n(x) + bias[0]


def _rope_neox(x_TxHxD, theta):
  """Rotates halves (x[i], x[i + d/2]) of every head by position t * theta^(-2i/d)."""
  t, _, d = x_TxHxD.shape
  inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
  ang = np.arange(t, dtype=np.float64)[:, None] * inv[None]  # [T, d/2]
  cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
  a, b = x_TxHxD[..., : d // 2], x_TxHxD[..., d // 2 :]
  return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _attend(q_TxHxD, k_TxKxD, v_TxKxD, scale):
  """Causal softmax attention; query head i reads kv head i // (H / K)."""
  t, h, _ = q_TxHxD.shape
  rep = h // k_TxKxD.shape[1]
  k = np.repeat(k_TxKxD, rep, axis=1)
  v = np.repeat(v_TxKxD, rep, axis=1)
  s_HxTxS = np.einsum("thd,shd->hts", q_TxHxD, k) * scale
  s_HxTxS = np.where(np.tril(np.ones((t, t), bool))[None], s_HxTxS, -np.inf)
  p = np.exp(s_HxTxS - s_HxTxS.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("hts,shd->thd", p, v)


def _layer_attention(x_TxE, w, i: int, hf) -> np.ndarray:
  heads = hf["num_attention_heads"]
  noise = hf.get("num_noise_heads") or heads // 2
  kv = hf.get("num_key_value_heads", heads)
  d = hf.get("head_dim") or hf["hidden_size"] // heads
  r = (heads - noise) // noise
  t = x_TxE.shape[0]
  p = f"model.layers.{i}.self_attn."
  q = (x_TxE @ w[p + "q_proj.weight"].T).reshape(t, heads, d)
  k = (x_TxE @ w[p + "k_proj.weight"].T).reshape(t, kv, d)
  v = (x_TxE @ w[p + "v_proj.weight"].T).reshape(t, kv, d)
  theta = hf.get("rope_theta", 10000.0)
  q, k = _rope_neox(q, theta), _rope_neox(k, theta)
  # Query heads: [noise groups, r signal heads + 1 noise head]; kv heads: pairs (2g, 2g + 1).
  grouped = q.reshape(t, noise, r + 1, d)
  q1, q2 = grouped[:, :, :r].reshape(t, noise * r, d), grouped[:, :, r]
  k1, k2, v1, v2 = k[:, 0::2], k[:, 1::2], v[:, 0::2], v[:, 1::2]
  scale = d**-0.5
  attn1 = np.concatenate([_attend(q1, k1, v1, scale), _attend(q1, k1, v2, scale)], -1)
  attn2 = np.concatenate([_attend(q2, k2, v1, scale), _attend(q2, k2, v2, scale)], -1)
  attn2 = np.repeat(attn2, r, axis=1)  # noise head g serves signal heads g r .. g r + r - 1
  lambda_init = 0.8 - 0.6 * math.exp(-0.3 * (i - 1))
  lam = (
    np.exp(np.sum(w[p + "lambda_q1"] * w[p + "lambda_k1"]))
    - np.exp(np.sum(w[p + "lambda_q2"] * w[p + "lambda_k2"]))
    + lambda_init
  )
  out = attn1 - lam * attn2
  out = _rms(out, w[p + "subln.weight"], hf.get("attn_rms_norm_eps", 1e-5)) * (1 - lambda_init)
  return out.reshape(t, -1) @ w[p + "o_proj.weight"].T


def motif_logits(tensors: Mapping[str, np.ndarray], hf: Mapping, ids_BxT) -> np.ndarray:
  """float64 logits [B, T, V] of Motif's forward on token ids [B, T] (positions 0..T-1)."""
  w = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
  eps = hf.get("rms_norm_eps", 1e-6)
  rows = []
  for ids in np.asarray(ids_BxT):
    x = w["model.embed_tokens.weight"][ids]
    for i in range(hf["num_hidden_layers"]):
      p = f"model.layers.{i}."
      x = x + _layer_attention(_rms(x, w[p + "input_layernorm.weight"], eps), w, i, hf)
      h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
      gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
      act = polynorm(gate, w[p + "mlp.act_fn.weight"], w[p + "mlp.act_fn.bias"])
      x = x + (act * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    rows.append(x @ head.T)
  return np.stack(rows)


def motif_greedy(tensors, hf, prompt_BxT, steps: int) -> np.ndarray:
  """Prompt followed by ``steps`` greedy tokens per row, recomputing the whole prefix."""
  tokens = np.asarray(prompt_BxT)
  for _ in range(steps):
    nxt = np.argmax(motif_logits(tensors, hf, tokens)[:, -1], axis=-1)
    tokens = np.concatenate([tokens, nxt[:, None]], axis=1)
  return tokens
