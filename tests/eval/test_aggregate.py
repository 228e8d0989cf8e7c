"""diffjax.eval.aggregate: which way each measure is better."""

from __future__ import annotations

import pytest

# flax warns about its own deprecated metadata names when models are built; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_directions_of_training_and_low_bit_measures():
  from diffjax.eval.aggregate import direction

  assert direction("lowbit/kv4/loss_increase") is False  # less added loss is better
  assert direction("lowbit/kv4/loss") is False and direction("lowbit/kv4/accuracy") is True
  assert direction("train/steps_to_learn") is False and direction("train/learned") is True
  assert direction("probe/map_correlation_mean") is None  # descriptive
