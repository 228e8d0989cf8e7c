"""Ahead-of-time TPU compiles of the DIFF attention kernels at the paper's 3B shapes.

No TPU is needed: with libtpu installed (``pip install 'jax[tpu]'``), a topology
description gives the devices of a real TPU slice, and lowering + compiling for them
runs the real XLA TPU and Mosaic compilers here. A kernel whose tiles do not fit VMEM,
or whose block shapes Mosaic rejects, fails to compile; the script then prints the
compiler's message and exits with status 1.

Shapes (paper 3B, section 2.5 of the design brief): head dim d = 128, sequence 4096,
bfloat16, causal, ``--batch-per-device`` sequences per device.

  mha splash      baseline: 24 heads of d, one splash-attention call (the matched peer)
  v1 fused        12 DIFF heads, 12 kv groups (K1, K2 of d, V of 2d), one fused kernel
  v1 stock        the same as two splash calls with the 2d-wide V, then a subtraction
  v2 fused        48 query heads = 24 pairs, 24 kv heads, one fused pair kernel
  v2 stock        one splash call over the 48 query heads, then the pair combination

Each runs inside ``jax.shard_map`` over a (data, model) mesh of the topology's devices
(model = 2: half of the heads and kv groups per device). Memory columns are the
per-device static plan of ``compiled.memory_analysis()`` in MiB: arguments, outputs,
temporaries, and their sum (minus aliased bytes). XLA may place buffers of up to a few
MiB in VMEM instead (v5e has 128 MiB of it); those do not appear, so compare the
columns within a topology with care. ``GFLOP`` is the algorithmic count per device
of the design brief (section 3) over the T (T + 1) / 2 visible query-key pairs of a
causal sequence: per unit of two baseline heads, baseline 8d forward / 28d
forward+backward, V1 stock 12d / 40d, V1 fused 12d / 32d; per V2 pair, stock 8d / 28d,
fused 8d / 24d (V2 has twice the query heads of the baseline, so twice its FLOPs).

  python benchmarks/aot_kernels_tpu.py
  python benchmarks/aot_kernels_tpu.py --topologies v5e:2x2,v5p:2x2x1,v6e:2x2 --seq 8192
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for TPU; never look for one here
# Compiling for a described topology touches no TPU, so another libtpu process's lock
# file need not stop this one.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from diffjax.kernels import tpu as kt  # noqa: E402  pylint: disable=g-import-not-at-top

MiB = 2**20


@dataclasses.dataclass
class Row:
  """One kernel pass compiled for one topology (``error`` is empty when it compiled)."""

  topology: str
  kernel: str
  pass_: str
  seconds: float
  # The compiler's plan per device in MiB: args, outs, temp and their total (less aliasing).
  mib: dict[str, float] = dataclasses.field(default_factory=dict)
  gflop: float = 0.0
  error: str = ""

  @property
  def ok(self) -> bool:
    return not self.error


# (units per device for H heads of the row's kind, FLOPs per visible pair / d) for
# (forward, forward+backward): units of two baseline heads, DIFF V1 heads or V2 pairs.
_FLOPS_PER_PAIR = {
  "mha splash": (8, 28),
  "v1 stock": (12, 40),
  "v1 fused": (12, 32),
  "v2 stock": (8, 28),
  "v2 fused": (8, 24),
}
_UNITS = {"mha splash": 12, "v1 stock": 12, "v1 fused": 12, "v2 stock": 24, "v2 fused": 24}


def _model_gflop(
  kernel: str, pass_: str, *, batch: int, seq: int, d: int, head_shards: int
) -> float:
  per_pair = _FLOPS_PER_PAIR[kernel][0 if pass_ == "fwd" else 1]
  units = _UNITS[kernel] / head_shards
  return units * batch * seq * (seq + 1) / 2 * per_pair * d / 1e9


def _specs_and_args(kernel: str, mesh: Mesh, *, batch: int, seq: int, d: int, dtype):
  """(per-device fn, in_specs, out_spec, abstract global args) of one table row."""
  n_data = mesh.shape["data"]
  b = batch * n_data
  sds = lambda shape, spec, dt=dtype: jax.ShapeDtypeStruct(
    shape, dt, sharding=NamedSharding(mesh, spec)
  )
  x = P("data", None, "model", None)
  if kernel.startswith("mha"):
    h = 24
    args = tuple(sds((b, seq, h, d), x) for _ in range(3))
    return kt.mha_stock_tpu, (x, x, x), x, args
  if kernel.startswith("v1"):
    h = 12
    in_specs, out_spec = kt.diff_v1_partition_specs("data", "model")
    args = (
      sds((b, seq, h, d), x),
      sds((b, seq, h, d), x),
      sds((b, seq, h, d), x),
      sds((b, seq, h, d), x),
      sds((b, seq, h, 2 * d), x),
      sds((h,), in_specs[5], jnp.float32),
    )
    fn = kt.diff_v1_pallas_tpu if kernel.endswith("fused") else kt.diff_v1_stock_tpu
    return fn, in_specs, out_spec, args
  h = 24
  in_specs, out_spec = kt.diff_v2_partition_specs("data", "model")
  args = (
    sds((b, seq, 2 * h, d), x),
    sds((b, seq, h, d), x),
    sds((b, seq, h, d), x),
    sds((b, seq, h), in_specs[3], jnp.float32),
  )
  fn = kt.diff_v2_pallas_tpu if kernel.endswith("fused") else kt.diff_v2_stock_tpu
  return fn, in_specs, out_spec, args


def _program(fn: Callable, mesh, in_specs, out_spec, n_args: int, pass_: str, block_sizes):
  kwargs = dict(causal=True)
  if block_sizes is not None and fn in (kt.diff_v1_pallas_tpu, kt.diff_v2_pallas_tpu):
    kwargs["block_sizes"] = block_sizes
  per_device = lambda *a: fn(*a, **kwargs)
  sharded = jax.shard_map(
    per_device, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False
  )
  if pass_ == "fwd":
    return jax.jit(sharded)
  # Differentiate every float input (lambda included) against a sum of the outputs.
  loss = lambda *a: jnp.sum(sharded(*a).astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=tuple(range(n_args))))


def _compile_row(topology: str, mesh: Mesh, kernel: str, pass_: str, args_ns) -> Row:
  fn, in_specs, out_spec, args = _specs_and_args(
    kernel,
    mesh,
    batch=args_ns.batch_per_device,
    seq=args_ns.seq,
    d=args_ns.head_dim,
    dtype=jnp.dtype(args_ns.dtype),
  )
  program = _program(fn, mesh, in_specs, out_spec, len(args), pass_, args_ns.block_sizes)
  start = time.perf_counter()
  try:
    compiled = program.lower(*args).compile()
  except Exception as e:  # pylint: disable=broad-except
    return Row(
      topology, kernel, pass_, time.perf_counter() - start, error=f"{type(e).__name__}: {e}"
    )
  seconds = time.perf_counter() - start
  mem = compiled.memory_analysis()
  row = Row(topology, kernel, pass_, seconds)
  if mem is not None:
    row.mib = {
      "args": mem.argument_size_in_bytes / MiB,
      "outs": mem.output_size_in_bytes / MiB,
      "temp": mem.temp_size_in_bytes / MiB,
    }
    row.mib["total"] = sum(row.mib.values()) - mem.alias_size_in_bytes / MiB
  row.gflop = _model_gflop(
    kernel,
    pass_,
    batch=args_ns.batch_per_device,
    seq=args_ns.seq,
    d=args_ns.head_dim,
    head_shards=mesh.shape["model"],
  )
  return row


def _print_table(rows: list[Row]) -> None:
  header = (
    f"{'topology':<11} {'kernel':<11} {'pass':<8} {'compiled':<8} "
    f"{'args MiB':>9} {'out MiB':>8} {'temp MiB':>9} {'total MiB':>10} "
    f"{'GFLOP':>8} {'compile s':>9}"
  )
  print(header)
  print("-" * len(header))
  for r in rows:
    gflop = f"{r.gflop:8.1f}"
    if r.ok:
      m = {k: r.mib.get(k, float("nan")) for k in ("args", "outs", "temp", "total")}
      print(
        f"{r.topology:<11} {r.kernel:<11} {r.pass_:<8} {'OK':<8} {m['args']:9.1f} "
        f"{m['outs']:8.1f} {m['temp']:9.1f} {m['total']:10.1f} {gflop} {r.seconds:9.1f}"
      )
    else:
      print(f"{r.topology:<11} {r.kernel:<11} {r.pass_:<8} {'FAILED':<8}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--topologies", default="v5e:2x2,v5p:2x2x1", help="comma-separated TPU topology names"
  )
  parser.add_argument("--kernels", default="mha splash,v1 fused,v1 stock,v2 fused,v2 stock")
  parser.add_argument("--passes", default="fwd,fwd+bwd")
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--batch-per-device", type=int, default=2)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument(
    "--block-sizes",
    default=None,
    help="fused-kernel tiles, e.g. block_q=512,block_kv=512,block_kv_bwd=256",
  )
  ns = parser.parse_args(argv)
  ns.block_sizes = (
    None
    if not ns.block_sizes
    else {k: int(v) for k, v in (kv.split("=") for kv in ns.block_sizes.split(","))}
  )

  rows = []
  for topology in ns.topologies.split(","):
    try:
      devices = np.array(topologies.get_topology_desc(topology, "tpu").devices)
    except Exception as e:  # pylint: disable=broad-except
      print(
        f"Cannot describe TPU topology {topology!r} (is libtpu installed? "
        f"pip install 'jax[tpu]'): {e}",
        file=sys.stderr,
      )
      return 1
    mesh = Mesh(devices.reshape(devices.size // 2, 2), ("data", "model"))
    for kernel in ns.kernels.split(","):
      for pass_ in ns.passes.split(","):
        rows.append(_compile_row(topology, mesh, kernel.strip(), pass_.strip(), ns))
        print(
          f"  compiled {topology} {kernel} {pass_}: "
          f"{'OK' if rows[-1].ok else 'FAILED'} ({rows[-1].seconds:.1f}s)",
          file=sys.stderr,
          flush=True,
        )
  print(
    f"\nAOT TPU compiles: seq {ns.seq}, head dim {ns.head_dim}, {ns.dtype}, causal, "
    f"{ns.batch_per_device} sequence(s) per device, mesh (data, model=2); "
    "memory per device.\n"
  )
  _print_table(rows)
  failed = [r for r in rows if not r.ok]
  for r in failed:
    print(f"\n{r.topology} {r.kernel} {r.pass_} failed to compile:\n{r.error}", file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
