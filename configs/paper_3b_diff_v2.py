"""The paper's 3B setup, diff_v2 arm (arXiv 2410.05258 section 3; brief 2.5).

Train on a TPU pod (see tpu_setup/README.md) with tokenized ArrayRecord data:
  python train.py --config=configs/paper_3b_diff_v2.py --workdir=gs://BUCKET/3b_diff_v2 \
      --config.data.paths="('gs://BUCKET/data/train-*.array_record',)" \
      --config.data.tokenizer=/path/to/tokenizer.json
Check that it compiles and fits before renting the pod:
  JAX_PLATFORMS=cpu python -m diffjax.aot --config=configs/paper_3b_diff_v2.py --topology=v5p:4x4x4  # v5p-128
"""

from diffjax.presets import paper_3b


def get_config():
  return paper_3b("diff_v2")
