"""Checks on run configs (``ml_collections.ConfigDict``) with actionable errors.

:func:`check_config` runs before anything is read or written, so a bad value stops a
run with one line naming it. :func:`unknown_override_message` explains a
``--config.<key>=...`` flag whose key the config does not have.
"""

from __future__ import annotations

import difflib
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from diffjax.model import ArmModel, resolve_model
from diffjax.sharding import CONTEXT_STRATEGIES

REQUIRED = (
  "model",
  "data",
  "optim",
  "checkpoint",
  "mesh",
  "seed",
  "seq_len",
  "global_batch_size",
  "grad_accum_steps",
  "num_steps",
  "log_every",
  "eval_every",
  "eval_batches",
)

# Float options and the range each must lie in: (key, low, high, low_open, high_open);
# None is an unbounded side. Every one must also be finite: a NaN learning rate, say,
# gives NaN parameters while the loss still looks finite.
_FLOAT_RANGES = (
  ("optim.lr", 0.0, None, True, False),
  ("optim.min_lr", 0.0, None, False, False),
  ("optim.b1", 0.0, 1.0, False, True),
  ("optim.b2", 0.0, 1.0, False, True),
  ("optim.eps", 0.0, None, True, False),
  ("optim.weight_decay", 0.0, None, False, False),
  ("optim.clip_norm", 0.0, None, False, False),  # 0 (or None) disables clipping
  ("task_mix.fraction", 0.0, 1.0, False, False),
  ("data.val_fraction", 0.0, 1.0, False, True),
  ("model.rope_theta", 0.0, None, True, False),
  ("model.norm_eps", 0.0, None, True, False),
  ("model.diff_norm_eps", 0.0, None, True, False),
  ("model.init_std", 0.0, None, True, False),
  ("model.diff_fixed_lambda", None, None, False, False),
)


def _get(config, dotted: str) -> tuple[bool, Any]:
  node = config
  for part in dotted.split("."):
    if not hasattr(node, "keys") or part not in node:
      return False, None
    node = node[part]
  return True, node


def _range_text(low, high, low_open: bool, high_open: bool) -> str:
  if low is not None and high is not None:
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
  if low is not None:
    return f"{'>' if low_open else '>='} {low:g}"
  if high is not None:
    return f"{'<' if high_open else '<='} {high:g}"
  return "a finite number"


def check_float_options(config) -> None:
  """Refuses non-finite or out-of-range float options (those present and not None).

  Raises:
    ValueError: naming the key, the value seen and the allowed range.
  """
  for key, low, high, low_open, high_open in _FLOAT_RANGES:
    present, value = _get(config, key)
    if not present or value is None:
      continue
    want = _range_text(low, high, low_open, high_open)
    try:
      x = float(value)
    except (TypeError, ValueError):
      raise ValueError(f"{key}={value!r} must be a number {want}.") from None
    bad = (
      not math.isfinite(x)
      or (low is not None and (x <= low if low_open else x < low))
      or (high is not None and (x >= high if high_open else x > high))
    )
    if bad:
      where = "" if want == "a finite number" else f", {want}"
      raise ValueError(f"{key}={x} must be a finite number{where}; set --config.{key}=<value>.")


def check_config(config) -> None:
  """Validates a run config before anything is read or written.

  Raises:
    ValueError: a missing section, a model section that does not resolve (an unknown arm
      or size, a bad width), a non-positive count, or a float option that is not finite or
      out of its range; the message names the value.
  """
  missing = [k for k in REQUIRED if k not in config]
  if missing:
    raise ValueError(f"Config is missing keys {missing}; start from configs/default.py.")
  resolve_model(config.model.to_dict())
  for k in (
    "seq_len",
    "global_batch_size",
    "grad_accum_steps",
    "num_steps",
    "log_every",
    "eval_batches",
  ):
    if int(config[k]) <= 0:
      raise ValueError(f"{k}={config[k]} must be a positive integer.")
  skips = config.get("max_skipped_updates", 0)
  if isinstance(skips, bool) or not isinstance(skips, int) or skips < 0:
    raise ValueError(
      f"max_skipped_updates={skips!r} must be an integer >= 0 (updates skipped "
      "as non-finite before the run stops; 0 stops at the first)."
    )
  if int(config.eval_every) < 0:
    raise ValueError(f"eval_every={config.eval_every} must be >= 0 (0 disables periodic eval).")
  if int(config.checkpoint.every) <= 0 or int(config.checkpoint.keep) <= 0:
    raise ValueError(
      f"checkpoint.every={config.checkpoint.every} and checkpoint.keep="
      f"{config.checkpoint.keep} must be positive."
    )
  check_float_options(config)
  lr, min_lr = float(config.optim.lr), float(config.optim.min_lr)
  if min_lr > lr:
    raise ValueError(f"optim.min_lr={min_lr} must be <= optim.lr={lr}.")
  strategy = mesh_context_options(config)["context_strategy"]
  if strategy not in CONTEXT_STRATEGIES:
    raise ValueError(f"mesh.context_strategy={strategy!r} is not one of {CONTEXT_STRATEGIES}.")
  shape = tuple(config.mesh.shape)
  context = int(shape[3]) if len(shape) == 4 else 1
  if context > 1:
    chunk = 2 * context if mesh_context_options(config)["context_load_balance"] else context
    if int(config.seq_len) % chunk:
      raise ValueError(
        f"seq_len={config.seq_len} must be a multiple of {chunk} to shard the "
        f"sequence over a context axis of {context}"
        f"{' in load-balanced halves' if chunk > context else ''}."
      )


