"""What a user sees when a run goes wrong: refused options, suggested keys, preemption
status, one metrics line per step after a resume, a non-finite update never applied."""

import math
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from helpers import REPO, WAIT_LIMIT_S, metrics_rows, tiny_config  # noqa: E402

from diffjax.model import ModelConfig
from diffjax.train import steps as steps_lib
from diffjax.train.trainer import train_and_evaluate

# A one-layer model on 40 documents: starts, trains and stops within a test.
SMALL_RUN = [
  "--config.model.num_layers=1",
  "--config.model.d_model=64",
  "--config.model.mlp_dim=128",
  "--config.seq_len=32",
  "--config.global_batch_size=2",
  "--config.data.max_documents=40",
  "--config.eval_every=0",
  "--config.tensorboard=False",
]


def tiny_eval_config(steps=4):
  """The shared tiny config with one layer, an eval and a checkpoint every 2 steps."""
  c = tiny_config("diff_v1", steps)
  c.model.num_layers = 1
  c.eval_every, c.eval_batches, c.log_batch_hash = 2, 1, False
  c.optim.warmup_steps = 1
  c.checkpoint.every = 2
  return c


def train_cli(args, cwd=REPO, timeout=WAIT_LIMIT_S, config=True, workdir=None):
  argv = [sys.executable, os.path.join(REPO, "train.py")]
  if config:
    argv.append("--config=" + os.path.join(REPO, "configs/default.py"))
  if workdir is not None:
    argv.append(f"--workdir={workdir}")
  return subprocess.run(
    argv + list(args),
    capture_output=True,
    text=True,
    cwd=cwd,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    timeout=timeout,
  )


def error_line(r):
  lines = [l for l in r.stderr.splitlines() if l.startswith("error:")]
  assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-2000:])
  return lines[0]


# --- options that must be finite, or in range ---------------------------------------------------


@pytest.mark.parametrize(
  "key,value",
  [
    ("optim.lr", math.nan),
    ("optim.lr", math.inf),
    ("optim.min_lr", math.nan),
    ("optim.b1", math.nan),
    ("optim.b2", 1.0),
    ("optim.eps", math.inf),
    ("optim.weight_decay", math.nan),
    ("optim.clip_norm", math.nan),
    ("task_mix.fraction", math.nan),
    ("data.val_fraction", math.nan),
  ],
)
def test_non_finite_or_out_of_range_options_are_refused(tmp_path, key, value):
  c = tiny_eval_config()
  section, name = key.split(".")
  c[section][name] = value
  wd = tmp_path / "run"
  with pytest.raises(ValueError, match=rf"{key}={value}"):
    train_and_evaluate(c, str(wd))
  assert not (wd / "checkpoints").exists()


@pytest.mark.integration
def test_nan_lr_on_the_command_line_is_one_error_line(tmp_path):
  wd = tmp_path / "run"
  r = train_cli(
    ["--config.optim.lr=nan", "--config.checkpoint.every=1", *SMALL_RUN],
    workdir=wd,
    timeout=WAIT_LIMIT_S,
  )
  line = error_line(r)
  assert "optim.lr=nan" in line and "finite" in line, line
  assert not (wd / "checkpoints").exists()


