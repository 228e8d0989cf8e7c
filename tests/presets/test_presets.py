"""The parameter table in the docs is the code's, and its differences are the closed forms.

The counts are checked three ways: against a count of the built (abstract) model's parameters
at a small size, against the closed-form per-layer differences, and the docs' table against
``param_table()`` line by line.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import REPO  # noqa: E402

from diffjax.model import DecoderLM, count_params, resolve_model
from diffjax.model.sizes import PAPER_SIZES, PAPER_VOCAB, SIZES
from diffjax.presets import grouped_table, model_section, param_table

DOCS = os.path.join(REPO, "docs")


def _arm(size: str, arm: str, v2_match: str = "params", vocab: int = PAPER_VOCAB):
  section = model_section(arm=arm, size=size, vocab_size=vocab).to_dict()
  return resolve_model({**section, "v2_match": v2_match}).config


def test_the_docs_table_is_the_codes():
  text = open(os.path.join(DOCS, "model.md"), encoding="utf-8").read()
  table = param_table()
  assert table in text, "docs/model.md's parameter table differs from `python -m diffjax.presets`"
  assert len(table.splitlines()) == 2 + len(PAPER_SIZES)
  assert grouped_table() in text, "docs/model.md's grouped-arm table differs from the code's"


@pytest.mark.parametrize("size", sorted(SIZES))
def test_arm_differences_are_the_closed_forms(size):
  t, v1 = _arm(size, "transformer"), _arm(size, "diff_v1")
  v2_heads, v2_params = _arm(size, "diff_v2", "heads"), _arm(size, "diff_v2", "params")
  n_t = count_params(t)
  e, h, d, layers = t.d_model, t.num_heads, t.head_dim, t.num_layers
  # V1: lambda's four d-vectors and the 2d norm gain per layer.
  assert count_params(v1) - n_t == layers * 6 * d
  # V2 by heads: the second query head of each pair (E·h·d) and W_lambda (E·h) per layer.
  assert count_params(v2_heads) - n_t == layers * (e * h * d + e * h)
  # V2 by parameters: round(h(d + 1) / 3) SwiGLU columns fewer, each worth 3E weights.
  cut = round(h * (d + 1) / 3)
  assert v2_params.mlp_dim == t.mlp_dim - cut
  diff = count_params(v2_params) - n_t
  assert diff == layers * e * (h * (d + 1) - 3 * cut)
  assert (diff == 0) == (h * (d + 1) % 3 == 0), size
  assert abs(diff) <= 0.005 * n_t


def test_v2_by_parameters_is_exact_for_every_size_but_micro_350m_and_830m():
  inexact = {
    s for s in SIZES if count_params(_arm(s, "diff_v2")) != count_params(_arm(s, "transformer"))
  }
  assert inexact == {"micro", "350m", "830m"}


@pytest.mark.parametrize("arm", ["transformer", "diff_v1", "diff_v2"])
def test_count_params_counts_the_models_parameters(arm):
  cfg = _arm("micro", arm, vocab=258)
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(params=0)))
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert sum(int(np.prod(x.shape)) for x in leaves) == count_params(cfg)
