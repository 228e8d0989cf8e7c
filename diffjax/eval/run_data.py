"""`run_val_batches`: a training run's own held-out batches, built the way its trainer built them.

The eval command and the comparison score a run's checkpoint on these, so every evaluation of a
run sees the same rows.
"""

from __future__ import annotations

from typing import Any


def run_val_batches(
  data: Any, task_mix: Any, *, seq_len: int, batch_size: int, seed: int, count: int
) -> tuple[list[Any], Any]:
  """(the first ``count`` validation batches of a run, as its trainer's eval/loss saw them; the
  tokenizer its task mix was built with, or None for a run of text alone).

  Args:
    data: the run's data config: a `DataConfig` or its mapping.
    task_mix: the run's task-mix config: a `TaskMixConfig`, its mapping, or None for a run
      without one (text alone). A run that mixed a task into its text holds out a share of the
      mixed documents, so its validation rows come from that mix, not from the text alone.
    seq_len, batch_size, seed: the run's sequence length, global batch size and seed.
    count: how many batches.
  """
  # pylint: disable=import-outside-toplevel
  from diffjax.data import DataConfig, build_datasets
  from diffjax.train.sections import TaskMixConfig
  from diffjax.train.task_mix import run_source

  data_cfg = data if isinstance(data, DataConfig) else DataConfig.from_dict(data)
  mix = TaskMixConfig() if task_mix is None else TaskMixConfig.from_config(task_mix)
  source, tokenizer = run_source(mix, data_cfg, seed)
  datasets = build_datasets(
    data_cfg,
    seq_len=seq_len,
    global_batch_size=batch_size,
    seed=seed,
    source=source,
    tokenizer=tokenizer,
  )
  return list(datasets.val_batches(count)), tokenizer
