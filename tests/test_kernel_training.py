"""Training the tiny LM through the fused kernels (interpreted) matches the XLA path."""

import jax
import numpy as np
import pytest

from diffjax.model import ModelConfig
from diffjax.presets import base_config
from diffjax.train.optim import make_optimizer
from diffjax.train.steps import init_state, make_train_step

STEPS = 3
# Per-step loss agreement, float32: the kernels reorder the softmax sums (online
# softmax over key blocks), so equality is to rounding, compounded over steps.
LOSS_RTOL = 2e-4


def _losses(arm, implementation):
  cfg = ModelConfig(attention=arm, vocab_size=64, d_model=32, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
                    implementation=implementation, interpret=implementation != "xla")
  ocfg = base_config().optim
  ocfg.update(dict(lr=3e-3, warmup_steps=0, decay_steps=10))
  tx, schedule = make_optimizer(ocfg, cfg)
  graphdef, state = init_state(cfg, tx, seed=0)
  step = jax.jit(make_train_step(graphdef, tx, schedule))
  rng = np.random.default_rng(1)
  seg = np.array([[1] * 20 + [2] * 12, [1] * 32], np.int32)
  pos = np.array([list(range(20)) + list(range(12)), list(range(32))], np.int32)
  # One fixed batch, so the loss must fall step after step.
  batch = {"inputs": rng.integers(0, 64, (2, 32)).astype(np.int32),
           "targets": rng.integers(0, 64, (2, 32)).astype(np.int32),
           "segment_ids": seg, "positions": pos, "loss_mask": np.ones((2, 32), np.float32)}
  losses = []
  for _ in range(STEPS):
    state, m = step(state, batch)
    losses.append(float(m["loss"]))
  return losses


# By default one arm trains through the GPU kernels, which take the same path through the
# model, the ops and the dispatcher as the TPU kernels; the TPU kernels' gradients are
# checked in tests/test_kernels_tpu.py (and their call from the ops by its dispatcher
# test), and training through them, 3x slower in the TPU interpreter, runs with -m slow
# with the other pairs.
@pytest.mark.parametrize("arm,kernel", [
    ("diff_v2", "pallas_gpu"),
    pytest.param("diff_v1", "pallas_tpu", marks=pytest.mark.slow),
    pytest.param("diff_v2", "pallas_tpu", marks=pytest.mark.slow),
    pytest.param("diff_v1", "pallas_gpu", marks=pytest.mark.slow)])
def test_kernel_training_matches_xla(arm, kernel):
  ref = _losses(arm, "xla")
  got = _losses(arm, kernel)
  np.testing.assert_allclose(got, ref, rtol=LOSS_RTOL, err_msg=f"{arm} via {kernel}")
  assert ref[-1] < ref[0]  # the steps really train
