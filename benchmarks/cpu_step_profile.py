"""Where a CPU train step's time goes: XLA's own per-kernel timings, summed by kind.

    python benchmarks/cpu_step_profile.py                          # Transformer, auto
    python benchmarks/cpu_step_profile.py --arm diff_v1 --implementation xla --top 30

Builds the 4-layer LM of `benchmarks/cpu_vs_torch.py` (width 256, SwiGLU 688, vocabulary 256,
batch 8 x 256), traces `--steps` forward+backward passes with `jax.profiler` (a Perfetto trace
under `--trace_dir`) and prints, per step, the milliseconds of every XLA CPU kernel (thunk)
summed by kind (the fusion name without its number: `ynn_fusion` are matmuls fused by
YNNPACK, `copy_*` layout copies, `subtract_exponential_fusion` the softmax exponentials), then
the largest single kernels. Kernel times are summed over XLA's threads, so their total can
exceed the wall time of a step. The optimizer update is left out (about 7 ms).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import tempfile
import time

import numpy as np
from cpu_vs_torch import VOCAB, diffjax_config  # the same model (benchmarks/ is on sys.path)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--arm", default="transformer", choices=("transformer", "diff_v1", "diff_v2"))
  p.add_argument("--implementation", default="auto")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--top", type=int, default=15, help="how many single kernels to list")
  p.add_argument("--trace_dir", default=None, help="keep the trace here (default: a temp dir)")
  a = p.parse_args()

  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from diffjax.train.steps import create_model, loss_sums, split_params  # pylint: disable=import-outside-toplevel

  graphdef, params = split_params(create_model(diffjax_config(a.arm, a.implementation), 0))
  rng = np.random.default_rng(0)
  b, t = a.batch, a.seq
  batch = {
    "inputs": jnp.asarray(rng.integers(0, VOCAB, (b, t)), jnp.int32),
    "targets": jnp.asarray(rng.integers(0, VOCAB, (b, t)), jnp.int32),
    "segment_ids": jnp.ones((b, t), jnp.int32),
    "positions": jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1)),
    "loss_mask": jnp.ones((b, t), jnp.float32),
  }
  grad = jax.jit(jax.grad(lambda p_, b_: loss_sums(graphdef, p_, b_)[0]))
  for _ in range(2):
    jax.block_until_ready(grad(params, batch))
  trace_dir = a.trace_dir or tempfile.mkdtemp(prefix="diffjax_cpu_profile_")
  t0 = time.perf_counter()
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(a.steps):
      jax.block_until_ready(grad(params, batch))
  wall = (time.perf_counter() - t0) / a.steps
  path = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)[0]
  with gzip.open(path) as f:
    events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
  per_kernel: dict[str, float] = collections.defaultdict(float)
  for e in events:
    name = e["name"]
    # Python frames, executor spans, thread-pool waits and loops (a `while` span contains
    # the kernels of its body, which are counted themselves) are not kernels.
    if name.startswith(("$", "ThunkExecutor", "Pjit", "SlinkyThreadPool", "while")):
      continue
    per_kernel[name] += e["dur"] / 1e3 / a.steps
  by_kind: dict[str, float] = collections.defaultdict(float)
  for name, ms in per_kernel.items():
    by_kind[name.split(".")[0]] += ms
  total = sum(by_kind.values())
  print(
    f"{a.arm}, implementation={a.implementation}, batch {b} x {t}: forward+backward "
    f"{wall * 1e3:.0f} ms wall per step (traced), kernels {total:.0f} ms summed over threads\n"
  )
  print("| kernel kind | ms per step | share |")
  print("|---|---|---|")
  for kind, ms in sorted(by_kind.items(), key=lambda x: -x[1]):
    if ms >= 0.005 * total:
      print(f"| {kind} | {ms:.1f} | {ms / total:.1%} |")
  print("\nlargest single kernels:")
  for name, ms in sorted(per_kernel.items(), key=lambda x: -x[1])[: a.top]:
    print(f"  {ms:7.1f} ms  {name}")
  if a.trace_dir is None:
    shutil.rmtree(trace_dir, ignore_errors=True)


if __name__ == "__main__":
  main()
