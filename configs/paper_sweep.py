"""The paper's scaling sweep (830M, 1.4B, 2.8B, 6.8B, 13.1B), DIFF V1 by default. The argument
names the size (default 1.4b), since the learning rate depends on it.

AdamW 0.9/0.98, lr 1.5e-3 (7.5e-4 from 6.8B), 375 warm-up steps, linear decay, weight decay
0.05, 0.25M-token batches (128 x 2048), 40K steps. Every arm is matched to the Transformer of
the size; DIFF V2 by parameters. The data path is a directory every worker reads through its file
system (a mount of the bucket: tpu_setup/bootstrap.sh --mount).

  python train.py --config=configs/paper_sweep.py:2.8b --config.model.arm=diff_v2 \
      --workdir=gs://BUCKET/2.8b_diff_v2 \
      --config.data.paths="('/mnt/data/prepared',)" \
      --config.data.tokenizer=/path/to/tokenizer.json
"""

from diffjax.model.sizes import PAPER_VOCAB, SWEEP_SIZES
from diffjax.presets import base_config


def get_config(size: str = "1.4b"):
  if size not in SWEEP_SIZES:
    raise ValueError(
      f"configs/paper_sweep.py:{size}: the sweep's sizes are {SWEEP_SIZES}; e.g. "
      "--config=configs/paper_sweep.py:2.8b."
    )
  c = base_config()
  c.model.arm = "diff_v1"
  c.model.size = size
  c.model.v2_match = "params"
  c.model.vocab_size = PAPER_VOCAB
  c.model.dtype = "bfloat16"
  c.model.remat = "dots_no_batch"
  c.model.scan_layers = True  # one block in the compiled program: compiles in minutes, not tens
  c.seq_len = 2048
  c.global_batch_size = 128  # 128 x 2048 = 0.25M tokens
  c.num_steps = 40_000
  lr = 7.5e-4 if size in ("6.8b", "13.1b") else 1.5e-3
  c.optim.update(
    dict(
      lr=lr,
      min_lr=0.0,
      warmup_steps=375,
      schedule="linear",
      decay_steps=40_000,
      b1=0.9,
      b2=0.98,
      weight_decay=0.05,
    )
  )
  c.log_every, c.eval_every, c.eval_batches = 10, 1000, 16
  c.checkpoint.update(dict(every=1000, keep=3))
  c.mesh.shape = (1, -1, 1)
  c.data.update(dict(kind="prepared", paths=(), tokenizer=""))
  return c
