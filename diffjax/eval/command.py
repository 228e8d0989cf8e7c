"""`python -m diffjax.eval --workdir=RUN`: evaluate a run's checkpoint and write eval JSON.

    python -m diffjax.eval --workdir=runs/diff_v1_s0 --quick
    python -m diffjax.eval --workdir=runs/diff_v1_s0 --out=results/diff_v1_s0.json \\
        --config.samples_per_depth=50 --config.heatmap_lengths='(256, 512, 1024, 2048)'

The model comes from `diffjax.train.load_model(workdir, step)`; validation batches are the run's
own held-out batches (its data config, sequence length, batch size and seed; the first
`val_batches` of them, by default the run's `eval_batches`), so val/loss reproduces the
trainer's final eval/loss. `--config.KEY=VALUE` overrides an `EvalConfig` field (VALUE is a
Python literal), as `--config.<key>=<value>` overrides a run config in train.py. Then aggregate runs with `python -m diffjax.eval.report RUN ... --out=DIR`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from diffjax.eval import evaluate as E
from diffjax.train.records import write_json


def _overrides(args: Sequence[str], fields: Sequence[str]) -> dict[str, Any]:
  """``{field: value}`` from ``--config.<field>=<value>`` arguments (values are Python
  literals; anything else is a string). Raises SystemExit naming a bad argument."""
  import difflib  # pylint: disable=import-outside-toplevel

  out = {}
  for arg in args:
    if not arg.startswith("--config.") or "=" not in arg:
      raise SystemExit(
        f"error: unexpected argument {arg!r}; EvalConfig fields are set with "
        "--config.<field>=<value>."
      )
    key, value = arg[len("--config.") :].split("=", 1)
    if key not in fields:
      near = difflib.get_close_matches(key, fields, n=3)
      raise SystemExit(
        f"error: unknown EvalConfig field {key!r} in {arg}; "
        + (
          f"did you mean {', '.join(near)}?"
          if near
          else f"the fields are {', '.join(sorted(fields))}."
        )
      )
    try:
      out[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      out[key] = value
    if isinstance(out[key], list):
      out[key] = tuple(tuple(v) if isinstance(v, list) else v for v in out[key])
  return out


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


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(
    prog="python -m diffjax.eval",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("--workdir", required=True, help="run directory holding checkpoints/")
  p.add_argument("--out", default=None, help="output JSON (default: <workdir>/eval.json)")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  p.add_argument("--quick", action="store_true", help="small sizes: seconds on a CPU, noisy")
  p.add_argument("--seq_len", type=int, default=None, help="override the run's sequence length")
  p.add_argument("--seed", type=int, default=None, help="the run's seed as recorded in the JSON")
  p.add_argument("--sections", default="", help=f"comma list out of {','.join(E.SECTIONS)}")
  p.epilog = (
    "EvalConfig fields: --config.<field>=<value>, e.g. --config.samples_per_depth=50; "
    "the fields are " + ", ".join(sorted(E.EvalConfig.__dataclass_fields__)) + "."
  )
  args, extra = p.parse_known_args(argv)
  overrides = _overrides(extra, tuple(E.EvalConfig.__dataclass_fields__))

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
  make = E.EvalConfig.quick if args.quick else E.EvalConfig.full
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
  result = E.evaluate_model(model, val, cfg, meta=meta, log=log)
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
