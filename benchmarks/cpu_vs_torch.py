"""CPU train-step speed of diffjax next to PyTorch (transformers) on the same model, in one run.

    pip install -e '.[bench-torch]'        # torch and transformers: this benchmark only
    python benchmarks/cpu_vs_torch.py      # the 4-layer LM below, float32, AdamW
    python benchmarks/cpu_vs_torch.py --rounds 11 --batch 16
    python benchmarks/cpu_vs_torch.py --arms llama,transformer,transformer:xla

The model: a LLaMA-style LM of 4 layers, width 256, SwiGLU 688, vocabulary 256, RMSNorm and
RoPE; the Transformer has 8 heads of 32, DIFF V1 4 heads of two 32-wide components
(transformers' `DiffLlamaForCausalLM` with 8 component heads). Batch 8 x 256 tokens.

Every arm is built and warmed up first; then each round runs one train step of every arm in
turn, so slow phases of the machine hit all arms alike. The table gives medians over the rounds
after `--warmup` rounds. A train step is forward, cross-entropy loss, backward and an AdamW
update: `torch.optim.AdamW` on the transformers models (loss from `labels`, which they shift
by one), diffjax's trainer step (`diffjax.train.build_train_setup`, the default optimizer
settings) on the diffjax arms, with `implementation="auto"` (on a CPU the `xla_cpu` attention)
unless the arm names another, as `diff_v1:xla` (the reference formulation).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

WIDTH, LAYERS, FFN, VOCAB, HEAD_DIM = 256, 4, 688, 256, 32


def torch_arm(kind: str, batch: int, seq: int, seed: int):
  import torch  # pylint: disable=import-outside-toplevel
  from transformers import (DiffLlamaConfig, DiffLlamaForCausalLM, LlamaConfig,  # pylint: disable=import-outside-toplevel
                            LlamaForCausalLM)
  torch.manual_seed(seed)
  common = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=8, num_key_value_heads=8, head_dim=HEAD_DIM,
                max_position_embeddings=seq, rms_norm_eps=1e-5, tie_word_embeddings=False,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
  cls, cfg_cls = ((LlamaForCausalLM, LlamaConfig) if kind == "llama"
                  else (DiffLlamaForCausalLM, DiffLlamaConfig))
  model = cls(cfg_cls(**common)).float().train()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
  gen = np.random.default_rng(seed)
  ids = torch.from_numpy(gen.integers(0, VOCAB, (batch, seq)).astype(np.int64))

  def step():
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)

  params = sum(p.numel() for p in model.parameters())
  return step, params


def diffjax_config(arm: str, implementation: str):
  """The diffjax model of `arm` at the shapes above (also used by cpu_step_profile.py)."""
  from diffjax.model import ModelConfig, matched_configs  # pylint: disable=import-outside-toplevel
  base = ModelConfig(attention="transformer", vocab_size=VOCAB, d_model=WIDTH, num_layers=LAYERS,
                     num_heads=8, num_kv_heads=8, head_dim=HEAD_DIM, mlp_dim=FFN,
                     implementation=implementation)
  return matched_configs(base)[arm]


def diffjax_arm(arm: str, batch: int, seq: int, seed: int, implementation: str):
  import jax  # pylint: disable=import-outside-toplevel
  from diffjax import sharding as shd  # pylint: disable=import-outside-toplevel
  from diffjax.model import count_params  # pylint: disable=import-outside-toplevel
  from diffjax.presets import base_config  # pylint: disable=import-outside-toplevel
  from diffjax.train.setup import build_train_setup  # pylint: disable=import-outside-toplevel
  cfg = diffjax_config(arm, implementation)
  setup = build_train_setup(cfg, base_config().optim, seed=seed,
                            mesh=shd.make_mesh((-1, 1, 1)), rules=shd.DEFAULT_RULES)
  gen = np.random.default_rng(seed)
  ids = gen.integers(0, VOCAB, (batch, seq + 1)).astype(np.int32)
  host = {"inputs": ids[:, :-1], "targets": ids[:, 1:],
          "segment_ids": np.ones((batch, seq), np.int32),
          "positions": np.tile(np.arange(seq, dtype=np.int32), (batch, 1)),
          "loss_mask": np.ones((batch, seq), np.float32)}
  data = {k: jax.device_put(v, setup.batch_sharding) for k, v in host.items()}
  box = {"state": setup.init_fn()}

  def step():
    box["state"], metrics = setup.train_step(box["state"], data)
    return float(metrics["loss"])  # waits for the step, as torch's float(loss) does

  return step, count_params(cfg)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--rounds", type=int, default=7, help="timed rounds (one step of each arm)")
  p.add_argument("--warmup", type=int, default=2, help="untimed rounds after the first step")
  p.add_argument("--arms", default="llama,diffllama,transformer,diff_v1,transformer:xla,diff_v1:xla",
                 help="comma-separated: llama, diffllama (transformers); transformer, diff_v1, "
                      "diff_v2 (diffjax, implementation='auto'), each optionally with "
                      "':<implementation>', e.g. 'diff_v1:xla'")
  p.add_argument("--malloc", default="keep", choices=("keep", "default"),
                 help="'keep': glibc malloc keeps freed memory for the next step, as diffjax's "
                      "trainer sets on a CPU (both frameworks share the process, so both get "
                      "it); 'default': glibc's own thresholds")
  a = p.parse_args()
  if a.malloc == "keep":
    from diffjax.train.host import keep_freed_memory  # pylint: disable=import-outside-toplevel
    if not keep_freed_memory():
      print("malloc: left at its defaults (not glibc on Linux, or DIFFJAX_KEEP_FREED_MEMORY=0)")
  import jax  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  names = {"llama": "transformers LlamaForCausalLM", "diffllama": "transformers DiffLlamaForCausalLM",
           "transformer": "diffjax Transformer", "diff_v1": "diffjax DIFF V1",
           "diff_v2": "diffjax DIFF V2"}
  arms = a.arms.split(",")
  unknown = [x for x in arms if x.split(":")[0] not in names]
  if unknown:
    raise SystemExit(f"Unknown arms {unknown}; choose from {sorted(names)}.")
  steps, params, compile_s = {}, {}, {}
  for arm in arms:
    t0 = time.perf_counter()
    if arm in ("llama", "diffllama"):
      steps[arm], params[arm] = torch_arm(arm, a.batch, a.seq, seed=0)
    else:
      name, _, implementation = arm.partition(":")
      steps[arm], params[arm] = diffjax_arm(name, a.batch, a.seq, 0, implementation or "auto")
    steps[arm]()  # first step: compiles the diffjax arms
    compile_s[arm] = time.perf_counter() - t0
  for _ in range(a.warmup):
    for arm in arms:
      steps[arm]()
  times: dict[str, list[float]] = {arm: [] for arm in arms}
  for r in range(a.rounds):
    for arm in arms:
      t0 = time.perf_counter()
      steps[arm]()
      times[arm].append(time.perf_counter() - t0)
    print(f"  round {r + 1}/{a.rounds}: " + ", ".join(f"{arm} {times[arm][-1] * 1e3:.0f} ms"
                                                    for arm in arms), flush=True)
  tokens = a.batch * a.seq
  print(f"\ntorch {torch.__version__} ({torch.get_num_threads()} threads), transformers "
        f"{transformers.__version__}, jax {jax.__version__} ({jax.default_backend()}); "
        f"{os.cpu_count()} CPUs; batch {a.batch} x {a.seq}, float32, medians of {a.rounds} "
        f"alternating rounds after {a.warmup}; malloc {a.malloc}\n")
  print("| arm | params | step ms | tokens/s | first step s |")
  print("|---|---|---|---|---|")
  med = {arm: statistics.median(ts) for arm, ts in times.items()}
  def label(arm):
    name, _, implementation = arm.partition(":")
    if name in ("llama", "diffllama"):
      return names[name]
    return f"{names[name]} (implementation={implementation or 'auto'})"

  for arm in arms:
    print(f"| {label(arm)} | {params[arm]:,} | {med[arm] * 1e3:.0f} | {tokens / med[arm]:,.0f} | "
          f"{compile_s[arm]:.1f} |")
  for ours in arms:
    theirs = {"transformer": "llama", "diff_v1": "diffllama"}.get(ours.split(":")[0])
    if theirs in med:
      print(f"\n{label(ours)} / {names[theirs]} speed: {med[theirs] / med[ours]:.2f}", end="")
  print()


if __name__ == "__main__":
  main()
