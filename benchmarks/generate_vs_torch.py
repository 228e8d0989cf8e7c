"""End-to-end generation speed of ``diffjax.generate`` next to transformers' ``generate``, in one run.

    pip install torch==2.13.0 && pip install -e '.[bench-torch]'   # torch's CPU build first
    python benchmarks/generate_vs_torch.py                          # the default size, 5 rounds
    python benchmarks/generate_vs_torch.py --rounds 9 --batches 1,8,16 --new 256

The models: the Transformer and DIFF V1 arms at a named size (``--size``, default
``default``: configs/default.py's model, width 192, 3 layers, 6 baseline heads of 32, SwiGLU
512, byte vocabulary 258), float32. The peers: transformers' ``LlamaForCausalLM`` and
``DiffLlamaForCausalLM`` of the same shapes (DiffLlama counts component heads, so its 6
heads are diffjax's 3 DIFF heads), ``generate`` greedy under ``torch.inference_mode`` with its
default dynamic KV cache; diffjax's ``generate`` greedy. Every row gets a random prompt of
``--prompt`` tokens and generates exactly ``--new`` tokens (no stop token).

Each peer runs in its own process (torch and JAX never share the interpreter or its threads),
started once; every model is built and called twice before timing, so the times are of
second and later calls (diffjax's first call compiles; its time is printed apart). Each
round then times one call of every (arm, batch) on both peers, the order of the peers
alternating between rounds, so a slow phase of a shared machine hits both alike. The table
gives medians over the rounds of new tokens per second (batch x new tokens / wall time of
the call, end to end: tokenized prompts in, token ids out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

ARMS = ("transformer", "diff_v1")
VOCAB = 258


def _prompts(batch: int, length: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, VOCAB, (batch, length))


class TorchPeer:
  """transformers' models of the diffjax baseline widths, timed through ``generate``."""

  def __init__(self, size: str):
    import torch  # pylint: disable=import-outside-toplevel

    from diffjax.model.sizes import size_widths  # pylint: disable=import-outside-toplevel

    self.torch = torch
    self.widths = size_widths(size)
    self.models = {}

  def _model(self, arm: str):
    if arm not in self.models:
      from transformers import (
        DiffLlamaConfig,
        DiffLlamaForCausalLM,
        LlamaConfig,  # pylint: disable=import-outside-toplevel
        LlamaForCausalLM,
      )

      w = self.widths
      common = dict(
        vocab_size=VOCAB,
        hidden_size=w["d_model"],
        intermediate_size=w["mlp_dim"],
        num_hidden_layers=w["num_layers"],
        num_attention_heads=w["num_heads"],
        num_key_value_heads=w["num_kv_heads"],
        head_dim=w["head_dim"],
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
      )
      cls, cfg_cls = (
        (LlamaForCausalLM, LlamaConfig)
        if arm == "transformer"
        else (DiffLlamaForCausalLM, DiffLlamaConfig)
      )
      self.torch.manual_seed(0)
      self.models[arm] = cls(cfg_cls(**common)).float().eval()
    return self.models[arm]

  def run(self, arm: str, batch: int, prompt: int, new: int) -> float:
    model = self._model(arm)
    ids = self.torch.from_numpy(_prompts(batch, prompt).astype(np.int64))
    mask = self.torch.ones_like(ids)
    t0 = time.perf_counter()
    with self.torch.inference_mode():
      out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
      )
    seconds = time.perf_counter() - t0
    assert out.shape == (batch, prompt + new), out.shape
    return seconds


class JaxPeer:
  """The diffjax arms matched to the same baseline, timed through ``diffjax.generate``."""

  def __init__(self, size: str):
    from diffjax.model import ModelConfig, matched_configs  # pylint: disable=import-outside-toplevel
    from diffjax.model.sizes import size_widths  # pylint: disable=import-outside-toplevel

    base = ModelConfig(attention="transformer", vocab_size=VOCAB, **size_widths(size))
    self.configs = matched_configs(base)
    self.models = {}

  def _model(self, arm: str):
    if arm not in self.models:
      from flax import nnx  # pylint: disable=import-outside-toplevel

      from diffjax.model import DecoderLM  # pylint: disable=import-outside-toplevel

      self.models[arm] = DecoderLM(self.configs[arm], rngs=nnx.Rngs(0))
    return self.models[arm]

  def run(self, arm: str, batch: int, prompt: int, new: int) -> float:
    import diffjax  # pylint: disable=import-outside-toplevel

    model = self._model(arm)
    ids = _prompts(batch, prompt)
    t0 = time.perf_counter()
    out = diffjax.generate(model, ids, max_new_tokens=new)
    seconds = time.perf_counter() - t0
    assert all(len(row) == new for row in out.tokens)
    return seconds


