"""Starting an arm from a trained Transformer: DIFF V2 exactly, DIFF V1 from a start with
lambda = 0 (`retrofit` on a workdir or an HF Llama directory, `retrofit_params` on arrays).

Each arm's rule is its :attr:`diffjax.arms.ArmSpec.retrofit`; the starts: docs/hf_conversion.md.
"""

from __future__ import annotations

import os
import shlex
import shutil
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
  used = {**rule.options, **given}
  if used.get("init") == "exact":
    # The exact start has no ramp and copies the first head: these would be ignored.
    for name in ("second", "mix_steps"):
      if name in given:
        raise ConversionError(
          f"{name}={given[name]!r} applies to init='mixed' only (init='exact' starts the second "
          f"head as a copy of the first, with no ramp): leave --{name} out or use --init=mixed."
        )
  return used


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
  """(config, per-layer params, description) of a Transformer workdir or HF directory; the
  description also holds the source run's config (``run_config``) or its HF directory's
  tokenizer file (``tokenizer``), for the command that continues the retrofit, and what an
  export of the source carries (``export``), which an export of the retrofit carries too."""
  # pylint: disable=import-outside-toplevel
  from diffjax.convert.api import export_defaults, hf_dir_export_defaults, model_params, read_hf
  from diffjax.train.loading import load_run

  if not os.path.isdir(path):
    raise ConversionError(
      f"source {path!r} is not a directory: give a train.py workdir of the "
      "Transformer arm or an HF LlamaForCausalLM directory."
    )
  if os.path.isdir(os.path.join(path, "checkpoints")):
    run = load_run(path, step=step)
    return (
      run.model_config,
      model_params(run.model),
      {
        "source": os.path.abspath(path),
        "source_step": run.step,
        "run_config": run.config,
        "export": export_defaults(run),
      },
    )
  if os.path.isfile(os.path.join(path, "config.json")):
    if step is not None:
      raise ConversionError(
        f"--step={step} picks a checkpoint of a train.py workdir, but source {path!r} is an HF "
        "directory, which holds one: leave --step out."
      )
    cfg, params, hf_config = read_hf(path)
    tokenizer = os.path.join(path, "tokenizer.json")
    described = {"source": os.path.abspath(path), "export": hf_dir_export_defaults(path, hf_config)}
    if os.path.isfile(tokenizer):
      described["tokenizer"] = os.path.abspath(tokenizer)
    return cfg, params, described
  raise ConversionError(
    f"source {path!r} holds neither checkpoints/ (a train.py workdir) nor "
    "config.json (an HF directory)."
  )


# The model settings the continuing run must state as the source has them: the widths (the
# run's arm is matched to a Transformer of these), the vocabulary and the settings that change
# what the weights compute (diffjax.train.loading.FUNCTION_FIELDS, which init_from checks).
_SOURCE_WIDTHS = ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim")
_SOURCE_SETTINGS = ("vocab_size", "tie_embeddings", "rope_style", "rope_theta", "norm_eps")


def _shown_path(path: str) -> str:
  """``path`` relative to the working directory when it lies below it, else absolute."""
  rel = os.path.relpath(path)
  return rel if not rel.startswith("..") else os.path.abspath(path)


