"""Matched comparison: end to end in miniature, rerun and resume, the data check, bad configs."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys

import pytest
from helpers import REPO, WAIT_LIMIT_S, metrics_rows, wait_until

from diffjax import compare
from diffjax.model import resolve_model
from diffjax.presets import base_config, load_config
from diffjax.train.config import RunConfig

# ml_collections loads config files with importlib's deprecated load_module().
pytestmark = [
  pytest.mark.integration,
  pytest.mark.filterwarnings(
    "ignore:the load_module\\(\\) method is deprecated:DeprecationWarning"
  ),
]

ARMS = ("transformer", "diff_v1")
SEEDS = (0, 1)
STEPS = 6

# A config file, as a user would write one: two arms, two seeds, a few steps, a tiny eval.
MINI_CONFIG = f"""
from diffjax.compare import comparison_config
from diffjax.presets import base_config


def get_config():
  base = base_config()
  base.model.update(dict(arm="transformer", size="tiny", d_model=64, num_layers=1, mlp_dim=128,
                         head_dim=16))
  base.seq_len, base.global_batch_size, base.num_steps = 32, 4, {STEPS}
  base.log_every, base.eval_every, base.eval_batches = 2, 3, 2
  base.tensorboard = False
  base.data.max_documents = 40
  base.optim.update(dict(warmup_steps=2, decay_steps={STEPS}))
  base.checkpoint.update(dict(every=3, keep=2, async_save=False))
  c = comparison_config(base, seeds={SEEDS}, arms={ARMS})
  c.eval.overrides = dict(context_len=128, heatmap_lengths=(128,), heatmap_needles=(1, 1),
                          val_batches=2, sections=("validation", "retrieval", "heatmap"))
  # One lm-eval task on local data, four examples (the [harness] extra).
  c.eval.harness_tasks = ("diffjax_fixture_choice",)
  c.eval.harness_include_path = {os.path.join(REPO, "tests", "fixtures", "harness")!r}
  c.eval.harness_limit = 4
  return c
