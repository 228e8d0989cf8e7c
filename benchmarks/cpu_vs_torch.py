"""CPU train-step speed of diffjax next to PyTorch (transformers) on the same model, in one run.

    pip install torch==2.13.0 --index-url <the CPU wheel index of torch>   # the CPU build (see below)
    pip install -e '.[bench-torch]'        # transformers (and torch, if not installed yet)
    python benchmarks/cpu_vs_torch.py      # the 4-layer LM below, float32, AdamW
    python benchmarks/cpu_vs_torch.py --rounds 11 --batch 16
    python benchmarks/cpu_vs_torch.py --arms llama,transformer@user,transformer:xla@user+cpu_setup

The model: a LLaMA-style LM of 4 layers, width 256, SwiGLU 688, vocabulary 256, RMSNorm and
RoPE; the Transformer has 8 heads of 32, DIFF V1 4 heads of two 32-wide components
(transformers' `DiffLlamaForCausalLM` with 8 component heads). Batch 8 x 256 tokens.

Which torch: a CPU user installs torch's CPU build (its version ends in `+cpu`); the general
package index's default torch wheels for Linux are CUDA builds, which also run on a CPU but
more slowly. The header names the build measured.

Every arm runs in its own process (two frameworks' thread pools in one process slow whichever
runs second). Each process builds its arm and runs its first step (the diffjax arms compile
there); then each round asks every arm in turn for one timed step, so slow phases of the machine
hit all arms alike, with `--pause` seconds between steps for the last arm's threads to go idle.
The table gives medians over the rounds after `--warmup` rounds; the speed next to
transformers is the median over rounds of the ratio of the two arms' steps in that round (on a
machine whose speed drifts, pairing by round cancels the drift that a ratio of medians keeps).

A train step is forward, cross-entropy loss, backward and an AdamW update (lr 1e-3, weight
decay 0.1):
- `llama`, `diffllama`: transformers' models in eager mode with `torch.optim.AdamW`, loss from
  `labels` (which they shift by one);
- `transformer`, `diff_v1`, `diff_v2`: diffjax's trainer step (`diffjax.train.build_train_setup`,
  the default optimizer settings), as `train.py` runs it;
- `transformer@user`, `diff_v1@user`, ...: the code a user writes around diffjax's modules: a
  `DecoderLM`, an `nnx.Optimizer` over `optax.adamw` and one `nnx.jit` step, nothing else;
- `transformer@user+cpu_setup`, ...: the same loop in a script that calls `diffjax.cpu_setup()`
  first (the trainer's CPU settings, see `diffjax/cpu.py`).
A diffjax arm may name its attention implementation, as `diff_v1:xla` (the reference
formulation); the default is `"auto"` (`xla_cpu` on a CPU).

`--malloc`: `framework` (the default) leaves each process as its framework leaves it: glibc's
own thresholds for torch and the plain user loop, freed memory kept for diffjax's trainer (the
trainer sets it) and for the loop that calls `diffjax.cpu_setup()`; `keep` or `default` sets
every process alike.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

import numpy as np

WIDTH, LAYERS, FFN, VOCAB, HEAD_DIM = 256, 4, 688, 256, 32
TORCH_ARMS = {
  "llama": "transformers LlamaForCausalLM",
  "diffllama": "transformers DiffLlamaForCausalLM",
}
DIFFJAX_ARMS = {
  "transformer": "diffjax Transformer",
  "diff_v1": "diffjax DIFF V1",
  "diff_v2": "diffjax DIFF V2",
}
PEER = {"transformer": "llama", "diff_v1": "diffllama"}
LOOPS = {
  "trainer": "trainer step",
  "user": "user's nnx.jit loop",
  "user+cpu_setup": "user's nnx.jit loop after diffjax.cpu_setup()",
}


def parse_arm(arm: str) -> tuple[str, str, str]:
  """'diff_v1:xla@user' -> ('diff_v1', 'xla', 'user'); the loop is one of LOOPS."""
  head, _, loop = arm.partition("@")
  name, _, implementation = head.partition(":")
  if name in TORCH_ARMS:
    if implementation or loop:
      raise SystemExit(f"Arm {arm!r}: the transformers arms take no ':implementation' or '@user'.")
    return name, "", "eager"
  if name not in DIFFJAX_ARMS:
    raise SystemExit(
      f"Unknown arm {arm!r}; choose from {sorted(TORCH_ARMS) + sorted(DIFFJAX_ARMS)}, "
      "a diffjax arm optionally with ':<implementation>' and/or '@<loop>', the loop one of "
      f"{list(LOOPS)}."
    )
  if loop and loop not in LOOPS:
    raise SystemExit(f"Arm {arm!r}: the loop after '@' is one of {list(LOOPS)}.")
  return name, implementation or "auto", loop or "trainer"


def torch_arm(kind: str, batch: int, seq: int, seed: int):
  import torch  # pylint: disable=import-outside-toplevel
  from transformers import (
    DiffLlamaConfig,
    DiffLlamaForCausalLM,
    LlamaConfig,  # pylint: disable=import-outside-toplevel
    LlamaForCausalLM,
  )

  torch.manual_seed(seed)
  common = dict(
    vocab_size=VOCAB,
    hidden_size=WIDTH,
    intermediate_size=FFN,
    num_hidden_layers=LAYERS,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=HEAD_DIM,
    max_position_embeddings=seq,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
  )
  cls, cfg_cls = (
    (LlamaForCausalLM, LlamaConfig) if kind == "llama" else (DiffLlamaForCausalLM, DiffLlamaConfig)
  )
  model = cls(cfg_cls(**common)).float().train()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
  gen = np.random.default_rng(seed)
  ids = torch.from_numpy(gen.integers(0, VOCAB, (batch, seq)).astype(np.int64))

  def step():
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()

  params = sum(p.numel() for p in model.parameters())
  return step, params


def diffjax_config(arm: str, implementation: str):
  """The diffjax model of `arm` at the shapes above (also used by cpu_step_profile.py)."""
  from diffjax.model import ModelConfig, matched_configs  # pylint: disable=import-outside-toplevel

  base = ModelConfig(
    attention="transformer",
    vocab_size=VOCAB,
    d_model=WIDTH,
    num_layers=LAYERS,
    num_heads=8,
    num_kv_heads=8,
    head_dim=HEAD_DIM,
    mlp_dim=FFN,
    implementation=implementation,
  )
  return matched_configs(base)[arm]


def _tokens(batch: int, seq: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, VOCAB, (batch, seq + 1)).astype(np.int32)


def diffjax_arm(arm: str, batch: int, seq: int, seed: int, implementation: str):
  """diffjax's trainer step on the arm's model."""
  import jax  # pylint: disable=import-outside-toplevel

  from diffjax import sharding as shd  # pylint: disable=import-outside-toplevel
  from diffjax.model import count_params  # pylint: disable=import-outside-toplevel
  from diffjax.presets import base_config  # pylint: disable=import-outside-toplevel
  from diffjax.train.setup import build_train_setup  # pylint: disable=import-outside-toplevel

  cfg = diffjax_config(arm, implementation)
  setup = build_train_setup(
    cfg, base_config().optim, seed=seed, mesh=shd.make_mesh((-1, 1, 1)), rules=shd.DEFAULT_RULES
  )
  ids = _tokens(batch, seq, seed)
  host = {
    "inputs": ids[:, :-1],
    "targets": ids[:, 1:],
    "segment_ids": np.ones((batch, seq), np.int32),
    "positions": np.tile(np.arange(seq, dtype=np.int32), (batch, 1)),
    "loss_mask": np.ones((batch, seq), np.float32),
  }
  data = {k: jax.device_put(v, setup.batch_sharding) for k, v in host.items()}
  box = {"state": setup.init_fn()}

  def step():
    box["state"], metrics = setup.train_step(box["state"], data)
    return float(metrics["loss"])  # waits for the step, as torch's loss.item() does

  return step, count_params(cfg)


def user_loop_arm(arm: str, batch: int, seq: int, seed: int, implementation: str):
  """The train step a user writes around diffjax's modules: plain Flax NNX and optax."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from diffjax.model import DecoderLM, count_params  # pylint: disable=import-outside-toplevel

  cfg = diffjax_config(arm, implementation)
  model = DecoderLM(cfg, rngs=nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-3, weight_decay=0.1), wrt=nnx.Param)

  def loss_fn(model, inputs, targets):
    logits = model(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  @nnx.jit
  def train_step(model, optimizer, inputs, targets):
    loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets)
    optimizer.update(model, grads)
    return loss

  ids = _tokens(batch, seq, seed)
  inputs, targets = jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:])

  def step():
    return float(train_step(model, optimizer, inputs, targets))

  return step, count_params(cfg)


