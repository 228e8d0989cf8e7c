"""The paper's 64K-context extension of a 3B run (arXiv 2410.05258 section 3.3), DIFF V1 by
default.

Sequence 65,536, RoPE theta 640,000, lr 8e-5, 1.5B more tokens (1,431 steps of 16 sequences,
two micro-batches of 8), starting from the weights of a finished 4K run of the same arm
(configs/paper_3b.py; checkpoint.init_from is required). Mesh (data, fsdp, tensor, context) =
(1, 4, 1, 16) on a v5p-128 slice: every sequence is split over 16 chips with ring attention in
the load-balanced (zig-zag) order, and parameters and optimizer state are sharded over
fsdp x context (64-way). The data path is a directory every worker reads through its file
system (a mount of the bucket: tpu_setup/bootstrap.sh --mount).

  python train.py --config=configs/paper_3b_64k.py --config.model.arm=diff_v1 \
      --workdir=gs://BUCKET/3b_diff_v1_64k \
      --config.checkpoint.init_from=gs://BUCKET/3b_diff_v1 \
      --config.data.paths="('/mnt/data/prepared_64k',)" \
      --config.data.tokenizer=/path/to/tokenizer.json

Check that it compiles and fits first:

  JAX_PLATFORMS=cpu python -m diffjax.aot --config=configs/paper_3b_64k.py --topology=v5p:4x4x4
"""

import os

from diffjax.presets import load_config
from diffjax.sharding import DEFAULT_RULES


def get_config():
  c = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "paper_3b.py"))
  c.model.rope_theta = 640_000.0
  c.seq_len = 65_536
  c.global_batch_size = 16  # 16 x 65,536 = 1M tokens a step
  c.grad_accum_steps = 2  # two micro-batches of 8: room to spare for every arm
  c.num_steps = 1431  # 1.5e9 / 2**20
  c.optim.update(dict(lr=8e-5, min_lr=8e-5, warmup_steps=0, schedule="constant", decay_steps=1431))
  c.log_every, c.eval_every, c.eval_batches = 10, 200, 4
  c.checkpoint.update(dict(every=100, keep=3))
  c.checkpoint.init_from = None  # required: the 4K run's workdir
  c.checkpoint.init_changes = ("rope_theta",)  # the 4K run's weights, under the longer RoPE
  c.mesh.shape = (1, 4, 1, 16)
  c.mesh.context_strategy = "ring"
  c.mesh.context_load_balance = True
  # FSDP over both axes: the context axis would otherwise hold 16 copies of the weights.
  c.mesh.rules = [
    [name, ("fsdp", "context") if name == "embed" else axes] for name, axes in DEFAULT_RULES
  ]
  return c
