"""The attention modules re-implemented in NumPy float64 from the brief's definitions and the
modules' own stored weights, for the module tests (tests/nn) and the float64 tests (tests/ops)."""

from __future__ import annotations

import math

import numpy as np


def _np(x):
  return np.asarray(x, np.float64)


# --------------------------------------------------------------------------------------
# NumPy float64 building blocks.
# --------------------------------------------------------------------------------------


def np_rope(x_BxTxHxD, positions_BxT, *, theta=10000.0, style="interleaved"):
  """Rotates channel pairs by position * theta^(-2i/D).

  Pair i is (2i, 2i+1) for "interleaved" and (i, i + D/2) for "half".
  """
  x = _np(x_BxTxHxD)
  d = x.shape[-1]
  out = np.empty_like(x)
  pos = _np(positions_BxT)[:, :, None]
  for i in range(d // 2):
    angle = pos * theta ** (-2.0 * i / d)
    a, b = (2 * i, 2 * i + 1) if style == "interleaved" else (i, i + d // 2)
    out[..., a] = x[..., a] * np.cos(angle) - x[..., b] * np.sin(angle)
    out[..., b] = x[..., a] * np.sin(angle) + x[..., b] * np.cos(angle)
  return out


def np_allowed(positions_count, segment_ids_BxT, batch):
  """Causal (and same-segment) masks [B, T, T]."""
  t = positions_count
  causal = np.tril(np.ones((t, t), bool))
  allowed = np.broadcast_to(causal, (batch, t, t)).copy()
  if segment_ids_BxT is not None:
    seg = np.asarray(segment_ids_BxT)
    allowed &= seg[:, :, None] == seg[:, None, :]
  return allowed


def np_softmax_rows(scores_TxS, allowed_TxS):
  s = np.where(allowed_TxS, scores_TxS, -np.inf)
  e = np.exp(s - s.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def np_attention_module(m, x, pos, seg, style):
  wq, wk, wv, wo = (_np(m.q[...]), _np(m.k[...]), _np(m.v[...]), _np(m.o[...]))
  x = _np(x)
  b_len, t_len, _ = x.shape
  h_len, d = wq.shape[1], wq.shape[2]
  per_group = h_len // wk.shape[1]
  q = np_rope(np.einsum("bte,ehd->bthd", x, wq), pos, style=style)
  k = np_rope(np.einsum("bte,ekd->btkd", x, wk), pos, style=style)
  v = np.einsum("bte,ekd->btkd", x, wv)
  allowed = np_allowed(t_len, seg, b_len)
  y = np.zeros_like(x)
  for b in range(b_len):
    for h in range(h_len):
      g = h // per_group
      p = np_softmax_rows(q[b, :, h] @ k[b, :, g].T / math.sqrt(d), allowed[b])
      y[b] += (p @ v[b, :, g]) @ wo[h]
  return y


def np_diff_v1_module(m, x, pos, seg, style, layer_index):
  wq, wk, wv, wo = (_np(m.q[...]), _np(m.k[...]), _np(m.v[...]), _np(m.o[...]))
  gain = _np(m.norm_scale[...])
  lq1, lk1, lq2, lk2 = (_np(p[...]) for p in (m.lambda_q1, m.lambda_k1, m.lambda_q2, m.lambda_k2))
  lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_index)
  lam = math.exp(lq1 @ lk1) - math.exp(lq2 @ lk2) + lambda_init
  x = _np(x)
  b_len, t_len, _ = x.shape
  h_len, d = wq.shape[1], wq.shape[3]
  per_group = h_len // wk.shape[1]
  q = np.einsum("bte,ehsd->bthsd", x, wq)  # component s of head i: d-block 2i+s
  k = np.einsum("bte,eksd->btksd", x, wk)
  v = np.einsum("bte,ekf->btkf", x, wv)  # [B, T, K, 2d]
  q1, q2 = (np_rope(q[:, :, :, s], pos, style=style) for s in (0, 1))
  k1, k2 = (np_rope(k[:, :, :, s], pos, style=style) for s in (0, 1))
  allowed = np_allowed(t_len, seg, b_len)
  y = np.zeros_like(x)
  for b in range(b_len):
    for h in range(h_len):
      g = h // per_group
      a1 = np_softmax_rows(q1[b, :, h] @ k1[b, :, g].T / math.sqrt(d), allowed[b])
      a2 = np_softmax_rows(q2[b, :, h] @ k2[b, :, g].T / math.sqrt(d), allowed[b])
      o = (a1 - lam * a2) @ v[b, :, g]  # [T, 2d]
      o = o / np.sqrt(np.mean(o**2, axis=-1, keepdims=True) + 1e-5) * gain
      o = o * (1.0 - lambda_init)
      y[b] += o @ wo[h]
  return y


def np_diff_v2_module(m, x, pos, seg, style):
  wq, wk, wv, wo = (_np(m.q[...]), _np(m.k[...]), _np(m.v[...]), _np(m.o[...]))
  w_lambda = _np(m.w_lambda[...])
  x = _np(x)
  b_len, t_len, _ = x.shape
  h_len, d = wq.shape[1], wq.shape[3]
  per_group = h_len // wk.shape[1]
  q = np.einsum("bte,ehsd->bthsd", x, wq)
  k = np_rope(np.einsum("bte,ekd->btkd", x, wk), pos, style=style)
  v = np.einsum("bte,ekd->btkd", x, wv)
  q1, q2 = (np_rope(q[:, :, :, s], pos, style=style) for s in (0, 1))
  lam = 1.0 / (1.0 + np.exp(-np.einsum("bte,eh->bth", x, w_lambda)))
  allowed = np_allowed(t_len, seg, b_len)
  y = np.zeros_like(x)
  for b in range(b_len):
    for i in range(h_len):
      g = i // per_group
      a1 = np_softmax_rows(q1[b, :, i] @ k[b, :, g].T / math.sqrt(d), allowed[b])
      a2 = np_softmax_rows(q2[b, :, i] @ k[b, :, g].T / math.sqrt(d), allowed[b])
      o = a1 @ v[b, :, g] - lam[b, :, i : i + 1] * (a2 @ v[b, :, g])
      y[b] += o @ wo[i]
  return y
