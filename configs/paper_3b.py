"""The paper's 3B setup (arXiv 2410.05258 section 3), DIFF V1 by default.

28 layers, hidden 3072, FFN 8192, d = 128, sequence 4096, 4M-token batches (1024 x 4096),
~1T tokens, AdamW 0.9/0.95, lr 3.2e-4, 1000 warm-up steps, linear decay to 1.28e-5, weight
decay 0.1. Every arm is matched to the Transformer of size "3b" (24 heads of 128); DIFF V2 by
parameters (v2_match="params", its FFN narrowed to pay for the extra query heads).

Train on a TPU pod (tpu_setup/README.md) on a corpus prepared by `python -m diffjax.data.prepare`
(data.paths and data.tokenizer are required; every worker reads the corpus through its file
system, here a mount of the bucket, tpu_setup/bootstrap.sh --mount):

  python train.py --config=configs/paper_3b.py --config.model.arm=diff_v1 \
      --workdir=gs://BUCKET/3b_diff_v1 \
      --config.data.paths="('/mnt/data/prepared',)" \
      --config.data.tokenizer=/path/to/tokenizer.json

Check that it compiles and fits before renting the pod (v5p-128):

  JAX_PLATFORMS=cpu python -m diffjax.aot --config=configs/paper_3b.py --topology=v5p:4x4x4
"""

from diffjax.model.sizes import PAPER_VOCAB
from diffjax.presets import base_config


def get_config():
  c = base_config()
  c.model.arm = "diff_v1"
  c.model.size = "3b"
  c.model.v2_match = "params"
  c.model.vocab_size = PAPER_VOCAB
  c.model.dtype = "bfloat16"
  c.model.remat = "dots_no_batch"
  c.model.scan_layers = True  # one block in the compiled program: compiles in minutes, not tens
  c.seq_len = 4096
  c.global_batch_size = 1024  # 1024 x 4096 = 4M tokens
  c.num_steps = 240_000  # ~1T tokens at 4M tokens a step (the paper trains 3B on 1T tokens)
  c.optim.update(
    dict(
      lr=3.2e-4,
      min_lr=1.28e-5,
      warmup_steps=1000,
      schedule="linear",
      decay_steps=240_000,
      b1=0.9,
      b2=0.95,
      weight_decay=0.1,
    )
  )
  c.log_every, c.eval_every, c.eval_batches = 10, 1000, 16
  c.checkpoint.update(dict(every=1000, keep=3))
  c.mesh.shape = (1, -1, 1)
  # A prepared corpus and its trained tokenizer: both left empty, so a run without
  # --config.data.paths and --config.data.tokenizer stops with one error naming both.
  c.data.update(dict(kind="prepared", paths=(), tokenizer=""))
  return c