def child(peer_name: str, size: str) -> None:
  """Serves timing requests (one JSON line each) on stdin until it closes."""
  if peer_name == "jax":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  peer = TorchPeer(size) if peer_name == "torch" else JaxPeer(size)
  for line in sys.stdin:
    req = json.loads(line)
    args = (req["arm"], req["batch"], req["prompt"], req["new"])
    if req.get("warm"):
      first = peer.run(*args)
      peer.run(*args)
      reply = {"first": first}
    else:
      reply = {"seconds": peer.run(*args)}
    print(json.dumps(reply), flush=True)


class _Child:
  def __init__(self, peer_name: str, size: str):
    self.proc = subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), f"--child={peer_name}", f"--size={size}"],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
      env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")},
    )

  def ask(self, **req) -> dict:
    self.proc.stdin.write(json.dumps(req) + "\n")
    self.proc.stdin.flush()
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"the benchmark child exited with status {self.proc.wait()}")
    return json.loads(line)

  def close(self) -> None:
    self.proc.stdin.close()
    self.proc.wait()


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--size", default="default", help="baseline size from diffjax.model.sizes")
  p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
  p.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
  p.add_argument("--new", type=int, default=128, help="new tokens per row")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--child", choices=("torch", "jax"), help=argparse.SUPPRESS)
  a = p.parse_args()
  if a.child:
    child(a.child, a.size)
    return
  batches = [int(b) for b in a.batches.split(",")]
  cases = [(arm, b) for arm in ARMS for b in batches]
  peers = {"torch": _Child("torch", a.size), "jax": _Child("jax", a.size)}
  versions = subprocess.run(
    [
      sys.executable,
      "-c",
      "import torch, transformers, jax; print(f'torch {torch.__version__}, "
      "transformers {transformers.__version__}, jax {jax.__version__}')",
    ],
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()
  load = os.getloadavg()[0]
  try:
    first = {}
    for arm, b in cases:
      for name, peer in peers.items():
        first[name, arm, b] = peer.ask(arm=arm, batch=b, prompt=a.prompt, new=a.new, warm=True)[
          "first"
        ]
    times = {(name, arm, b): [] for name in peers for arm, b in cases}
    for r in range(a.rounds):
      order = ("torch", "jax") if r % 2 == 0 else ("jax", "torch")
      for arm, b in cases:
        for name in order:
          times[name, arm, b].append(
            peers[name].ask(arm=arm, batch=b, prompt=a.prompt, new=a.new)["seconds"]
          )
  finally:
    for peer in peers.values():
      peer.close()
  print(
    f"{versions}; {os.cpu_count()} CPUs, load average {load:.2f} at the start, "
    f"{os.getloadavg()[0]:.2f} at the end; size={a.size} prompt={a.prompt} new={a.new} "
    f"float32 greedy; medians of {a.rounds} rounds"
  )
  print(
    "| arm | batch | transformers new tokens/s | diffjax new tokens/s | diffjax / transformers "
    "| transformers call (ms) | diffjax call (ms) | diffjax first call (s) |"
  )
  print("|---|---|---|---|---|---|---|---|")
  for arm, b in cases:
    t_torch = statistics.median(times["torch", arm, b])
    t_jax = statistics.median(times["jax", arm, b])
    tps_torch, tps_jax = b * a.new / t_torch, b * a.new / t_jax
    print(
      f"| {arm} | {b} | {tps_torch:,.0f} | {tps_jax:,.0f} | {tps_jax / tps_torch:.2f} | "
      f"{t_torch * 1e3:,.1f} | {t_jax * 1e3:,.1f} | {first['jax', arm, b]:.2f} |",
      flush=True,
    )


if __name__ == "__main__":
  main()
