"""Decode tokens/s and KV-cache bytes per token of the three matched arms, side by side.

  python benchmarks/decode.py                          # the default config's size, on CPU
  python benchmarks/decode.py --size=350m --context=4096 --batch=8 --dtype=bfloat16

Each arm generates --new tokens after random prompts of --context tokens through
``diffjax.generate`` (greedy; the decode loop runs on the device, the cache donated and
updated in place). Each arm is called once to compile and then timed on a second call.
Decode tokens/s = batch x decode steps / decode seconds; the prefill is timed separately. KV bytes per token: the cache of
every layer divided by its batch x slots. Ratios are to the Transformer.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from flax import nnx

import diffjax
from diffjax.model import DecoderLM, ModelConfig, count_params, matched_configs
from diffjax.model.sizes import size_widths


def kv_bytes_per_token(model: DecoderLM) -> int:
  """Cache bytes one token occupies over all layers (the compute dtype)."""
  cache = jax.eval_shape(lambda: model.init_cache(1, 1))
  return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(cache))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--size", default="default", help="baseline size from diffjax.model.sizes")
  p.add_argument("--context", type=int, default=512, help="prompt tokens per row")
  p.add_argument("--new", type=int, default=64, help="generated tokens per row")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--vocab", type=int, default=258)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--implementation", default="auto")
  a = p.parse_args()

  base = ModelConfig(
    attention="transformer",
    vocab_size=a.vocab,
    **{**size_widths(a.size), "dtype": a.dtype, "implementation": a.implementation},
  )
  prompts = np.random.default_rng(0).integers(0, a.vocab, (a.batch, a.context))
  dev = jax.devices()[0]
  print(
    f"device: {dev.device_kind} x{jax.device_count()} ({jax.default_backend()}), "
    f"jax {jax.__version__}; size={a.size} context={a.context} new={a.new} "
    f"batch={a.batch} dtype={a.dtype} implementation={a.implementation}"
  )
  print(
    "| arm | params | KV bytes/token | ratio | prefill tokens/s | decode ms/step | "
    "decode tokens/s | ratio to Transformer (decode tokens/s) |"
  )
  print("|---|---|---|---|---|---|---|---|")
  base_kv = base_tps = None
  for arm, cfg in matched_configs(base).items():
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    kv = kv_bytes_per_token(model)
    diffjax.generate(model, prompts, max_new_tokens=a.new)  # compiles
    out = diffjax.generate(model, prompts, max_new_tokens=a.new)
    step_s = out.decode_seconds / out.decode_steps
    tps = a.batch / step_s
    base_kv, base_tps = base_kv or kv, base_tps or tps
    print(
      f"| {arm} | {count_params(cfg):,} | {kv:,} | {kv / base_kv:.3f} | "
      f"{a.batch * a.context / out.prefill_seconds:,.0f} | {step_s * 1e3:.2f} | "
      f"{tps:,.0f} | {tps / base_tps:.3f} |",
      flush=True,
    )


if __name__ == "__main__":
  main()
