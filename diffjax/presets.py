"""The run config's schema and defaults, loading config files, and the parameter table.

:func:`base_config` holds every key a run reads, with CPU-friendly defaults; the files in
``configs/`` start from it and state the values of their run (arm, size, data, schedule,
batch, steps, mesh). A run's ``model`` section names its arm and the Transformer it is
matched to (see :mod:`diffjax.model.arms`), so ``--config.model.arm=diff_v2`` on any config
trains the matched DIFF V2.

``python -m diffjax.presets`` prints the parameter counts of the paper's sizes per arm.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import ml_collections

from diffjax.core.config import DEFAULT_V2_MATCH
from diffjax.model import count_params, resolve_model
from diffjax.model.flops import flops_per_token
from diffjax.model.sizes import PAPER_SIZES, PAPER_VOCAB, WIDTHS

_placeholder = ml_collections.config_dict.placeholder


def model_section(
  arm: str = "diff_v1", size: str = "default", **values
) -> ml_collections.ConfigDict:
  """A run's ``model`` section: ``arm`` matched to the Transformer of ``size``.

  Every baseline width (``d_model, num_layers, num_heads, num_kv_heads, head_dim, mlp_dim``)
  is None (the size's) unless given; ``unmatched`` holds the arm's own widths, None unless
  an experiment sets them on purpose. ``values`` set other keys (ModelConfig fields).
  """
  m = ml_collections.ConfigDict()
  m.arm = arm
  m.size = size
  m.v2_match = DEFAULT_V2_MATCH
  for k in WIDTHS:
    m[k] = _placeholder(int)
  m.unmatched = ml_collections.ConfigDict({k: _placeholder(int) for k in WIDTHS})
  m.vocab_size = -1  # -1: the tokenizer's vocabulary
  m.rope_theta = 10000.0
  m.rope_style = "interleaved"
  m.norm_eps = 1e-5
  m.diff_norm_eps = 1e-5
  m.tie_embeddings = False
  m.init_std = 0.02
  m.dtype = "float32"
  m.param_dtype = "float32"
  m.remat = "none"
  m.scan_layers = False
  m.implementation = "auto"
  m.block_sizes = _placeholder(dict)
  m.interpret = False
  m.diff_use_norm = True
  m.diff_fixed_lambda = _placeholder(float)
  m.v2_pairing = "group"
  m.v2_lambda = "sigmoid"
  m.v2_mix_steps = 0
  for k, v in values.items():
    if k not in m:
      raise ValueError(f"model_section: unknown key {k!r}.")
    m[k] = v
  return m


def base_config() -> ml_collections.ConfigDict:
  """Every key a run reads, with CPU-friendly defaults (the default model is DIFF V1)."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.seq_len = 256
  c.global_batch_size = 16
  c.grad_accum_steps = 1
  c.num_steps = 1000
  c.log_every = 50
  c.eval_every = 250
  c.eval_batches = 8
  c.tensorboard = True
  c.log_batch_hash = False
  # Updates skipped as non-finite (loss, gradient or update) before the run stops; each is
  # counted in metrics.jsonl (train/skipped) and final_metrics.json. 0: stop at the first.
  c.max_skipped_updates = 0

  c.model = model_section()

  c.data = ml_collections.ConfigDict(
    dict(
      kind="stdlib",
      paths=(),
      tokenizer="byte",
      val_fraction=0.01,
      split_seed=0,
      max_documents=_placeholder(int),
      max_tokens=_placeholder(int),
      shuffle=True,
      streams_per_row=16,
      prefetch_batches=4,
      shards_per_group=16,
    )
  )

  c.optim = ml_collections.ConfigDict(
    dict(
      lr=3e-3,
      min_lr=3e-4,
      warmup_steps=50,
      schedule="cosine",
      decay_steps=1000,
      b1=0.9,
      b2=0.95,
      eps=1e-8,
      weight_decay=0.1,
      clip_norm=1.0,
    )
  )

  # Synthetic retrieval examples mixed into training (diffjax/train/task_mix.py).
  c.task_mix = ml_collections.ConfigDict(
    dict(
      task="none",
      fraction=0.0,
      context_len=512,
      num_needles=2,
      num_queries=1,
      num_pairs=16,
      distractors_per_query=1,
      key_len=3,
      value_len=3,
      separator=":",
      grid=(),
      num_examples=0,
      loss="all",
    )
  )
  # init_from: a train.py workdir whose newest parameters a fresh run starts from (fresh
  # optimizer state, step 0); ignored once this run has a checkpoint of its own. None where a
  # config requires it (check_config names it).
  c.checkpoint = ml_collections.ConfigDict(
    dict(every=500, keep=2, async_save=True, init_from=_placeholder(str))
  )
  c.checkpoint.init_from = ""
  # mesh.shape: (data, fsdp, tensor[, context]); one entry may be -1 ("the rest").
  c.mesh = ml_collections.ConfigDict(
    dict(
      shape=(-1, 1, 1), rules=_placeholder(list), context_strategy="ring", context_load_balance=True
    )
  )
  # peer_timeout_s: a process whose peer stops answering this long says so and exits (75).
  # supervise: with several processes, train.py trains in a child process, so that a lost
  # coordinator is said in one line too (diffjax/train/supervise.py).
  c.distributed = ml_collections.ConfigDict(
    dict(initialize=_placeholder(bool), peer_timeout_s=60.0, supervise=True)
  )
  # Dense bf16 peak FLOP/s per device for the MFU; None: by device kind (TPU, GPU), no MFU
  # on a CPU unless given.
  c.peak_flops = _placeholder(float)
  # steps=(first, last): a profiler trace of those steps; dump_hlo: the train step's HLO.
  c.profile = ml_collections.ConfigDict(dict(steps=(), dump_hlo=False))
  # preflight: on a GPU or TPU, run each fused kernel the model chose once against XLA
  # before the first step; a failing one is switched to the stock path (diffjax/ops/preflight.py).
  c.kernels = ml_collections.ConfigDict(dict(preflight=True))
  return c


def load_config(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """``get_config(arg)`` (or ``get_config()``) of the config file at ``path``.

  For config files that build on another one (a comparison on a run config).
  """
  path = os.path.abspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"No config file at {path}.")
  name = "diffjax_config_" + "".join(ch if ch.isalnum() else "_" for ch in path)
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module.get_config() if arg is None else module.get_config(arg)


def param_table(sizes=PAPER_SIZES, vocab_size: int = PAPER_VOCAB) -> str:
  """A markdown table of parameter counts per arm for the named sizes, each arm matched to
  the Transformer of that size; DIFF V2 both ways (``v2_match`` "params" and "heads")."""
  rows = [
    "| size | d_model | layers | heads (T / V1 / V2 pairs) | d | Transformer | DIFF V1 | "
    "V1 - T | DIFF V2 (params) | V2 - T | DIFF V2 (heads) | V2 - T |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for size in sizes:
    section = model_section(size=size, vocab_size=vocab_size).to_dict()
    arm = {
      a: resolve_model({**section, "arm": a}).config for a in ("transformer", "diff_v1", "diff_v2")
    }
    v2_heads = resolve_model({**section, "arm": "diff_v2", "v2_match": "heads"}).config
    n = {a: count_params(cfg) for a, cfg in arm.items()}
    n_heads = count_params(v2_heads)
    t = arm["transformer"]
    rows.append(
      f"| {size} | {t.d_model} | {t.num_layers} | {t.num_heads} / "
      f"{arm['diff_v1'].num_heads} / {arm['diff_v2'].num_heads} | {t.head_dim} | "
      f"{n['transformer']:,} | {n['diff_v1']:,} | {n['diff_v1'] - n['transformer']:+,} | "
      f"{n['diff_v2']:,} | {n['diff_v2'] - n['transformer']:+,} | "
      f"{n_heads:,} | {n_heads - n['transformer']:+,} |"
    )
  return "\n".join(rows)


def flops_table(sizes=PAPER_SIZES, seq_len: int = 4096, vocab_size: int = PAPER_VOCAB) -> str:
  """A markdown table of training FLOPs per token per arm (:func:`diffjax.model.flops.
  flops_per_token`: forward + backward, causal, no remat) at ``seq_len``, with each DIFF arm's
  ratio to the Transformer of its size."""
  rows = [
    "| size | Transformer GFLOP/token | DIFF V1 | V1 / T | DIFF V2 (params) | V2 / T |",
    "|---|---|---|---|---|---|",
  ]
  for size in sizes:
    section = model_section(size=size, vocab_size=vocab_size).to_dict()
    f = {
      a: flops_per_token(resolve_model({**section, "arm": a}).config, seq_len).model
      for a in ("transformer", "diff_v1", "diff_v2")
    }
    t = f["transformer"]
    rows.append(
      f"| {size} | {t / 1e9:.2f} | {f['diff_v1'] / 1e9:.2f} | {f['diff_v1'] / t:.3f} | "
      f"{f['diff_v2'] / 1e9:.2f} | {f['diff_v2'] / t:.3f} |"
    )
  return "\n".join(rows)


def main(argv=None) -> None:
  import argparse  # pylint: disable=import-outside-toplevel

  argparse.ArgumentParser(
    prog="python -m diffjax.presets",
    description="Prints the parameter counts and training FLOPs per token of the paper's sizes "
    "for every arm, each matched to the Transformer of its size (DIFF V2 by "
    "parameters and by heads).",
  ).parse_args(argv)
  print(
    f"Parameter counts (vocabulary {PAPER_VOCAB:,}, untied head, SwiGLU FFN); every arm is "
    "matched to the Transformer of its size:"
  )
  print(param_table())
  print(
    "\nTraining FLOPs per token at sequence length 4,096 (forward + backward, causal; what "
    "the MFU counts):"
  )
  print(flops_table())


if __name__ == "__main__":
  main()
