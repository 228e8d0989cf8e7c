"""The GPU check: everything a person with an H100/H200 runs in one command, as one table.

  python benchmarks/gpu_check.py --out docs/results/gpu_check.md     # on an H100/H200
  python benchmarks/gpu_check.py --dry-run                           # anywhere (CPU)

In order, each row of the table naming what ran and what came out:

1. the ``gpu``-marked tests (the compiled Mosaic GPU kernels against the reference:
   forward, every gradient, decoding; the stock paths), in a child process with
   ``JAX_PLATFORMS=cuda`` (the test suite defaults to the CPU otherwise, where every one of
   them skips): the row says FAILED when any test fails, errors or skips, or none ran;
2. the attention benchmark (``benchmarks/attention.py``) at the 3B layer (d 128, 12 DIFF
   heads, T 4096, bf16): baseline flash (cuDNN), jax's own Mosaic GPU flash attention as a
   peer kernel, V1 and V2 stock, V1 and V2 fused, forward and forward+backward, ms and
   TFLOP/s, ratio to the baseline;
3. DIFF V1 decoding at the 3B layer (batch 8, caches of 4K and 32K): the fused kernel
   ("auto") against XLA, ms per token and the cache bytes read per second;
4. a few train steps of the three matched arms at the 350m size with scanned layers
   (``benchmarks/train_step.py``), bf16: ms per step and tokens/s, ratio to the Transformer.

The whole check fits ``--budget_s`` seconds (default 540, for a 10-minute device call): the
tests get at most ``--tests_s`` (default 240) and each later part starts only while time is
left, a part that could not start being a row saying so. The exit status is 1 when a row
failed or a part did not run, so a table cannot look complete without being so.

``--dry-run`` runs the same sequence at toy sizes on whatever backend there is (the
tests are only collected, the fused kernels skipped off a GPU), to show the command
works; its numbers mean nothing. The table goes to stdout and to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import attention as attention_bench  # noqa: E402  pylint: disable=wrong-import-position
import train_step as train_bench  # noqa: E402  pylint: disable=wrong-import-position

from diffjax import ops  # noqa: E402  pylint: disable=wrong-import-position
from diffjax.model import ModelConfig, matched_configs  # noqa: E402
from diffjax.model.sizes import size_widths  # noqa: E402

GPU_TESTS = (
  "tests/kernels/gpu/test_kernels_mosaic_gpu.py",
  "tests/kernels/gpu/test_kernels_gpu.py",
)


def tests_failed(summary: str, dry: bool) -> bool:
  """Whether pytest's last line ``summary`` fails the check: anything failed, errored or
  skipped, or nothing passed (a dry run only collects, so only an error fails it)."""
  counts = {
    k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", summary)
  }
  if dry:
    return bool(counts.get("error") or counts.get("errors")) or "collected" not in summary
  bad = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
  return bad > 0 or counts.get("skipped", 0) > 0 or counts.get("passed", 0) == 0


def run_tests(dry: bool, timeout_s: float = 240) -> list[tuple[str, str, str]]:
  cmd = [
    sys.executable,
    "-m",
    "pytest",
    "-q",
    "-rs",
    "-m",
    "gpu",
    "-p",
    "no:cacheprovider",
    *GPU_TESTS,
  ] + (["--collect-only"] if dry else [])
  # tests/conftest.py makes the CPU the default backend; the GPU tests need the GPU's.
  env = dict(os.environ, JAX_PLATFORMS="cpu" if dry else "cuda")
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout_s, env=env)
  except subprocess.TimeoutExpired:
    return [("gpu-marked tests", " ".join(GPU_TESTS), f"FAILED: not done within {timeout_s:.0f} s")]
  lines = [l for l in proc.stdout.strip().splitlines() if l.strip()]
  summary = re.sub(r"=+", "", (lines[-1:] or ["no output"])[0]).strip()
  what = "collected (dry run)" if dry else f"{time.perf_counter() - t0:.0f} s"
  if tests_failed(summary, dry):
    skips = [l for l in lines if l.startswith("SKIPPED")][:2]
    summary = "FAILED: " + summary + "".join(f"; {l[:160]}" for l in skips)
  return [("gpu-marked tests", " ".join(GPU_TESTS) + f" ({what})", summary)]


def run_attention(dry: bool) -> list[tuple[str, str, str]]:
  on_gpu = jax.default_backend() == "gpu"
  seq, batch, heads, d = (64, 1, 1, 32) if dry else (4096, 4, 12, 128)
  dtype = jnp.float32 if dry and not on_gpu else jnp.bfloat16
  rows = attention_bench.measure(
    seq,
    batch,
    heads,
    d,
    dtype,
    interpret=not on_gpu,
    warmup=1 if dry else 3,
    iters=2 if dry else 20,
  )
  out = []
  case = f"T {seq}, batch {batch}, {heads} DIFF heads, d {d}, {jnp.dtype(dtype).name}"
  for r in rows:
    name = f"{r['path']} ({case})"
    if "error" in r:  # a peer kernel that cannot run here is information, not a failure
      peer = r["path"].startswith("peer")
      out.append(("attention", name, ("not measured: " if peer else "error: ") + r["error"]))
      continue
    fwd = f"fwd {r['fwd_ms']:.2f} ms {r['fwd_tflops']:.3g} TF/s x{r['fwd_x']:.2f}"
    if r["fb_ms"] is None:
      back = f"no fwd+bwd ({r['no_backward']})"
    else:
      back = f"fwd+bwd {r['fb_ms']:.2f} ms {r['fb_tflops']:.3g} TF/s x{r['fb_x']:.2f}"
    out.append(("attention", name, f"{fwd}; {back}"))
  return out


def _time(fn, args, iters: int) -> float:
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  for _ in range(iters):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / iters


def run_decode(dry: bool) -> list[tuple[str, str, str]]:
  batch, heads, d = (2, 2, 64) if dry else (8, 12, 128)
  caches = (256,) if dry else (4096, 32768)
  dtype = jnp.float32 if dry and jax.default_backend() != "gpu" else jnp.bfloat16
  out = []
  for s in caches:
    ks = jax.random.split(jax.random.key(0), 5)
    n = lambda i, shape: jax.random.normal(ks[i], shape, jnp.float32).astype(dtype)
    args = (
      n(0, (batch, 1, heads, d)),
      n(1, (batch, 1, heads, d)),
      n(2, (batch, s, heads, d)),
      n(3, (batch, s, heads, d)),
      n(4, (batch, s, heads, 2 * d)),
      0.3,
      jnp.full((batch,), s, jnp.int32),
    )
    cache_bytes = sum(a.size * a.dtype.itemsize for a in args[2:5])
    for impl in ("auto", "xla"):
      fn = jax.jit(lambda *a, impl=impl: ops.diff_v1_attention_decode(*a, implementation=impl))
      sec = _time(fn, args, 3 if dry else 50)
      out.append(
        (
          "decode",
          f"DIFF V1 {impl}, batch {batch}, cache {s}, {heads} heads, d {d}",
          f"{sec * 1e3:.3f} ms/token, {cache_bytes / sec / 1e9:.1f} GB/s of cache",
        )
      )
  return out


def run_train(dry: bool) -> list[tuple[str, str, str]]:
  size, seq, batch, steps = ("tiny", 16, 2, 1) if dry else ("350m", 2048, 8, 10)
  dtype = "float32" if dry and jax.default_backend() != "gpu" else "bfloat16"
  widths = {**size_widths(size), "dtype": dtype}
  if dry:
    widths["num_layers"] = 1
  # Scanned layers: one block compiled once (the unrolled 350m step takes minutes to compile).
  base = ModelConfig(attention="transformer", vocab_size=258, scan_layers=True, **widths)
  rng = np.random.default_rng(0)
  batch_np = {
    "inputs": rng.integers(0, 258, (batch, seq)).astype(np.int32),
    "targets": rng.integers(0, 258, (batch, seq)).astype(np.int32),
    "segment_ids": np.ones((batch, seq), np.int32),
    "positions": np.tile(np.arange(seq, dtype=np.int32), (batch, 1)),
    "loss_mask": np.ones((batch, seq), np.float32),
  }
  out, base_tps = [], None
  for arm, cfg in matched_configs(base).items():
    sec, compile_s = train_bench.bench_arm(cfg, batch_np, steps, 1)
    tps = batch * seq / sec
    base_tps = base_tps or tps
    out.append(
      (
        "train step",
        f"{arm}, size {size}, T {seq}, batch {batch}, {dtype}",
        f"{sec * 1e3:.1f} ms, {tps:,.0f} tokens/s, x{tps / base_tps:.3f} of the "
        f"Transformer (compile {compile_s:.0f} s)",
      )
    )
  return out


def table(rows) -> str:
  lines = ["| check | case | result |", "|---|---|---|"]
  lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--dry-run", action="store_true", help="toy sizes; tests only collected")
  p.add_argument("--out", default=None, help="also write the table (markdown) here")
  p.add_argument(
    "--budget_s", type=float, default=540, help="seconds for the whole check (default 540)"
  )
  p.add_argument(
    "--tests_s", type=float, default=240, help="seconds for the gpu-marked tests (default 240)"
  )
  a = p.parse_args(argv)
  dev = jax.devices()[0]
  head = (
    f"device: {dev.platform} {dev.device_kind} x{jax.device_count()}; jax "
    f"{jax.__version__}" + ("; DRY RUN (toy sizes, numbers mean nothing)" if a.dry_run else "")
  )
  if not a.dry_run and jax.default_backend() != "gpu":
    print(
      "error: no GPU here; pass --dry-run to check the command on this machine", file=sys.stderr
    )
    return 2
  t0 = time.perf_counter()
  rows = run_tests(a.dry_run, min(a.tests_s, a.budget_s))
  print("run_tests: done", file=sys.stderr, flush=True)
  for check, part in (
    ("attention", run_attention),
    ("decode", run_decode),
    ("train step", run_train),
  ):
    if time.perf_counter() - t0 >= a.budget_s:
      rows.append((check, "not run", f"FAILED: the budget of {a.budget_s:.0f} s was spent"))
      continue
    rows += part(a.dry_run)
    print(f"{check}: done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
  text = head + "\n\n" + table(rows) + "\n"
  print(text)
  if a.out:
    with open(a.out, "w", encoding="utf-8") as f:
      f.write(text)
  return 1 if any(r[2].startswith(("FAILED", "error")) for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
