"""Attention kernels side by side: baseline flash attention vs DIFF V1 and V2 paths.

One run prints one table per sequence length for the paper's 3B attention shapes
(head dim 128; 24 baseline heads = 12 DIFF V1 heads; V2 doubles the baseline's query
heads to 48 = 24 pairs; kv heads equal to heads; causal; bfloat16), with the batch
chosen so every call sees the same number of tokens (``--tokens``, 16K by default):

  baseline flash   jax.nn.dot_product_attention, 24 heads (cuDNN on a GPU when it
                   accepts the call, XLA otherwise)
  peer kernel      jax's own Mosaic GPU flash attention
                   (jax.experimental.pallas.ops.gpu.attention_mgpu) on the baseline's
                   inputs: what Mosaic GPU reaches on this GPU, beside what the DIFF
                   kernels reach; on a GPU for bf16 and fp16. Where its backward refuses
                   causal masks (jax 0.10) the row has the forward alone and says why;
                   a peer that cannot run here is a row saying so
  V1 stock         4 stock calls (each map against each D-wide half of V)
  V2 stock         1 stock call over 48 heads, then the pair combination
  V1/V2 fused      diffjax.kernels.gpu.diff_v1_pallas_gpu / diff_v2_pallas_gpu (Mosaic
                   GPU, Hopper: fused forward and one fused backward); on a GPU for
                   bf16 and fp16, in the interpreter only with 3 or more host devices
                   (XLA_FLAGS=--xla_force_host_platform_device_count=8), with the
                   test suite's additions to jax's Mosaic GPU interpreter installed
                   (tests/kernels/gpu/mosaic_interpret.py)

Columns: forward and forward+backward milliseconds (medians after warm-up, with
``block_until_ready``), achieved TFLOP/s, time relative to the baseline, and memory.

FLOPs are the algorithmic counts of the design brief (section 3) per visible
query-key pair (causal: T (T + 1) / 2 pairs per sequence), per unit of two baseline
heads of width d: baseline 8d forward / 28d forward+backward; V1 stock (4 calls)
16d / 56d; V1 fused 12d / 32d. V2 per pair of query heads: stock 8d / 28d (two heads
of a standard kernel), fused 8d / 24d (one shared dP and one dV matmul in the
backward). The Mosaic GPU kernels execute exactly these counts.

Memory: ``compiled.memory_analysis()`` of the forward+backward program (arguments +
outputs + temporaries, XLA's static plan); on a GPU also the device's
``peak_bytes_in_use`` after the row (cumulative over the process).

On a CPU the Pallas kernels run in the interpreter (rows marked ``interp``; their
times measure the interpreter, not a kernel) and the stock paths use XLA; use the
reduced sizes, e.g. ``--quick``.

  python benchmarks/attention.py                      # GPU: seq 2K..16K, 16K tokens
  python benchmarks/attention.py --quick              # CPU smoke run, about a minute
  python benchmarks/attention.py --seq 256 --batch 1 --heads 2 --head-dim 64
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffjax.kernels import gpu as kg  # noqa: E402
from diffjax.kernels.gpu import (
  measured,  # noqa: E402
  mosaic_common,  # noqa: E402
  stock,  # noqa: E402
)


@dataclasses.dataclass
class Row:
  name: str
  fn: Callable
  args: tuple
  fwd_coef: float  # FLOPs per visible query-key pair per unit, in units of d
  total_coef: float
  units: int  # units counted by the coefficients (head pairs or DIFF heads)


def _inputs(batch, seq, heads, d, dtype, seed=0):
  """Arrays for the baseline (2 * heads heads), V1 (heads) and V2 (2 * heads pairs)."""
  ks = iter(jax.random.split(jax.random.PRNGKey(seed), 16))
  n = lambda *shape: jax.random.normal(next(ks), shape, jnp.float32).astype(dtype)
  base_h = 2 * heads
  return {
    "mha": (n(batch, seq, base_h, d), n(batch, seq, base_h, d), n(batch, seq, base_h, d)),
    "v1": (
      n(batch, seq, heads, d),
      n(batch, seq, heads, d),
      n(batch, seq, heads, d),
      n(batch, seq, heads, d),
      n(batch, seq, heads, 2 * d),
      jnp.full((heads,), 0.5, jnp.float32),
    ),
    "v2": (
      n(batch, seq, 2 * base_h, d),
      n(batch, seq, base_h, d),
      n(batch, seq, base_h, d),
      jax.nn.sigmoid(n(batch, seq, base_h).astype(jnp.float32)),
    ),
  }


def _mosaic_runs_here(dtype, interpret: bool) -> bool:
  """Mosaic GPU rows: bf16/fp16 on a GPU, or interpreted with a thread per warpgroup."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return False
  return not interpret or len(jax.devices("cpu")) >= mosaic_common.COMPUTE_WGS + 1


