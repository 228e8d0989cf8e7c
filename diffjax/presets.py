"""The paper's sizes as tables, and what config files import to build a run.

``python -m diffjax.presets`` prints the parameter counts and training FLOPs per token of the
paper's sizes for every arm (:func:`param_table`, :func:`flops_table`; docs/model.md and
docs/training.md show them). Config files start from :func:`base_config` and edit its
:func:`model_section` (both :mod:`diffjax.train.config`), or build on another config file with
:func:`load_config` (:mod:`diffjax.cli`); they import the three from here.
"""

from __future__ import annotations

from diffjax.cli import load_config
from diffjax.model import ARMS, count_params, resolve_model
from diffjax.model.flops import flops_per_token
from diffjax.model.sizes import PAPER_SIZES, PAPER_VOCAB
from diffjax.train.config import base_config, model_section

__all__ = ["base_config", "flops_table", "load_config", "main", "model_section", "param_table"]


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
    arm = {a: resolve_model({**section, "arm": a}).config for a in ARMS}
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
      a: flops_per_token(resolve_model({**section, "arm": a}).config, seq_len).model for a in ARMS
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
