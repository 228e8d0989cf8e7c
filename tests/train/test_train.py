"""Training harness: exact resume, crash safety, schedules, accumulation, bad input."""

import json
import os
import re
import signal
import subprocess
import sys

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import REPO, WAIT_LIMIT_S, read_metrics, tiny_config, wait_until  # noqa: E402

from diffjax.model import ModelConfig
from diffjax.presets import base_config
from diffjax.train import checkpoint as ckpt
from diffjax.train import steps as steps_lib
from diffjax.train.optim import learning_rate_schedule, make_optimizer
from diffjax.train.records import read_metrics as read_rows
from diffjax.train.trainer import TrainingError, train_and_evaluate

EXIT_PREEMPTED = 75  # train.py's status after a SIGTERM save (documented there)


def _count_step_traces(monkeypatch) -> dict[str, int]:
  """Counts the traces of the train and eval steps the trainer builds; more than one per
  run fails at once (``chex.assert_max_traces``)."""
  from diffjax.train import setup as setup_lib  # pylint: disable=import-outside-toplevel

  traces = {"train": 0, "eval": 0}
  make_train, make_eval = setup_lib.make_train_step, setup_lib.make_eval_step

  # chex tells functions apart by their source and where they are defined: one each.
  def build_train(*args, **kwargs):
    fn = make_train(*args, **kwargs)

    def train_step(state, batch):
      traces["train"] += 1  # the Python body runs only while jax traces it
      return fn(state, batch)

    return chex.assert_max_traces(train_step, n=1)

  def build_eval(*args, **kwargs):
    fn = make_eval(*args, **kwargs)

    def eval_step(params, batch, step):
      traces["eval"] += 1
      return fn(params, batch, step)

    return chex.assert_max_traces(eval_step, n=1)

  monkeypatch.setattr(setup_lib, "make_train_step", build_train)
  monkeypatch.setattr(setup_lib, "make_eval_step", build_eval)
  return traces


def _with_evals(c):
  c.eval_every = 2
  return c


@pytest.mark.integration  # whole training runs
def test_resume_is_exact(tmp_path, monkeypatch):
  """A run stopped at step 3 and resumed equals a straight run, loss for loss and bit for bit;
  each run traces its train and eval steps once (no retrace per step, per eval, or for the
  restored state)."""
  traces = _count_step_traces(monkeypatch)
  straight = str(tmp_path / "straight")
  chex.clear_trace_counter()
  train_and_evaluate(_with_evals(tiny_config(steps=6)), straight)  # evals at 2, 4, 6
  assert traces == {"train": 1, "eval": 1}
  resumed = str(tmp_path / "resumed")
  chex.clear_trace_counter()
  first = train_and_evaluate(_with_evals(tiny_config(steps=3)), resumed)
  assert first["step"] == 3
  assert traces == {"train": 2, "eval": 2}
  chex.clear_trace_counter()
  train_and_evaluate(_with_evals(tiny_config(steps=6)), resumed)  # restored from step 3
  assert traces == {"train": 3, "eval": 3}
  evals = [
    r for r in map(json.loads, open(os.path.join(straight, "metrics.jsonl"))) if "eval/loss" in r
  ]
  assert len(evals) >= 3
  a, b = read_metrics(straight), read_metrics(resumed)
  assert sorted(a) == sorted(b) == list(range(1, 7))
  for s in range(4, 7):
    assert a[s]["train/loss"] == b[s]["train/loss"], f"loss differs at step {s}"
    assert a[s]["data/batch_hash"] == b[s]["data/batch_hash"], f"batch differs at step {s}"
  # The step-6 checkpoints hold bitwise-identical parameters.
  ma = ckpt.make_manager(os.path.join(straight, "checkpoints"), keep=5, async_save=False)
  mb = ckpt.make_manager(os.path.join(resumed, "checkpoints"), keep=5, async_save=False)
  raw = ocp.args.Composite(state=ocp.args.StandardRestore())
  ra = ma.restore(6, args=raw)["state"]["params"]
  rb = mb.restore(6, args=raw)["state"]["params"]
  for x, y in zip(jax.tree.leaves(ra), jax.tree.leaves(rb)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# Every comparison in tests/compare/test_compare.py checks the same property on its arms.
@pytest.mark.slow
def test_arms_see_same_batches(tmp_path):
  hashes = {}
  for arm in ("transformer", "diff_v1", "diff_v2"):
    wd = str(tmp_path / arm)
    train_and_evaluate(tiny_config(arm, steps=3), wd)
    hashes[arm] = [r["data/batch_hash"] for _, r in sorted(read_metrics(wd).items())]
  assert len(hashes["transformer"]) == 3
  assert hashes["transformer"] == hashes["diff_v1"] == hashes["diff_v2"]
  assert len(set(hashes["transformer"])) == 3  # different batches at each step


@pytest.mark.integration  # whole training runs
def test_changed_model_config_is_refused(tmp_path):
  wd = str(tmp_path / "run")
  train_and_evaluate(tiny_config(steps=3), wd)
  c = tiny_config(steps=6)
  c.model.num_layers = 3
  with pytest.raises(ckpt.CheckpointError, match="num_layers"):
    train_and_evaluate(c, wd)


@pytest.mark.integration  # whole training runs
def test_nan_loss_stops_with_last_good_checkpoint(tmp_path):
  wd = str(tmp_path / "run")
  train_and_evaluate(tiny_config(steps=3), wd)
  c = tiny_config(steps=6)
  c.optim.lr = 1e30  # the first update overflows to non-finite values
  c.optim.min_lr = 1e29
  with pytest.raises(TrainingError, match="Non-finite"):
    train_and_evaluate(c, wd)
  m = ckpt.make_manager(os.path.join(wd, "checkpoints"), keep=5, async_save=False)
  assert m.latest_step() == 3
  params = m.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"][
    "params"
  ]
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def _overflowing(steps: int, max_skipped: int):
  c = tiny_config(steps=steps)
  # No warm-up: the first update leaves the weights near 1e30 (AdamW moves each by about lr),
  # so every later loss is non-finite and each later update is skipped.
  c.optim.lr, c.optim.min_lr, c.optim.warmup_steps = 1e30, 1e29, 0
  c.max_skipped_updates = max_skipped
  return c


