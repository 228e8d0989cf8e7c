"""The paper's sizes as tables, and what config files import to build a run.

``python -m diffjax.presets`` prints the parameter counts and training FLOPs per token of the
paper's sizes for every arm (:func:`param_table`, :func:`flops_table`; docs/model.md and
docs/training.md show them). Config files start from :func:`base_config` and edit its
:func:`model_section` (both :mod:`diffjax.train.config`), or build on another config file with
:func:`load_config` (:mod:`diffjax.cli`); they import the three from here.
"""

from __future__ import annotations

from diffjax import arms
from diffjax.cli import load_config
from diffjax.model import count_params, resolve_model
from diffjax.model.flops import flops_per_token
from diffjax.model.sizes import PAPER_SIZES, PAPER_VOCAB
from diffjax.train.config import base_config, model_section

__all__ = ["base_config", "flops_table", "load_config", "main", "model_section", "param_table"]


def _matched(size: str, vocab_size: int, v2_match: str = "params") -> dict:
  """Every registered arm matched to the Transformer of ``size``."""
  section = model_section(size=size, vocab_size=vocab_size).to_dict()
  return {
    a: resolve_model({**section, "arm": a, "v2_match": v2_match}).config for a in arms.names()
  }


def _table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def param_table(sizes=PAPER_SIZES, vocab_size: int = PAPER_VOCAB) -> str:
  """A markdown table of parameter counts per arm for the named sizes, each arm matched to
  the Transformer of that size; an arm that matches otherwise by heads (DIFF V2) both ways
  (``v2_match`` "params" and "heads")."""
  names = [a for a in arms.names() if a != arms.BASELINE]
  by = {m: {s: _matched(s, vocab_size, m) for s in sizes} for m in ("params", "heads")}
  cols = []  # (arm, matched by, heading)
  for a in names:
    both = any(by["params"][s][a] != by["heads"][s][a] for s in sizes)
    title = arms.get(a).title
    cols += [(a, m, f"{title} ({m})" if both else title) for m in ("params", "heads")[: 1 + both]]
  header = [
    "size",
    "d_model",
    "layers",
    "heads (" + " / ".join(arms.get(a).title for a in arms.names()) + ")",
    "d",
    arms.get(arms.BASELINE).title,
  ]
  header += [h for _, _, heading in cols for h in (heading, "vs T")]
  rows = []
  for s in sizes:
    t = by["params"][s][arms.BASELINE]
    n_t = count_params(t)
    row = [s, str(t.d_model), str(t.num_layers)]
    row += [" / ".join(str(by["params"][s][a].num_heads) for a in arms.names()), str(t.head_dim)]
    row.append(f"{n_t:,}")
    for a, m, _ in cols:
      n = count_params(by[m][s][a])
      row += [f"{n:,}", f"{n - n_t:+,}"]
    rows.append(row)
  return _table(header, rows)


def flops_table(sizes=PAPER_SIZES, seq_len: int = 4096, vocab_size: int = PAPER_VOCAB) -> str:
  """A markdown table of training FLOPs per token per arm (:func:`diffjax.model.flops.
  flops_per_token`: forward + backward, causal, no remat) at ``seq_len``, with each arm's
  ratio to the Transformer of its size (arms matched by parameters)."""
  names = [a for a in arms.names() if a != arms.BASELINE]
  header = ["size", f"{arms.get(arms.BASELINE).title} GFLOP/token"]
  header += [h for a in names for h in (arms.get(a).title, "/ T")]
  rows = []
  for s in sizes:
    f = {a: flops_per_token(cfg, seq_len).model for a, cfg in _matched(s, vocab_size).items()}
    t = f[arms.BASELINE]
    rows.append(
      [s, f"{t / 1e9:.2f}"] + [x for a in names for x in (f"{f[a] / 1e9:.2f}", f"{f[a] / t:.3f}")]
    )
  return _table(header, rows)


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
