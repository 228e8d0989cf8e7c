"""Train-step time and tokens/s of the three matched arms, side by side in one run.

  python benchmarks/train_step.py                       # the default config's size
  python benchmarks/train_step.py --size=350m --seq=2048 --batch=8 --dtype=bfloat16
  python benchmarks/train_step.py --size=tiny --scan_layers=both   # unrolled vs scanned

Each arm is compiled once, warmed up, then timed over --steps steps (median of
per-step wall times with ``block_until_ready``); ratios are to the Transformer.
The three arms use the same batch, the same optimizer and the same shardings.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from diffjax import sharding as shd
from diffjax.model import ModelConfig, count_params, matched_configs
from diffjax.model.sizes import size_widths
from diffjax.presets import base_config
from diffjax.train.setup import build_train_setup


def bench_arm(cfg: ModelConfig, batch_np, steps: int, warmup: int):
  """Median step seconds and first-call (compile) seconds of ``cfg``'s train step."""
  setup = build_train_setup(
    cfg, base_config().optim, seed=0, mesh=shd.make_mesh((-1, 1, 1)), rules=shd.DEFAULT_RULES
  )
  batch = {k: jax.device_put(v, setup.batch_sharding) for k, v in batch_np.items()}
  step = setup.train_step
  state = setup.init_fn()
  t0 = time.perf_counter()
  state, m = step(state, batch)
  jax.block_until_ready(m["loss"])
  compile_s = time.perf_counter() - t0
  for _ in range(warmup):
    state, m = step(state, batch)
  jax.block_until_ready(m["loss"])
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m["loss"])
    times.append(time.perf_counter() - t0)
  return statistics.median(times), compile_s


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--size", default="small", help="baseline size from diffjax.model.sizes")
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--vocab", type=int, default=258)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--implementation", default="auto")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument(
    "--scan_layers",
    default="off",
    choices=("off", "on", "both"),
    help="run the blocks unrolled, under lax.scan, or both (rows side by side)",
  )
  a = p.parse_args()

  base = ModelConfig(
    attention="transformer",
    vocab_size=a.vocab,
    **{**size_widths(a.size), "dtype": a.dtype, "implementation": a.implementation},
  )
  rng = np.random.default_rng(0)
  batch = {
    "inputs": rng.integers(0, a.vocab, (a.batch, a.seq)).astype(np.int32),
    "targets": rng.integers(0, a.vocab, (a.batch, a.seq)).astype(np.int32),
    "segment_ids": np.ones((a.batch, a.seq), np.int32),
    "positions": np.tile(np.arange(a.seq, dtype=np.int32), (a.batch, 1)),
    "loss_mask": np.ones((a.batch, a.seq), np.float32),
  }
  dev = jax.devices()[0]
  print(
    f"device: {dev.device_kind} x{jax.device_count()} ({jax.default_backend()}), "
    f"jax {jax.__version__}; size={a.size} seq={a.seq} batch={a.batch} dtype={a.dtype} "
    f"implementation={a.implementation}; median of {a.steps} steps after {a.warmup} warm-up"
  )
  print(
    "| arm | layers | params | step ms | tokens/s | ratio to Transformer (tokens/s) | compile s |"
  )
  print("|---|---|---|---|---|---|---|")
  scans = {"off": (False,), "on": (True,), "both": (False, True)}[a.scan_layers]
  base_tps = {}
  for arm, cfg in matched_configs(base).items():
    for scan in scans:
      t, c = bench_arm(cfg.replace(scan_layers=scan), batch, a.steps, a.warmup)
      tps = a.batch * a.seq / t
      base_tps.setdefault(scan, tps)
      print(
        f"| {arm} | {'scanned' if scan else 'unrolled'} | {count_params(cfg):,} | "
        f"{t * 1e3:.1f} | {tps:,.0f} | {tps / base_tps[scan]:.3f} | {c:.1f} |",
        flush=True,
      )


if __name__ == "__main__":
  main()