"""


def _cli(config_path, workdir, *extra, timeout=WAIT_LIMIT_S):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(
    [
      sys.executable,
      "-m",
      "diffjax.compare",
      f"--config={config_path}",
      f"--workdir={workdir}",
      *extra,
    ],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
  """One miniature comparison through the command line: (workdir, config path, result)."""
  root = tmp_path_factory.mktemp("compare")
  config_path = root / "mini.py"
  config_path.write_text(MINI_CONFIG)
  workdir = root / "out"
  r = _cli(config_path, workdir)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  return workdir, config_path, r


def _run_dir(workdir, arm, seed):
  return workdir / "runs" / f"{arm}_seed{seed}"


def _hashes(run_dir):
  rows = metrics_rows(run_dir)
  return [
    r["data/batch_hash"] for r in sorted(rows, key=lambda r: r["step"]) if "data/batch_hash" in r
  ]


def test_report_results_and_plots(compared):
  workdir, _, r = compared
  report = (workdir / "report.md").read_text()
  # The per-arm summary table: a header and one row per arm with numbers in it.
  assert "## Comparison summary" in report
  assert report.index("## Comparison summary") < report.index("## Runs")
  assert "| arm | params | seeds | train loss (last 2 steps) | final eval loss |" in report
  for arm in ARMS:
    row = next(l for l in report.splitlines() if l.startswith(f"| {arm} | "))
    assert any(ch.isdigit() for ch in row.split("|")[4]), row
  assert "## Paired differences against transformer" in report
  assert "Data check: for every seed all arms saw identical batches" in report
  # The matching used and every arm's parameter count are stated.
  line = next(l for l in report.splitlines() if l.startswith("Arms matched to one Transformer"))
  assert "DIFF V2 matched by parameters" in line
  for arm in ARMS:
    assert f"{arm} " in line.split("Parameters:")[1], line
  # The speed table: every arm's step time, its ratio to the baseline; no MFU on a CPU.
  speed = report.split("| arm | step time | vs transformer |")[1].split("\n\n")[0].splitlines()[2:]
  assert [l.split(" | ")[0] for l in speed] == [f"| {a}" for a in ARMS], speed
  for l in speed:
    cells = l.split(" | ")
    assert cells[1].endswith(" ms") and float(cells[1][:-3]) > 0, l
    assert cells[-1].startswith("- (no peak"), l
  assert speed[0].split(" | ")[2] == "1.000x", speed

  # Strict JSON: NaN would not parse with this hook.
  def no_constants(name):
    raise AssertionError(f"results.json holds {name}")

  results = json.loads((workdir / "results.json").read_text(), parse_constant=no_constants)
  got = {(run["arm"], run["seed"]) for run in results["runs"]}
  assert got == {(a, s) for a in ARMS for s in SEEDS}
  for run in results["runs"]:
    assert run["step"] == STEPS
    for key in ("train/loss", "eval/loss"):
      assert math.isfinite(run["final_metrics"][key]), (run["name"], key)
    assert math.isfinite(run["scalars"]["val/loss"]), run["name"]
    assert 0.0 <= run["scalars"]["retrieval/mean"] <= 1.0
    assert run["curve"] and run["curve"][-1]["step"] == STEPS
  assert results["data_check"]["ok"] is True
  assert results["summary"]["diff_v1"]["paired_eval_loss"]["n"] == len(SEEDS)
  assert set(results["aggregate"]["per_arm"]) == set(ARMS)

  # The harness task's scores per arm and their paired difference against the baseline.
  paired = report.split("## Paired differences against transformer")[1]
  for metric in ("harness/diffjax_fixture_choice/acc", "harness/diffjax_fixture_choice/acc_norm"):
    row = next(l for l in paired.splitlines() if l.startswith(f"| {metric} | "))
    assert row.count("|") == 3 and f"(n={len(SEEDS)})" in row, row
  for run in results["runs"]:
    assert 0.0 <= run["scalars"]["harness/diffjax_fixture_choice/acc"] <= 1.0, run["name"]
    ev = json.loads((_run_dir(workdir, run["arm"], run["seed"]) / "eval.json").read_text())
    section = ev["sections"]["harness"]
    assert section["settings"]["tasks"] == ["diffjax_fixture_choice"]
    assert section["settings"]["limit"] == 4
    assert "acc,none" in section["results"]["diffjax_fixture_choice"]

  for name in ("loss_curves.png", "retrieval_heatmap.png"):
    data = (workdir / name).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, name
    assert f"]({name})" in report

  # Progress lines name the run, the runs left and the elapsed time.
  assert "[1/4 transformer_seed0] starting: 4 runs left, elapsed" in r.stdout
  assert "[4/4 diff_v1_seed1] done:" in r.stdout


def test_arms_share_batches_and_seeds_differ(compared):
  workdir, _, _ = compared
  per_seed = {}
  for seed in SEEDS:
    seqs = {arm: _hashes(_run_dir(workdir, arm, seed)) for arm in ARMS}
    assert all(len(s) == STEPS for s in seqs.values()), seqs
    assert seqs["transformer"] == seqs["diff_v1"], f"seed {seed}: the arms saw different batches"
    per_seed[seed] = seqs["transformer"]
  assert per_seed[0] != per_seed[1], "seeds 0 and 1 drew the same data order"


def _losses(run_dir):
  rows = metrics_rows(run_dir)
  return [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]


def test_rerun_skips_finished_runs(compared):
  workdir, config_path, _ = compared
  runs = [_run_dir(workdir, a, s) for s in SEEDS for a in ARMS]
  before = {
    d: (
      (d / "metrics.jsonl").read_bytes(),
      (d / "eval.json").stat().st_mtime_ns,
      sorted(os.listdir(d / "checkpoints")),
    )
    for d in runs
  }
  r = _cli(config_path, workdir)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.count("skipping training") == len(runs), r.stdout
  assert r.stdout.count("eval.json is up to date") == len(runs), r.stdout
  assert "training to step" not in r.stdout and "evaluating" not in r.stdout
  for d, (metrics, eval_mtime, ckpts) in before.items():
    assert (d / "metrics.jsonl").read_bytes() == metrics, f"{d.name} trained again"
    assert (d / "eval.json").stat().st_mtime_ns == eval_mtime, f"{d.name} evaluated again"
    assert sorted(os.listdir(d / "checkpoints")) == ckpts
  assert (workdir / "report.md").exists()


def test_a_run_trained_with_other_settings_is_refused(compared, tmp_path):
  """A rerun whose base settings changed does not skip (or resume) the runs trained under the
  old ones and report them under the new."""
  workdir, config_path, _ = compared
  copy = tmp_path / "out"
  shutil.copytree(workdir, copy)
  changed = tmp_path / "changed.py"
  changed.write_text(config_path.read_text().replace("warmup_steps=2", "warmup_steps=3"))
  before = {d.name: (d / "metrics.jsonl").read_bytes() for d in (copy / "runs").iterdir()}
  report = (copy / "report.md").read_bytes()
  written = (copy / "compare_config.json").read_bytes()
  r = _cli(changed, copy)
  assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
  assert "optim.warmup_steps: saved 2 vs now 3" in r.stderr, r.stderr
  assert "new --workdir" in r.stderr
  assert "skipping training" not in r.stdout and "resuming" not in r.stdout
  assert {d.name: (d / "metrics.jsonl").read_bytes() for d in (copy / "runs").iterdir()} == before
  assert (copy / "report.md").read_bytes() == report
  # Every run directory is checked before anything is written.
  assert (copy / "compare_config.json").read_bytes() == written
  # How the steps run is not a different run.
  fast = tmp_path / "fast.py"
  fast.write_text(
    config_path.read_text().replace(
      "base.tensorboard = False", "base.tensorboard = False\n  base.model.implementation = 'xla'"
    )
  )
  r = _cli(fast, copy)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def _changed_run(config, **changes):
  """diff_v1 seed 0 of ``config`` with ``changes`` ({"section__key": value}) to its run config."""
  run = compare.run_config(config, "diff_v1", 0)
  for key, value in changes.items():
    section, _, name = key.rpartition("__")
    (run[section] if section else run)[name] = value
  return RunConfig.from_config(run)


@pytest.mark.parametrize(
  "changes,needle",
  [
    (dict(task_mix__loss="answers"), "task_mix.loss: saved 'all' vs now 'answers'"),
    (dict(task_mix__num_examples=10), "task_mix.num_examples: saved 0 vs now 10"),
    (dict(task_mix__grid=((2, 0),)), "task_mix.grid: saved [] vs now [[2, 0]]"),
    (dict(data__streams_per_row=8), "data.streams_per_row: saved 16 vs now 8"),
    (dict(data__prefetch_batches=0), None),  # how batches are fetched: the same run
  ],
)
def test_a_run_trained_on_other_examples_or_scored_otherwise_is_refused(compared, changes, needle):
  """What a run trained on (its loss mask, its task examples, how its rows stream the data) is
  part of the run, as the model and optimizer are."""
  from diffjax.compare.runs import check_trained_as
  from diffjax.train.checkpoint import CheckpointError

  workdir, config_path, _ = compared
  config = compare.check_comparison_config(load_config(str(config_path)))
  run_dir = str(_run_dir(workdir, "diff_v1", 0))
  if needle is None:
    check_trained_as(_changed_run(config, **changes), run_dir)
    return
  with pytest.raises(CheckpointError) as e:
    check_trained_as(_changed_run(config, **changes), run_dir)
  assert needle in str(e.value) and "new --workdir" in str(e.value), str(e.value)


def test_finished_runs_scored_on_another_number_of_validation_batches_are_refused(
  compared, tmp_path
):
  """The final eval loss of a finished run was measured on the eval_batches it finished with:
  another number would be reported (and paired) as if measured on the new one."""
  from diffjax.compare.runs import FINAL_EVAL, check_trained_as
  from diffjax.train.checkpoint import CheckpointError

  workdir, config_path, _ = compared
  copy = tmp_path / "out"
  shutil.copytree(workdir, copy)
  config = compare.check_comparison_config(load_config(str(config_path)))
  run_dir = _run_dir(copy, "diff_v1", 0)
  assert json.loads((run_dir / FINAL_EVAL).read_text()) == {"step": STEPS, "eval_batches": 2}
  check_trained_as(_changed_run(config, eval_batches=2), str(run_dir))
  # Recorded by the comparison, or (a run it did not see finish) its checkpoint's config.
  for recorded in (True, False):
    if not recorded:
      (run_dir / FINAL_EVAL).unlink()
    with pytest.raises(CheckpointError, match="measured on eval_batches=2 validation batches"):
      check_trained_as(_changed_run(config, eval_batches=3), str(run_dir))
  # Unfinished, its final eval is still to come with the new number.
  (run_dir / "DONE").unlink()
  check_trained_as(_changed_run(config, eval_batches=3), str(run_dir))
  # The command: one line, naming the value to restore, and nothing written.
  written = (copy / "compare_config.json").read_bytes()
  r = _cli(config_path, copy, "--config.base.eval_batches=3")
  assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and "--config.base.eval_batches=2" in last, r.stderr
  assert (copy / "compare_config.json").read_bytes() == written


def test_runs_trained_past_the_asked_steps_are_refused(compared, tmp_path):
  """Fewer steps than the runs were trained to: their results would be reported (and paired)
  as the shorter length."""
  workdir, config_path, _ = compared
  copy = tmp_path / "out"
  shutil.copytree(workdir, copy)
  shorter = tmp_path / "shorter.py"
  text = config_path.read_text()
  assert f"= 32, 4, {STEPS}" in text
  shorter.write_text(text.replace(f"= 32, 4, {STEPS}", f"= 32, 4, {STEPS - 2}"))
  report = (copy / "report.md").read_bytes()
  r = _cli(shorter, copy)
  assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
  assert f"trained to step {STEPS}, past the comparison's num_steps={STEPS - 2}" in r.stderr
  assert "skipping training" not in r.stdout and (copy / "report.md").read_bytes() == report


def test_unfinished_run_resumes_from_its_checkpoint(compared):
  workdir, config_path, _ = compared
  run_dir = _run_dir(workdir, "diff_v1", 1)
  (run_dir / "DONE").unlink()  # as if killed after its last checkpoint
  train_rows = [
    l for l in (run_dir / "metrics.jsonl").read_text().splitlines() if "train/loss" in l
  ]
  r = _cli(config_path, workdir)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "[4/4 diff_v1_seed1] resuming to step" in r.stdout, r.stdout
  assert "Resumed from step 6" in r.stdout
  assert (run_dir / "DONE").read_text().strip() == str(STEPS)
  after = [l for l in (run_dir / "metrics.jsonl").read_text().splitlines() if "train/loss" in l]
  assert after == train_rows, "the resumed run trained steps again"


def test_parallel_workers_train_what_the_serial_loop_trains(compared, tmp_path):
  workdir, config_path, _ = compared
  copy = tmp_path / "out"
  shutil.copytree(workdir, copy)
  redone = [_run_dir(copy, a, 1) for a in ARMS]
  for d in redone:
    shutil.rmtree(d)
  r = _cli(
    config_path,
    copy,
    "--config.workers=2",
    "--config.report.learned_below=100.0",
    "--config.report.learned_window=2",
  )
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert "2 runs at a time" in r.stdout, r.stdout
  for arm in ARMS:
    assert f"{arm}_seed1] done: train loss" in r.stdout, r.stdout
    assert f"{arm}_seed0 finished earlier" not in r.stdout  # skipped runs log to their file
    serial = _run_dir(workdir, arm, 1)
    parallel = _run_dir(copy, arm, 1)
    # Same config, data order and step function in a worker process: the same losses.
    assert _losses(parallel) == _losses(serial), arm
    assert _hashes(parallel) == _hashes(serial), arm
    assert "training to step" in (parallel / "output.log").read_text()
    ev_serial = json.loads((serial / "eval.json").read_text())["scalars"]
    ev_parallel = json.loads((parallel / "eval.json").read_text())["scalars"]
    assert ev_parallel.keys() == ev_serial.keys()
    for k, v in ev_serial.items():
      assert ev_parallel[k] == pytest.approx(v, rel=1e-5, abs=1e-6, nan_ok=True), (arm, k)
  results = json.loads((copy / "results.json").read_text())
  assert [r["name"] for r in results["runs"]] == [f"{a}_seed{s}" for s in SEEDS for a in ARMS]
  # Every loss is below 100, so each run "learned" at its first full 2-step window.
  assert all(
    r["scalars"]["train/steps_to_learn"] == 2.0 and r["scalars"]["train/learned"] == 1.0
    for r in results["runs"]
  )
  assert "train/steps_to_learn" in (copy / "report.md").read_text()
  assert results["data_check"]["ok"] is True


def test_sigterm_stops_parallel_workers_after_they_save(tmp_path):
  config_path = tmp_path / "long.py"
  config_path.write_text(
    MINI_CONFIG.replace(f"= 32, 4, {STEPS}", "= 32, 4, 5000")
    .replace(f"decay_steps={STEPS}", "decay_steps=5000")
    .replace("seeds=(0, 1)", "seeds=(0,)")
  )
  workdir = tmp_path / "out"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "diffjax.compare",
      f"--config={config_path}",
      f"--workdir={workdir}",
      "--config.workers=2",
    ],
    cwd=REPO,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  metrics = [_run_dir(workdir, a, 0) / "metrics.jsonl" for a in ARMS]
  wait_until(
    lambda: all(m.exists() and m.stat().st_size > 0 for m in metrics),
    "both workers' first metrics",
    procs=[proc],
  )
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=WAIT_LIMIT_S)
  assert proc.returncode == 75, out[-3000:] + err[-3000:]
  assert "rerun the same command to continue" in err
  for arm in ARMS:
    d = _run_dir(workdir, arm, 0)
    saved = [int(n) for n in os.listdir(d / "checkpoints") if n.isdigit()]
    assert saved and 0 < max(saved) < 5000, (arm, saved)  # saved on the signal, not finished
    assert not (d / "DONE").exists()
    assert f"saved step {max(saved)}; rerun" in (d / "output.log").read_text()


@pytest.mark.slow  # the serial loop's own error lines run by default
def test_a_failing_parallel_run_gives_its_own_error_line(compared, tmp_path):
  workdir, config_path, _ = compared
  copy = tmp_path / "out"
  shutil.copytree(workdir, copy)
  # It resumes, from checkpoints whose state is gone: each is moved aside, then no step is left.
  run_dir = _run_dir(copy, "diff_v1", 1)
  (run_dir / "DONE").unlink()
  for step in (run_dir / "checkpoints").iterdir():
    if step.name.isdigit():
      shutil.rmtree(step / "state")
  r = _cli(config_path, copy, "--config.workers=2")
  assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("error:") and "No usable checkpoint" in last, r.stderr[-3000:]
  assert "diff_v1_seed1] failed" in r.stdout, r.stdout
  # Nothing is reported from a comparison that did not finish: the old report stays.
  assert (copy / "results.json").read_text() == (workdir / "results.json").read_text()


def test_batch_mismatch_is_reported_loudly(compared, tmp_path):
  workdir, config_path, _ = compared
  copy = tmp_path / "out"
  shutil.copytree(workdir, copy)
  metrics = _run_dir(copy, "diff_v1", 0) / "metrics.jsonl"
  rows = [json.loads(line) for line in metrics.read_text().splitlines()]
  for row in rows:
    if row["step"] == 3 and "data/batch_hash" in row:
      row["data/batch_hash"] += 1.0  # as if diff_v1 had drawn another batch at step 3
  metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
  r = _cli(config_path, copy)
  assert r.returncode == 1, r.stderr[-3000:]
  assert "DATA MISMATCH" in r.stdout and "seed 0: diff_v1 saw different batches" in r.stdout
  assert r.stderr.strip().splitlines()[-1].startswith("error: the arms did not see the same")
  report = (copy / "report.md").read_text()
  assert "## WARNING: the arms did not see the same data" in report
  assert report.index("WARNING") < report.index("## Comparison summary")
  results = json.loads((copy / "results.json").read_text())
  assert results["data_check"]["ok"] is False
  assert results["data_check"]["per_seed"]["1"]["match"] is True


def test_run_configs_differ_only_in_the_arm_and_seed():
  base = base_config()
  base.model.update(dict(arm="transformer", size="tiny"))
  config = compare.check_comparison_config(compare.comparison_config(base, seeds=(3, 4)))
  assert config.v2_match == "params"  # the one default
  runs = {arm: compare.run_config(config, arm, 4) for arm in compare.ARMS}
  for arm, run in runs.items():
    assert run.model.arm == arm and run.seed == 4 and run.log_batch_hash
    rest = {k: v for k, v in run.to_dict().items() if k != "model"}
    ref = {k: v for k, v in runs["transformer"].to_dict().items() if k != "model"}
    assert rest == ref, arm
    model = {k: v for k, v in run.model.to_dict().items() if k != "arm"}
    assert model == {k: v for k, v in base.model.to_dict().items() if k != "arm"}, arm
    assert resolve_model(run.model.to_dict()).matched, arm
  assert config.base.seed == 0 and base.seed == 0, "run_config must not change the base config"


def test_the_typed_config_gives_back_the_config_it_was_resolved_from():
  # comparison_config() is generated from ComparisonConfig: a resolved config file gives back
  # its ConfigDict, and the JSON a comparison writes is the file's.
  for name in ("tiny", "retrieval_cpu", "lr_stability_cpu"):
    c = load_config(f"{REPO}/configs/compare/{name}.py")
    typed = compare.check_comparison_config(c)
    assert json.loads(typed.to_json()) == json.loads(c.to_json_best_effort()), name
    if name != "lr_stability_cpu":  # it sets sweep-report keys at their defaults
      again = typed.to_config_dict().to_json_best_effort()
      assert json.loads(again) == json.loads(c.to_json_best_effort()), name
  assert compare.check_comparison_config(typed) is typed
  assert (typed.report.spike_factor, typed.report.also_against) == (3.0, ("diff_v2",))
  assert typed.variants["diff_v2_no_sigmoid"].model == {"v2_lambda": "identity"}


@pytest.mark.parametrize(
  "edit,needle",
  [
    (
      lambda c: c.report.update(dict(learned_windows=5)),
      "report.learned_windows is not a comparison config key; did you mean report.learned_window?",
    ),
    (
      lambda c: c.update(dict(worker=2)),
      "worker is not a comparison config key; did you mean workers?",
    ),
    (lambda c: c.variants.update(dict(x=dict(arm="diff_v2", modle={}))), "variants.x.modle"),
  ],
)
def test_a_key_the_comparison_does_not_have_is_named(edit, needle):
  c = load_config(f"{REPO}/configs/compare/tiny.py")
  edit(c)
  with pytest.raises(ValueError) as e:
    compare.check_comparison_config(c)
  assert needle in str(e.value), str(e.value)


def test_a_comparison_built_in_code_is_checked_too():
  base = load_config(f"{REPO}/configs/compare/tiny.py").base
  with pytest.raises(ValueError, match="allow_divergence='yes' must be True or False"):
    compare.ComparisonConfig(base=base, allow_divergence="yes")
  with pytest.raises(ValueError, match="report.confidence=1.5 must be in"):
    compare.ComparisonConfig(base=base, report=dict(confidence=1.5))
  with pytest.raises(
    ValueError, match=r"report.baseline='diff_v9' is no arm; choose from \['transformer'"
  ):
    compare.ComparisonConfig(base=base, report=dict(baseline="diff_v9"))
  with pytest.raises(ValueError, match="report.also_against='nope' is no arm"):
    compare.ComparisonConfig(base=base, report=dict(also_against=("diff_v1", "nope")))
  config = compare.ComparisonConfig(base=base, arms="transformer,diff_v1", seeds=3)
  assert (config.arms, config.seeds, config.workers) == (("transformer", "diff_v1"), (3,), 1)
  # Without a file to give back, its JSON is that of the ConfigDict it stands for.
  assert config.to_json() == config.to_config_dict().to_json_best_effort()
  assert json.loads(config.to_json())["report"] == json.loads(
    compare.comparison_config(base).report.to_json_best_effort()
  )


def test_paper_3b_runs_are_the_paper_config_with_each_arm():
  # The corpus is named at launch; the same paths on both sides.
  data = dict(paths=("/data/prepared",), tokenizer="tokenizer.json")
  config = load_config(f"{REPO}/configs/compare/paper_3b.py")
  config.base.data.update(data)
  config = compare.check_comparison_config(config)
  for arm in compare.ARMS:
    want = load_config(f"{REPO}/configs/paper_3b.py")
    want.data.update(data)
    want.model.arm, want.seed, want.log_batch_hash = arm, 7, True
    assert compare.run_config(config, arm, 7).to_dict() == want.to_dict(), arm


def test_retrieval_config_is_valid_matched_and_queries_one_key():
  config = compare.check_comparison_config(load_config(f"{REPO}/configs/compare/retrieval_cpu.py"))
  assert len(config.seeds) >= 3 and config.base.model.v2_match == "params"
  from diffjax.model import count_params

  counts = {}
  for arm in compare.ARMS:
    run = compare.run_config(config, arm, 0)
    counts[arm] = count_params(resolve_model(run.model.to_dict()).config)
    mix = run.task_mix
    assert (mix.fraction, mix.loss, mix.num_queries, mix.separator) == (1.0, "answers", 1, "")
  assert abs(counts["diff_v2"] / counts["transformer"] - 1) <= 0.005, counts
  ev = compare.eval_config(
    config.eval, RunConfig.from_config(compare.run_config(config, "transformer", 0))
  )
  assert ev.probe_task == "mqar" and ev.mqar["separator"] == ""
  cells = [(c["num_pairs"], c["distractors_per_query"]) for c in ev.mqar_grid]
  # The trained setting, near-duplicate distractors and longer contexts; one key asked each,
  # so a value picked without matching its key scores at most 1 / (values present).
  assert (2, 0) in cells and any(d > 0 for _, d in cells) and max(p for p, _ in cells) >= 8
  assert all(c["num_queries"] == 1 for c in ev.mqar_grid)


def test_check_batches_reports_mismatch_and_missing_hashes():
  same = {s: 100 + s for s in range(1, 5)}
  hashes = {
    ("transformer", 0): same,
    ("diff_v1", 0): {**same, 3: 999},
    ("transformer", 1): {s: 200 + s for s in range(1, 5)},
    ("diff_v1", 1): {s: 200 + s for s in range(1, 4)},
  }
  check = compare.check_batches(hashes, ["transformer", "diff_v1"], [0, 1], 4)
  assert not check["ok"]
  assert check["per_seed"] == {
    "0": {"match": False, "steps_compared": 4},
    "1": {"match": False, "steps_compared": 4},
  }
  assert any("seed 0" in p and "diff_v1" in p and "step 3" in p for p in check["problems"])
  assert any("seed 1" in p and "no batch hash" in p and "step 4" in p for p in check["problems"])
  good = {k: v for k, v in hashes.items() if k[1] == 0}
  good[("diff_v1", 0)] = same
  check = compare.check_batches(good, ["transformer", "diff_v1"], [0], 4)
  assert check["ok"] and not check["problems"]


@pytest.mark.parametrize(
  "override,needle",
  [
    ("--config.arms=('transformer', 'gpt')", "unknown arm(s) ['gpt']"),
    ("--config.arms=()", "arms is empty"),
    ("--config.seeds=()", "seeds is empty"),
    ("--config.seeds=(0, 0)", "repeats a seed"),
    ("--config.eval.mode=fast", "eval.mode='fast'"),
    ("--config.workers=0", "workers=0 must be a positive integer"),
    ("--config.base.model.attention=diff_v1", "a run's arm is --config.base.model.arm="),
    (
      "--config.eval.overrides.val_batches=2",
      "eval.overrides is empty, so a flag cannot add 'val_batches' to it; set it whole, e.g. "
      "--config.eval.overrides=\"{'val_batches': <value>}\"",
    ),
  ],
)
def test_bad_config_one_error_line(tmp_path, capsys, override, needle):
  workdir = tmp_path / "wd"
  code = compare.main(
    ["compare", f"--config={REPO}/configs/compare/tiny.py", f"--workdir={workdir}", override]
  )
  err = capsys.readouterr().err
  assert code == 2, err
  lines = [l for l in err.splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and needle.lower() in lines[0].lower(), err
  assert not workdir.exists(), "nothing may be written for a bad config"


def test_a_run_stopped_by_a_signal_exits_with_the_preempted_status(tmp_path, monkeypatch, capsys):
  # As train.py: 75 tells a scheduler "saved, rerun to continue", distinct from done (0).
  from diffjax.compare import command

  def stopped(config, workdir):
    raise compare.ComparisonStopped("transformer_seed0 stopped at step 3 by a signal")

  monkeypatch.setattr(command, "run_comparison", stopped)
  code = compare.main(
    ["compare", f"--config={REPO}/configs/compare/tiny.py", f"--workdir={tmp_path / 'wd'}"]
  )
  assert code == 75
  assert "rerun the same command to continue" in capsys.readouterr().err


def test_help_prints_usage_and_exits_zero(capsys):
  assert compare.main(["compare", "--help"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("usage: python -m diffjax.compare --config=") and "--workdir" in out


def test_module_entry_point_reports_unknown_arm(tmp_path):
  r = _cli(
    f"{REPO}/configs/compare/tiny.py", tmp_path / "wd", "--config.arms=gpt", timeout=WAIT_LIMIT_S
  )
  assert r.returncode == 2
  assert r.stderr.strip().splitlines()[-1].startswith("error: Unknown arm(s) ['gpt']"), r.stderr


def test_v2_matched_by_params_differs_only_in_ffn_width():
  from diffjax.model import ModelConfig, count_params, matched_configs  # pylint: disable=import-outside-toplevel
  from diffjax.model.sizes import size_widths  # pylint: disable=import-outside-toplevel

  for size, vocab in (
    ("tiny", 258),
    ("small", 258),
    ("350m", 258),
    ("3b", 100288),
    ("830m", 100288),
  ):
    base = ModelConfig(attention="transformer", vocab_size=vocab, **size_widths(size))
    by_heads = matched_configs(base, v2_match="heads")
    by_params = matched_configs(base, v2_match="params")
    assert by_params == matched_configs(base)  # "params" is the default
    assert by_params["transformer"] == by_heads["transformer"] == base
    assert by_params["diff_v1"] == by_heads["diff_v1"]
    v2 = by_params["diff_v2"]
    assert v2.mlp_dim < base.mlp_dim, size
    assert v2.replace(mlp_dim=base.mlp_dim) == by_heads["diff_v2"], size
    n_base, n_v2 = count_params(base), count_params(v2)
    assert abs(n_v2 - n_base) <= 0.005 * n_base, (size, n_base, n_v2)
    # "heads" matching leaves V2 larger by E·h·d + E·h per layer.
    e, h, d = base.d_model, base.num_heads, base.head_dim
    assert count_params(by_heads["diff_v2"]) - n_base == base.num_layers * (e * h * d + e * h)
  with pytest.raises(ValueError, match="v2_match"):
    matched_configs(base, v2_match="flops")
  tiny_ffn = ModelConfig(
    attention="transformer", vocab_size=258, **{**size_widths("tiny"), "mlp_dim": 8}
  )
  with pytest.raises(ValueError, match="mlp_dim=8"):
    matched_configs(tiny_ffn, v2_match="params")


def test_summary_names_what_the_runs_trained_on():
  from diffjax.compare.summary import _data_phrase

  base = base_config()
  assert _data_phrase(RunConfig.from_config(base)) == f"`{base.data.kind}` data"
  base.task_mix.update(dict(task="associative_recall", fraction=0.25))
  assert _data_phrase(RunConfig.from_config(base)) == (
    f"`{base.data.kind}` data with 25% of the tokens from `associative_recall` examples"
  )
  base.task_mix.update(dict(fraction=1.0, num_examples=20_000, loss="answers"))
  assert _data_phrase(RunConfig.from_config(base)) == (
    "`associative_recall` task examples alone (20,000 examples, "
    "only the answer tokens scored; no corpus text)"
  )


def test_steps_to_learn_is_the_first_window_below_the_threshold():
  from diffjax.compare.runs import steps_to_learn

  losses = [0.7] * 10 + [0.2] * 10  # steps 1..20
  rows = [{"step": i + 1, "train/loss": v} for i, v in enumerate(losses)]
  # Window 4: the mean of steps 10-13 is 0.325, the first below; of steps 9-12, 0.45.
  assert steps_to_learn(rows, 0.35, 4) == 13.0
  assert steps_to_learn(rows, 0.35, 1) == 11.0
  assert math.isnan(steps_to_learn(rows, 0.1, 4))  # never
  assert math.isnan(steps_to_learn(rows[:2], 0.9, 4))  # too few steps for one window
