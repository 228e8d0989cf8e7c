"""``python -m diffjax.eval.harness``: lm-eval tasks on a trained run, printed as the harness's table.

    python -m diffjax.eval.harness --workdir=runs/default --tasks=hellaswag,arc_easy [--limit=N]
    python -m diffjax.eval.harness --hf_dir=exported/ --tasks=...
    python -m diffjax.eval.harness --workdir=runs/default --tasks=... --batch_size=auto
        --gen_kwargs=max_gen_toks=32 --output_path=results/ --log_samples

Offline: tasks read the local datasets cache (``--include_path`` adds task YAML files of your own);
a missing dataset stops the command before the model loads, naming it. More: docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from diffjax import cli
from diffjax.errors import run_guarded

# Nothing is fetched at run time; the datasets library reads these when it is first imported,
# which lm-eval's own modules may do before diffjax.eval.harness.tasks is.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _parser() -> argparse.ArgumentParser:
  p = cli.ArgumentParser(
    prog="python -m diffjax.eval.harness",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--workdir", help="a train.py run directory")
  src.add_argument("--hf_dir", help="an HF Llama/DiffLlama directory or a diffjax export")
  p.add_argument("--tasks", required=True, help="comma-separated task names or YAML files")
  p.add_argument("--include_path", default=None, help="a directory of task YAML files")
  p.add_argument(
    "--limit", type=float, default=None, help="examples per task (a count, or a fraction below 1)"
  )
  p.add_argument("--num_fewshot", type=int, default=None)
  p.add_argument(
    "--batch_size",
    default="8",
    help="rows per forward pass, or 'auto' (also 'auto:N'): the largest power of two up to "
    "--max_batch_size that fits the device's memory",
  )
  p.add_argument("--max_batch_size", type=int, default=64, help="the ceiling of --batch_size=auto")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  p.add_argument(
    "--max_length",
    type=int,
    default=None,
    help="context length (default: the run's seq_len, or config.json's max_position_embeddings)",
  )
  p.add_argument("--max_gen_toks", type=int, default=256)
  p.add_argument(
    "--gen_kwargs",
    default=None,
    help="generation options over every generation task's own, as KEY=VALUE[,KEY=VALUE...] "
    "(e.g. max_gen_toks=32,temperature=0)",
  )
  p.add_argument("--tokenizer", default=None, help="tokenizer spec (default: the run's own)")
  p.add_argument(
    "--seed",
    type=int,
    default=1234,
    help="the seed of the few-shot draws and of sampled generation",
  )
  p.add_argument(
    "--bootstrap_iters", type=int, default=1000, help="resamples for the standard errors (0: none)"
  )
  p.add_argument("--output", default=None, help="results JSON (default: <workdir>/harness.json)")
  p.add_argument(
    "--output_path",
    default=None,
    help="also write lm-eval's output files into this directory: <source>/results_<date>.json, "
    "and samples_<task>_<date>.jsonl with --log_samples or --predict_only",
  )
  p.add_argument("--log_samples", action="store_true", help="keep per-example outputs")
  p.add_argument(
    "--predict_only",
    action="store_true",
    help="keep the model's outputs (as --log_samples) and compute no metric",
  )
  p.add_argument(
    "--use_cache",
    default=None,
    help="path prefix of a SQLite cache of the model's answers (<prefix>_rank0.db); a rerun "
    "answers the requests it holds without the model",
  )
  return p


def _main(args: argparse.Namespace) -> None:
  # Imported here so that --help and argument errors need no lm-eval.
  from lm_eval.utils import make_table  # pylint: disable=import-outside-toplevel

  from diffjax.eval.harness import DiffjaxLM, run_tasks  # pylint: disable=import-outside-toplevel
  from diffjax.eval.harness.tasks import check_task_data, parse_gen_kwargs  # pylint: disable=import-outside-toplevel

  limit = _limit(args.limit)
  tasks = [t.strip() for t in args.tasks.split(",")]
  gen_kwargs = parse_gen_kwargs(args.gen_kwargs)
  if args.use_cache is not None and not os.path.isdir(os.path.dirname(args.use_cache) or "."):
    raise ValueError(
      f"--use_cache={args.use_cache!r}: its directory does not exist; create it or pass a path "
      "prefix in an existing directory."
    )
  t0 = time.perf_counter()
  # Every task's data and generation options are checked before the model is loaded: a
  # problem fails in seconds.
  check_task_data(tasks, args.include_path, gen_kwargs)
  lm = DiffjaxLM(
    args.workdir,
    hf_dir=args.hf_dir,
    tokenizer=args.tokenizer,
    step=args.step,
    max_length=args.max_length,
    batch_size=args.batch_size,
    max_batch_size=args.max_batch_size,
    max_gen_toks=args.max_gen_toks,
    seed=args.seed,
  )
  arm = lm.model.config.attention
  print(
    f"[{arm}] context {lm.max_length} tokens ({lm.context_source}), batch {lm.batch_size}",
    file=sys.stderr,
  )
  source = args.workdir or args.hf_dir
  tracker = None
  if args.output_path:
    from lm_eval.loggers import EvaluationTracker  # pylint: disable=import-outside-toplevel

    tracker = EvaluationTracker(output_path=args.output_path)
  results = run_tasks(
    lm,
    tasks,
    include_path=args.include_path,
    limit=limit,
    num_fewshot=args.num_fewshot,
    seed=args.seed,
    log_samples=args.log_samples,
    bootstrap_iters=args.bootstrap_iters,
    gen_kwargs=gen_kwargs,
    predict_only=args.predict_only,
    use_cache=args.use_cache,
    evaluation_tracker=tracker,
    model_args={"path": source},
    checked=True,
  )
  seconds = time.perf_counter() - t0
  print(make_table(results))
  results["diffjax"] = {
    "source": source,
    "arm": arm,
    "max_length": lm.max_length,
    "context_from": lm.context_source,
    "batch_size": lm.batch_size,
    "seconds": seconds,
    "compiled_shapes": sorted(map(list, lm.scorer.compiled_shapes)),
  }
  where = _save(results, args.output or os.path.join(source, "harness.json"), tracker)
  if tracker is not None:
    where += f" and {args.output_path}"
  print(f"[{arm}] {len(tasks)} task(s) in {seconds:.1f} s; results in {where}", file=sys.stderr)


def _limit(limit: float | None) -> float | int | None:
  """``--limit`` as lm-eval takes it: a count from 1 up, a fraction below 1."""
  if limit is not None:
    if limit <= 0:
      raise ValueError(f"--limit={limit:g} must be positive.")
    limit = int(limit) if limit >= 1 else limit
  return limit


def _save(results: dict, out: str, tracker) -> str:
  """Writes ``results`` to ``out`` (whole or not at all), and to lm-eval's tracker when there
  is one; returns ``out``."""
  tmp = out + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1, default=str)
  os.replace(tmp, out)
  if tracker is not None:
    samples = results.pop("samples", None)
    tracker.save_results_aggregated(results=results, samples=samples)
    for task in results.get("configs", {}) if samples else ():
      tracker.save_results_samples(task_name=task, samples=samples[task])
  return out


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  return run_guarded(lambda: _main(args))
