"""The evaluation tests' model-level fixtures: a tiny model of every arm, real text and a needle
task, built once per test module (the cases themselves: eval_cases.py)."""

import pytest
from eval_cases import BASE, FILLER, TOK, T, fast_model

from diffjax.data.tasks import MultiNeedleTask
from diffjax.eval import evaluate
from diffjax.model import matched_configs


@pytest.fixture(scope="module")
def runners():
  arms = matched_configs(BASE)
  return {
    arm: evaluate.ModelRunner(fast_model(cfg, i)) for i, (arm, cfg) in enumerate(arms.items())
  }


@pytest.fixture(scope="module")
def text_batches():
  """Two (2, T + 1) token batches of real text (inputs are (2, T))."""
  corpus = TOK.encode("def f(x):\n    return x * 2  # doubles\n" * 40)
  return [corpus[i * 600 : i * 600 + 2 * (T + 1)].reshape(2, T + 1) for i in range(2)]


@pytest.fixture(scope="module")
def needle_task():
  return MultiNeedleTask(T, 2, 1, num_examples=2, seed=0, filler=FILLER)
