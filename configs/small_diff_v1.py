"""Small diff_v1 arm (about 3M parameters with byte tokens; CPU in tens of minutes).

  python train.py --config=configs/small_diff_v1.py --workdir=runs/small_diff_v1
"""

from diffjax.presets import arm_model, base_config


def get_config():
  c = base_config()
  c.model.update(arm_model("small", "diff_v1"))
  c.num_steps = 2000
  c.optim.decay_steps = 2000
  return c