def _install_interpreter_additions() -> None:
  """What jax's Mosaic GPU interpreter lacks for these kernels, as the tests add it."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sys.path.insert(0, os.path.join(root, "tests", "kernels", "gpu"))
  import mosaic_interpret  # pylint: disable=import-outside-toplevel

  mosaic_interpret.install()


def _rows(inputs, heads, interpret: bool) -> list[Row]:
  mha = inputs["mha"]
  impl = stock.pick_implementation(*mha, is_causal=True)
  tag = " (interp)" if interpret else ""
  fused = dict(causal=True, interpret=interpret)
  mosaic_rows = []
  if _mosaic_runs_here(mha[0].dtype, interpret):
    if interpret:
      _install_interpreter_additions()
    mosaic_rows = [
      Row(
        "V1 fused Mosaic GPU" + tag,
        lambda *a: kg.diff_v1_pallas_gpu(*a, **fused),
        inputs["v1"],
        12,
        32,
        heads,
      ),
      Row(
        "V2 fused Mosaic GPU" + tag,
        lambda *a: kg.diff_v2_pallas_gpu(*a, **fused),
        inputs["v2"],
        8,
        24,
        2 * heads,
      ),
    ]
  return [
    Row(
      f"baseline flash ({impl})", lambda *a: kg.mha_stock_gpu(*a, causal=True), mha, 8, 28, heads
    ),
    *_peer_rows(mha, heads, interpret),
    Row(
      "V1 stock (4 calls)",
      lambda *a: kg.diff_v1_stock_gpu(*a, causal=True),
      inputs["v1"],
      16,
      56,
      heads,
    ),
    Row(
      "V2 stock (1 call)",
      lambda *a: kg.diff_v2_stock_gpu(*a, causal=True),
      inputs["v2"],
      8,
      28,
      2 * heads,
    ),
  ] + mosaic_rows


def _peer_rows(mha, heads: int, interpret: bool) -> list[Row]:
  """jax's Mosaic GPU flash attention on the baseline's inputs (a real GPU, bf16/fp16)."""
  if interpret or jnp.dtype(mha[0].dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return []
  try:
    from jax.experimental.pallas.ops.gpu import attention_mgpu  # pylint: disable=import-outside-toplevel
  except ImportError:
    return []
  config = attention_mgpu.TuningConfig(
    block_q=64, block_kv=128, max_concurrent_steps=2, causal=True
  )
  return [
    Row(
      "peer: jax Mosaic GPU flash",
      lambda q, k, v: attention_mgpu.attention(q, k, v, config),
      mha,
      8,
      28,
      heads,
    )
  ]


def _median_ms(fn, args, warmup: int, iters: int) -> float:
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times))


def _fwd_bwd(fn):
  def run(*args):
    out, vjp = jax.vjp(fn, *args)
    # A fixed cotangent (ones) stands in for dL/dout; gradients of every input.
    return vjp(jnp.ones_like(out))

  return run


def _memory_mib(compiled) -> float | None:
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  (not every backend reports)
    return None
  if m is None:
    return None
  total = (
    m.argument_size_in_bytes
    + m.output_size_in_bytes
    + m.temp_size_in_bytes
    - getattr(m, "alias_size_in_bytes", 0)
  )
  return total / 2**20


def _device_peak_mib() -> float | None:
  stats = jax.devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return None if peak is None else peak / 2**20


def measure(
  seq: int, batch: int, heads: int, d: int, dtype, *, interpret: bool, warmup: int, iters: int
) -> list[dict]:
  """One sequence length: per path, ms and TFLOP/s forward and forward+backward, the
  ratio to the baseline, memory; an ``error`` entry for a path that fails."""
  pairs = batch * seq * (seq + 1) / 2  # visible query-key pairs (causal)
  inputs = _inputs(batch, seq, heads, d, dtype)
  out, base = [], None
  for i, row in enumerate(_rows(inputs, heads, interpret)):
    no_backward = None
    try:
      t_f = _median_ms(jax.jit(row.fn), row.args, warmup, iters)
      try:
        compiled = jax.jit(_fwd_bwd(row.fn)).lower(*row.args).compile()
      except NotImplementedError as e:  # a peer without this backward (e.g. causal)
        if not row.name.startswith("peer"):
          raise
        no_backward, mem, t_b = _short(e), None, None
      else:
        mem = _memory_mib(compiled)
        t_b = _median_ms(compiled, row.args, warmup, iters)
    except Exception as e:  # pylint: disable=broad-except  (report and go on)
      out.append({"path": row.name, "error": _short(e)})
      continue
    if i == 0:  # the baseline
      base = (t_f, t_b)
    out.append(
      {
        "path": row.name,
        "seq": seq,
        "batch": batch,
        "fwd_ms": t_f,
        "fb_ms": t_b,
        "fwd_tflops": row.fwd_coef * d * pairs * row.units / t_f / 1e9,
        "fb_tflops": None if t_b is None else row.total_coef * d * pairs * row.units / t_b / 1e9,
        "fwd_x": t_f / base[0] if base else None,
        "fb_x": t_b / base[1] if base and t_b is not None else None,
        "mem_mib": mem,
        "no_backward": no_backward,
      }
    )
  return out


def _short(e: Exception) -> str:
  return f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--seq",
    type=int,
    nargs="+",
    default=None,
    help="sequence lengths (default 2048 4096 8192 16384; quick: 256)",
  )
  parser.add_argument(
    "--tokens", type=int, default=16384, help="tokens per call; batch = tokens // seq"
  )
  parser.add_argument("--batch", type=int, default=None, help="fixed batch (overrides --tokens)")
  parser.add_argument("--heads", type=int, default=None, help="DIFF V1 heads (default 12)")
  parser.add_argument("--head-dim", type=int, default=None, help="component head dim (128)")
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
  parser.add_argument("--warmup", type=int, default=None)
  parser.add_argument("--iters", type=int, default=None)
  parser.add_argument(
    "--quick",
    action="store_true",
    help="small CPU-friendly sizes: seq 256, batch 1, 2 heads, dim 64",
  )
  parser.add_argument(
    "--interpret",
    action="store_true",
    help="run the Pallas kernels in the interpreter (default on CPU)",
  )
  parser.add_argument(
    "--record",
    nargs="?",
    const=measured.PATH,
    default=None,
    help="on a GPU: write the fused and stock paths' times into the figures 'auto' follows "
    "(default file: diffjax/kernels/gpu/measured.json)",
  )
  args = parser.parse_args(argv)

  on_gpu = jax.default_backend() == "gpu"
  if args.record and not on_gpu:
    parser.error("--record writes a GPU's figures: run it on the GPU they are for.")
  interpret = args.interpret or not on_gpu
  seqs = args.seq or ([256] if args.quick else [2048, 4096, 8192, 16384])
  heads = args.heads or (2 if args.quick else 12)
  d = args.head_dim or (64 if args.quick else 128)
  batch_fixed = args.batch or (1 if args.quick else None)
  warmup = args.warmup if args.warmup is not None else (1 if args.quick or not on_gpu else 3)
  iters = args.iters if args.iters is not None else (3 if args.quick or not on_gpu else 20)
  dtype = jnp.dtype(args.dtype)

  dev = jax.devices()[0]
  print(
    f"device: {dev.platform} {dev.device_kind} ({jax.device_count()} device(s)); "
    f"jax {jax.__version__}; dtype {dtype.name}; causal; warmup {warmup}, "
    f"median of {iters}"
  )
  print(
    f"shapes: head dim d={d}; baseline {2 * heads} heads (kv {2 * heads}); V1 {heads} "
    f"DIFF heads, V width {2 * d} (kv {heads}); V2 {4 * heads} query heads = "
    f"{2 * heads} pairs (kv {2 * heads})"
  )
  if interpret:
    print("note: Pallas rows run in the interpreter (no GPU): their times are not kernel times.")

  header = (
    f"{'path':<28}{'fwd ms':>10}{'f+b ms':>10}{'fwd TF/s':>10}{'f+b TF/s':>10}"
    f"{'fwd x':>8}{'f+b x':>8}{'mem MiB':>10}" + (f"{'dev peak':>10}" if on_gpu else "")
  )
  recorded = []
  for seq in seqs:
    batch = batch_fixed or max(1, args.tokens // seq)
    print(f"\nseq {seq}, batch {batch} ({batch * seq} tokens)")
    print(header)
    print("-" * len(header))
    results = measure(seq, batch, heads, d, dtype, interpret=interpret, warmup=warmup, iters=iters)
    source = f"benchmarks/attention.py, {batch * seq} tokens a call, {heads} DIFF heads; jax {jax.__version__}"
    recorded += measured_rows(results, dev.device_kind, seq, dtype.name, d, source)
    for r in results:
      if "error" in r:
        print(f"{r['path']:<28}error: {r['error']}")
        continue
      num = lambda x, fmt, w: f"{x:>{w}{fmt}}" if x is not None else f"{'n/a':>{w}}"  # noqa: E731
      mem = r["mem_mib"]
      line = (
        f"{r['path']:<28}{num(r['fwd_ms'], '.2f', 10)}{num(r['fb_ms'], '.2f', 10)}"
        f"{num(r['fwd_tflops'], '.3g', 10)}{num(r['fb_tflops'], '.3g', 10)}"
        f"{num(r['fwd_x'], '.2f', 8)}{num(r['fb_x'], '.2f', 8)}{num(mem, '.0f', 10)}"
      )
      if on_gpu:
        peak = _device_peak_mib()
        line += f"{(f'{peak:.0f}' if peak is not None else 'n/a'):>10}"
      if r["no_backward"]:
        line += f"  (no backward: {r['no_backward']})"
      print(line, flush=True)
  if args.record:
    measured.record(recorded, args.record)
    print(f"\nwrote {len(recorded)} rows for {dev.device_kind} into {args.record}")


# The rows of a run that --record keeps: per op, the fused kernel against the stock path.
_RECORDED = {
  "diff_v1": {"pallas_gpu": "V1 fused Mosaic GPU", "stock": "V1 stock (4 calls)"},
  "diff_v2": {"pallas_gpu": "V2 fused Mosaic GPU", "stock": "V2 stock (1 call)"},
}


def measured_rows(results, device: str, seq: int, dtype: str, d: int, source: str) -> list[dict]:
  """The figures of one sequence length as rows of diffjax/kernels/gpu/measured.json (an op
  whose paths did not all run gives none)."""
  by_path = {r["path"]: r for r in results if "error" not in r}
  rows = []
  for op, paths in _RECORDED.items():
    got = {impl: by_path.get(path) for impl, path in paths.items()}
    if any(r is None or r["fb_ms"] is None for r in got.values()):
      continue
    for pass_, key in (("forward", "fwd_ms"), ("forward+backward", "fb_ms")):
      ms = {impl: round(r[key], 3) for impl, r in got.items()}
      rows.append(
        dict(device=device, op=op, seq=seq, dtype=dtype, head_dim=d, ms=ms, source=source)
        | {"pass": pass_}
      )
  return rows


if __name__ == "__main__":
  main()