@pytest.mark.integration  # whole training runs
def test_skipped_updates_are_counted_and_limited(tmp_path):
  """Up to max_skipped_updates non-finite updates are skipped and counted, across a resume;
  one more stops the run, its line kept in metrics.jsonl."""
  wd = str(tmp_path / "run")
  result = train_and_evaluate(_overflowing(3, 10), wd)
  assert result["step"] == 3 and result["train/skipped_updates"] == 2
  rows = read_rows(wd)
  assert [(r["step"], r["train/skipped_updates"]) for r in rows if r.get("train/skipped")] == [
    (2, 1),
    (3, 2),
  ]
  assert [r["step"] for r in rows if "train/loss" in r] == [1]
  # Resumed from step 3 with two skips on record: steps 4, 5 and 6 make five, one too many.
  with pytest.raises(TrainingError, match="5 skipped updates, more than max_skipped_updates=4"):
    train_and_evaluate(_overflowing(8, 4), wd)
  rows = read_rows(wd)
  assert [r["step"] for r in rows if r.get("train/skipped")] == [2, 3, 4, 5, 6]


def test_default_schedule_values():
  c = base_config().optim
  c.update(dict(lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110, schedule="cosine"))
  s = learning_rate_schedule(c)
  np.testing.assert_allclose([float(s(0)), float(s(5)), float(s(10))], [0.0, 0.5, 1.0], atol=1e-6)
  np.testing.assert_allclose(float(s(60)), 0.1 + 0.9 * 0.5, atol=1e-6)  # halfway: cos = 0
  np.testing.assert_allclose([float(s(110)), float(s(500))], [0.1, 0.1], atol=1e-6)
  c.schedule = "linear"
  s = learning_rate_schedule(c)
  np.testing.assert_allclose([float(s(60)), float(s(110))], [0.55, 0.1], atol=1e-6)
  c.min_lr = 2.0
  with pytest.raises(ValueError, match="min_lr=2.0"):
    learning_rate_schedule(c)


def _small(arm: str, **widths) -> ModelConfig:
  """A 32-wide model of 50 tokens (one layer, one kv head unless ``widths`` say otherwise)."""
  return ModelConfig(
    **{
      **dict(attention=arm, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8),
      **dict(mlp_dim=64, vocab_size=50),
      **widths,
    }
  )


def _random_batch(rows: int, length: int) -> dict:
  rng = np.random.default_rng(0)
  return {
    "inputs": rng.integers(0, 50, (rows, length)).astype(np.int32),
    "targets": rng.integers(0, 50, (rows, length)).astype(np.int32),
    "segment_ids": np.ones((rows, length), np.int32),
    "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
    "loss_mask": (rng.random((rows, length)) > 0.2).astype(np.float32),
  }


