"""`python -m diffjax.eval --workdir=RUN`: evaluate a run's checkpoint and write eval JSON.

    python -m diffjax.eval --workdir=runs/diff_v1_s0 --quick
    python -m diffjax.eval --workdir=runs/diff_v1_s0 --out=results/diff_v1_s0.json \\
        --config.samples_per_depth=50 --config.heatmap_lengths='(256, 512, 1024, 2048)'

The model comes from `diffjax.train.load_model(workdir, step)`; validation batches are the run's
own held-out batches (its data config, sequence length, batch size and seed; the first
`val_batches` of them, by default the run's `eval_batches`), so val/loss reproduces the
trainer's final eval/loss. The command line is train.py's (`diffjax.cli`): `--config.KEY=VALUE`
overrides an `EvalConfig` field (VALUE is a Python literal), and a mistake is one `error:` line
with exit status 2. Then aggregate runs with `python -m diffjax.eval.report RUN ... --out=DIR`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import textwrap
import time
import types
from collections.abc import Sequence
from typing import Any

from diffjax import cli
from diffjax.eval import evaluate
from diffjax.train.records import write_json


def _load(workdir: str, step: int | None):
  """(model, run config, step) from a train.py workdir (`diffjax.train.load_run`)."""
  from diffjax.train import checkpoint as ckpt  # pylint: disable=import-outside-toplevel
  from diffjax.train.loading import load_run  # pylint: disable=import-outside-toplevel

  try:
    run = load_run(workdir, step=step)
  except (FileNotFoundError, ValueError, ckpt.CheckpointError) as e:
    raise SystemExit(f"error: cannot load a model from {workdir!r}: {e}") from e
  return run.model, run.config, run.step


def _val_batches(config: Any, seq_len: int, batch_size: int, count: int, seed: int):
  from diffjax.data import DataConfig, build_datasets  # pylint: disable=import-outside-toplevel

  data_cfg = DataConfig.from_dict(config["data"])
  data = build_datasets(data_cfg, seq_len=seq_len, global_batch_size=batch_size, seed=seed)
  return data.val_batches(count)


USAGE = (
  "usage: python -m diffjax.eval --workdir=<run> [--out=<file>] [--quick] [--step=N] "
  "[--sections=a,b] [--config.<field>=<value> ...]"
)
SUMMARY = """\
Evaluates a training run's checkpoint (the newest by default) with the evaluation suite and
writes its eval JSON: the validation loss on the run's own held-out batches, retrieval, the
heatmap, associative recall, attention allocation, low-bit inference, mechanisms, probes."""
FLAGS = (
  cli.Flag("workdir", None, "run directory holding checkpoints/ (required)"),
  cli.Flag("out", None, "output JSON [default: <workdir>/eval.json]"),
  cli.Flag("step", None, "checkpoint step [default: the newest]", kind=int),
  cli.Flag("quick", False, "small sizes: seconds on a CPU, noisy"),
  cli.Flag("seq_len", None, "override the run's sequence length", kind=int),
  cli.Flag("seed", None, "the run's seed as recorded in the JSON", kind=int),
  cli.Flag("sections", "", f"comma list out of {','.join(evaluate.SECTIONS)}"),
)


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command on ``argv`` (default: ``sys.argv[1:]``, without the program name) and
  returns its exit status."""
  fields = tuple(evaluate.EvalConfig.__dataclass_fields__)
  parsed = cli.parse(
    ["diffjax.eval", *(sys.argv[1:] if argv is None else argv)],
    usage=USAGE,
    summary=SUMMARY,
    flags=FLAGS,
    fields=fields,
    overrides_help=textwrap.fill(
      "Overrides: --config.<field>=<value> sets an EvalConfig field (a Python literal), e.g. "
      "--config.samples_per_depth=50; the fields are " + ", ".join(sorted(fields)) + ".",
      width=96,
    ),
  )
  if isinstance(parsed, int):
    return parsed
  overrides, values, _ = parsed
  if values["workdir"] is None:
    print(f"error: --workdir is required; {USAGE}", file=sys.stderr)
    return 2
  args = types.SimpleNamespace(**values)
  if not os.path.isdir(args.workdir):
    raise SystemExit(
      f"--workdir {args.workdir!r} is not a directory; pass a training run's workdir."
    )
  t0 = time.time()
  model, config, step = _load(args.workdir, args.step)
  seq_len = args.seq_len or int(config.get("seq_len", 0) or 0)
  if seq_len <= 0:
    raise SystemExit("The run config has no seq_len; pass --seq_len.")
  seed = args.seed if args.seed is not None else config.get("seed")
  if args.sections:
    overrides["sections"] = tuple(s.strip() for s in args.sections.split(",") if s.strip())
  make = evaluate.EvalConfig.quick if args.quick else evaluate.EvalConfig.full
  try:
    cfg = make(seq_len, **overrides)
  except TypeError as e:
    raise SystemExit(f"error: bad --config override: {e}.") from None
  val = []
  if config.get("data") is not None:
    # The trainer's validation batches: same split, batch size and order, so with the run's
    # eval_batches (the default outside --quick) val/loss reproduces its final eval/loss.
    batch_size = int(config.get("global_batch_size", cfg.batch_size))
    if "val_batches" not in overrides and not args.quick and config.get("eval_batches"):
      cfg = dataclasses.replace(cfg, val_batches=int(config.get("eval_batches")))
    val = _val_batches(config, seq_len, batch_size, cfg.val_batches, int(seed or 0))
  else:
    print("No data config in the run config: skipping loss-based sections.", file=sys.stderr)
  meta = {
    "seed": seed,
    "workdir": os.path.abspath(args.workdir),
    "quick": bool(args.quick),
    "step": step,
  }
  log = lambda msg: print(f"[eval {model.config.attention}] {msg}", file=sys.stderr, flush=True)
  result = evaluate.evaluate_model(model, val, cfg, meta=meta, log=log)
  out = args.out or os.path.join(args.workdir, "eval.json")
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  write_json(out, result)
  s = result["scalars"]
  summary = ", ".join(
    f"{k}={v:.4g}"
    for k, v in s.items()
    if k in ("val/loss", "retrieval/mean", "heatmap/mean", "mqar/accuracy")
    and isinstance(v, float)
    and not math.isnan(v)
  )
  print(f"wrote {out} in {time.time() - t0:.1f}s: {summary}")
  return 0
