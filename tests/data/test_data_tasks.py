"""The synthetic retrieval tasks: deterministic examples whose recorded spans, regions and
answers are right, the errors they raise, and their use as training data."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import WAIT_LIMIT_S, filler_source

from diffjax.data import ByteTokenizer, DocumentSource
from diffjax.data.tasks import (
  ANSWER,
  CONTEXT,
  QUERY,
  SINK,
  AssociativeRecallMix,
  AssociativeRecallTask,
  ContextTooShort,
  MultiNeedleTask,
)

TOK = ByteTokenizer()
FILLER = filler_source()


def test_needle_task_is_deterministic_and_a_document_source():
  a = MultiNeedleTask(400, 4, 2, num_examples=6, seed=3, filler=FILLER)
  b = MultiNeedleTask(400, 4, 2, num_examples=6, seed=3, filler=FILLER)
  c = MultiNeedleTask(400, 4, 2, num_examples=6, seed=4, filler=FILLER)
  assert isinstance(a, DocumentSource) and len(a) == 6
  for i in range(6):
    np.testing.assert_array_equal(a[i], b[i])
    assert a[i].dtype == np.int32 and a[i].shape == (400,)
  assert any(not np.array_equal(a[i], c[i]) for i in range(6))
  with pytest.raises(IndexError):
    a[6]


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_answer_needle_sits_at_the_requested_depth_with_the_right_answer(depth):
  task = MultiNeedleTask(600, 6, 2, depths=(depth,), num_examples=3, seed=11, filler=FILLER)
  for i in range(3):
    ex = task.example(i)
    assert ex.tokens.size == 600 and ex.depth == depth
    # Query `depth_query` asks for the needle at `depth` of the filler, up to rounding.
    r0 = ex.depth_query
    assert abs(ex.needle_depths[r0] - depth) <= 1.0 / 300
    start = ex.needle_spans[r0][0]
    is_filler = ex.regions != QUERY
    for s0, e0 in ex.needle_spans + ex.distractor_spans:
      is_filler[s0:e0] = False
    filler_total = int(is_filler.sum())
    assert abs(is_filler[:start].sum() / filler_total - depth) <= 0.5 / filler_total + 1e-12
    for r in range(2):
      text = TOK.decode(ex.tokens[slice(*ex.needle_spans[r])])
      assert text == f"\nThe secret number for {ex.keys[r]} is {ex.values[r]}.\n"
      np.testing.assert_array_equal(ex.tokens[slice(*ex.value_spans[r])], ex.answers[r])
      np.testing.assert_array_equal(ex.tokens[slice(*ex.answer_spans[r])], ex.answers[r])
      assert TOK.decode(ex.answers[r]) == ex.values[r] and len(ex.values[r]) == 7
      s0, e0 = ex.needle_spans[r]
      assert np.all(ex.regions[max(s0, 1) : e0] == ANSWER)  # token 0 is always the sink
      assert np.all(ex.answer_segments[slice(*ex.answer_spans[r])] == r)
    assert len(ex.distractor_spans) == 4 and len(set(ex.keys)) == 2
    assert ex.prompt_len == ex.answer_spans[0][0]
    assert np.sum(ex.answer_segments >= 0) == 14
    assert ex.regions[0] == SINK


def test_training_with_a_task_mix_does_not_import_the_evaluation_package():
  # The tasks are data: training (which mixes them into the corpus) must not pull in evaluation.
  code = (
    "import sys\n"
    "from diffjax.data import ByteTokenizer, MultiNeedleTask\n"
    "from diffjax.train.task_mix import mixed_source\n"
    "import ml_collections\n"
    "mix = ml_collections.ConfigDict(dict(task='associative_recall', fraction=0.5,\n"
    "                                     num_pairs=4, num_queries=1))\n"
    "mixed_source(MultiNeedleTask(300, num_examples=2), mix, ByteTokenizer(), seed=0)\n"
    "print(sorted(m for m in sys.modules if m.startswith('diffjax.eval')))\n"
  )
  r = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    timeout=WAIT_LIMIT_S,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


# The filter of the evaluation tests it came from (flax's own deprecation warnings).
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_task_only_training_data_and_its_errors():
  import ml_collections

  from diffjax.train.task_mix import TRAIN_SEED_OFFSET, mixed_source, task_only

  mix = ml_collections.ConfigDict(
    dict(
      task="associative_recall",
      fraction=1.0,
      num_pairs=8,
      num_queries=2,
      distractors_per_query=1,
      key_len=3,
      value_len=3,
      grid=((4, 0), (8, 2)),
      num_examples=6,
      context_len=0,
      num_needles=0,
    )
  )
  assert task_only(mix)
  src = mixed_source(None, mix, TOK, seed=1)
  assert len(src) == 6 and src.seed == TRAIN_SEED_OFFSET + 1
  # No leakage: no training example equals an example of the evaluation grid's seeds.
  evals = {
    TOK.decode(AssociativeRecallTask(p, min(4, p), d, num_examples=20, seed=s)[i])
    for s in range(1234, 1234 + 120)
    for p, d in ((4, 0), (8, 2))
    for i in range(2)
  }
  assert not evals & {TOK.decode(src[i]) for i in range(6)}
  mix.num_examples = 0
  with pytest.raises(ValueError, match="num_examples"):
    mixed_source(None, mix, TOK, seed=1)
  mix.task, mix.num_examples = "multi_needle", 4
  with pytest.raises(ValueError, match="fraction below 1"):
    mixed_source(None, mix, TOK, seed=1)


def test_needle_task_rejects_a_context_too_short():
  with pytest.raises(ContextTooShort, match="too short"):
    MultiNeedleTask(120, 4, 2, filler=FILLER)


def test_default_filler_is_real_text():
  ex = MultiNeedleTask(512, 1, 1, num_examples=1, seed=0).example(0)
  context = TOK.decode(ex.tokens[ex.regions == CONTEXT])
  assert len(context) > 300 and any(w in context for w in ("def ", "import", "self", "return", "#"))


def test_collate_marks_the_rows_that_predict_answers():
  task = MultiNeedleTask(300, 2, 2, num_examples=2, seed=0, filler=FILLER)
  batch = task.batch([0, 1])
  assert batch["tokens"].shape == (2, 300)
  for b in range(2):
    rows = np.flatnonzero(batch["prediction_rows"][b])
    np.testing.assert_array_equal(rows + 1, np.flatnonzero(batch["answer_segments"][b] >= 0))


def test_associative_recall_has_near_miss_distractors_and_right_answers():
  task = AssociativeRecallTask(
    num_pairs=12, num_queries=3, distractors_per_query=2, num_examples=4, seed=5
  )
  ex = task.example(1)
  np.testing.assert_array_equal(task[1], task.example(1).tokens)
  text = TOK.decode(ex.tokens)
  context, queries = text.split("\n")
  pairs = dict(p.split(":") for p in context.split())
  assert len(pairs) == 12 + 3 * 2  # keys are unique
  for r, key in enumerate(ex.keys):
    assert pairs[key] == ex.values[r] == TOK.decode(ex.answers[r])
    near = [k for k in pairs if k != key and sum(a != b for a, b in zip(k, key)) == 1]
    assert len(near) >= 2
    assert all(pairs[k] != ex.values[r] for k in near)
    assert TOK.decode(ex.tokens[slice(*ex.needle_spans[r])]) == f"{key}:{ex.values[r]} "
  assert queries.split() == [f"{k}:{v}" for k, v in zip(ex.keys, ex.values)]


def test_associative_recall_without_a_separator_keeps_the_draws_and_the_answers():
  kw = dict(
    num_pairs=5,
    num_queries=3,
    distractors_per_query=1,
    num_examples=3,
    seed=2,
    key_len=2,
    value_len=1,
  )
  plain, bare = AssociativeRecallTask(**kw), AssociativeRecallTask(**kw, separator="")
  for i in range(3):
    a, b = plain.example(i), bare.example(i)
    assert TOK.decode(b.tokens) == TOK.decode(a.tokens).replace(":", "")
    assert a.keys == b.keys and a.values == b.values
    for r, key in enumerate(b.keys):
      assert TOK.decode(b.tokens[slice(*b.answer_spans[r])]) == b.values[r]
      # The answer follows its key directly.
      assert TOK.decode(b.tokens[b.answer_spans[r][0] - 2 : b.answer_spans[r][0]]) == key
  for bad in ("a", "1", " ", "\n", 3):
    with pytest.raises(ValueError, match="separator="):
      AssociativeRecallTask(**kw, separator=bad)
  assert "sep=''" in bare.name and "sep" not in plain.name


def test_recall_mix_cycles_its_settings_with_right_answers_and_independent_draws():
  mix = AssociativeRecallMix([(4, 0), (8, 2), (16, 1)], num_queries=2, num_examples=9, seed=3)
  assert len(mix) == 9
  for i in range(9):
    ex = mix.example(i)
    pairs_expected, dis = [(4, 0), (8, 2), (16, 1)][i % 3]
    context, queries = TOK.decode(ex.tokens).split("\n")
    pairs = dict(p.split(":") for p in context.split())
    assert len(pairs) == pairs_expected + 2 * dis
    for r, key in enumerate(ex.keys):
      assert pairs[key] == ex.values[r]
      near = [k for k in pairs if k != key and sum(a != b for a, b in zip(k, key)) == 1]
      assert len(near) >= dis and all(pairs[k] != ex.values[r] for k in near)
    np.testing.assert_array_equal(mix[i], ex.tokens)
  # Settings draw from their own streams: the same setting twice gives different examples,
  # and stream 0 keeps the examples of a plain task.
  twice = AssociativeRecallMix([(8, 1), (8, 1)], num_examples=2, seed=3)
  assert not np.array_equal(twice[0], twice[1])
  plain = AssociativeRecallTask(8, 4, 1, num_examples=1, seed=3)
  np.testing.assert_array_equal(
    plain[0], AssociativeRecallTask(8, 4, 1, num_examples=1, seed=3, stream=0)[0]
  )
  with pytest.raises(ValueError, match="settings"):
    AssociativeRecallMix([], num_examples=1)
