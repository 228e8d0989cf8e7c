"""Small transformer arm (about 3M parameters with byte tokens; CPU in tens of minutes).

  python train.py --config=configs/small_transformer.py --workdir=runs/small_transformer
"""

from diffjax.presets import arm_model, base_config


def get_config():
  c = base_config()
  c.model.update(arm_model("small", "transformer"))
  c.num_steps = 2000
  c.optim.decay_steps = 2000
  return c