def test_a_non_finite_update_is_not_applied():
  """A finite loss and gradient with a NaN learning rate: the step must refuse the update."""
  cfg = ModelConfig(
    attention="diff_v1",
    d_model=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=64,
    vocab_size=40,
  )
  tx = optax.adamw(math.nan)
  graphdef, state = steps_lib.init_state(cfg, tx, seed=0)
  before = jax.tree.map(np.asarray, state["params"])
  batch = {k: np.ones((2, 8), np.int32) for k in ("inputs", "targets", "segment_ids")}
  batch["positions"] = np.tile(np.arange(8, dtype=np.int32), (2, 1))
  batch["loss_mask"] = np.ones((2, 8), np.float32)
  step = jax.jit(steps_lib.make_train_step(graphdef, tx, lambda _: math.nan))
  new, metrics = step(state, batch)
  assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
  assert not bool(metrics["finite"])
  assert int(new["step"]) == 1  # the batch was used; the update was not
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(new["params"])):
    np.testing.assert_array_equal(x, np.asarray(y))
  for x, y in zip(jax.tree.leaves(state["opt_state"]), jax.tree.leaves(new["opt_state"])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- unknown keys -------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(
  "flag,wanted",
  [
    ("--config.num_step=5", ["'num_step'", "num_steps"]),
    pytest.param("--config.optim.lrr=1e-3", ["'optim.lrr'", "optim.lr"], marks=pytest.mark.slow),
    pytest.param(
      "--config.foo=1",
      ["'foo'", "num_steps"],  # nothing close: the top-level keys
      marks=pytest.mark.slow,
    ),
  ],
)
def test_unknown_key_is_named_with_suggestions(tmp_path, flag, wanted):
  line = error_line(train_cli([flag], workdir=tmp_path / "run", timeout=WAIT_LIMIT_S))
  for w in wanted:
    assert w in line, line
  assert not (tmp_path / "run").exists()


# --- resume keeps one metrics line per step -----------------------------------------------------


@pytest.mark.integration  # whole training runs
def test_resume_keeps_one_metrics_line_per_step(tmp_path):
  wd = tmp_path / "run"
  train_and_evaluate(tiny_eval_config(steps=3), str(wd))  # checkpoints at 2 and 3
  # As if the process died before saving step 3: the resume redoes step 3.
  shutil.rmtree(wd / "checkpoints" / "3")
  train_and_evaluate(tiny_eval_config(steps=4), str(wd))
  rows = metrics_rows(wd)
  train_steps = [r["step"] for r in rows if "train/loss" in r]
  eval_steps = [r["step"] for r in rows if "eval/loss" in r]
  assert train_steps == [1, 2, 3, 4], train_steps
  assert eval_steps == [2, 4], eval_steps  # periodic at 2, final at 4; the old final at 3 is gone
  # Rerunning a finished run changes nothing, and returns its recorded final metrics.
  result = train_and_evaluate(tiny_eval_config(steps=4), str(wd))
  assert metrics_rows(wd) == rows
  assert result["step"] == 4 and result["eval/loss"] == rows[-1]["eval/loss"]


@pytest.mark.integration  # two short runs
def test_the_wall_time_of_a_resumed_run_counts_every_attempt(tmp_path):
  wd = tmp_path / "run"
  first = train_and_evaluate(tiny_eval_config(steps=2), str(wd))  # its last checkpoint: step 2
  assert first["wall_s_all_attempts"] == first["wall_s"]  # one attempt
  second = train_and_evaluate(tiny_eval_config(steps=4), str(wd))
  # The first attempt's time up to its step-2 checkpoint, then the second's.
  assert 0.2 * first["wall_s"] < second["wall_s_all_attempts"] - second["wall_s"] <= first["wall_s"]


# --- preemption and the default run --------------------------------------------------------------


@pytest.mark.integration
def test_default_command_trains_the_default_config_into_runs_default(tmp_path):
  r = train_cli(["--config.num_steps=2", *SMALL_RUN], cwd=tmp_path, config=False)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "runs/default" in r.stdout, r.stdout[-2000:]
  assert (tmp_path / "runs" / "default" / "DONE").read_text().strip() == "2"


def test_a_path_that_cannot_be_written_is_one_error_line(capsys):
  from diffjax.errors import run_guarded  # pylint: disable=import-outside-toplevel

  def write():  # as a workdir on a read-only mount fails (root writes anywhere, so raised here)
    raise PermissionError(13, "Permission denied", "/sys/run")

  assert run_guarded(write) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [
    "error: [Errno 13] Permission denied: '/sys/run': choose a directory this user can write"
  ]


# --- the corpus under a run ------------------------------------------------------------------------


@pytest.mark.integration  # two short runs of train.py
def test_a_resume_on_a_corpus_whose_files_changed_is_refused(tmp_path):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(12):
    (corpus / f"d{i:02d}.py").write_text(f"def f{i}(x):\n  return x + {i}\n" * 20)
  args = [
    *SMALL_RUN,
    "--config.data.kind=text",
    f"--config.data.paths=('{corpus}',)",
    "--config.eval_batches=1",
  ]
  env_cache = {"DIFFJAX_DATA_CACHE": str(tmp_path / "cache")}
  wd = tmp_path / "run"

  def train(steps):
    return subprocess.run(
      [sys.executable, os.path.join(REPO, "train.py"), f"--workdir={wd}", *args, steps],
      capture_output=True,
      text=True,
      cwd=tmp_path,
      env=dict(os.environ, JAX_PLATFORMS="cpu", **env_cache),
      timeout=WAIT_LIMIT_S,
    )

  first = train("--config.num_steps=2")
  assert first.returncode == 0, first.stderr[-3000:]
  before = sorted(os.listdir(wd / "checkpoints"))
  # One file rewritten to the same size, and not one of the few documents the other digest
  # reads: the digest of every token that prepare records tells.
  (corpus / "d04.py").write_text("def f4(x):\n  return x - 4\n" * 20)
  line = error_line(train("--config.num_steps=4"))
  assert "The corpus is not the one the checkpoint" in line and "now 12 documents of" in line, line
  assert sorted(os.listdir(wd / "checkpoints")) == before  # nothing moved
  (corpus / "d04.py").write_text("def f4(x):\n  return x + 4\n" * 20)  # restored
  again = train("--config.num_steps=4")
  assert again.returncode == 0 and "Resumed from step 2" in again.stdout, again.stderr[-3000:]


@pytest.mark.integration  # a short training run
def test_an_evaluation_that_scores_no_token_is_nan_and_said(tmp_path):
  # Associative recall scored on its answers only, in windows too short to hold one.
  r = train_cli(
    [
      *SMALL_RUN,
      "--config.num_steps=2",
      "--config.eval_every=2",
      "--config.eval_batches=1",
      "--config.task_mix.task=associative_recall",
      "--config.task_mix.fraction=1",
      "--config.task_mix.num_examples=40",
      "--config.task_mix.loss=answers",
      "--config.task_mix.num_pairs=4",
    ],
    cwd=tmp_path,
    workdir=tmp_path / "run",
  )
  assert r.returncode == 0, r.stderr[-3000:]
  said = [line for line in r.stdout.splitlines() if "scored no token" in line]
  assert [line.split(" scored")[0] for line in said] == [
    "Training step 1",
    "The evaluation at step 2",
  ]
  final = metrics_rows(tmp_path / "run")[-1]
  assert math.isnan(final["eval/loss"]) and math.isnan(final["eval/perplexity"]), final
