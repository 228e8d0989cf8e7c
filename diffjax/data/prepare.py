"""`python -m diffjax.data.prepare`: raw corpus -> tokenized shards + manifest.

Resumable and idempotent: a rerun skips finished work units and redoes the others. The command,
its inputs and the layout: docs/data.md#prepared-corpora-of-any-size.
"""

from __future__ import annotations

import glob
import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Sequence

import numpy as np

from diffjax import cli
from diffjax.data.manifest import read_manifest, tokenizer_fingerprint, write_manifest
from diffjax.data.raw import Unit, iter_documents, plan_units, require_pyarrow
from diffjax.data.shards import SUFFIX, TokenShardWriter, token_bytes_for
from diffjax.data.tokenizers import Tokenizer, load_tokenizer

PLAN_NAME = "prepare_plan.json"
_ENCODE_BATCH = 256
_worker_tokenizer: Tokenizer | None = None


def _init_worker(spec: str) -> None:
  global _worker_tokenizer
  # Ctrl-C reaches the whole process group: the parent stops the pool (and so its workers).
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  _worker_tokenizer = load_tokenizer(spec)


def _encode(tokenizer: Tokenizer, docs: list) -> list[np.ndarray]:
  """Token ids of each document; raw bytes go through `encode_bytes` when the tokenizer has it
  (the byte tokenizer: exact, as `data.kind="text"`), else are decoded as UTF-8."""
  encode_bytes = getattr(tokenizer, "encode_bytes", None)
  if encode_bytes is not None and all(isinstance(d, bytes) for d in docs):
    return [encode_bytes(d) for d in docs]
  texts = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in docs]
  encode_batch = getattr(tokenizer, "encode_batch", None)
  return list(encode_batch(texts)) if encode_batch else [tokenizer.encode(t) for t in texts]


def _marker(output: str, index: int) -> str:
  return os.path.join(output, f"unit-{index:05d}.done.json")


def _remove_partial(output: str, index: int) -> None:
  for path in glob.glob(os.path.join(output, f"*shard-{index:05d}-*")):
    os.remove(path)


def run_unit(
  unit: Unit, output: str, shard_tokens: int, text_field: str, tokenizer: Tokenizer | None = None
) -> tuple[int, int, int]:
  """Writes the shards of `unit` and its completion marker; returns (index, documents, tokens)."""
  tokenizer = tokenizer or _worker_tokenizer
  _remove_partial(output, unit.index)
  shards: list[dict] = []
  writer, name, docs, tokens = None, "", 0, 0

  def close():
    nonlocal writer
    writer.close()
    os.replace(os.path.join(output, "tmp-" + name), os.path.join(output, name))
    shards.append(
      {"path": name, "num_documents": docs, "num_tokens": tokens, "sha256": writer.sha256}
    )
    writer = None

  def write_all(batch: list) -> None:
    nonlocal writer, name, docs, tokens
    for ids in _encode(tokenizer, batch):
      if ids.size == 0:
        continue
      if writer is None:
        name = f"shard-{unit.index:05d}-{len(shards):04d}{SUFFIX}"
        writer = TokenShardWriter(
          os.path.join(output, "tmp-" + name), token_bytes_for(tokenizer.vocab_size)
        )
        docs = tokens = 0
      writer.write(ids)
      docs, tokens = docs + 1, tokens + int(ids.size)
      if tokens >= shard_tokens:
        close()

  batch: list = []
  for doc in iter_documents(unit, text_field):
    batch.append(doc)
    if len(batch) == _ENCODE_BATCH:
      write_all(batch)
      batch = []
  write_all(batch)
  if writer is not None:
    close()
  tmp = _marker(output, unit.index) + ".tmp"
  with open(tmp, "w") as f:
    json.dump({"unit": unit.index, "files": list(unit.files), "shards": shards}, f)
  os.replace(tmp, _marker(output, unit.index))
  return unit.index, sum(s["num_documents"] for s in shards), sum(s["num_tokens"] for s in shards)


def _run_unit_star(args) -> tuple[int, int, int]:
  return run_unit(*args)


def _check_plan(output: str, plan: dict) -> None:
  path = os.path.join(output, PLAN_NAME)
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    # A key an older plan lacks is not compared.
    changed = sorted(k for k in plan if k in old and old[k] != plan[k])
    if changed == ["file_stats"]:
      raise ValueError(
        f"{output!r} holds a preparation of these files as they were before (their sizes or "
        "modification times differ now): delete it to prepare them again, or use another "
        "--output."
      )
    if changed:
      raise ValueError(
        f"{output!r} holds a preparation with different {', '.join(changed)}; "
        "rerun with the same arguments to resume, or use another --output."
      )
    return
  with open(path + ".tmp", "w") as f:
    json.dump(plan, f, indent=1)
  os.replace(path + ".tmp", path)


