"""diffjax.eval.scoring (through diffjax.eval.evaluate): retrieval accuracy and greedy exact
match with hand-written "models", and the validation loss against a direct computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from eval_cases import FILLER, T, oracle, perfect_model, wrong_model

from diffjax.data.tasks import AssociativeRecallTask, MultiNeedleTask
from diffjax.eval import evaluate, measures

# flax warns about its own deprecated metadata names when models are built; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_perfect_model_scores_one_and_wrong_model_scores_zero():
  task = MultiNeedleTask(400, 4, 2, num_examples=5, seed=2, filler=FILLER)
  assert evaluate.retrieval_accuracy(perfect_model, task, batch_size=2)["accuracy"] == 1.0
  res = evaluate.retrieval_accuracy(wrong_model, task, batch_size=2)
  assert res["accuracy"] == 0.0 and res["all_correct"] == 0.0 and res["num_answers"] == 10
  mq = AssociativeRecallTask(num_pairs=6, num_queries=2, num_examples=3)
  assert evaluate.retrieval_accuracy(perfect_model, mq)["accuracy"] == 1.0


def test_teacher_forced_exact_match_equals_greedy_decoding():
  task = MultiNeedleTask(160, 1, 1, num_examples=3, seed=1, num_digits=4, filler=FILLER)
  batch = task.batch()
  seqs = batch["tokens"]
  ans = [np.flatnonzero(batch["answer_segments"][b] >= 0) for b in range(3)]
  # Example 0 right, example 1 wrong at its first digit, example 2 wrong at its last digit.
  fn = oracle(seqs, wrong=[(1, int(ans[1][0])), (2, int(ans[2][-1]))])
  tf, present = measures.answer_exact_match(fn(seqs), seqs, batch["answer_segments"])
  greedy, present_g = evaluate.greedy_exact_match(fn, batch)
  np.testing.assert_array_equal(tf[:, 0], [True, False, False])
  np.testing.assert_array_equal(tf, greedy)
  np.testing.assert_array_equal(present, present_g)


def test_validation_loss_matches_a_direct_computation(runners, text_batches):
  fn = runners["transformer"].logits_fn()
  res = evaluate.validation_loss(fn, text_batches)
  nll = []
  for tokens in text_batches:
    logits = fn(tokens[:, :-1]).astype(np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll.append(-np.take_along_axis(logp, tokens[:, 1:, None].astype(np.int64), -1))
  want = float(np.mean(np.concatenate(nll)))
  assert res["loss"] == pytest.approx(want, rel=1e-6) and res["tokens"] == 2 * 2 * T
  assert res["perplexity"] == pytest.approx(math.exp(want), rel=1e-6)
  # Pipeline-style dicts honour the loss mask.
  mask = np.zeros((2, 5), np.float32)
  mask[0, :3] = 1
  fake = lambda tokens, *unused: np.zeros(
    tokens.shape + (4,), np.float32
  )  # uniform: ln 4 per token
  batch = {
    "inputs": np.zeros((2, 5), np.int32),
    "targets": np.ones((2, 5), np.int32),
    "loss_mask": mask,
    "segment_ids": np.ones((2, 5), np.int32),
    "positions": np.tile(np.arange(5), (2, 1)),
  }
  res = evaluate.validation_loss(fake, [batch])
  assert res["tokens"] == 3 and res["loss"] == pytest.approx(math.log(4))