def continue_command(
  source_cfg: ModelConfig, cfg: ModelConfig, workdir: str, described: Mapping[str, Any]
) -> str:
  """The ``train.py`` command line that continues the retrofit in ``workdir`` into
  ``<workdir>_continued``: the default config with the source's model (widths, vocabulary,
  RoPE and norm settings), the arm, and for a workdir source its sequence length and data.

  Every setting ``checkpoint.init_from`` checks is stated, so the command runs as printed
  (from any directory); append overrides of the schedule or batch as wanted.
  """
  # pylint: disable=import-outside-toplevel
  from diffjax.cli import REPO_ROOT, load_config
  from diffjax.train.loading import FUNCTION_FIELDS

  config_file = os.path.join(REPO_ROOT, "configs", "default.py")
  base = load_config(config_file).model
  model: dict[str, Any] = {"arm": cfg.attention, "size": "custom"}
  model.update({k: getattr(source_cfg, k) for k in _SOURCE_WIDTHS + _SOURCE_SETTINGS})
  # The arm's own settings where the retrofit's differ from the config's.
  model.update(
    {
      k: getattr(cfg, k)
      for k in FUNCTION_FIELDS
      if k not in model and k in base and getattr(cfg, k) != base[k]
    }
  )
  model["v2_match"] = "heads"  # the retrofit keeps the source's heads (V1: half of them)
  if cfg.v2_mix_steps:
    model["v2_mix_steps"] = cfg.v2_mix_steps
  overrides = [(f"model.{k}", v) for k, v in model.items()]
  run = described.get("run_config") or {}
  if run.get("seq_len"):
    overrides.append(("seq_len", int(run["seq_len"])))
  data = run.get("data") or {}
  for key in ("kind", "paths", "tokenizer"):
    if data.get(key) not in (None, "", [], ()):
      value = data[key]
      overrides.append((f"data.{key}", tuple(value) if isinstance(value, list) else value))
  if described.get("tokenizer"):
    overrides.append(("data.tokenizer", described["tokenizer"]))
  overrides.append(("checkpoint.init_from", _shown_path(workdir)))

  def flag(key: str, value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return shlex.quote(f"--config.{key}={text}")

  return " ".join(
    [
      "python",
      shlex.quote(_shown_path(os.path.join(REPO_ROOT, "train.py"))),
      shlex.quote(f"--config={_shown_path(config_file)}"),
      shlex.quote(f"--workdir={_shown_path(workdir.rstrip(os.sep))}_continued"),
      *(flag(k, v) for k, v in overrides),
    ]
  )


def retrofit_run(
  source: str,
  workdir: str,
  *,
  arm: str = "diff_v2",
  step: int | None = None,
  seed: int = 0,
  **options,
) -> tuple[ModelConfig, str]:
  """:func:`retrofit`, and the :func:`continue_command` that trains the result further."""
  # pylint: disable=import-outside-toplevel
  from diffjax.convert.api import build_model, write_workdir

  _check_target(source, workdir)
  used = _options(arm, options)
  src_cfg, src_params, described = _source(source, step)
  cfg, params = retrofit_params(src_cfg, src_params, arm, seed=seed, **options)
  params = layout.convert_layout(
    params, layout.SCANNED if cfg.scan_layers else layout.UNSCANNED, cfg.num_layers
  )
  model = build_model(cfg, params)  # checks every shape against the config
  meta = {k: v for k, v in described.items() if k in ("source", "source_step", "export")}
  # Written beside the workdir and renamed onto it when whole: a retrofit stopped while
  # writing leaves only the partial copy, which the next attempt removes.
  partial = _partial_dir(workdir)
  shutil.rmtree(partial, ignore_errors=True)
  write_workdir(partial, model, {**meta, "retrofit": arm, **used})
  os.rename(partial, workdir)  # onto a missing or empty directory
  return cfg, continue_command(src_cfg, cfg, workdir, described)


def _partial_dir(workdir: str) -> str:
  """Where :func:`retrofit_run` writes ``workdir`` before renaming it into place."""
  parent, name = os.path.split(os.path.abspath(workdir))
  return os.path.join(parent, f".{name}.retrofit-partial")


def _check_target(source: str, workdir: str) -> None:
  """Refuses a ``workdir`` that is the source or lies inside it, holds checkpoints, or holds
  anything else."""
  from diffjax.convert.api import check_new_workdir  # pylint: disable=import-outside-toplevel

  src, target = os.path.realpath(source), os.path.realpath(workdir)
  if target == src or target.startswith(src + os.sep):
    where = "the source directory" if target == src else "inside the source"
    raise ConversionError(
      f"--workdir={workdir!r} is {where} {source!r}: give a new directory for the retrofitted run."
    )
  check_new_workdir(workdir)
  held = sorted(os.listdir(workdir)) if os.path.isdir(workdir) else []
  if held:
    shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
    raise ConversionError(
      f"--workdir={workdir!r} is not empty (it holds {shown}): give a new or empty directory "
      "for the retrofitted run."
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
  :func:`retrofit_params`). Continuing it with ``train.py``: :func:`continue_command`,
  docs/hf_conversion.md. Every check runs before anything is written. Returns the new model
  config.
  """
  return retrofit_run(source, workdir, arm=arm, step=step, seed=seed, **options)[0]
