"""`python -m diffjax.eval --workdir=RUN`: evaluate a run's checkpoint and write eval JSON.

The model, its validation batches, the `--config.KEY=VALUE` overrides and the exit statuses:
docs/evaluation.md#evaluating-a-run; aggregate runs with `python -m diffjax.eval.report`.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import math
import os
import sys
import textwrap
import time
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from diffjax import cli
from diffjax.data.tasks import ContextTooShort
from diffjax.eval import evaluate
from diffjax.train.records import write_json


class BadInput(Exception):
  """A mistake on the command line or in the run: printed as one ``error:`` line, status 2."""


def _load(workdir: str, step: int | None):
  """(model, run config, step) from a train.py workdir (`diffjax.train.load_run`)."""
  from diffjax.train import checkpoint as ckpt  # pylint: disable=import-outside-toplevel
  from diffjax.train.loading import load_run  # pylint: disable=import-outside-toplevel

  try:
    run = load_run(workdir, step=step)
  except (FileNotFoundError, ValueError, ckpt.CheckpointError) as e:
    raise BadInput(f"cannot load a model from {workdir!r}: {e}") from None
  return run.model, run.config, run.step


def _fits(value: Any, hint: Any) -> bool:
  """Whether ``value`` (a parsed Python literal) has the type ``hint`` of an EvalConfig field."""
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if hint is Any:
    return True
  if origin in (typing.Union, types.UnionType):
    return any(_fits(value, a) for a in args)
  if hint is type(None):
    return value is None
  if hint is bool:
    return isinstance(value, bool)
  if hint is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if hint is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if hint is str:
    return isinstance(value, str)
  if origin is tuple:
    if not isinstance(value, tuple):
      return False
    if len(args) == 2 and args[1] is Ellipsis:
      return all(_fits(v, args[0]) for v in value)
    return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args))
  if origin in (dict, Mapping, collections.abc.Mapping):
    return isinstance(value, Mapping) and all(_fits(v, args[1]) for v in value.values())
  return True


def check_overrides(overrides: Mapping[str, Any]) -> None:
  """Raises :class:`BadInput` naming the first ``--config.<field>=`` value whose type is not
  the EvalConfig field's, and any section name that is not a registered section, before
  anything is loaded."""
  hints = typing.get_type_hints(evaluate.EvalConfig)
  for name, value in overrides.items():
    if not _fits(value, hints[name]):
      kind = getattr(hints[name], "__name__", None) if isinstance(hints[name], type) else None
      kind = kind or str(hints[name]).replace("typing.", "").replace("collections.abc.", "")
      example = _example(evaluate.EvalConfig.__dataclass_fields__[name])
      raise BadInput(
        f"--config.{name}={value!r} must be of type {kind}"
        + (f"; e.g. --config.{name}={example}." if example else " (a Python literal).")
      )
  names = evaluate.sections.section_names()
  for section in (*overrides.get("sections", ()), *overrides.get("options", {})):
    if section not in names:
      near = difflib.get_close_matches(section, names, n=1)
      hint = f"did you mean {near[0]!r}? " if near else ""
      raise BadInput(
        f"unknown eval section {section!r}; {hint}the sections are {', '.join(names)}."
      )


def _example(field: dataclasses.Field) -> str | None:
  """The field's default as a command-line value (None when it shows nothing: empty, None)."""
  default = field.default
  if default is dataclasses.MISSING:
    default = field.default_factory()  # type: ignore[misc]
  return repr(default).replace(" ", "") if default not in (None, (), {}) else None


def _val_batches(config: Any, seq_len: int, batch_size: int, count: int, seed: int):
  """The run's validation batches, built from its data config and task mix as its trainer did."""
  from diffjax.eval.run_data import run_val_batches  # pylint: disable=import-outside-toplevel

  batches, _ = run_val_batches(
    config["data"],
    config.get("task_mix"),
    seq_len=seq_len,
    batch_size=batch_size,
    seed=seed,
    count=count,
  )
  return batches


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
  cli.Flag("quick", False, "small sizes, noisy numbers: 1-2 minutes on a CPU"),
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
  with cli.stop_signals_raise():
    try:
      return _run(overrides, types.SimpleNamespace(**values))
    except BadInput as e:
      print(f"error: {e}", file=sys.stderr, flush=True)
      return 2
    except KeyboardInterrupt as e:
      print(
        f"stopped: interrupted by signal {cli.interrupt_signal(e)}; nothing was written.",
        file=sys.stderr,
        flush=True,
      )
      return cli.EXIT_INTERRUPTED


def _check_writable(out: str) -> None:
  """Refuses an output path that is a directory or lies under a file."""
  if os.path.isdir(out):
    raise BadInput(f"--out={out!r} is a directory; name the JSON file to write.")
  folder = cli.nearest_existing(os.path.dirname(os.path.abspath(out)))
  if not os.path.isdir(folder):
    raise BadInput(f"--out={out!r} cannot be written: {folder!r} is a file, not a directory.")


def _run(overrides: dict[str, Any], args: types.SimpleNamespace) -> int:
  if args.workdir is None:
    raise BadInput(f"--workdir is required; {USAGE}")
  if args.sections:
    overrides["sections"] = tuple(s.strip() for s in args.sections.split(",") if s.strip())
  check_overrides(overrides)  # before the model is loaded: a typo costs no waiting
  if not os.path.isdir(args.workdir):
    raise BadInput(f"--workdir {args.workdir!r} is not a directory; pass a training run's workdir.")
  out = args.out or os.path.join(args.workdir, "eval.json")
  _check_writable(out)  # before the evaluation: a bad --out costs no waiting
  t0 = time.time()
  model, config, step = _load(args.workdir, args.step)
  seq_len = args.seq_len or int(config.get("seq_len", 0) or 0)
  if seq_len <= 0:
    raise BadInput("the run config has no seq_len; pass --seq_len=N.")
  seed = args.seed if args.seed is not None else config.get("seed")
  make = evaluate.EvalConfig.quick if args.quick else evaluate.EvalConfig.full
  try:
    cfg = make(seq_len, **overrides)
  except (TypeError, ValueError) as e:
    raise BadInput(f"bad --config override: {e}") from None
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
  try:
    result = evaluate.evaluate_model(model, val, cfg, meta=meta, log=log)
  except ContextTooShort as e:
    reason = str(e).rstrip(".")
    raise BadInput(
      f"{reason}; or leave out the sections that need a longer context with --sections."
    ) from None
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
  measured = ""
  if val:
    trained = config.get("eval_batches")
    measured = f"; val/loss over {len(val)} validation batch(es)" + (
      f", not the {trained} of the trainer's eval/loss" if trained and trained != len(val) else ""
    )
  print(f"wrote {out} in {time.time() - t0:.1f}s: {summary}{measured}")
  return 0