def _worker(conn, arm: str, batch: int, seq: int, malloc: str) -> None:
  """One arm in its own process: build, first step, then one timed step per request."""
  name, implementation, loop = parse_arm(arm)
  if name not in TORCH_ARMS:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if malloc == "keep" or (malloc == "framework" and loop == "trainer"):
    from diffjax.cpu import keep_freed_memory  # pylint: disable=import-outside-toplevel

    keep_freed_memory()
  if loop == "user+cpu_setup":
    import diffjax  # pylint: disable=import-outside-toplevel

    diffjax.cpu_setup(keep_freed_memory=malloc != "default")
  t0 = time.perf_counter()
  if name in TORCH_ARMS:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel

    step, params = torch_arm(name, batch, seq, seed=0)
    about = (
      f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers "
      f"{transformers.__version__}"
    )
  else:
    import jax  # pylint: disable=import-outside-toplevel

    build = diffjax_arm if loop == "trainer" else user_loop_arm
    step, params = build(name, batch, seq, 0, implementation)
    about = f"jax {jax.__version__} ({jax.default_backend()})"
  loss = step()
  conn.send({"params": params, "first_s": time.perf_counter() - t0, "about": about, "loss": loss})
  while conn.recv() == "step":
    t0 = time.perf_counter()
    step()
    conn.send(time.perf_counter() - t0)