def mesh_context_options(config) -> dict[str, Any]:
  """The ``mesh`` section's context-parallel settings, as keyword arguments of the setup."""
  return {
    "context_strategy": config.mesh.context_strategy,
    "context_load_balance": bool(config.mesh.context_load_balance),
  }


def resolved_model(config, tokenizer_vocab: int) -> ArmModel:
  """The run's model (:func:`diffjax.model.resolve_model`); ``vocab_size=-1`` takes the
  tokenizer's vocabulary."""
  arm_model = resolve_model(config.model.to_dict(), vocab_size=tokenizer_vocab)
  if arm_model.config.vocab_size < tokenizer_vocab:
    raise ValueError(
      f"model.vocab_size={arm_model.config.vocab_size} is smaller than the "
      f"tokenizer's vocabulary ({tokenizer_vocab}); set it to -1 to use the "
      "tokenizer's."
    )
  return arm_model


# ----------------------------------------------------------------------------------------------
# Unknown --config.<key> overrides.


def flat_keys(config, prefix: str = "") -> Iterator[str]:
  """Every value key of a (nested) ConfigDict as a dotted path (sections are descended
  into, not listed)."""
  for k in config.keys():
    path = f"{prefix}{k}"
    value = config[k]
    if hasattr(value, "keys") and not isinstance(value, dict):  # a ConfigDict section
      yield from flat_keys(value, path + ".")
    else:
      yield path


def unknown_key(config, dotted: str) -> str | None:
  """The first prefix of ``dotted`` that is not a key of ``config``, or None if all are."""
  node, parts = config, dotted.split(".")
  for i, part in enumerate(parts):
    if not hasattr(node, "keys") or isinstance(node, dict) or part not in node:
      return ".".join(parts[: i + 1])
    node = node[part]
  return None


def suggest_keys(config, key: str, n: int = 3) -> list[str]:
  """The valid dotted keys nearest to ``key`` (by spelling of the whole path or of its
  last part), at most ``n``."""
  keys = list(flat_keys(config))
  close = difflib.get_close_matches(key, keys, n=n, cutoff=0.6)
  if len(close) < n:
    last = key.rsplit(".", 1)[-1]
    by_leaf: dict[str, list[str]] = {}
    for k in keys:
      by_leaf.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    for leaf in difflib.get_close_matches(last, list(by_leaf), n=n, cutoff=0.75):
      close += [k for k in by_leaf[leaf] if k not in close]
  return close[:n]


def override_keys(argv: Sequence[str], flag: str = "config") -> list[tuple[str, str]]:
  """``(key, argument)`` of every ``--<flag>.<key>[=value]`` argument in ``argv``."""
  out = []
  for arg in argv:
    for start in (f"--{flag}.", f"-{flag}."):
      if arg.startswith(start):
        out.append((arg[len(start) :].split("=", 1)[0], arg))
        break
  return out


