"""The paper's sizes as tables (``python -m diffjax.presets``), and what config files import.

:func:`base_config`, its :func:`model_section` and :func:`load_config` (to build on another
config file): docs/training.md#run-keys.
"""

from __future__ import annotations

from diffjax import arms
from diffjax.cli import load_config
from diffjax.model import count_params, resolve_model
from diffjax.model.flops import flops_per_token
from diffjax.model.sizes import PAPER_SIZES, PAPER_VOCAB
from diffjax.train.config import base_config, model_section

__all__ = [
  "GDA_RATIOS",
  "base_config",
  "flops_table",
  "grouped_table",
  "load_config",
  "main",
  "model_section",
  "param_table",
]


def _matched(size: str, vocab_size: int, v2_match: str = "params") -> dict:
  """The arms compared by default, each matched to the Transformer of ``size``."""
  section = model_section(size=size, vocab_size=vocab_size).to_dict()
  return {
    a: resolve_model({**section, "arm": a, "v2_match": v2_match}).config
    for a in arms.default_names()
  }


# The signal:noise ratios the grouped arms are tabled at (the GDA paper's 3:1 and 4:1).
GDA_RATIOS = (3, 4)


def grouped_table(sizes=PAPER_SIZES, vocab_size: int = PAPER_VOCAB, seq_len: int = 4096) -> str:
  """A markdown table of the grouped arms at :data:`GDA_RATIOS`, each matched by parameters
  to the Transformer of each size: signal / noise / kv heads, parameters against the
  Transformer's, and training FLOPs per token against its; "-" where the size's head counts
  do not form the groups (the reason follows the table)."""
  grouped = [a for a in arms.names() if not arms.get(a).by_default]
  header = ["size", "arm", "r", "signal / noise / kv heads", "params", "vs T", "FLOPs / T"]
  rows, reasons = [], {}
  for s in sizes:
    section = model_section(size=s, vocab_size=vocab_size).to_dict()
    t = resolve_model({**section, "arm": arms.BASELINE}).config
    n_t, f_t = count_params(t), flops_per_token(t, seq_len).model
    for a in grouped:
      for r in GDA_RATIOS:
        try:
          cfg = resolve_model({**section, "arm": a, "gda_ratio": r, "v2_match": "params"}).config
        except ValueError as e:
          reasons[(s, a, r)] = str(e).split(": ", 1)[-1]
          rows.append([s, arms.get(a).title, str(r), "-", "-", "-", "-"])
          continue
        n = count_params(cfg)
        heads = f"{cfg.num_heads} / {cfg.num_heads // r} / {cfg.num_kv_heads}"
        f = flops_per_token(cfg, seq_len).model / f_t
        rows.append([s, arms.get(a).title, str(r), heads, f"{n:,}", f"{n - n_t:+,}", f"{f:.3f}"])
  notes = sorted({why for why in reasons.values()})
  return _table(header, rows) + "".join(f"\n\n- {why}" for why in notes)


def _table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def param_table(sizes=PAPER_SIZES, vocab_size: int = PAPER_VOCAB) -> str:
  """A markdown table of parameter counts per arm for the named sizes, each arm matched to
  the Transformer of that size; an arm that matches otherwise by heads (DIFF V2) both ways
  (``v2_match`` "params" and "heads")."""
  names = [a for a in arms.default_names() if a != arms.BASELINE]
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
    "heads (" + " / ".join(arms.get(a).title for a in arms.default_names()) + ")",
    "d",
    arms.get(arms.BASELINE).title,
  ]
  header += [h for _, _, heading in cols for h in (heading, "vs T")]
  rows = []
  for s in sizes:
    t = by["params"][s][arms.BASELINE]
    n_t = count_params(t)
    row = [s, str(t.d_model), str(t.num_layers)]
    row += [
      " / ".join(str(by["params"][s][a].num_heads) for a in arms.default_names()),
      str(t.head_dim),
    ]
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
  names = [a for a in arms.default_names() if a != arms.BASELINE]
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
  print(
    "\nGrouped differential attention at r = 3 and 4 signal heads per noise head, matched by "
    "parameters (training FLOPs per token at 4,096 against the Transformer's):"
  )
  print(grouped_table())


if __name__ == "__main__":
  main()