def label(arm: str) -> str:
  name, implementation, loop = parse_arm(arm)
  if name in TORCH_ARMS:
    return TORCH_ARMS[name]
  return f"{DIFFJAX_ARMS[name]}, {LOOPS[loop]} (implementation={implementation})"


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--rounds", type=int, default=9, help="timed rounds (one step of each arm)")
  p.add_argument("--warmup", type=int, default=2, help="untimed rounds after the first step")
  p.add_argument(
    "--arms",
    default="llama,diffllama,transformer,diff_v1,transformer@user,"
    "diff_v1@user,transformer@user+cpu_setup,diff_v1@user+cpu_setup",
    help="comma-separated: llama, diffllama (transformers); transformer, diff_v1, "
    "diff_v2 (diffjax's trainer step), each optionally with ':<implementation>' "
    "and '@user' or '@user+cpu_setup' (a user's own nnx.jit loop, plain or "
    "after diffjax.cpu_setup()), e.g. 'diff_v1:xla@user'",
  )
  p.add_argument("--pause", type=float, default=0.05, help="seconds between two arms' steps")
  p.add_argument(
    "--malloc",
    default="framework",
    choices=("framework", "keep", "default"),
    help="glibc malloc thresholds per process: as each framework sets them, or "
    "'keep' (freed memory kept, diffjax.cpu.keep_freed_memory) / "
    "'default' for every process",
  )
  a = p.parse_args()
  arms = a.arms.split(",")
  for arm in arms:
    parse_arm(arm)
  ctx = multiprocessing.get_context("spawn")
  conns, procs, info = {}, [], {}
  try:
    for arm in arms:  # one at a time, so compiles do not overlap
      ours, theirs = ctx.Pipe()
      proc = ctx.Process(target=_worker, args=(theirs, arm, a.batch, a.seq, a.malloc), daemon=True)
      proc.start()
      procs.append(proc)
      conns[arm] = ours
      info[arm] = ours.recv()
      print(
        f"  {arm}: ready, first step {info[arm]['first_s']:.1f} s, loss {info[arm]['loss']:.4f}",
        flush=True,
      )
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for r in range(a.warmup + a.rounds):
      # Forward order in even rounds, backward in odd ones: a machine getting slower or
      # faster during a round favours no arm.
      for arm in arms if r % 2 == 0 else arms[::-1]:
        time.sleep(a.pause)
        conns[arm].send("step")
        dt = conns[arm].recv()
        if r >= a.warmup:
          times[arm].append(dt)
      if r >= a.warmup:
        print(
          f"  round {r - a.warmup + 1}/{a.rounds}: "
          + ", ".join(f"{arm} {times[arm][-1] * 1e3:.0f} ms" for arm in arms),
          flush=True,
        )
  finally:
    for conn in conns.values():
      try:
        conn.send("stop")
      except (BrokenPipeError, OSError):
        pass
    for proc in procs:
      proc.join(timeout=30)
  tokens = a.batch * a.seq
  abouts = sorted({info[arm]["about"] for arm in arms})
  print(
    f"\n{'; '.join(abouts)}; {os.cpu_count()} CPUs; batch {a.batch} x {a.seq}, float32; "
    f"one process per arm, medians of {a.rounds} alternating rounds after {a.warmup}; "
    f"malloc {a.malloc}\n"
  )
  print(
    "| arm | params | step ms | tokens/s | first step s | speed vs transformers, paired by round |"
  )
  print("|---|---|---|---|---|---|")
  med = {arm: statistics.median(ts) for arm, ts in times.items()}
  for arm in arms:
    name = parse_arm(arm)[0]
    peer = arm if name in TORCH_ARMS else PEER.get(name)
    # Paired by round: the median over rounds of (peer's step / this arm's step).
    speed = f"{statistics.median(np.divide(times[peer], times[arm])):.2f}" if peer in med else "-"
    print(
      f"| {label(arm)} | {info[arm]['params']:,} | {med[arm] * 1e3:.0f} | "
      f"{tokens / med[arm]:,.0f} | {info[arm]['first_s']:.1f} | {speed} |"
    )


if __name__ == "__main__":
  main()