def unknown_override_message(config, argv: Sequence[str], flag: str = "config") -> str | None:
  """One line naming the first ``--config.<key>`` override whose key ``config`` lacks,
  with the nearest valid keys (or the top-level keys if none is near); None if every
  override names an existing key."""
  for key, arg in override_keys(argv, flag):
    bad = unknown_key(config, key)
    if bad is None:
      continue
    if bad.endswith("model.attention"):
      return (
        f"unknown config key {key!r} in {arg}: a run's arm is --{flag}."
        f"{bad.removesuffix('attention')}arm=<transformer|diff_v1|diff_v2>, which derives "
        "the arm's widths from the Transformer it is matched to."
      )
    parent = bad.rsplit(".", 1)[0] if "." in bad else ""
    _, node = _get(config, parent) if parent else (True, config)
    if parent and (not hasattr(node, "keys") or isinstance(node, dict)):
      return (
        f"unknown config key {key!r} in {arg}: {parent} is a value, not a section; "
        f"set it with --{flag}.{parent}=<value>."
      )
    # A typo in one part: the same key with that part corrected, then near spellings.
    parts, depth = key.split("."), bad.count(".")
    near = []
    for fix in difflib.get_close_matches(parts[depth], list(node.keys()), n=3, cutoff=0.6):
      fixed = ".".join(parts[:depth] + [fix] + parts[depth + 1 :])
      if unknown_key(config, fixed) is None:
        near.append(fixed)
    near += [k for k in suggest_keys(config, bad) if k not in near]
    near = near[:3]
    if near:
      hint = "did you mean " + " or ".join(f"--{flag}.{k}" for k in near) + "?"
    else:
      scope = f"{parent}." if parent else ""
      hint = (
        f"the keys{' of ' + parent if parent else ''} are "
        + ", ".join(f"{scope}{k}" for k in node.keys())
        + "."
      )
    return f"unknown config key {key!r} in {arg}; {hint}"
  return None


def explain_flag_error(argv: Sequence[str], flag: str = "config") -> str | None:
  """After a failed flag parse: :func:`unknown_override_message` for ``argv``.

  Loads the config file named by ``--<flag>=`` alone (without the overrides) to learn
  its keys. Returns None when the config cannot be loaded or every key exists (the
  parse failed for another reason, e.g. a value of the wrong type).
  """
  from absl import flags as absl_flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  prefixes = (f"--{flag}.", f"-{flag}.")
  plain = [a for a in argv if not a.startswith(prefixes)]
  values = absl_flags.FlagValues()
  holder = config_flags.DEFINE_config_file(flag, None, "", flag_values=values)
  # ml_collections reads the overrides from sys.argv too: hide them while loading.
  saved, sys.argv = sys.argv, plain
  try:
    values(plain, known_only=True)
    config = holder.value
  except Exception:  # pylint: disable=broad-except  # the caller reports the original error
    return None
  finally:
    sys.argv = saved
  return None if config is None else unknown_override_message(config, argv, flag)


def describe_run(config) -> str:
  """What a run config trains, checked as the trainer checks it, without reading data: the
  model it resolves to (its arm, what it is matched to, its parameter counts and widths), the
  batch and schedule, and the data it names."""
  check_config(config)
  vocab = int(config.model.vocab_size)
  if vocab == -1:
    try:
      from diffjax.data import load_tokenizer  # pylint: disable=import-outside-toplevel

      vocab = load_tokenizer(config.data.tokenizer).vocab_size
    except Exception:  # pylint: disable=broad-except  # a tokenizer path given at launch
      vocab = -1
  arm_model = resolve_model(config.model.to_dict(), vocab_size=None if vocab == -1 else vocab)
  m = arm_model.config
  widths = (
    f"d_model={m.d_model} num_layers={m.num_layers} num_heads={m.num_heads} "
    f"num_kv_heads={m.num_kv_heads} head_dim={m.head_dim} mlp_dim={m.mlp_dim} "
    f"vocab_size={m.vocab_size if vocab != -1 else 'the tokenizer' + chr(39) + 's'}"
  )
  data = config.data
  return "\n".join(
    [
      "model: " + arm_model.describe(),
      f"  {m.attention} widths: {widths}",
      f"run: seq_len={config.seq_len} global_batch_size={config.global_batch_size} "
      f"grad_accum_steps={config.grad_accum_steps} num_steps={config.num_steps} "
      f"tokens={config.seq_len * config.global_batch_size * config.num_steps:,} "
      f"lr={config.optim.lr} ({config.optim.schedule}, warmup {config.optim.warmup_steps}) "
      f"seed={config.seed} mesh={tuple(config.mesh.shape)}",
      f"data: kind={data.kind} paths={tuple(data.paths)} tokenizer={data.tokenizer!r} "
      f"val_fraction={data.val_fraction}",
    ]
  )
