"""Streaming data pipeline at the 3B run's per-host batch shape, for growing corpora.

    python benchmarks/data_pipeline.py                      # 10M, 100M and 1B tokens
    python benchmarks/data_pipeline.py --sizes 10e6,100e6   # a subset
    python benchmarks/data_pipeline.py --dir /big/disk      # where the corpora go (~4.4 GB at 1B)

For each size, writes a synthetic prepared corpus (random token ids below the paper's 100,288,
document lengths log-normal around 1,000 tokens, shards of 50M tokens in the `.tokens` format
that `prepare` writes) into a temporary directory, then in fresh processes (`--repeats` per corpus,
interleaved across corpora) measures what one host of a v5p-128 does: rows 0..63 of 1024-row
global batches of 4096 tokens (process 0 of 16).
Printed side by side: peak RSS of that process, time to the first batch, steady batches/s and
tokens/s, and the ratio to what one host consumes in the paper's 3B run:

  6 N FLOPs per token, N = 3.79e9 -> 2.27e10 FLOP/token; 64 chips x 459 TFLOP/s bf16 peak x 50% MFU
  = 1.47e16 FLOP/s -> 6.5e5 tokens/s for the pod, 4.0e4 tokens/s per host (16 hosts);
  at 40% MFU 3.2e4 tokens/s. The ratio below uses the 50% figure (the harder target).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

SEQ_LEN, GLOBAL_ROWS, HOSTS = 4096, 1024, 16
N_PARAMS, CHIPS, PEAK, MFU = 3.79e9, 64, 459e12, 0.5
HOST_TOKENS_PER_S = CHIPS * PEAK * MFU / (6 * N_PARAMS) / HOSTS
VOCAB, SHARD_TOKENS = 100288, 50_000_000


def write_corpus(directory: str, num_tokens: int, seed: int = 0) -> None:
  """A prepared corpus of about `num_tokens` random tokens (byte-tokenizer manifest: the check
  passes with data.tokenizer='byte'; ids are not checked against the vocabulary when streaming)."""
  from diffjax.data import ByteTokenizer
  from diffjax.data.manifest import tokenizer_fingerprint, write_manifest
  from diffjax.data.shards import SUFFIX, TokenShardWriter

  rng = np.random.default_rng(seed)
  pool = rng.integers(0, VOCAB, size=1 << 22, dtype=np.int32).astype("<i4")
  shards, written = [], 0
  while written < num_tokens:
    name = f"shard-{len(shards):05d}-0000{SUFFIX}"
    w = TokenShardWriter(os.path.join(directory, name))
    docs = tokens = 0
    target = min(SHARD_TOKENS, num_tokens - written)
    while tokens < target:
      n = int(min(max(1, rng.lognormal(6.5, 1.0)), 100_000))
      start = int(rng.integers(0, pool.size - n))
      w.write(pool[start : start + n])
      docs, tokens = docs + 1, tokens + n
    w.close()
    shards.append({"path": name, "num_documents": docs, "num_tokens": tokens})
    written += tokens
  tok = ByteTokenizer()
  write_manifest(
    directory,
    shards,
    {
      "spec": "byte",
      "sha256": tokenizer_fingerprint(tok),
      "vocab_size": tok.vocab_size,
      "eos_id": tok.eos_id,
    },
  )


def measure(directory: str, batches: int) -> dict:
  """Runs in a fresh process: time to first batch, steady rate, peak RSS."""
  from diffjax.data import DataConfig, build_datasets

  t0 = time.perf_counter()  # after imports: they do not depend on the corpus
  data = build_datasets(
    DataConfig(kind="prepared", paths=(directory,)),
    seq_len=SEQ_LEN,
    global_batch_size=GLOBAL_ROWS,
    seed=0,
    process_index=0,
    process_count=HOSTS,
  )
  batch = next(data.train_iter)
  first = time.perf_counter() - t0
  assert batch["inputs"].shape == (GLOBAL_ROWS // HOSTS, SEQ_LEN)
  for _ in range(3):
    next(data.train_iter)
  t1 = time.perf_counter()
  for _ in range(batches):
    next(data.train_iter)
  rate = batches / (time.perf_counter() - t1)
  data.train_iter.close()
  return {
    "first_s": first,
    "batches_per_s": rate,
    "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
  }


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--sizes", default="10e6,100e6,1e9")
  p.add_argument("--batches", type=int, default=30)
  p.add_argument(
    "--repeats",
    type=int,
    default=5,
    help="fresh-process measurements per corpus, interleaved across corpora; the table "
    "gives medians (time to first batch varies by tens of ms from run to run)",
  )
  p.add_argument("--dir", default=None, help="where to write corpora (default: a temp dir)")
  p.add_argument("--_measure", default=None, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args._measure:
    print(json.dumps(measure(args._measure, args.batches)))
    return
  sizes = [int(float(s)) for s in args.sizes.split(",")]
  roots: dict[int, str] = {}
  results: dict[int, list[dict]] = {}
  try:
    for size in sizes:
      root = tempfile.mkdtemp(dir=args.dir, prefix="diffjax_data_bench_")
      free = shutil.disk_usage(root).free
      if free < size * 4.4:
        print(
          f"skipping {size:,} tokens: needs ~{size * 4.4 / 2**30:.1f} GiB, {free / 2**30:.1f} free"
        )
        shutil.rmtree(root, ignore_errors=True)
        continue
      roots[size] = root
      t = time.perf_counter()
      write_corpus(root, size)
      print(f"  {size:,} tokens written in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    for rep in range(args.repeats):
      for size, root in roots.items():
        out = subprocess.run(
          [sys.executable, __file__, "--_measure", root, "--batches", str(args.batches)],
          capture_output=True,
          text=True,
          check=True,
        )
        results.setdefault(size, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
      print(f"  round {rep + 1}/{args.repeats} measured", file=sys.stderr)
  finally:
    for root in roots.values():
      shutil.rmtree(root, ignore_errors=True)
  per_batch = GLOBAL_ROWS // HOSTS * SEQ_LEN
  print(
    f"\nper-host batch: {GLOBAL_ROWS // HOSTS} rows x {SEQ_LEN} tokens (process 0 of {HOSTS});"
    f" one v5p-128 host of the 3B run consumes {HOST_TOKENS_PER_S:,.0f} tokens/s at 50% MFU;"
    f" medians of {args.repeats} fresh processes per corpus (first batch: min-max)\n"
  )
  print("| corpus tokens | peak RSS MiB | first batch s | batches/s | tokens/s | x host need |")
  print("|---|---|---|---|---|---|")
  for size, rs in results.items():
    med = {k: float(np.median([r[k] for r in rs])) for k in rs[0]}
    firsts = [r["first_s"] for r in rs]
    tps = med["batches_per_s"] * per_batch
    print(
      f"| {size:,} | {med['rss_mib']:.0f} | {med['first_s']:.3f} ({min(firsts):.3f}-"
      f"{max(firsts):.3f}) | {med['batches_per_s']:.2f} | {tps:,.0f} | "
      f"{tps / HOST_TOKENS_PER_S:.1f} |"
    )


if __name__ == "__main__":
  main()