def _state_and_batch(accum):
  cfg = _small("diff_v2")
  c = base_config().optim
  c.update(dict(lr=1e-2, warmup_steps=0, decay_steps=10))
  tx, sched = make_optimizer(c, cfg)
  graphdef, state = steps_lib.init_state(cfg, tx, seed=0)
  step = jax.jit(steps_lib.make_train_step(graphdef, tx, sched, accum))
  return step(state, _random_batch(8, 12))


def test_grad_accumulation_equals_large_batch():
  s1, m1 = _state_and_batch(1)
  s4, m4 = _state_and_batch(4)
  chex.assert_tree_all_finite((s1, m1, s4, m4))
  assert bool(m1["finite"]) and bool(m4["finite"])
  np.testing.assert_allclose(float(m1["loss"]), float(m4["loss"]), rtol=1e-5)
  np.testing.assert_allclose(float(m1["grad_norm"]), float(m4["grad_norm"]), rtol=1e-4)
  for x, y in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s4["params"])):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-6)


@pytest.mark.parametrize(
  "mesh_shape, accum",
  [((2, 2, 1, 1), 2), ((2, 1, 2, 1), 4), ((4, 1, 1, 1), 2), ((2, 1, 1, 2), 2), ((2, 1, 2, 2), 2)],
)
def test_accumulation_over_data_shards_gives_the_large_batch_gradient(
  mesh_shape, accum, monkeypatch
):
  """With a data axis and grad_accum_reduce="step", each data shard sums its own rows'
  gradients over the micro-batches and the shards' sums are added once (one reduction over
  data per step, not one per micro-batch): the gradient is still the large batch's, as it is
  with the default reduction per micro-batch."""
  import optax  # pylint: disable=import-outside-toplevel

  from diffjax import sharding as shd  # pylint: disable=import-outside-toplevel
  from diffjax.train.setup import with_mesh_rules  # pylint: disable=import-outside-toplevel

  cfg = _small("diff_v1", num_layers=2, num_kv_heads=2)
  graphdef, state = steps_lib.init_state(cfg, optax.sgd(1.0), seed=0)
  batch = _random_batch(16, 8)
  schedule = lambda step: 1.0  # noqa: E731
  grouped = []
  real = steps_lib._accumulate_per_data_shard  # pylint: disable=protected-access
  monkeypatch.setattr(
    steps_lib, "_accumulate_per_data_shard", lambda *a: grouped.append(1) or real(*a)
  )

  def after(mesh, k, reduce="step"):  # the parameters after one SGD step of rate 1
    step = steps_lib.make_train_step(graphdef, optax.sgd(1.0), schedule, k, reduce)
    if mesh is not None:
      step = with_mesh_rules(step, mesh, shd.DEFAULT_RULES)
    new, metrics = jax.jit(step)(state, batch)
    return jax.tree.leaves(new["params"]), float(metrics["loss"])

  want, want_loss = after(None, 1)
  mesh = shd.make_mesh(mesh_shape, jax.devices()[: int(np.prod(mesh_shape))])
  for k, reduce in [(1, "step"), (accum, "micro_batch"), (accum, "step")]:
    grouped.clear()
    got, loss = after(mesh, k, reduce)
    # Only accumulation asked to reduce once per step sums per data shard.
    assert len(grouped) == (k > 1 and reduce == "step"), (k, reduce)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for a, b in zip(got, want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_batch_that_does_not_split_into_micro_batches_is_refused_in_one_line():
  from diffjax import sharding as shd  # pylint: disable=import-outside-toplevel
  from diffjax.train.setup import build_train_setup  # pylint: disable=import-outside-toplevel

  cfg = _small("diff_v1")
  mesh = shd.make_mesh((2, 2, 1, 1), jax.devices()[:4])
  for batch, accum, needle in [
    (8, 3, "global_batch_size=8 must be divisible by grad_accum_steps=3"),
    (8, 4, "8 / grad_accum_steps=4 = 2 rows does not split over data*fsdp=4"),
  ]:
    with pytest.raises(ValueError, match=re.escape(needle)):
      build_train_setup(
        cfg,
        base_config().optim,
        seed=0,
        mesh=mesh,
        rules=shd.DEFAULT_RULES,
        grad_accum_steps=accum,
        global_batch_size=batch,
      )


def test_a_batch_that_does_not_split_over_the_devices_is_refused_before_anything_is_written(
  tmp_path,
):
  c = tiny_config(steps=2)
  c.mesh.num_devices, c.global_batch_size = 3, 4
  with pytest.raises(ValueError, match=re.escape("global_batch_size=4 does not split over the 3")):
    train_and_evaluate(c, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("arm", ["transformer", "diff_v1", "diff_v2"])
def test_every_parameter_gets_a_finite_nonzero_gradient(arm):
  cfg = ModelConfig(
    attention=arm,
    d_model=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    mlp_dim=64,
    vocab_size=50,
  )
  graphdef, params = steps_lib.split_params(steps_lib.create_model(cfg, seed=0))
  rng = np.random.default_rng(1)
  batch = {
    "inputs": rng.integers(0, 50, (2, 10)).astype(np.int32),
    "targets": rng.integers(0, 50, (2, 10)).astype(np.int32),
    "segment_ids": np.ones((2, 10), np.int32),
    "positions": np.tile(np.arange(10, dtype=np.int32), (2, 1)),
    "loss_mask": np.ones((2, 10), np.float32),
  }
  grads = jax.jit(jax.grad(lambda p: steps_lib.loss_sums(graphdef, p, batch)[0]))(params)
  chex.assert_trees_all_equal_shapes_and_dtypes(grads, params)
  chex.assert_tree_all_finite(grads)
  flat = jax.tree_util.tree_flatten_with_path(grads)[0]
  dead = [jax.tree_util.keystr(path) for path, g in flat if not np.any(np.asarray(g) != 0)]
  assert not dead, f"parameters with an all-zero gradient: {dead}"


def test_checkpoint_round_trip(tmp_path):
  cfg = ModelConfig(
    attention="diff_v1",
    d_model=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=64,
    vocab_size=40,
  )
  tx, _ = make_optimizer(base_config().optim, cfg)
  _, state = steps_lib.init_state(cfg, tx, seed=3)
  m = ckpt.make_manager(str(tmp_path / "ck"), keep=2, async_save=True)
  ckpt.save(m, 7, state, None, {"model_config": cfg.to_dict()}, force=True)
  m.wait_until_finished()
  assert ckpt.read_meta(m, 7)["model_config"] == json.loads(json.dumps(cfg.to_dict()))
  back = ckpt.restore(m, 7, ckpt.abstract_like(state), None)
  for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _cli(args, workdir, timeout=WAIT_LIMIT_S):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(
    [
      sys.executable,
      os.path.join(REPO, "train.py"),
      "--config=" + os.path.join(REPO, "configs/default.py"),
      f"--workdir={workdir}",
      *args,
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=timeout,
    cwd=REPO,
  )


@pytest.mark.integration
@pytest.mark.parametrize(
  "args,needle",
  [
    (
      ["--config.data.kind=text", "--config.data.paths=('/no/such/dir/*.txt',)"],
      "/no/such/dir/*.txt",
    ),
    pytest.param(
      ["--config.data.kind=text", "--config.data.paths=('{empty}',)"],
      "empty",
      marks=pytest.mark.slow,
    ),
    (["--config.seq_len=100000000"], "100000001"),
    pytest.param(["--config.model.arm=gpt"], "'gpt'", marks=pytest.mark.slow),
    (["--config.model.no_such_key=1"], "no_such_key"),
    pytest.param(["--config.num_steps=abc"], "abc", marks=pytest.mark.slow),
  ],
)
def test_bad_input_one_error_line(tmp_path, args, needle):
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  args = [a.replace("{empty}", str(empty)) for a in args]
  wd = tmp_path / "wd"
  r = _cli(args, str(wd), timeout=WAIT_LIMIT_S)
  assert r.returncode == 2, r.stderr[-2000:]
  err_lines = [l for l in r.stderr.splitlines() if l.startswith("error:")]
  assert len(err_lines) == 1, r.stderr[-2000:]
  assert needle.lower() in err_lines[0].lower(), err_lines[0]
  assert not (wd / "checkpoints").exists()


# A one-layer model on 40 documents: fast enough to start, train and stop in a test.
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


def _start_endless_run(workdir, flags, stdout):
  return subprocess.Popen(
    [
      sys.executable,
      os.path.join(REPO, "train.py"),
      "--config=" + os.path.join(REPO, "configs/default.py"),
      f"--workdir={workdir}",
      "--config.num_steps=100000",
      *flags,
    ],
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    cwd=REPO,
    stdout=stdout,
    stderr=subprocess.DEVNULL,
    text=True,
  )


@pytest.mark.integration
def test_sigkill_during_saves_restarts_from_complete_checkpoint(tmp_path):
  wd = tmp_path / "wd"
  small = SMALL_RUN + ["--config.checkpoint.keep=100", "--config.checkpoint.every=1"]
  proc = _start_endless_run(wd, small, stdout=subprocess.DEVNULL)
  ckdir = wd / "checkpoints"
  wait_until(
    lambda: ckdir.exists() and len([p for p in ckdir.glob("*") if p.name.isdigit()]) >= 3,
    "three checkpoints",
    procs=[proc],
  )
  proc.send_signal(signal.SIGKILL)  # saves run every step: very likely mid-save
  proc.wait()
  complete = sorted(int(p.name) for p in ckdir.glob("*") if p.name.isdigit())
  assert complete, "no checkpoint was written before the kill"
  # A half-written step directory must be ignored on restart.
  (ckdir / f"{complete[-1] + 1}.orbax-checkpoint-tmp-123").mkdir(exist_ok=True)
  target = complete[-1] + 2
  r = _cli([f"--config.num_steps={target}", *small], str(wd))
  assert r.returncode == 0, r.stderr[-3000:]
  assert f"Resumed from step {complete[-1]}" in r.stdout, r.stdout[-2000:]
  rows = read_metrics(str(wd))
  assert max(rows) == target


@pytest.mark.integration
def test_sigterm_saves_and_resume_continues(tmp_path):
  wd = tmp_path / "wd"
  small = SMALL_RUN + ["--config.checkpoint.every=1000000", "--config.log_every=1"]
  proc = _start_endless_run(wd, small, stdout=subprocess.PIPE)
  wait_until(
    lambda: (wd / "metrics.jsonl").exists() and len(read_metrics(str(wd))) >= 3,
    "three logged steps",
    procs=[proc],
  )
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=WAIT_LIMIT_S)
  # A distinct status, so a scheduler can tell "stopped, rerun to resume" from "finished".
  assert proc.returncode == EXIT_PREEMPTED, out[-2000:]
  assert "saved step" in out, out[-2000:]
  saved = sorted(int(p.name) for p in (wd / "checkpoints").glob("*") if p.name.isdigit())
  assert len(saved) == 1 and saved[0] >= 3  # no periodic save happened: the signal saved it
  assert not (wd / "DONE").exists()
  r = _cli([f"--config.num_steps={saved[0] + 2}", *small], str(wd))
  assert r.returncode == 0, r.stderr[-3000:]
  assert f"Resumed from step {saved[0]}" in r.stdout
  assert (wd / "DONE").exists()


@pytest.mark.integration  # a whole training run
def test_task_mix_interleaves_retrieval_examples(tmp_path):
  from diffjax.data import DataConfig, load_tokenizer, open_corpus, stdlib_files
  from diffjax.train.task_mix import TRAIN_SEED_OFFSET, mixed_source

  c = tiny_config(steps=2)
  c.task_mix.update(dict(task="multi_needle", fraction=0.25, context_len=256, num_needles=1))
  # A corpus of 40 real source files keeps the example count (and the test) small.
  c.data.update(dict(kind="text", paths=tuple(str(f) for f in stdlib_files()[:40])))
  corpus = open_corpus(DataConfig.from_dict(c.data.to_dict()), load_tokenizer("byte"))
  mixed = mixed_source(corpus, c.task_mix, load_tokenizer("byte"), seed=0)
  n_task = len(mixed) - len(corpus)
  assert n_task > 0 and str(TRAIN_SEED_OFFSET) in mixed.name
  kinds = [b"secret number" in bytes(mixed[i].astype(np.uint8)) for i in range(len(mixed))]
  assert sum(kinds) >= n_task  # every task document is a needle example
  task_tokens = n_task * 256
  corpus_tokens = sum(corpus[i].size for i in range(len(corpus)))
  assert 0.2 < task_tokens / (task_tokens + corpus_tokens) < 0.3
  # Spread evenly: a prefix of documents keeps about the same share of task examples.
  first_half = sum(kinds[: len(kinds) // 2])
  assert abs(first_half - n_task / 2) <= n_task * 0.05 + 1
  # Training runs through the normal path, with a document cap.
  result = train_and_evaluate(c, str(tmp_path / "mix"))
  assert result["step"] == 2 and np.isfinite(result["train/loss"])
  c.task_mix.task = "sorting"
  with pytest.raises(ValueError, match="sorting"):
    train_and_evaluate(c, str(tmp_path / "bad"))


@pytest.mark.integration  # whole training runs
def test_changed_data_settings_are_refused_moving_nothing_and_the_run_stays_finished(tmp_path):
  """Another seed or data order cannot continue the saved data position: one refusal, no step
  quarantined, and the finished run keeps its DONE marker and its files."""
  from diffjax.train.workdir import done_step  # pylint: disable=import-outside-toplevel

  wd = str(tmp_path / "run")
  first = train_and_evaluate(tiny_config(steps=3), wd)
  metrics = open(os.path.join(wd, "metrics.jsonl"), encoding="utf-8").read()
  for key, value in (("seed", 7), ("data.shuffle", False), ("seq_len", 16)):
    c = tiny_config(steps=5)
    section, _, name = key.rpartition(".")
    (c[section] if section else c)[name] = value
    with pytest.raises(ckpt.CheckpointError, match=re.escape(f"{key}: saved")):
      train_and_evaluate(c, wd)
  c = tiny_config(steps=5)
  c.model.num_layers = 2
  with pytest.raises(ckpt.CheckpointError, match="num_layers"):
    train_and_evaluate(c, wd)
  assert not os.path.exists(os.path.join(wd, "checkpoints_quarantine"))
  assert done_step(wd) == 3
  assert open(os.path.join(wd, "metrics.jsonl"), encoding="utf-8").read() == metrics
  assert train_and_evaluate(tiny_config(steps=3), wd)["train/loss"] == first["train/loss"]


@pytest.mark.integration  # whole training runs
def test_a_run_stopped_after_its_last_save_finishes_with_its_recorded_loss(tmp_path):
  """As a signal right after the last step leaves it: the step saved, its train and perf lines
  written, no final evaluation and no DONE marker. The rerun evaluates and reports the loss on
  record (it trains no step)."""
  wd = str(tmp_path / "run")
  c = tiny_config(steps=3)
  c.eval_every = 3
  first = train_and_evaluate(c, wd)
  path = os.path.join(wd, "metrics.jsonl")
  lines = open(path, encoding="utf-8").read().splitlines()
  kept = [l for l in lines if not (json.loads(l)["step"] == 3 and "eval/loss" in json.loads(l))]
  assert len(kept) == len(lines) - 1
  open(path, "w", encoding="utf-8").write("\n".join(kept) + "\n")
  os.remove(os.path.join(wd, "DONE"))
  again = train_and_evaluate(c, wd)
  assert again["train/loss"] == first["train/loss"] and np.isfinite(again["train/loss"])
  rows = [json.loads(l) for l in open(path, encoding="utf-8").read().splitlines()]
  at_3 = [set(r) - {"step"} for r in rows if r["step"] == 3]
  assert any("perf/step_time_s" in r for r in at_3) and any("eval/loss" in r for r in at_3)
  assert sum("train/loss" in r for r in at_3) == 1


@pytest.mark.integration  # whole training runs
def test_a_signal_during_the_restore_saves_and_stops_after_the_next_step(tmp_path, monkeypatch):
  """The restore is not cut short (which could look like a damaged step): the signal asks the
  run to stop, which it does after the next step, saved; nothing is moved."""
  wd = str(tmp_path / "run")
  train_and_evaluate(tiny_config(steps=3), wd)
  real = ckpt.restore_newest_good

  def signalled_restore(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)

  monkeypatch.setattr(ckpt, "restore_newest_good", signalled_restore)
  result = train_and_evaluate(tiny_config(steps=6), wd)
  assert result["stopped"] and result["step"] == 4
  assert not os.path.exists(os.path.join(wd, "checkpoints_quarantine"))
  m = ckpt.make_manager(os.path.join(wd, "checkpoints"), keep=5, async_save=False)
  assert m.latest_step() == 4


def test_a_keyboard_interrupt_inside_a_librarys_error_is_seen():
  try:
    try:
      raise KeyboardInterrupt(2)
    except KeyboardInterrupt as k:
      raise ValueError("wrapped") from k
  except ValueError as e:
    wrapped = e
  assert ckpt._interrupted(wrapped) and not ckpt._interrupted(ValueError("damaged"))
