"""One attention layer's forward and backward on a CPU: the reference formulation vs xla_cpu.

    python benchmarks/cpu_attention.py                 # batch 8 x 256, 8 heads of 32
    python benchmarks/cpu_attention.py --batch 16 --seq 128 --rounds 21

The shapes of `benchmarks/cpu_vs_torch.py`'s model: the baseline with 8 heads of 32, DIFF V1
with 4 heads of two 32-wide components and a 64-wide value, DIFF V2 with 8 pairs of query heads
on 8 kv heads; causal, float32. Each round runs every row once (alternating, so slow phases of
the machine hit all rows alike); the table gives medians after `--warmup` rounds. The timed
function is the gradient of a weighted sum of the output with respect to every input.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--rounds", type=int, default=15)
  p.add_argument("--warmup", type=int, default=3)
  a = p.parse_args()

  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from diffjax import ops  # pylint: disable=import-outside-toplevel

  b, t = a.batch, a.seq
  keys = iter(jax.random.split(jax.random.key(0), 16))
  rnd = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32)
  cases = {
    "Transformer (8 heads)": (
      ops.dot_product_attention,
      (rnd(b, t, 8, 32), rnd(b, t, 8, 32), rnd(b, t, 8, 32)),
    ),
    "DIFF V1 (4 heads x 2 maps)": (
      ops.diff_v1_attention_core,
      (
        rnd(b, t, 4, 32),
        rnd(b, t, 4, 32),
        rnd(b, t, 4, 32),
        rnd(b, t, 4, 32),
        rnd(b, t, 4, 64),
        jnp.full((4,), 0.5),
      ),
    ),
    "DIFF V2 (8 pairs)": (
      ops.diff_v2_attention,
      (rnd(b, t, 16, 32), rnd(b, t, 8, 32), rnd(b, t, 8, 32), jax.nn.sigmoid(rnd(b, t, 8))),
    ),
  }
  fns = {}
  for name, (op, args) in cases.items():
    w = rnd(*jax.eval_shape(lambda *x: op(*x, causal=True), *args).shape)
    for impl in ("xla", "xla_cpu"):
      loss = lambda *x, op=op, impl=impl, w=w: jnp.sum(op(*x, causal=True, implementation=impl) * w)
      g = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
      fns[(name, impl)] = (g, args)
  times = {k: [] for k in fns}
  for r in range(a.warmup + a.rounds):
    for k, (g, args) in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(g(*args))
      if r >= a.warmup:
        times[k].append(time.perf_counter() - t0)
  print(
    f"jax {jax.__version__}; batch {b} x {t}, causal, float32, forward+backward, medians "
    f"of {a.rounds} alternating rounds after {a.warmup}\n"
  )
  print("| attention | xla (reference) ms | xla_cpu ms | speed-up |")
  print("|---|---|---|---|")
  for name in cases:
    ref, ours = (statistics.median(times[(name, i)]) * 1e3 for i in ("xla", "xla_cpu"))
    print(f"| {name} | {ref:.1f} | {ours:.1f} | {ref / ours:.2f}x |")


if __name__ == "__main__":
  main()
