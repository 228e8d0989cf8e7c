"""The paper's 3B setup (arXiv 2410.05258 section 3) for one arm (default diff_v1).

28 layers, hidden 3072, FFN 8192, d = 128, sequence 4096, 4M-token batches, AdamW 0.9/0.95,
lr 3.2e-4, 1000 warm-up steps, linear decay to 1.28e-5, weight decay 0.1.

Train on a TPU pod (see tpu_setup/README.md) on a corpus prepared by
`python -m diffjax.data.prepare` (data.paths and data.tokenizer are required):
  python train.py --config=configs/paper_3b.py:diff_v1 --workdir=gs://BUCKET/3b_diff_v1 \
      --config.data.paths="('gs://BUCKET/data/prepared',)" \
      --config.data.tokenizer=/path/to/tokenizer.json
Check that it compiles and fits before renting the pod (v5p-128):
  JAX_PLATFORMS=cpu python -m diffjax.aot --config=configs/paper_3b.py:diff_v1 --topology=v5p:4x4x4
"""

from diffjax.presets import config_args, paper_3b


def get_config(arg: str = "diff_v1"):
  arm, _ = config_args(arg, default_arm="diff_v1")
  return paper_3b(arm)
