"""The paper's scaling sweep (830M, 1.4B, 2.8B, 6.8B, 13.1B): one size and one arm.

AdamW 0.9/0.98, lr 1.5e-3 (7.5e-4 from 6.8B), 375 warm-up steps, weight decay 0.05,
0.25M-token batches, 40K steps. The argument names the size and the arm, comma-separated in
either order (defaults 1.4b and diff_v1):

  python train.py --config=configs/paper_sweep.py:1.4b,diff_v2 --workdir=gs://BUCKET/1.4b_diff_v2
"""

from diffjax.presets import SWEEP_SIZES, config_args, paper_sweep


def get_config(arg: str = "1.4b,diff_v1"):
  arm, size = config_args(arg, default_arm="diff_v1", sizes=SWEEP_SIZES, default_size="1.4b")
  return paper_sweep(size, arm)
