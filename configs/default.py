"""Default run: a DIFF V1 LM (1.4M parameters) on the embedded corpus, for a laptop CPU.

The corpus is the Python standard library's own source (present wherever Python is, so
nothing is downloaded; real, varied text with long-range structure such as indentation,
names defined far above their use, and docstrings), byte-level tokens. 1000 steps of
16 x 128 tokens take a few minutes on 2 CPU cores (docs/results/default_run.md).

  python train.py --config=configs/default.py --workdir=runs/default

The arm is DIFF V1 matched to the Transformer of size "default" (192 wide, 3 layers, 6 heads
of 32); another arm of the same comparison: --config.model.arm=transformer (or diff_v2).
"""

from diffjax.presets import base_config


def get_config():
  c = base_config()
  c.model.arm = "diff_v1"
  c.model.size = "default"
  c.model.v2_match = "params"
  c.data.kind = "stdlib"
  c.data.tokenizer = "byte"
  c.seq_len = 128
  c.global_batch_size = 16
  c.num_steps = 1000
  c.optim.update(
    dict(
      lr=3e-3, min_lr=3e-4, warmup_steps=50, schedule="cosine", decay_steps=1000, weight_decay=0.1
    )
  )
  c.log_every = 50
  c.eval_every = 250
  c.checkpoint.every = 500
  return c
