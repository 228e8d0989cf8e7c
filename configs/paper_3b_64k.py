"""The paper's 64K-context extension of a 3B run (arXiv 2410.05258 section 3.3) for one arm.

Sequence 65,536, RoPE theta 640,000, lr 8e-5, 1.5B more tokens (1,431 steps of 16 sequences),
starting from the weights of a finished 4K run of the same arm (configs/paper_3b.py).
Mesh (data, fsdp, tensor, context) = (1, 4, 1, 16) on a v5p-128 slice: every sequence is
split over 16 chips with ring attention in the load-balanced (zig-zag) order.

  python train.py --config=configs/paper_3b_64k.py:diff_v1 --workdir=gs://BUCKET/3b_diff_v1_64k \
      --config.checkpoint.init_from=gs://BUCKET/3b_diff_v1 \
      --config.data.paths="('gs://BUCKET/data/prepared_64k',)" \
      --config.data.tokenizer=/path/to/tokenizer.json
Check that it compiles and fits first:
  JAX_PLATFORMS=cpu python -m diffjax.aot --config=configs/paper_3b_64k.py:diff_v1 --topology=v5p:4x4x4
"""

from diffjax.presets import config_args, paper_3b_64k


def get_config(arg: str = "diff_v1"):
  arm, _ = config_args(arg, default_arm="diff_v1")
  return paper_3b_64k(arm)
