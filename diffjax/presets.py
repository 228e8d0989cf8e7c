"""Config building blocks shared by the files in ``configs/``.

``base_config()`` holds every key a run reads, with CPU-friendly defaults;
``baseline_spec(name)`` gives the Transformer spec of a named size (the paper's
sizes included), from which :func:`diffjax.model.matched_configs` derives the arms.
"""

from __future__ import annotations

import ml_collections

from diffjax.model import ModelConfig, matched_configs
from diffjax.sharding import DEFAULT_RULES


def _round_up(x: float, multiple: int) -> int:
  return int(-(-x // multiple) * multiple)


def llama_ffn(d_model: int, multiple: int = 256) -> int:
  """SwiGLU hidden size 8/3 * d_model rounded up (used where the paper gives none)."""
  return _round_up(8 * d_model / 3, multiple)


# Baseline (Transformer) specs: (d_model, layers, baseline heads, mlp_dim).
# The paper lists DIFF heads; the baseline has twice as many with the same d.
_SPECS = {
    # CPU sizes. "micro" learns associative recall in minutes (configs/compare/retrieval_cpu.py).
    "micro": dict(d_model=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, mlp_dim=176),
    "tiny": dict(d_model=128, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=32, mlp_dim=352),
    "default": dict(d_model=192, num_layers=3, num_heads=6, num_kv_heads=6, head_dim=32,
                    mlp_dim=512),
    "small": dict(d_model=256, num_layers=4, num_heads=8, num_kv_heads=8, head_dim=32,
                  mlp_dim=688),
    # One-GPU size (~350M parameters with a 100K vocabulary).
    "350m": dict(d_model=1024, num_layers=24, num_heads=16, num_kv_heads=16, head_dim=64,
                 mlp_dim=2816),
    # arXiv 2410.05258 section 3: 3B (FFN given), and the scaling sweep (FFN 8/3 d rounded).
    "3b": dict(d_model=3072, num_layers=28, num_heads=24, num_kv_heads=24, head_dim=128,
               mlp_dim=8192),
    # d = d_model / (2 * DIFF heads): 96 for 830M, 128 for the others.
    "830m": dict(d_model=1536, num_layers=24, num_heads=16, num_kv_heads=16, head_dim=96),
    "1.4b": dict(d_model=2048, num_layers=24, num_heads=16, num_kv_heads=16, head_dim=128),
    "2.8b": dict(d_model=2560, num_layers=32, num_heads=20, num_kv_heads=20, head_dim=128),
    "6.8b": dict(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128),
    "13.1b": dict(d_model=5120, num_layers=40, num_heads=40, num_kv_heads=40, head_dim=128),
}
PAPER_VOCAB = 100288  # tiktoken cl100k_base as used by the paper, padded.


def baseline_spec(name: str, vocab_size: int = -1) -> dict:
  if name not in _SPECS:
    raise ValueError(f"Unknown size {name!r}; known sizes are {sorted(_SPECS)}.")
  spec = dict(_SPECS[name])
  spec.setdefault("mlp_dim", llama_ffn(spec["d_model"]))
  spec["vocab_size"] = vocab_size
  return spec


def arm_model(size: str, arm: str, vocab_size: int = -1, *, v2_match: str = "heads",
              **overrides) -> dict:
  """The model dict of ``arm`` matched to the Transformer of ``size``.

  ``v2_match`` as in :func:`diffjax.model.matched_configs` ("heads" or "params").
  """
  base = ModelConfig(attention="transformer", **{
      **baseline_spec(size, vocab_size if vocab_size > 0 else 258), **overrides})
  cfg = matched_configs(base, v2_match=v2_match)[arm].to_dict()
  cfg["vocab_size"] = vocab_size
  return cfg


ARM_NAMES = ("transformer", "diff_v1", "diff_v2")
SWEEP_SIZES = ("830m", "1.4b", "2.8b", "6.8b", "13.1b")


def config_args(arg: str | None, *, default_arm: str, sizes: tuple[str, ...] = (),
                default_size: str | None = None) -> tuple[str, str | None]:
  """Parses the ``:ARG`` of ``--config=configs/FILE.py:ARG`` into ``(arm, size)``.

  ``ARG`` is an arm (``transformer``, ``diff_v1``, ``diff_v2``), a size from
  ``sizes``, or both separated by a comma in either order (``1.4b,diff_v2``).
  Empty parts take the defaults.
  """
  arm, size = default_arm, default_size
  for part in (p.strip() for p in (arg or "").split(",")):
    if not part:
      continue
    if part in ARM_NAMES:
      arm = part
    elif part in sizes:
      size = part
    else:
      known = f"an arm {ARM_NAMES}" + (f" or a size {sizes}" if sizes else "")
      raise ValueError(f"config argument {part!r} is not {known}; e.g. "
                       f"--config=configs/tiny.py:diff_v2.")
  return arm, size


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.seq_len = 256
  c.global_batch_size = 16
  c.grad_accum_steps = 1
  c.num_steps = 1000
  c.log_every = 50
  c.eval_every = 250
  c.eval_batches = 8
  c.tensorboard = True
  c.log_batch_hash = False

  c.model = ml_collections.ConfigDict(arm_model("small", "diff_v1"))
  # Optional keys take None, so ConfigDict fields must allow it.
  c.model.block_sizes = ml_collections.config_dict.placeholder(dict)
  c.model.diff_fixed_lambda = ml_collections.config_dict.placeholder(float)

  c.data = ml_collections.ConfigDict(dict(
      kind="stdlib", paths=(), tokenizer="byte", val_fraction=0.01, split_seed=0,
      max_documents=ml_collections.config_dict.placeholder(int),
      max_tokens=ml_collections.config_dict.placeholder(int), shuffle=True, num_threads=2,
      prefetch_batches=4, shards_per_group=16))

  c.optim = ml_collections.ConfigDict(dict(
      lr=3e-3, min_lr=3e-4, warmup_steps=50, schedule="cosine", decay_steps=1000,
      b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0))

  # Synthetic retrieval examples mixed into training (diffjax/train/task_mix.py).
  c.task_mix = ml_collections.ConfigDict(dict(
      task="none", fraction=0.0, context_len=512, num_needles=2, num_queries=1, num_pairs=16,
      distractors_per_query=1, key_len=3, value_len=3, separator=":", grid=(), num_examples=0,
      loss="all"))
  # init_from: a train.py workdir whose newest parameters a fresh run starts from (fresh
  # optimizer state, step 0); ignored once this run has a checkpoint of its own.
  c.checkpoint = ml_collections.ConfigDict(dict(every=500, keep=2, async_save=True,
                                                init_from=""))
  # mesh.shape: (data, fsdp, tensor[, context]); one entry may be -1 ("the rest").
  c.mesh = ml_collections.ConfigDict(dict(shape=(-1, 1, 1),
                                          rules=ml_collections.config_dict.placeholder(list),
                                          context_strategy="ring", context_load_balance=True))
  c.distributed = ml_collections.ConfigDict(
      dict(initialize=ml_collections.config_dict.placeholder(bool)))
  return c


def tiny(arm: str, v2_match: str = "heads") -> ml_collections.ConfigDict:
  """The tiny CPU arm (0.47M parameters with byte tokens; a couple of minutes on 2 cores)."""
  c = base_config()
  c.model.update(arm_model("tiny", arm, v2_match=v2_match))
  c.seq_len = 128
  c.global_batch_size = 16
  c.num_steps = 500
  c.optim.update(dict(warmup_steps=50, decay_steps=500))
  c.log_every = 50
  c.eval_every = 100
  c.checkpoint.every = 250
  return c


def small(arm: str, v2_match: str = "heads") -> ml_collections.ConfigDict:
  """The small CPU arm (3.3M parameters with byte tokens; tens of minutes on 2 cores)."""
  c = base_config()
  c.model.update(arm_model("small", arm, v2_match=v2_match))
  c.num_steps = 2000
  c.optim.decay_steps = 2000
  return c


def _require_prepared_data(c: ml_collections.ConfigDict) -> None:
  """The paper runs stream a prepared corpus with a trained tokenizer; both paths are left empty
  so that DataConfig refuses a run without `--config.data.paths` and `--config.data.tokenizer`
  (one error naming both) when the data is built, not when the config is imported."""
  c.data.kind = "prepared"
  c.data.paths = ()
  c.data.tokenizer = ""


def paper_3b(arm: str, v2_match: str = "heads") -> ml_collections.ConfigDict:
  """The paper's 3B setup (sequence 4096, 4M-token batches, AdamW 0.9/0.95, lr 3.2e-4,
  1000 warm-up steps, linear decay to 1.28e-5, weight decay 0.1)."""
  c = base_config()
  c.model = ml_collections.ConfigDict(arm_model("3b", arm, PAPER_VOCAB, v2_match=v2_match,
                                                   dtype="bfloat16"))
  c.model.block_sizes = ml_collections.config_dict.placeholder(dict)
  c.model.diff_fixed_lambda = ml_collections.config_dict.placeholder(float)
  c.model.remat = "dots_no_batch"
  c.model.scan_layers = True  # one block in the compiled program: compiles in minutes, not tens
  c.seq_len = 4096
  c.global_batch_size = 1024  # 1024 x 4096 = 4M tokens
  c.num_steps = 240_000  # ~1T tokens at 4M tokens a step (the paper trains 3B on 1T tokens)
  c.optim.update(dict(lr=3.2e-4, min_lr=1.28e-5, warmup_steps=1000, schedule="linear",
                      decay_steps=c.num_steps, b1=0.9, b2=0.95, weight_decay=0.1))
  c.log_every, c.eval_every, c.eval_batches = 10, 1000, 16
  c.checkpoint.update(dict(every=1000, keep=3))
  c.mesh.shape = (1, -1, 1)
  _require_prepared_data(c)
  return c


def paper_3b_64k(arm: str, v2_match: str = "heads") -> ml_collections.ConfigDict:
  """The paper's 64K-context extension of the 3B models: 1.5B more tokens at sequence
  65,536, lr 8e-5, RoPE theta 640,000, starting from a 4K run's weights
  (``checkpoint.init_from``, required).

  Sized for a v5p-128 slice (64 chips): mesh (data, fsdp, tensor, context) = (1, 4, 1, 16),
  so each sequence is split over 16 chips (4K tokens each, ring attention in the zig-zag
  order) and the 16 sequences of a step (1M tokens, two micro-batches) over 4 FSDP groups;
  parameters and optimizer state are sharded over fsdp x context (64-way); 1,431 steps
  make the 1.5B tokens.
  """
  c = paper_3b(arm, v2_match)
  c.model.rope_theta = 640_000.0
  c.seq_len = 65_536
  c.global_batch_size = 16  # 16 x 65,536 = 1M tokens a step
  c.grad_accum_steps = 2  # two micro-batches of 8: room to spare for every arm (README)
  c.num_steps = 1431  # 1.5e9 / 2**20
  c.optim.update(dict(lr=8e-5, min_lr=8e-5, warmup_steps=0, schedule="constant",
                      decay_steps=c.num_steps))
  c.log_every, c.eval_every, c.eval_batches = 10, 200, 4
  c.checkpoint.update(dict(every=100, keep=3))
  # None: required (check_config names it); "" would mean "from scratch".
  c.checkpoint.init_from = ml_collections.config_dict.placeholder(str)
  c.mesh.shape = (1, 4, 1, 16)
  c.mesh.context_strategy = "ring"
  c.mesh.context_load_balance = True
  # FSDP over both axes: the context axis would otherwise hold 16 copies of the weights.
  c.mesh.rules = [[name, ("fsdp", "context") if name == "embed" else axes]
                  for name, axes in DEFAULT_RULES]
  return c


def paper_sweep(size: str, arm: str, v2_match: str = "heads") -> ml_collections.ConfigDict:
  """The paper's scaling sweep (830M-13.1B): AdamW 0.9/0.98, lr 1.5e-3 (7.5e-4 from
  6.8B), 375 warm-up steps, weight decay 0.05, 0.25M-token batches, 40K steps."""
  c = base_config()
  c.model = ml_collections.ConfigDict(arm_model(size, arm, PAPER_VOCAB, v2_match=v2_match,
                                                   dtype="bfloat16"))
  c.model.block_sizes = ml_collections.config_dict.placeholder(dict)
  c.model.diff_fixed_lambda = ml_collections.config_dict.placeholder(float)
  c.model.remat = "dots_no_batch"
  c.model.scan_layers = True  # one block in the compiled program: compiles in minutes, not tens
  c.seq_len = 2048
  c.global_batch_size = 128  # 128 x 2048 = 0.25M tokens
  c.num_steps = 40_000
  lr = 7.5e-4 if size in ("6.8b", "13.1b") else 1.5e-3
  c.optim.update(dict(lr=lr, min_lr=0.0, warmup_steps=375, schedule="linear",
                      decay_steps=c.num_steps, b1=0.9, b2=0.98, weight_decay=0.05))
  c.log_every, c.eval_every, c.eval_batches = 10, 1000, 16
  c.checkpoint.update(dict(every=1000, keep=3))
  c.mesh.shape = (1, -1, 1)
  _require_prepared_data(c)
  return c


def param_table(sizes=("3b", "830m", "1.4b", "2.8b", "6.8b", "13.1b"),
                vocab_size: int = PAPER_VOCAB) -> str:
  """A markdown table of parameter counts per arm for the named sizes."""
  from diffjax.model import count_params  # pylint: disable=import-outside-toplevel
  rows = ["| size | d_model | layers | heads (T / V1 / V2 pairs) | d | Transformer | DIFF V1 | "
          "V1 - T | DIFF V2 | V2 - T |", "|---|---|---|---|---|---|---|---|---|---|"]
  for size in sizes:
    base = ModelConfig(attention="transformer", **baseline_spec(size, vocab_size))
    arms = matched_configs(base)
    n = {arm: count_params(cfg) for arm, cfg in arms.items()}
    rows.append(
        f"| {size} | {base.d_model} | {base.num_layers} | {base.num_heads} / "
        f"{arms['diff_v1'].num_heads} / {arms['diff_v2'].num_heads} | {base.head_dim} | "
        f"{n['transformer']:,} | {n['diff_v1']:,} | +{n['diff_v1'] - n['transformer']:,} | "
        f"{n['diff_v2']:,} | +{n['diff_v2'] - n['transformer']:,} |")
  return "\n".join(rows)


if __name__ == "__main__":
  print(f"Parameter counts (vocabulary {PAPER_VOCAB}, untied head, SwiGLU FFN):")
  print(param_table())
