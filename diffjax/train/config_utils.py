"""A run config on the command line: what ``--dry_run`` prints, the default workdir, the
override help and the renamed keys that train.py, ``python -m diffjax.compare`` and
``python -m diffjax.aot`` share, and the model a run resolves to once its tokenizer is known.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from diffjax import arms
from diffjax.cli import RenamedKey
from diffjax.model import ArmModel, resolve_model
from diffjax.train.config import RunConfig, check_config

__all__ = [
  "OVERRIDE_HELP",
  "RENAMED_KEYS",
  "check_config",
  "default_workdir",
  "describe_run",
  "resolved_model",
]

OVERRIDE_HELP = """\
Overrides: --config.<key>=<value> sets any key of the config (values are Python literals):
  --config.model.arm=diff_v2          the arm; its widths are derived again from the
                                      Transformer it is matched to (model.size and the
                                      model.d_model/num_heads/... baseline widths)
  --config.model.size=small           another baseline size (model.sizes)
  --config.model.v2_match=heads       how DIFF V2 is matched: params (default) or heads
  --config.model.unmatched.mlp_dim=256  an arm width set on purpose: the run is then
                                      reported as UNMATCHED, with its parameter counts
  --config.num_steps=2000 --config.optim.lr=1e-3 --config.data.paths="('corpus/',)"
"""

# Keys a run config does not have, answered with the one that replaced them.
RENAMED_KEYS = (
  RenamedKey(
    old="model.attention",
    new="model.arm",
    text="a run's arm is {new}=<"
    + "|".join(arms.names())
    + ">, which derives the arm's widths from "
    "the Transformer it is matched to.",
  ),
)


def resolved_model(model: Mapping[str, Any], tokenizer_vocab: int) -> ArmModel:
  """The model of a run's ``model`` section (:func:`diffjax.model.resolve_model`);
  ``vocab_size=-1`` takes the tokenizer's vocabulary."""
  arm_model = resolve_model(model, vocab_size=tokenizer_vocab)
  if arm_model.config.vocab_size < tokenizer_vocab:
    raise ValueError(
      f"model.vocab_size={arm_model.config.vocab_size} is smaller than the "
      f"tokenizer's vocabulary ({tokenizer_vocab}); set it to -1 to use the "
      "tokenizer's."
    )
  return arm_model


def describe_run(config) -> str:
  """What a run config trains, checked as the trainer checks it, without reading data: the
  model it resolves to (its arm, what it is matched to, its parameter counts and widths), the
  batch and schedule, and the data it names (which may be named at launch)."""
  run = RunConfig.from_config(config, data_at_launch=True)
  data = config.data if run.data is None else run.data
  vocab = run.fixed_vocab_size
  if vocab is None:
    try:
      from diffjax.data import load_tokenizer  # pylint: disable=import-outside-toplevel

      vocab = load_tokenizer(data.tokenizer).vocab_size
    except Exception:  # pylint: disable=broad-except  # a tokenizer path given at launch
      vocab = None
  arm_model = resolve_model(run.model, vocab_size=vocab)
  m = arm_model.config
  widths = (
    f"d_model={m.d_model} num_layers={m.num_layers} num_heads={m.num_heads} "
    f"num_kv_heads={m.num_kv_heads} head_dim={m.head_dim} mlp_dim={m.mlp_dim} "
    f"vocab_size={m.vocab_size if vocab is not None else 'the tokenizer' + chr(39) + 's'}"
  )
  return "\n".join(
    [
      "model: " + arm_model.describe(),
      f"  {m.attention} widths: {widths}",
      f"run: seq_len={run.seq_len} global_batch_size={run.global_batch_size} "
      f"grad_accum_steps={run.grad_accum_steps} num_steps={run.num_steps} "
      f"tokens={run.tokens_per_step * run.num_steps:,} "
      f"lr={run.optim.lr} ({run.optim.schedule}, warmup {run.optim.warmup_steps}, min_lr "
      f"{run.optim.min_lr} at step {run.optim.decay_steps}) "
      f"seed={run.seed} mesh={run.mesh.shape}",
      f"data: kind={data.kind} paths={tuple(data.paths)} tokenizer={data.tokenizer!r} "
      f"val_fraction={data.val_fraction}",
      *filter(None, [run.optim.decay_note(run.num_steps)]),
    ]
  )


def default_workdir(config_arg: str, argv: Sequence[str]) -> str:
  """runs/<file stem>[_<argument>] for ``--config=<path>[:<argument>]``, with ``_<arm>`` added
  when the command line sets ``--config.model.arm`` (another arm is another run)."""
  path, _, arg = config_arg.partition(":")
  name = os.path.splitext(os.path.basename(path))[0] + (f"_{arg}" if arg else "")
  for a in argv:
    if a.startswith("--config.model.arm="):
      name += "_" + a.split("=", 1)[1]
  return os.path.join("runs", "".join(c if c.isalnum() or c in "._-" else "_" for c in name))
