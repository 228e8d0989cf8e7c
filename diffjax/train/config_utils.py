"""Checks on run configs (``ml_collections.ConfigDict``) with actionable errors."""

from __future__ import annotations

from diffjax.model import ARMS, ModelConfig

REQUIRED = ("model", "data", "optim", "checkpoint", "mesh", "seed", "seq_len",
            "global_batch_size", "grad_accum_steps", "num_steps", "log_every", "eval_every",
            "eval_batches")


def check_config(config) -> None:
  missing = [k for k in REQUIRED if k not in config]
  if missing:
    raise ValueError(f"Config is missing keys {missing}; start from configs/default.py.")
  arm = config.model.get("attention")
  if arm not in ARMS:
    raise ValueError(f"model.attention={arm!r} is not a known arm; choose one of {ARMS}.")
  for k in ("seq_len", "global_batch_size", "grad_accum_steps", "num_steps", "log_every",
            "eval_batches"):
    if int(config[k]) <= 0:
      raise ValueError(f"{k}={config[k]} must be a positive integer.")
  if int(config.eval_every) < 0:
    raise ValueError(f"eval_every={config.eval_every} must be >= 0 (0 disables periodic eval).")
  if int(config.checkpoint.every) <= 0 or int(config.checkpoint.keep) <= 0:
    raise ValueError(f"checkpoint.every={config.checkpoint.every} and checkpoint.keep="
                     f"{config.checkpoint.keep} must be positive.")


def resolved_model_config(config, tokenizer_vocab: int) -> ModelConfig:
  """The typed model config; ``vocab_size=-1`` takes the tokenizer's vocabulary."""
  d = config.model.to_dict()
  if d.get("vocab_size", -1) == -1:
    d["vocab_size"] = tokenizer_vocab
  cfg = ModelConfig.from_dict(d)
  if cfg.vocab_size < tokenizer_vocab:
    raise ValueError(f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's "
                     f"vocabulary ({tokenizer_vocab}); set it to -1 to use the tokenizer's.")
  return cfg
