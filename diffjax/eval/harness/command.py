"""``python -m diffjax.eval.harness``: lm-eval tasks on a trained run, printed as the harness's table.

    python -m diffjax.eval.harness --workdir=runs/default --tasks=hellaswag,arc_easy [--limit=N]
    python -m diffjax.eval.harness --hf_dir=exported/ --tasks=...

Offline: real tasks read the local datasets cache, ``--include_path`` adds task YAML files of
your own. A task whose dataset is not there stops before the model loads, with one line naming
the dataset and how to give a local copy. docs/evaluation.md describes the flags and the output.
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
  src.add_argument("--hf_dir", help="an HF Llama/DiffLlama directory")
  p.add_argument("--tasks", required=True, help="comma-separated task names or YAML files")
  p.add_argument("--include_path", default=None, help="a directory of task YAML files")
  p.add_argument(
    "--limit", type=float, default=None, help="examples per task (a count, or a fraction below 1)"
  )
  p.add_argument("--num_fewshot", type=int, default=None)
  p.add_argument("--batch_size", type=int, default=8)
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  p.add_argument(
    "--max_length", type=int, default=None, help="context length (default: the run's seq_len)"
  )
  p.add_argument("--max_gen_toks", type=int, default=256)
  p.add_argument("--tokenizer", default=None, help="tokenizer spec (default: the run's own)")
  p.add_argument("--seed", type=int, default=1234)
  p.add_argument(
    "--bootstrap_iters", type=int, default=1000, help="resamples for the standard errors (0: none)"
  )
  p.add_argument("--output", default=None, help="results JSON (default: <workdir>/harness.json)")
  p.add_argument("--log_samples", action="store_true", help="keep per-example outputs")
  return p


def _main(args: argparse.Namespace) -> None:
  # Imported here so that --help and argument errors need no lm-eval.
  from lm_eval.utils import make_table  # pylint: disable=import-outside-toplevel

  from diffjax.eval.harness import DiffjaxLM, run_tasks  # pylint: disable=import-outside-toplevel
  from diffjax.eval.harness.tasks import check_task_data  # pylint: disable=import-outside-toplevel

  limit = args.limit
  if limit is not None:
    if limit <= 0:
      raise ValueError(f"--limit={limit:g} must be positive.")
    limit = int(limit) if limit >= 1 else limit
  tasks = [t.strip() for t in args.tasks.split(",")]
  t0 = time.perf_counter()
  # Every task's data is found before the model is loaded: a missing one fails in seconds.
  check_task_data(tasks, args.include_path)
  lm = DiffjaxLM(
    args.workdir,
    hf_dir=args.hf_dir,
    tokenizer=args.tokenizer,
    step=args.step,
    max_length=args.max_length,
    batch_size=args.batch_size,
    max_gen_toks=args.max_gen_toks,
  )
  results = run_tasks(
    lm,
    tasks,
    include_path=args.include_path,
    limit=limit,
    num_fewshot=args.num_fewshot,
    seed=args.seed,
    log_samples=args.log_samples,
    bootstrap_iters=args.bootstrap_iters,
  )
  seconds = time.perf_counter() - t0
  print(make_table(results))
  results["diffjax"] = {
    "source": args.workdir or args.hf_dir,
    "arm": lm.model.config.attention,
    "max_length": lm.max_length,
    "seconds": seconds,
    "compiled_shapes": sorted(map(list, lm.scorer.compiled_shapes)),
  }
  out = args.output or os.path.join(args.workdir or args.hf_dir, "harness.json")
  tmp = out + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1, default=str)
  os.replace(tmp, out)
  print(
    f"[{lm.model.config.attention}] {len(tasks)} task(s) in {seconds:.1f} s; results in {out}",
    file=sys.stderr,
  )


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  return run_guarded(lambda: _main(args))
