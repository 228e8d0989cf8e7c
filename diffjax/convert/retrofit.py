"""Starting DIFF from a pretrained Transformer: DIFF V2 exactly, DIFF V1 as close as its layout allows.

    cfg, params = retrofit_params(source_cfg, source_params, "diff_v2", init="exact")
    retrofit("runs/transformer", "runs/retro_v2", arm="diff_v2")          # a train.py workdir
    retrofit("path/to/llama_dir", "runs/retro_v2", arm="diff_v2")         # or an HF Llama dir

**DIFF V2, exact.** V2 keeps the baseline's K, V and W_o and gives every head a pair of query
heads. Each source query head becomes both heads of its pair, W_lambda is zero (so
sigma(lambda) = 0.5 for every token) and W_o is doubled: the pair computes A V - 0.5 A V =
0.5 A V, and the doubled W_o returns the source's output. So the retrofitted model's logits are
the source's (up to float rounding; the tests hold them to 1e-5). It is a plain V2 model from
the first step: the gradients of the pair's two query heads are the same up to the factor
-sigma(lambda) (the second map enters with the opposite sign), so training moves them apart.
Embeddings, norms, the MLP and the LM head are copied.

**DIFF V2, mixed in** (``init="mixed"``, the default: it recovered the source's loss faster
than the exact start in the CPU benchmark). Each pair's first query head is the source head and
its second one is a copy of it, small noise (std 0.02 x the source head's own) or zeros
(``second=``); W_lambda is zero, W_o is the source's, and the model config gets
``v2_mix_steps=N``: the subtraction is scaled by min(step / N, 1), so at step 0 the pair
computes A V, the source's output, whatever the second head, and from step N on the model is a
plain V2. The train and eval steps apply the ramp by step (it survives resume: the step is in
the checkpoint).

**DIFF V1, the closest start.** V1 turns two source heads (2i, 2i+1) into one DIFF head with
one attention map over a 2d-wide value and a per-head RMSNorm, so no V1 model computes the
source's function. The start used here keeps as much as the layout allows: q1/k1 of DIFF head
i are source head 2i's query and key, q2 is zero (its map is then uniform over the visible
keys) and k2 is head 2i+1's key; the value of kv group g is source kv heads 2g and 2g+1 side by
side, W_o's two halves are source heads 2i and 2i+1's; the lambda vectors are set so that
lambda = 0 exactly (lq1 = lk1 = 0, lq2 . lk2 = log(1 + lambda_init)), and the norm's gain is
1 / (1 - lambda_init), cancelling the output scale. What stays different: head 2i+1's value is
read through head 2i's map, and the RMSNorm rescales every head output to unit RMS. With a GQA
source (several query heads per kv head) the value halves also come from other kv heads than
the source heads read. The step-0 loss gap is measured, not assumed (docs/hf_conversion.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from diffjax.convert.files import ConversionError
from diffjax.model import ModelConfig, layout, matched_configs
from diffjax.ops.reference import lambda_init_for_layer

RETROFIT_ARMS = ("diff_v2", "diff_v1")
V2_INITS = ("exact", "mixed")
SECOND_HEADS = ("copy", "noise", "zeros")
# The default DIFF V2 start: mixed in, second head small noise, a 100-step ramp. It recovered the
# source's loss faster than the exact start on both seeds of benchmarks/retrofit_cpu.py
# (docs/results/retrofit_cpu.md).
DEFAULT_V2_INIT = "mixed"
DEFAULT_MIX_STEPS = 100


def retrofit_config(source: ModelConfig, arm: str) -> ModelConfig:
  """The model a Transformer ``source`` is retrofitted into: V2 with the source's heads (what
  ``matched_configs(v2_match="heads")`` gives), V1 with half the heads and kv heads (the
  matched V1 arm)."""
  if source.attention != "transformer":
    raise ConversionError(
      f"the source has attention={source.attention!r}: retrofit starts "
      "from a Transformer-arm run or an HF LlamaForCausalLM directory."
    )
  if arm not in RETROFIT_ARMS:
    raise ConversionError(f"arm={arm!r} is not one of {RETROFIT_ARMS}.")
  if arm == "diff_v1" and (source.num_heads % 2 or source.num_kv_heads % 2):
    raise ConversionError(
      f"num_heads={source.num_heads}, num_kv_heads={source.num_kv_heads}: DIFF V1 pairs the "
      "source's heads and kv heads, so both must be even."
    )
  if source.diff_fixed_lambda is not None:
    raise ConversionError("the source sets diff_fixed_lambda, a DIFF V1 ablation; clear it.")
  # V2 keeps every baseline setting (its query pairs live inside the module); V1 is the matched
  # arm (half the heads and kv heads, the same component width).
  cfg = (
    dataclasses.replace(source, attention="diff_v2")
    if arm == "diff_v2"
    else matched_configs(source, v2_match="heads")["diff_v1"]
  )
  if (cfg.mlp_dim, cfg.head_dim, cfg.d_model) != (source.mlp_dim, source.head_dim, source.d_model):
    raise ConversionError(
      f"the matched {arm} arm changes the MLP or head width of the source; "
      "retrofit needs them equal."
    )
  return cfg


def _v2_attention(
  src: Mapping[str, np.ndarray],
  init: str = "exact",
  second: str = "copy",
  rng: np.random.Generator | None = None,
) -> dict[str, np.ndarray]:
  q_ExHxD = np.asarray(src["q"])
  e, h = q_ExHxD.shape[:2]
  o = np.asarray(src["o"])
  if init == "exact":
    q2, o = q_ExHxD, 2 * o
  elif second == "copy":
    q2 = q_ExHxD
  elif second == "zeros":
    q2 = np.zeros_like(q_ExHxD)
  else:
    scale = 0.02 * np.std(q_ExHxD, axis=0, keepdims=True)
    q2 = (scale * rng.standard_normal(q_ExHxD.shape)).astype(q_ExHxD.dtype)
  return {
    "q": np.stack([q_ExHxD, q2], axis=2),
    "k": np.asarray(src["k"]),
    "v": np.asarray(src["v"]),
    "o": o,
    "w_lambda": np.zeros((e, h), q_ExHxD.dtype),
  }


def _resolve_init(arm: str, init: str | None) -> str | None:
  """The V2 start (``init``, or the default for V2); None for V1, which has one start."""
  if arm != "diff_v2":
    if init is not None:
      raise ConversionError(
        f"init={init!r} is a DIFF V2 start; DIFF V1 has its own (leave init unset)."
      )
    return None
  return DEFAULT_V2_INIT if init is None else init


def _check_v2_init(arm: str, init: str | None, second: str, mix_steps: int) -> None:
  if arm != "diff_v2":
    return
  if init not in V2_INITS:
    raise ConversionError(f"init={init!r} is not one of {V2_INITS}.")
  if second not in SECOND_HEADS:
    raise ConversionError(f"second={second!r} is not one of {SECOND_HEADS}.")
  if init == "mixed" and (isinstance(mix_steps, bool) or int(mix_steps) < 1):
    raise ConversionError(
      f"mix_steps={mix_steps!r}: init='mixed' ramps the subtraction in over "
      "mix_steps >= 1 training steps."
    )


def _v1_attention(src: Mapping[str, np.ndarray], layer_index: int) -> dict[str, np.ndarray]:
  q_ExNxD, k_ExKxD = np.asarray(src["q"]), np.asarray(src["k"])
  v_ExKxD, o_NxDxE = np.asarray(src["v"]), np.asarray(src["o"])
  e, n, d = q_ExNxD.shape
  q = np.zeros((e, n // 2, 2, d), q_ExNxD.dtype)
  q[:, :, 0] = q_ExNxD[:, 0::2]  # q1: heads 2i; q2 = 0
  k = np.stack([k_ExKxD[:, 0::2], k_ExKxD[:, 1::2]], axis=2)  # [E, K/2, 2, d]
  v = np.concatenate([v_ExKxD[:, 0::2], v_ExKxD[:, 1::2]], axis=-1)  # [E, K/2, 2d]
  o = np.concatenate([o_NxDxE[0::2], o_NxDxE[1::2]], axis=1)  # [N/2, 2d, E]
  lam_init = lambda_init_for_layer(layer_index)
  # lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init = 1 - (1 + lambda_init) + lambda_init.
  side = math.sqrt(math.log1p(lam_init) / d)
  f32 = np.float32
  return {
    "q": q,
    "k": k,
    "v": v,
    "o": o,
    "lambda_q1": np.zeros(d, f32),
    "lambda_k1": np.zeros(d, f32),
    "lambda_q2": np.full(d, side, f32),
    "lambda_k2": np.full(d, side, f32),
    "norm_scale": np.full(2 * d, 1.0 / (1.0 - lam_init), f32),
  }


def retrofit_params(
  source_cfg: ModelConfig,
  source_params: Mapping[str, Any],
  arm: str,
  *,
  init: str | None = None,
  second: str = "noise",
  mix_steps: int = DEFAULT_MIX_STEPS,
  seed: int = 0,
) -> tuple[ModelConfig, dict]:
  """``(config, params)`` of the ``arm`` model retrofitted from a Transformer.

  ``source_params`` is the per-layer (``blocks``) pure dict of
  :func:`diffjax.convert.model_params`; the result has the same layout (numpy arrays). DIFF V2
  starts ``init="exact"`` (the default) or ``"mixed"`` (``second`` head, ``mix_steps`` ramp,
  ``seed`` for the noise; the default is mixed in, small noise, 100 steps); see the module
  docstring.
  """
  init = _resolve_init(arm, init)
  _check_v2_init(arm, init, second, mix_steps)
  cfg = retrofit_config(source_cfg, arm)
  if init == "mixed":
    cfg = dataclasses.replace(cfg, v2_mix_steps=int(mix_steps))
  rng = np.random.default_rng(seed)
  source_params = layout.convert_layout(source_params, layout.UNSCANNED, source_cfg.num_layers)
  out = {k: v for k, v in source_params.items() if k != "blocks"}
  blocks = source_params["blocks"]
  new_blocks = {}
  for i in sorted(blocks, key=int):
    block = dict(blocks[i])
    attn = block["attn"]
    block["attn"] = (
      _v2_attention(attn, init, second, rng) if arm == "diff_v2" else _v1_attention(attn, int(i))
    )
    new_blocks[i] = block
  out["blocks"] = new_blocks
  return cfg, out


def _source(path: str, step: int | None) -> tuple[ModelConfig, dict, dict]:
  """(config, per-layer params, description) of a Transformer workdir or HF directory."""
  # pylint: disable=import-outside-toplevel
  from diffjax.convert.api import model_params, read_hf
  from diffjax.train.loading import load_model

  if not os.path.isdir(path):
    raise ConversionError(
      f"source {path!r} is not a directory: give a train.py workdir of the "
      "Transformer arm or an HF LlamaForCausalLM directory."
    )
  if os.path.isdir(os.path.join(path, "checkpoints")):
    model, cfg, used = load_model(path, step=step)
    return cfg, model_params(model), {"source": os.path.abspath(path), "source_step": used}
  if os.path.isfile(os.path.join(path, "config.json")):
    cfg, params, _ = read_hf(path)
    return cfg, params, {"source": os.path.abspath(path)}
  raise ConversionError(
    f"source {path!r} holds neither checkpoints/ (a train.py workdir) nor "
    "config.json (an HF directory)."
  )


def retrofit(
  source: str,
  workdir: str,
  *,
  arm: str = "diff_v2",
  step: int | None = None,
  init: str | None = None,
  second: str = "noise",
  mix_steps: int = DEFAULT_MIX_STEPS,
  seed: int = 0,
) -> ModelConfig:
  """Writes a new workdir (step 0) holding the ``arm`` model retrofitted from ``source``.

  ``source`` is a Transformer-arm ``train.py`` workdir (its newest good checkpoint, or
  ``step``) or an HF ``LlamaForCausalLM`` directory. Continue training it with
  ``train.py --config.checkpoint.init_from=<workdir>`` and a config of the same model
  (``model.arm=<arm>``, ``model.v2_match=heads``, the source's size; with ``init="mixed"``
  also ``model.v2_mix_steps=<mix_steps>``). Every check runs before anything is written.
  Returns the new model config.
  """
  # pylint: disable=import-outside-toplevel
  from diffjax.convert.api import build_model, check_new_workdir, write_workdir

  check_new_workdir(workdir)
  init = _resolve_init(arm, init)
  _check_v2_init(arm, init, second, mix_steps)
  src_cfg, src_params, meta = _source(source, step)
  cfg, params = retrofit_params(
    src_cfg, src_params, arm, init=init, second=second, mix_steps=mix_steps, seed=seed
  )
  params = layout.convert_layout(
    params, layout.SCANNED if cfg.scan_layers else layout.UNSCANNED, cfg.num_layers
  )
  model = build_model(cfg, params)  # checks every shape against the config
  write_workdir(
    workdir,
    model,
    {
      **meta,
      "retrofit": arm,
      **(
        {
          "init": init,
          **({"second": second, "mix_steps": int(mix_steps)} if init == "mixed" else {}),
        }
        if arm == "diff_v2"
        else {}
      ),
    },
  )
  return cfg
