"""The settings a resume must keep (checkpoint.DATA_ORDER_KEYS): those that decide which tokens
each step reads and which of them it scores, not the corpus's path nor how batches are fetched."""

import json

import pytest

from diffjax.presets import base_config
from diffjax.train import checkpoint as ckpt


def _config(changes=()) -> dict:
  """The default run config as a checkpoint saves it (JSON), with ``changes`` ((key, value),
  "section.name" keys) made."""
  c = json.loads(base_config().to_json_best_effort())
  for key, value in changes:
    section, _, name = key.rpartition(".")
    (c[section] if section else c)[name] = value
  return c


@pytest.mark.parametrize(
  "key,saved,now",
  [
    ("task_mix.loss", "all", "answers"),
    ("task_mix.num_examples", 500, 1000),
    ("task_mix.grid", [], [[2, 0], [8, 1]]),
    ("task_mix.num_pairs", 16, 8),
    ("seq_len", 256, 128),
  ],
)
def test_a_resume_under_another_loss_mask_or_other_task_examples_is_refused(key, saved, now):
  with pytest.raises(ckpt.CheckpointError) as e:
    ckpt.check_data_order(_config([(key, saved)]), _config([(key, now)]), "runs/x/checkpoints")
  assert f"{key}: saved {saved!r} vs now {now!r}" in str(e.value), str(e.value)


@pytest.mark.parametrize(
  "key,saved,now",
  [
    # The corpus moved: check_corpus compares what the paths hold.
    ("data.paths", ["/old/corpus"], ["/new/corpus"]),
    # How batches are fetched, and what the data iterator checks itself.
    ("data.prefetch_batches", 4, 0),
    ("data.streams_per_row", 16, 8),
  ],
)
def test_a_resume_from_a_moved_corpus_or_with_other_prefetching_is_not_refused(key, saved, now):
  ckpt.check_data_order(_config([(key, saved)]), _config([(key, now)]), "runs/x/checkpoints")


def test_a_key_an_older_checkpoint_lacks_is_not_compared():
  saved = _config()
  del saved["task_mix"]["loss"]
  ckpt.check_data_order(saved, _config([("task_mix.loss", "answers")]), "runs/x/checkpoints")
