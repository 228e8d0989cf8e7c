"""Resuming a checkpoint on another number of processes than wrote it.

Each process saves the data position of its rows; the rows' lanes are global, so the saved
states of all processes give the position of the whole batch, from which each process of
the new run takes its rows. The unit tests assemble and split positions (and refuse what
does not fit); the slow ones train on several processes on 127.0.0.1 and compare the
losses with an uninterrupted single-process run.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO, WAIT_LIMIT_S, free_port, read_metrics

from diffjax.data import ByteTokenizer, DataConfig, build_datasets
from diffjax.data.streaming import DataPositionError, global_position, split_position
from diffjax.train import checkpoint as ckpt
from diffjax.train.digest import sha256

B = 4  # the global batch


class _Docs:
  """Documents of random bytes and lengths (a DocumentSource)."""

  def __init__(self, n: int = 48, seed: int = 0):
    rng = np.random.default_rng(seed)
    self.docs = [
      rng.integers(1, 250, size=int(rng.integers(3, 50))).astype(np.int32) for _ in range(n)
    ]

  def __len__(self):
    return len(self.docs)

  def __getitem__(self, i):
    return self.docs[i]


def _data(index: int = 0, count: int = 1, batch: int = B, streams: int = 2):
  cfg = DataConfig(val_fraction=0.1, prefetch_batches=0, streams_per_row=streams)
  return build_datasets(cfg, 16, batch, 0, index, count, source=_Docs(), tokenizer=ByteTokenizer())


def _iters(count: int) -> list:
  return [_data(p, count).train_iter for p in range(count)]


def _advance(iterators, n: int) -> list[dict]:
  """Each iterator ``n`` batches on; their states as a checkpoint holds them (JSON)."""
  for it in iterators:
    for _ in range(n):
      next(it)
  return [json.loads(json.dumps(it.get_state())) for it in iterators]


def _same(a: dict, b: dict) -> bool:
  return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# --- the global position from N processes' states into M processes' rows ----------------------


@pytest.mark.parametrize("saved,now", [(2, 1), (2, 4), (1, 2), (4, 2)])
def test_n_saved_states_give_m_processes_the_rows_of_one_global_order(saved, now):
  # 5 batches: past one round of the 2 streams per row, with lanes inside their documents.
  states = _advance(_iters(saved), 5)
  position = global_position(dict(enumerate(states)), saved)
  (whole,) = _advance(_iters(1), 5)
  assert position == whole  # what a single process would hold after the same batches
  parts = split_position(position, now)
  assert parts == _advance(_iters(now), 5)

  # Iterators of the new layout continue from it as an uninterrupted single process does.
  straight = _iters(1)[0]
  _advance([straight], 5)
  want = [next(straight) for _ in range(3)]
  resumed = _iters(now)
  for it in resumed:
    it.set_position(position)
  got = [[next(it) for it in resumed] for _ in range(3)]
  for w, g in zip(want, got):
    assert _same(w, {k: np.concatenate([part[k] for part in g]) for k in w})


def test_a_missing_process_state_is_refused_naming_it():
  states = _advance(_iters(2), 1)
  with pytest.raises(DataPositionError, match=r"process 1 of the 2 processes .* missing"):
    global_position({0: states[0]}, 2)


def test_a_count_that_does_not_divide_the_global_batch_is_refused():
  position = global_position(dict(enumerate(_advance(_iters(2), 1))), 2)
  with pytest.raises(DataPositionError, match="global batch of 4 rows, which 3 processes"):
    split_position(position, 3)


def test_states_that_do_not_fit_together_are_refused():
  a, b = _advance(_iters(2), 2)
  with pytest.raises(DataPositionError, match="disagree"):  # one process a batch behind
    global_position({0: a, 1: dict(b, batches=b["batches"] + 1)}, 2)
  with pytest.raises(DataPositionError, match="disagree on row 0"):  # a context group's copy
    global_position({0: a, 1: dict(a, lanes=[[0, 0, 0]] * len(a["lanes"]))}, 2)
  with pytest.raises(DataPositionError, match=r"rows \[0, 1\] of the 4-row batch"):
    global_position({0: b}, 1)


def test_a_position_of_another_global_batch_or_streams_is_refused():
  position = global_position(dict(enumerate(_advance(_iters(2), 1))), 2)
  it = _data(0, 1, batch=8).train_iter
  with pytest.raises(DataPositionError, match="global batch of 4 rows.*global_batch_size=4"):
    it.set_position(position)
  one_stream = dict(position, lanes=position["lanes"][::2])
  with pytest.raises(DataPositionError, match="1 streams per row, but this run reads 2"):
    _iters(1)[0].set_position(one_stream)


# --- a checkpoint step saved by two processes, restored by this one ---------------------------


def _tiny_state(seed: int) -> dict:
  rng = np.random.default_rng(seed)
  return {
    "params": {"w_DxF": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)},
    "step": jnp.asarray(seed, jnp.int32),
  }


def _as_if_saved_by(step_dir: str, states: list[dict]) -> None:
  """Rewrites a step saved by this process as the processes of ``states`` write one: their
  state files, and their digests in the integrity record."""
  data = os.path.join(step_dir, "data")
  for f in glob.glob(os.path.join(data, "process_*.json")):
    os.remove(f)
  n = len(states)
  for i, s in enumerate(states):
    with open(os.path.join(data, f"process_{i}-of-{n}.json"), "w", encoding="utf-8") as f:
      json.dump(s, f, indent=4)
  meta_file = os.path.join(step_dir, "meta", "metadata")
  with open(meta_file, encoding="utf-8") as f:
    meta = json.load(f)
  meta["integrity"]["data"] = {str(i): sha256(s) for i, s in enumerate(states)}
  with open(meta_file, "w", encoding="utf-8") as f:
    json.dump(meta, f)


def _two_steps_saved_by_two_processes(directory: str) -> None:
  """Steps 2 and 4 of a run, each rewritten as two processes would have saved it."""
  manager = ckpt.make_manager(directory, keep=5, async_save=False)
  whole, halves = _iters(1)[0], _iters(2)
  for step in (2, 4):
    _advance([whole], 2)
    states = _advance(halves, 2)
    ckpt.save(manager, step, _tiny_state(step), whole, {"note": step}, force=True)
    manager.wait_until_finished()
    _as_if_saved_by(os.path.join(directory, str(step)), states)
  manager.close()


def _restore(directory: str):
  manager = ckpt.make_manager(directory, keep=5, async_save=False)
  it, lines = _iters(1)[0], []
  step, state = ckpt.restore_newest_good(
    manager,
    ckpt.abstract_like(_tiny_state(0)),
    it,
    check_meta=lambda meta: None,
    message=lines.append,
  )
  return step, state, it, lines


def test_a_step_saved_by_two_processes_resumes_on_one_with_one_line(tmp_path):
  directory = str(tmp_path / "checkpoints")
  _two_steps_saved_by_two_processes(directory)
  step, state, it, lines = _restore(directory)
  assert step == 4 and int(state["step"]) == 4
  assert lines == [
    "Resuming step 4 written by 2 processes on 1 process: the data position is global, each "
    "process takes its rows from it."
  ]
  straight = _iters(1)[0]
  _advance([straight], 4)
  assert it.get_state() == straight.get_state()
  assert all(_same(next(it), next(straight)) for _ in range(3))


@pytest.mark.parametrize("damage", ["missing", "edited"])
def test_a_missing_or_edited_process_state_moves_the_step_aside(tmp_path, damage):
  directory = str(tmp_path / "checkpoints")
  _two_steps_saved_by_two_processes(directory)
  path = os.path.join(directory, "4", "data", "process_1-of-2.json")
  if damage == "missing":
    os.remove(path)
  else:
    with open(path, encoding="utf-8") as f:
      s = json.load(f)
    s["lanes"][0][2] += 1
    with open(path, "w", encoding="utf-8") as f:
      json.dump(s, f)
  step, _, it, lines = _restore(directory)
  reason = "missing" if damage == "missing" else "digest-mismatch"
  what = "no data iterator state of process 1" if damage == "missing" else "of process 1"
  assert step == 2, lines
  assert len(lines) == 2 and what in lines[0] and f"4-{reason}" in lines[0], lines
  assert lines[1].startswith("Resuming step 2 written by 2 processes on 1 process"), lines
  assert os.path.isdir(str(tmp_path / "checkpoints_quarantine" / f"4-{reason}"))
  straight = _iters(1)[0]
  _advance([straight], 2)
  assert it.get_state() == straight.get_state()


def test_an_iterator_without_a_global_position_is_refused_not_moved(tmp_path):
  import grain  # pylint: disable=import-outside-toplevel

  directory = str(tmp_path / "checkpoints")
  _two_steps_saved_by_two_processes(directory)
  manager = ckpt.make_manager(directory, keep=5, async_save=False)
  per_process = iter(grain.MapDataset.range(100).batch(4).to_iter_dataset())
  with pytest.raises(ckpt.CheckpointError, match="written by 2 processes.*run 2 processes, not 1"):
    ckpt.restore_newest_good(
      manager,
      ckpt.abstract_like(_tiny_state(0)),
      per_process,
      check_meta=lambda meta: None,
      message=print,
    )
  assert sorted(manager.all_steps()) == [2, 4]


def _refused_resume(tmp_path, resumed) -> str:
  """A step saved by one process (4 rows, 2 streams per row) resumed by the iterator
  ``resumed`` of one process: the one-line refusal, checked to move nothing aside."""
  directory = str(tmp_path / "checkpoints")
  manager = ckpt.make_manager(directory, keep=5, async_save=False)
  it = _iters(1)[0]
  _advance([it], 2)
  ckpt.save(manager, 2, _tiny_state(2), it, {"note": 2}, force=True)
  manager.wait_until_finished()
  with pytest.raises(ckpt.CheckpointError) as e:
    ckpt.restore_newest_good(
      manager,
      ckpt.abstract_like(_tiny_state(0)),
      resumed,
      check_meta=lambda meta: None,
      message=print,
    )
  msg = str(e.value)
  assert not isinstance(e.value, ckpt.CorruptCheckpointError)
  assert "\n" not in msg and "step 2" in msg, msg
  assert sorted(manager.all_steps()) == [2]
  assert not os.path.exists(str(tmp_path / "checkpoints_quarantine"))
  return msg


def test_another_global_batch_is_refused_naming_the_value_and_nothing_moves(tmp_path):
  # Saved by as many processes (one) as resume, but of 4 rows where the run reads 8.
  msg = _refused_resume(tmp_path, _data(0, 1, batch=8).train_iter)
  assert "global batch of 4 rows" in msg and "resume with global_batch_size=4" in msg, msg


def test_other_streams_per_row_on_as_many_processes_are_refused_and_nothing_moves(tmp_path):
  # Saved by one process reading the rows this run reads, with 2 streams per row; the run
  # reads 1: its lanes would take other lanes' positions.
  one_stream = _data(0, 1, streams=1).train_iter
  msg = _refused_resume(tmp_path, one_stream)
  assert "2 streams per row, but this run reads 1" in msg, msg
  # The iterator refuses such a state itself too.
  saved = _iters(1)[0]
  with pytest.raises(ValueError, match="2 streams per row, but this run reads 1"):
    one_stream.set_state(saved.get_state())


def test_num_devices_on_several_processes_names_the_total_and_the_fix(monkeypatch):
  # A run restarted on another number of processes sees another total (here 2 processes of
  # this test process's 8 devices): a count kept from the run before is refused.
  import jax  # pylint: disable=import-outside-toplevel

  from diffjax.train.sections import MeshConfig  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  total = jax.device_count()
  with pytest.raises(ValueError) as e:
    MeshConfig(num_devices=2).devices()
  assert str(e.value) == (
    f"mesh.num_devices=2: a run of 2 processes spans all {total} devices (every device of "
    f"every process). Set mesh.num_devices=0 (or {total})."
  )
  assert MeshConfig(num_devices=0).devices() is None
  assert len(MeshConfig(num_devices=total).devices()) == total


# --- training runs on several processes -------------------------------------------------------

STEPS, SAVED_AT = 8, 4


def _train(wd: str, processes: int, steps: int, devices: int = 1) -> str:
  """``train.py --config=configs/tiny.py`` (batch 4, length 32) to ``steps`` on ``processes``
  processes on 127.0.0.1 with ``devices`` CPU devices each, every device on the fsdp axis (so
  the parameters and moments are sharded over the processes); returns process 0's output."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  env["XLA_FLAGS"] = " ".join(
    f for f in (env.get("XLA_FLAGS"), f"--xla_force_host_platform_device_count={devices}") if f
  )
  if processes > 1:
    env.update(DIFFJAX_COORDINATOR=f"127.0.0.1:{free_port()}", DIFFJAX_NUM_PROCESSES=str(processes))
  args = [
    sys.executable,
    "train.py",
    "--config=configs/tiny.py",
    f"--workdir={wd}",
    f"--config.num_steps={steps}",
    "--config.eval_every=0",
    "--config.eval_batches=1",
    f"--config.checkpoint.every={SAVED_AT}",
    "--config.checkpoint.keep=3",
    "--config.global_batch_size=4",
    "--config.seq_len=32",
    "--config.mesh.shape=(1,-1,1)",
  ]
  logs = [
    os.path.join(os.path.dirname(wd), f"{os.path.basename(wd)}.{i}.log") for i in range(processes)
  ]
  procs = []
  for i, log in enumerate(logs):
    with open(log, "w", encoding="utf-8") as out:
      procs.append(
        subprocess.Popen(
          args,
          cwd=REPO,
          env={**env, "DIFFJAX_PROCESS_ID": str(i)} if processes > 1 else env,
          stdout=out,
          stderr=subprocess.STDOUT,
        )
      )
  try:
    for p in procs:
      p.wait(timeout=WAIT_LIMIT_S)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  texts = []
  for log in logs:
    with open(log, encoding="utf-8") as f:
      texts.append(f.read())
  for p, text in zip(procs, texts):
    assert p.returncode == 0, text[-3000:]
  return texts[0]


