"""The constructed cases the evaluation tests share: filler text, hand-written "models" whose
answers are known, and tiny models of every arm (their fixtures: tests/eval/conftest.py).

Array-level tests use hand-built inputs; model-level tests use one tiny model per arm (built
once per module) so that each file stays fast on a CPU.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import filler_source

from diffjax.data import ByteTokenizer
from diffjax.model import DecoderLM, ModelConfig

TOK = ByteTokenizer()
FILLER = filler_source()


# ----------------------------------------------------------------------------------------------
# Hand-written "models" for retrieval scoring.


def oracle(sequences, wrong=(), vocab=258):
  """A causal 'model' that continues any prefix of a known sequence with its next token.

  `wrong` lists (sequence index, position) pairs where it predicts a wrong token instead.
  """
  seqs = [np.asarray(s) for s in sequences]
  bad = set(wrong)

  def fn(tokens, *unused):
    tokens = np.asarray(tokens)
    out = np.zeros(tokens.shape + (vocab,), np.float32)
    for b in range(tokens.shape[0]):
      for t in range(tokens.shape[1]):
        nxt = 0
        for i, s in enumerate(seqs):
          if t + 1 < s.size and np.array_equal(s[: t + 1], tokens[b, : t + 1]):
            nxt = int(s[t + 1])
            if (i, t + 1) in bad:
              nxt = (nxt + 1) % 256
            break
        out[b, t, nxt] = 1.0
    return out

  return fn


def perfect_model(tokens, *unused):
  """Teacher-forced oracle: puts all mass on the true next token."""
  tokens = np.asarray(tokens)
  out = np.zeros(tokens.shape + (258,), np.float32)
  b, t = np.indices(tokens[:, 1:].shape)
  out[b, t, tokens[:, 1:]] = 1.0
  return out


def wrong_model(tokens, *unused):
  return np.roll(perfect_model(tokens), 1, axis=-1)


# ----------------------------------------------------------------------------------------------
# Tiny models. Every model-level test uses T = 256 and batch 2, so the compiled functions of
# the shared runners are reused across the tests of a file.

BASE = ModelConfig(
  attention="transformer",
  d_model=32,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  mlp_dim=64,
)
T = 256


def fast_model(cfg: ModelConfig, seed: int) -> DecoderLM:
  """A model with numpy-drawn parameters: building it compiles nothing (eager init would)."""
  model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(seed)
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Variable):
      name = str(path[-1])
      if "scale" in name:
        value = np.ones(node.shape)
      elif name.startswith("lambda_"):
        value = rng.normal(0.0, 0.1, node.shape)
      else:
        value = rng.normal(0.0, 0.3 if name in ("q", "k") else 0.05, node.shape)
      node.set_value(jnp.asarray(value, jnp.float32))
  if cfg.attention == "diff_v1":
    # lambda = exp(0.833) - exp(0) + lambda_init ~ 1.5: A1 - lambda A2 has many negative entries.
    c = math.sqrt(0.833 / cfg.head_dim)
    for block in model.blocks:
      for name, v in (("lambda_q1", c), ("lambda_k1", c), ("lambda_q2", 0.0), ("lambda_k2", 0.0)):
        getattr(block.attn, name).set_value(jnp.full((cfg.head_dim,), v, jnp.float32))
  return model
