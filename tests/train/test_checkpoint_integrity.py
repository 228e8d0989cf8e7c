"""Checkpoint integrity: a content digest checked on restore, unusable steps moved aside
(never deleted) with a fallback to the newest good one, one-line messages with no
background tracebacks, and no checkpoint saved from non-finite parameters.

The corruption cases run in a subprocess (this file is also the script it runs), so the
test sees everything the process writes to stderr, up to and including its exit.
"""

from __future__ import annotations

import gc
import glob
import json
import os
import subprocess
import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import TESTS, WAIT_LIMIT_S

from diffjax.train import checkpoint as ckpt

NOISE = ("Traceback", "Event loop is closed", "tensorstore_spec", "TensorStore(")


def tiny_state(seed: int) -> dict:
  """A train-state-like pytree: float params in two dtypes, optimizer moments, counters."""
  rng = np.random.default_rng(seed)
  return {
    "params": {
      "w_DxF": jnp.asarray(rng.normal(size=(16, 64)), jnp.float32),
      "b_F": jnp.asarray(rng.normal(size=(64,)), jnp.float32),
      "emb_VxD": jnp.asarray(rng.normal(size=(32, 16)), jnp.bfloat16),
    },
    "opt_state": {
      "mu_DxF": jnp.asarray(rng.normal(size=(16, 64)), jnp.float32) * 1e-3,
      "count": jnp.asarray(seed, jnp.int32),
    },
    "step": jnp.asarray(seed, jnp.int32),
    # Random bits do not compress: this leaf's bytes sit verbatim in a data file.
    "rng": jnp.asarray(rng.integers(0, 2**32, size=(512,), dtype=np.uint32)),
  }


def batches_iter():
  """A grain iterator of 4-element batches of 0, 1, 2, ..."""
  return iter(grain.MapDataset.range(1000).batch(4).to_iter_dataset())


def meta_for(step: int) -> dict:
  return {"model_config": {"d_model": 16}, "note": f"saved at {step}"}


def write_two_steps(directory: str, async_save: bool = False) -> dict:
  """Saves steps 1 and 2 (the iterator one batch further each time); returns their states."""
  manager = ckpt.make_manager(directory, keep=5, async_save=async_save)
  it = batches_iter()
  states = {}
  for step in (1, 2):
    next(it)
    states[step] = tiny_state(step)
    ckpt.save(manager, step, states[step], it, meta_for(step), force=True)
    manager.wait_until_finished()
  manager.close()
  return states


def bitwise_equal(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
    x.dtype == y.dtype and x.shape == y.shape and np.asarray(x).tobytes() == np.asarray(y).tobytes()
    for x, y in zip(la, lb)
  )