def prepare(
  inputs: Sequence[str],
  output: str,
  tokenizer: str = "byte",
  *,
  shard_tokens: int = 50_000_000,
  workers: int = 1,
  text_field: str = "text",
  files_per_unit: int = 256,
  progress: bool = True,
) -> str:
  """Tokenizes `inputs` into shards under `output`; returns the manifest's path.

  Raises:
    FileNotFoundError: an input matches nothing.
    ValueError: `output` holds a preparation with other arguments; a bad JSONL line.
    ImportError: Parquet inputs without pyarrow.
  """
  if shard_tokens < 1 or workers < 1:
    raise ValueError(f"--shard_tokens={shard_tokens} and --workers={workers} must be >= 1.")
  units = plan_units(inputs, files_per_unit, exclude=output)
  if any(u.kind == "parquet" for u in units):
    require_pyarrow()
  tok = load_tokenizer(tokenizer)
  fingerprint = tokenizer_fingerprint(tok)
  os.makedirs(output, exist_ok=True)
  _check_plan(
    output,
    {
      "units": [list(u.files) for u in units],
      "file_stats": [[os.stat(f).st_size, os.stat(f).st_mtime_ns] for u in units for f in u.files],
      "tokenizer_sha256": fingerprint,
      "shard_tokens": shard_tokens,
      "text_field": text_field,
    },
  )
  pending = [u for u in units if not os.path.exists(_marker(output, u.index))]
  jobs = [(u, output, shard_tokens, text_field) for u in pending]
  _run_units(jobs, len(units), tokenizer, tok, workers, progress)
  return _write_manifest(output, units, inputs, tokenizer, tok, fingerprint, progress)


def _run_units(
  jobs: list[tuple], num_units: int, spec: str, tok: Tokenizer, workers: int, progress: bool
) -> None:
  """Runs the unfinished units' ``jobs``, in ``workers`` processes when there are several,
  printing progress to stderr after each."""
  t0, done_docs, done_tokens = time.perf_counter(), 0, 0

  def report(i: int) -> None:
    if progress:
      rate = done_tokens / max(time.perf_counter() - t0, 1e-9)
      end = "\n" if i == len(jobs) or not sys.stderr.isatty() else ""
      print(
        f"\rprepare: {num_units - len(jobs) + i}/{num_units} units, {done_docs:,} docs, "
        f"{done_tokens:,} tokens, {rate:,.0f} tokens/s",
        end=end,
        file=sys.stderr,
        flush=True,
      )

  if workers == 1 or len(jobs) <= 1:
    for i, job in enumerate(jobs, 1):
      _, d, n = run_unit(*job, tokenizer=tok)
      done_docs, done_tokens = done_docs + d, done_tokens + n
      report(i)
  else:
    with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (spec,)) as pool:
      for i, (_, d, n) in enumerate(pool.imap_unordered(_run_unit_star, jobs), 1):
        done_docs, done_tokens = done_docs + d, done_tokens + n
        report(i)


def _write_manifest(
  output: str,
  units: Sequence[Unit],
  inputs: Sequence[str],
  spec: str,
  tok: Tokenizer,
  fingerprint: str,
  progress: bool,
) -> str:
  """Gathers every unit's shards from its marker into manifest.json; returns its path."""
  shards: list[dict] = []
  for u in units:
    with open(_marker(output, u.index)) as f:
      shards.extend(json.load(f)["shards"])
  if not shards:
    raise ValueError(f"Inputs {list(inputs)} hold no non-empty document.")
  info = {"spec": spec, "sha256": fingerprint, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id}
  path = write_manifest(output, shards, info)
  m = read_manifest(path)
  if progress:
    print(
      f"prepare: wrote {path}: {len(m.shards)} shards, {m.num_documents:,} documents, "
      f"{m.num_tokens:,} tokens",
      file=sys.stderr,
    )
  return path


def main(argv: Sequence[str] | None = None) -> int:
  p = cli.ArgumentParser(prog="python -m diffjax.data.prepare", description=__doc__.split("\n")[0])
  p.add_argument(
    "--input",
    action="append",
    required=True,
    help="file, directory, glob, or 'stdlib'; repeat for several",
  )
  p.add_argument("--output", required=True, help="directory for shards and manifest.json")
  p.add_argument("--tokenizer", default="byte", help="'byte', tokenizer.json or a .model file")
  p.add_argument("--shard_tokens", type=int, default=50_000_000, help="tokens per shard (about)")
  p.add_argument(
    "--workers",
    type=int,
    default=max(1, (os.cpu_count() or 2) - 1),
    help="worker processes (default: CPU count - 1)",
  )
  p.add_argument("--text_field", default="text", help="JSONL field / Parquet column")
  p.add_argument(
    "--files_per_unit", type=int, default=256, help="text files (one document each) per work unit"
  )
  args = p.parse_args(argv)
  # SIGTERM and Ctrl-C leave the pool's `with`, which stops its workers.
  with cli.stop_signals_raise():
    try:
      prepare(
        args.input,
        args.output,
        args.tokenizer,
        shard_tokens=args.shard_tokens,
        workers=args.workers,
        text_field=args.text_field,
        files_per_unit=args.files_per_unit,
      )
    except (ValueError, FileNotFoundError, ImportError) as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    except KeyboardInterrupt as e:
      print(
        f"\nprepare: stopped by signal {cli.interrupt_signal(e)}; rerun the same command to "
        "resume (finished units are kept).",
        file=sys.stderr,
      )
      return cli.EXIT_INTERRUPTED
  return 0


if __name__ == "__main__":
  sys.exit(main())
