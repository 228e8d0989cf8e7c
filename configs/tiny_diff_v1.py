"""Tiny diff_v1 arm of the matched comparison (CPU, a minute or two).

  python train.py --config=configs/tiny_diff_v1.py --workdir=runs/tiny_diff_v1
"""


from diffjax.presets import arm_model, base_config


def get_config():
  c = base_config()
  c.model.update(arm_model("tiny", "diff_v1"))
  c.seq_len = 128
  c.global_batch_size = 16
  c.num_steps = 300
  c.optim.update(dict(warmup_steps=30, decay_steps=300))
  c.eval_every = 100
  c.checkpoint.every = 100
  return c