def _losses(wd: str) -> dict[int, float]:
  return {s: r["train/loss"] for s, r in read_metrics(wd).items()}


def _as_if_stopped_at(wd: str, step: int) -> None:
  """A finished run's workdir as if it had stopped after saving ``step``."""
  for name in os.listdir(os.path.join(wd, "checkpoints")):
    if name.isdigit() and int(name) > step:
      shutil.rmtree(os.path.join(wd, "checkpoints", name))
  for name in ("DONE", "final_metrics.json"):
    if os.path.exists(os.path.join(wd, name)):
      os.remove(os.path.join(wd, name))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """An uninterrupted single-process run of STEPS steps, and a run on two processes of two
  devices each stopped at its SAVED_AT checkpoint."""
  root = tmp_path_factory.mktemp("elastic")
  straight, two = str(root / "straight"), str(root / "two")
  _train(straight, 1, STEPS)
  _train(two, 2, SAVED_AT, devices=2)
  return {"root": root, "straight": straight, "two": two}


def _assert_same_losses(wd: str, straight: str) -> None:
  got, want = _losses(wd), _losses(straight)
  assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), (sorted(got), sorted(want))
  for s in want:
    assert got[s] == pytest.approx(want[s], rel=1e-5), (s, got[s], want[s])


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("processes", [1, 4])
def test_a_checkpoint_of_two_processes_resumes_on_another_number(runs, processes):
  wd = str(runs["root"] / f"two_on_{processes}")
  shutil.copytree(runs["two"], wd)
  out = _train(wd, processes, STEPS)
  line = (
    f"Resuming step {SAVED_AT} written by 2 processes on {processes} "
    f"process{'es' if processes > 1 else ''}: the data position is global, each process "
    "takes its rows from it."
  )
  assert out.count(line) == 1, out[-3000:]
  assert f"Resumed from step {SAVED_AT}" in out
  # 4 devices (2 x 2) saved the sharded state; 1 and 4 (4 x 1) restore it.
  _assert_same_losses(wd, runs["straight"])


@pytest.mark.slow
@pytest.mark.integration
def test_a_checkpoint_of_one_process_resumes_on_two(runs):
  wd = str(runs["root"] / "one_on_two")
  shutil.copytree(runs["straight"], wd)
  _as_if_stopped_at(wd, SAVED_AT)
  out = _train(wd, 2, STEPS)
  assert (
    out.count(
      f"Resuming step {SAVED_AT} written by 1 process on 2 processes: the data position is "
      "global, each process takes its rows from it."
    )
    == 1
  ), out[-3000:]
  _assert_same_losses(wd, runs["straight"])