def corrupt(step_dir: str, kind: str, raw_leaf: np.ndarray | None = None) -> None:
  """Damages one complete step directory the way disks and copies do."""
  state_files = [
    f
    for f in glob.glob(os.path.join(step_dir, "state", "**", "*"), recursive=True)
    if os.path.isfile(f)
  ]
  if kind == "truncate":  # a data chunk cut short (a partial copy, a full disk)
    data = max((f for f in state_files if f"{os.sep}d{os.sep}" in f), key=os.path.getsize)
    with open(data, "rb") as f:
      content = f.read()
    with open(data, "wb") as f:
      f.write(content[: len(content) // 2])
  elif kind == "manifests":  # the OCDBT manifests gone
    manifests = [f for f in state_files if os.path.basename(f) == "manifest.ocdbt"]
    assert manifests, state_files
    for f in manifests:
      os.remove(f)
  elif kind == "flip":  # a flipped bit inside stored array values: still readable
    window = raw_leaf.tobytes()[256:288]
    for f in state_files:
      with open(f, "rb") as fh:
        content = bytearray(fh.read())
      at = content.find(window)
      if at >= 0:
        content[at + 5] ^= 0x04
        with open(f, "wb") as fh:
          fh.write(content)
        return
    raise AssertionError("the raw leaf bytes were not found in any data file")
  elif kind == "iterator":  # an edited data-iterator position: still valid JSON
    path = os.path.join(step_dir, "data", "process_0-of-1.json")
    with open(path, encoding="utf-8") as f:
      position = json.load(f)
    position["next_index"] += 1
    with open(path, "w", encoding="utf-8") as f:
      json.dump(position, f)
  else:
    raise ValueError(kind)


def remesh_scenario(root: str) -> dict:
  """Saves a state sharded on a 2x4 mesh and restores it onto 8x1 and unsharded targets."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  devices = np.asarray(jax.devices()[:8])  # the test process's 8 CPU devices
  assert devices.size == 8, jax.devices()

  def place(state, mesh, spec):
    return jax.tree.map(
      lambda x: jax.device_put(x, NamedSharding(mesh, spec if x.ndim == 2 else P())), state
    )

  mesh_a = jax.sharding.Mesh(devices.reshape(2, 4), ("x", "y"))
  mesh_b = jax.sharding.Mesh(devices.reshape(8, 1), ("x", "y"))
  state = place(tiny_state(1), mesh_a, P("x", "y"))
  directory = os.path.join(root, "checkpoints")
  manager = ckpt.make_manager(directory, keep=5, async_save=False)
  ckpt.save(manager, 1, state, None, meta_for(1), force=True)
  manager.wait_until_finished()
  out = {}
  for name, target in (
    ("8x1", place(tiny_state(0), mesh_b, P("x", None))),
    ("unsharded", tiny_state(0)),
  ):
    messages = []
    step, back = ckpt.restore_newest_good(
      manager,
      ckpt.abstract_like(target, jax.tree.map(lambda x: x.sharding, target)),
      None,
      check_meta=lambda m: None,
      message=messages.append,
    )
    out[name] = dict(step=step, equal=bitwise_equal(back, state), messages=messages)
  manager.close()
  return out


def scenario(kind: str, root: str) -> dict:
  """Writes two steps, damages step 2, restores the newest good step; returns what it saw."""
  directory = os.path.join(root, "checkpoints")
  states = write_two_steps(directory)
  kinds = kind.split("+")
  for k in kinds:
    corrupt(
      os.path.join(directory, "2" if k != "truncate1" else "1"),
      k.replace("truncate1", "truncate"),
      np.asarray(states[2]["rng"]),
    )
  manager = ckpt.make_manager(directory, keep=5, async_save=False)
  it = batches_iter()
  messages, seen_meta = [], []
  out = {}
  try:
    step, state = ckpt.restore_newest_good(
      manager,
      ckpt.abstract_like(tiny_state(0)),
      it,
      check_meta=seen_meta.append,
      message=messages.append,
    )
    out.update(
      step=step,
      equal_to_step1=bitwise_equal(state, states[1]),
      next_batch=np.asarray(next(it)).tolist(),
      last_meta=seen_meta[-1],
    )
  except ckpt.CheckpointError as e:
    out.update(error=str(e))
  manager.close()
  gc.collect()  # reports of abandoned reads, if any, come out now rather than at some later time
  out.update(
    messages=messages, steps_left=sorted(int(p) for p in os.listdir(directory) if p.isdigit())
  )
  return out


def run_scenario(kind: str, tmp_path) -> tuple[dict, str]:
  # The script imports the shared helpers of tests/.
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p),
  )
  r = subprocess.run(
    [sys.executable, os.path.abspath(__file__), kind, str(tmp_path)],
    capture_output=True,
    text=True,
    timeout=WAIT_LIMIT_S,
    env=env,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def moved_copies(tmp_path) -> list[str]:
  """Step directories moved aside (anywhere under the workdir but the checkpoints folder)."""
  found = []
  for root, dirs, _ in os.walk(tmp_path):
    if os.path.abspath(root) == os.path.abspath(tmp_path / "checkpoints"):
      dirs[:] = []
      continue
    for d in dirs:
      if os.path.isfile(os.path.join(root, d, "_CHECKPOINT_METADATA")):
        found.append(os.path.join(root, d))
  return found


@pytest.mark.parametrize(
  "kind,needle",
  [
    ("truncate", "step 2"),
    pytest.param("manifests", "step 2", marks=pytest.mark.slow),
    ("flip", "digest"),
    pytest.param("iterator", "data iterator", marks=pytest.mark.slow),
  ],
)
def test_corrupt_newest_step_moves_aside_and_falls_back(tmp_path, kind, needle):
  out, stderr = run_scenario(kind, tmp_path)
  assert "error" not in out, out
  # Resumes exactly at step 1: bitwise the saved state, the iterator one batch in.
  assert out["step"] == 1 and out["equal_to_step1"], out
  assert out["next_batch"] == [4, 5, 6, 7], out
  assert out["last_meta"] == meta_for(1), out
  # One line names the step, what was wrong and where it went; the step was moved, not deleted.
  assert len(out["messages"]) == 1, out["messages"]
  msg = out["messages"][0]
  assert "\n" not in msg and len(msg) < 500, msg
  assert "step 2" in msg and needle in msg, msg
  assert out["steps_left"] == [1], out
  moved = moved_copies(tmp_path)
  assert len(moved) == 1 and moved[0] in msg, (moved, msg)
  assert os.path.isdir(os.path.join(moved[0], "state"))
  assert not any(n in stderr for n in NOISE), stderr[-3000:]


def test_no_good_step_raises_one_line_naming_what_moved(tmp_path):
  out, stderr = run_scenario("manifests+truncate1", tmp_path)
  assert "error" in out, out
  err = out["error"]
  assert "\n" not in err and len(err) < 800, err
  moved = moved_copies(tmp_path)
  assert len(moved) == 2, moved
  assert all(m in err for m in moved), (moved, err)
  assert out["steps_left"] == [], out
  assert not any(n in stderr for n in NOISE), stderr[-3000:]


def test_digest_does_not_depend_on_the_mesh(tmp_path):
  out = remesh_scenario(str(tmp_path))
  for name in ("8x1", "unsharded"):
    assert out[name] == dict(step=1, equal=True, messages=[]), (name, out)


def test_async_saves_verify(tmp_path):
  # The iterator moves on right after an async save returns: the digest must be the saved state's.
  directory = str(tmp_path / "checkpoints")
  states = write_two_steps(directory, async_save=True)
  manager = ckpt.make_manager(directory, keep=5, async_save=True)
  it, messages = batches_iter(), []
  step, state = ckpt.restore_newest_good(
    manager,
    ckpt.abstract_like(tiny_state(0)),
    it,
    check_meta=lambda m: None,
    message=messages.append,
  )
  manager.close()
  assert step == 2 and bitwise_equal(state, states[2]) and messages == []
  assert np.asarray(next(it)).tolist() == [8, 9, 10, 11]


def test_empty_directory_returns_none(tmp_path):
  manager = ckpt.make_manager(str(tmp_path / "checkpoints"), keep=5, async_save=False)
  got = ckpt.restore_newest_good(
    manager,
    ckpt.abstract_like(tiny_state(0)),
    batches_iter(),
    check_meta=lambda m: None,
    message=print,
  )
  assert got == (None, None)


def test_changed_model_config_refusal_moves_nothing(tmp_path):
  directory = str(tmp_path / "checkpoints")
  write_two_steps(directory)

  def refuse(meta):
    raise ckpt.CheckpointError(f"model config differs: {meta['model_config']}")

  manager = ckpt.make_manager(directory, keep=5, async_save=False)
  with pytest.raises(ckpt.CheckpointError, match="model config differs"):
    ckpt.restore_newest_good(
      manager, ckpt.abstract_like(tiny_state(0)), batches_iter(), check_meta=refuse, message=print
    )
  assert sorted(manager.all_steps()) == [1, 2]
  assert moved_copies(tmp_path) == []


def test_changed_state_structure_is_refused_not_moved(tmp_path):
  # e.g. gradient clipping switched on: the optimizer state has another leaf.
  directory = str(tmp_path / "checkpoints")
  write_two_steps(directory)
  target = tiny_state(0)
  target["opt_state"]["clip"] = jnp.zeros((3,), jnp.float32)
  manager = ckpt.make_manager(directory, keep=5, async_save=False)
  with pytest.raises(ckpt.CheckpointError, match="clip") as e:
    ckpt.restore_newest_good(
      manager, ckpt.abstract_like(target), batches_iter(), check_meta=lambda m: None, message=print
    )
  assert "\n" not in str(e.value)
  assert sorted(manager.all_steps()) == [1, 2]
  assert moved_copies(tmp_path) == []


def test_checkpoint_without_integrity_record_is_refused_naming_the_fix(tmp_path):
  # A step written by Orbax alone, without the record that save stores in meta.
  directory = str(tmp_path / "checkpoints")
  write_two_steps(directory)
  manager = ckpt.make_manager(directory, keep=5, async_save=False)
  it = batches_iter()
  manager.save(
    3,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(tiny_state(3)),
      meta=ocp.args.JsonSave(meta_for(3)),
      data=grain.checkpoint.CheckpointSave(it),
    ),
  )
  manager.wait_until_finished()
  for read in (
    lambda: ckpt.read_meta(manager, 3),
    lambda: ckpt.restore_newest_good(
      manager,
      ckpt.abstract_like(tiny_state(0)),
      batches_iter(),
      check_meta=lambda m: None,
      message=print,
    ),
  ):
    with pytest.raises(ckpt.CheckpointError) as e:
      read()
    msg = str(e.value)
    assert not isinstance(e.value, ckpt.CorruptCheckpointError)
    assert "\n" not in msg and "step 3" in msg and directory in msg, msg
    assert "no integrity record" in msg and "Move the step out" in msg, msg
  # Refused, not moved: the steps saved before it are still there.
  assert sorted(manager.all_steps()) == [1, 2, 3]
  assert moved_copies(tmp_path) == []
  manager.close()


@pytest.mark.parametrize("where", ["params", "opt_state"])
def test_non_finite_state_is_not_saved(tmp_path, where):
  directory = str(tmp_path / "checkpoints")
  manager = ckpt.make_manager(directory, keep=5, async_save=False)
  ckpt.save(manager, 1, tiny_state(1), None, meta_for(1), force=True)
  manager.wait_until_finished()
  bad = tiny_state(2)
  leaf = "b_F" if where == "params" else "mu_DxF"
  bad[where][leaf] = bad[where][leaf].at[3].set(jnp.nan)
  with pytest.raises(ckpt.CheckpointError) as e:
    ckpt.save(manager, 2, bad, None, meta_for(2), force=True)
  manager.wait_until_finished()
  msg = str(e.value)
  assert "\n" not in msg and "step 2" in msg and "not finite" in msg and "not saved" in msg, msg
  assert leaf in msg and "1" in msg.split("kept")[0], msg
  assert sorted(manager.all_steps()) == [1]
  assert not any(p.startswith("2") for p in os.listdir(directory))
  manager.close()


def test_load_model_falls_back_without_moving_and_refuses_an_explicit_corrupt_step(tmp_path):
  from diffjax.model import ModelConfig
  from diffjax.presets import base_config
  from diffjax.train import load_model
  from diffjax.train import steps as steps_lib
  from diffjax.train.optim import make_optimizer

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
  tx, _ = make_optimizer(base_config().optim, cfg)
  directory = tmp_path / "checkpoints"
  manager = ckpt.make_manager(str(directory), keep=5, async_save=False)
  states = {}
  for step in (1, 2):
    _, states[step] = steps_lib.init_state(cfg, tx, seed=step)
    ckpt.save(manager, step, states[step], None, {"model_config": cfg.to_dict()}, force=True)
  manager.wait_until_finished()
  manager.close()
  corrupt(str(directory / "2"), "manifests")
  messages = []
  model, _, step = load_model(str(tmp_path), message=messages.append)
  assert step == 1
  assert len(messages) == 1 and "step 2" in messages[0] and "\n" not in messages[0], messages
  loaded = steps_lib.split_params(model)[1]
  assert bitwise_equal(loaded, states[1]["params"])
  assert sorted(int(p) for p in os.listdir(directory) if p.isdigit()) == [1, 2]  # read-only
  with pytest.raises(ckpt.CheckpointError) as e:
    load_model(str(tmp_path), step=2)
  assert "\n" not in str(e.value) and "step 2" in str(e.value)
  assert not any(n in str(e.value) for n in NOISE), str(e.value)


if __name__ == "__main__":
  print(json.dumps(scenario(sys.argv[1], sys.argv[2])))
