"""Starting an arm from a trained Transformer: DIFF V2 exactly, DIFF V1 as close as its layout
allows (`retrofit` on a workdir or an HF Llama directory, `retrofit_params` on arrays).

Each arm's rule is its :attr:`diffjax.arms.ArmSpec.retrofit`; the starts: docs/hf_conversion.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from diffjax import arms
from diffjax.convert.files import ConversionError
from diffjax.model import ModelConfig, layout


def _retrofit_of(arm: str) -> arms.Retrofit:
  able = [a.name for a in arms.all_arms() if a.retrofit is not None]
  if arm not in able:
    raise ConversionError(f"arm={arm!r} is not one of {tuple(able)} (the arms with a retrofit).")
  return arms.get(arm).retrofit


def _options(arm: str, options: Mapping[str, Any]) -> dict[str, Any]:
  """The arm's retrofit options: its defaults, with those given (None: the default)."""
  rule = _retrofit_of(arm)
  given = {k: v for k, v in options.items() if v is not None}
  bad = sorted(set(given) - set(rule.options))
  if bad:
    raise ConversionError(
      f"{bad[0]}={given[bad[0]]!r}: the {arm} retrofit takes "
      + (f"only {sorted(rule.options)}" if rule.options else "no options")
      + " (leave the others unset)."
    )
  return {**rule.options, **given}


def retrofit_config(source: ModelConfig, arm: str, **options) -> ModelConfig:
  """The model a Transformer ``source`` is retrofitted into (the arm's rule: DIFF V2 with the
  source's heads, DIFF V1 the matched arm with half the heads and kv heads)."""
  if not arms.get(source.attention).is_baseline:
    raise ConversionError(
      f"the source has attention={source.attention!r}: retrofit starts "
      "from a Transformer-arm run or an HF LlamaForCausalLM directory."
    )
  if source.diff_fixed_lambda is not None:
    raise ConversionError("the source sets diff_fixed_lambda, a DIFF V1 ablation; clear it.")
  rule = _retrofit_of(arm)
  try:
    cfg = rule.config(source, **_options(arm, options))
  except ValueError as e:
    raise ConversionError(str(e)) from None
  if (cfg.mlp_dim, cfg.head_dim, cfg.d_model) != (source.mlp_dim, source.head_dim, source.d_model):
    raise ConversionError(
      f"the matched {arm} arm changes the MLP or head width of the source; "
      "retrofit needs them equal."
    )
  return cfg


def retrofit_params(
  source_cfg: ModelConfig, source_params: Mapping[str, Any], arm: str, *, seed: int = 0, **options
) -> tuple[ModelConfig, dict]:
  """``(config, params)`` of the ``arm`` model retrofitted from a Transformer.

  ``source_params`` is the per-layer (``blocks``) pure dict of
  :func:`diffjax.convert.model_params`; the result has the same layout (numpy arrays).
  ``options`` are the arm's own (DIFF V2: ``init`` "mixed" (the default) or "exact",
  ``second`` head and ``mix_steps`` ramp; docs/hf_conversion.md); ``seed`` draws any
  noise.
  """
  cfg = retrofit_config(source_cfg, arm, **options)
  rule, options = _retrofit_of(arm), _options(arm, options)
  rng = np.random.default_rng(seed)
  source_params = layout.convert_layout(source_params, layout.UNSCANNED, source_cfg.num_layers)
  out = {k: v for k, v in source_params.items() if k != "blocks"}
  out["blocks"] = {}
  for i in sorted(source_params["blocks"], key=int):
    block = dict(source_params["blocks"][i])
    block["attn"] = rule.attention(block["attn"], int(i), rng, **options)
    out["blocks"][i] = block
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
  seed: int = 0,
  **options,
) -> ModelConfig:
  """Writes a new workdir (step 0) holding the ``arm`` model retrofitted from ``source``.

  ``source`` is a Transformer-arm ``train.py`` workdir (its newest good checkpoint, or
  ``step``) or an HF ``LlamaForCausalLM`` directory; ``options`` are the arm's own (see
  :func:`retrofit_params`). Continuing it with ``train.py``: docs/hf_conversion.md. Every
  check runs before anything is written. Returns the new model config.
  """
  # pylint: disable=import-outside-toplevel
  from diffjax.convert.api import build_model, check_new_workdir, write_workdir

  check_new_workdir(workdir)
  used = _options(arm, options)
  src_cfg, src_params, meta = _source(source, step)
  cfg, params = retrofit_params(src_cfg, src_params, arm, seed=seed, **options)
  params = layout.convert_layout(
    params, layout.SCANNED if cfg.scan_layers else layout.UNSCANNED, cfg.num_layers
  )
  model = build_model(cfg, params)  # checks every shape against the config
  write_workdir(workdir, model, {**meta, "retrofit": arm, **used})
  return cfg
