"""Comparison variants, divergence recording and sweeps: a miniature learning-rate sweep in
which one value diverges, counted in the report; the config checks; the report's measures."""

import dataclasses
import json
import math

import pytest
from helpers import REPO

from diffjax import compare
from diffjax.compare import sweep as sweep_lib
from diffjax.compare.config import describe_comparison, run_config, sweep_points
from diffjax.model import count_params, resolve_model
from diffjax.presets import base_config, load_config

pytestmark = [
  pytest.mark.integration,
  pytest.mark.filterwarnings(
    "ignore:the load_module\\(\\) method is deprecated:DeprecationWarning"
  ),
]


def _mini(values=(3e-3, 1e30), max_skipped=3):
  base = base_config()
  base.model.update(
    dict(
      arm="transformer",
      size="custom",
      d_model=32,
      num_layers=1,
      num_heads=4,
      num_kv_heads=2,
      head_dim=8,
      mlp_dim=64,
    )
  )
  base.seq_len, base.global_batch_size, base.num_steps = 32, 4, 6
  base.log_every, base.eval_every, base.eval_batches = 3, 0, 1
  base.tensorboard = False
  base.data.max_documents = 40
  # No warm-up: at 1e30 the first update leaves the weights near 1e30, every later update is
  # non-finite and skipped, and the fourth skip (more than 3) stops the run.
  base.optim.update(dict(lr=3e-3, min_lr=3e-4, warmup_steps=0, decay_steps=6))
  base.max_skipped_updates = max_skipped
  base.checkpoint.update(dict(every=6, keep=1, async_save=False))
  base.mesh.num_devices = 1  # as a train.py process on a CPU has
  c = compare.comparison_config(base, seeds=(0,), arms=("transformer", "v2_nosig"))
  c.variants.v2_nosig = dict(arm="diff_v2", model=dict(v2_lambda="identity"))
  c.allow_divergence = True
  c.sweep.update(dict(key="optim.lr", values=values, scaled=("optim.min_lr",)))
  c.eval.overrides = dict(val_batches=1, sections=("validation", "mechanisms"), mechanism_batches=1)
  c.report.spike_window = 3
  # Six steps do not get below the unigram baseline: only non-finite runs diverge here (the
  # unigram criteria have their own test below).
  c.report.divergence_above_unigram = False
  return c


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("sweep") / "out"
  results = compare.run_comparison(_mini(), str(workdir), log=lambda _m: None)
  return workdir, results


def test_a_diverged_value_is_recorded_counted_and_reported(swept):
  workdir, results = swept
  assert results["schema"] == sweep_lib.SCHEMA and results["key"] == "optim.lr"
  runs = {(r["point"], r["arm"]): r for r in results["runs"]}
  for arm in ("transformer", "v2_nosig"):
    ok, gone = runs[("lr=0.003", arm)], runs[("lr=1e+30", arm)]
    assert not ok["diverged"] and ok["skipped_updates"] == 0 and ok["step"] == 6
    assert math.isfinite(ok["final_eval_loss"])
    assert gone["diverged"] and "non-finite" in gone["why"]
    assert gone["skipped_updates"] == 4 and gone["final_eval_loss"] is None
    run_dir = workdir / "sweep" / "lr=1e+30" / "runs" / f"{arm}_seed0"
    marker = json.loads((run_dir / "DIVERGED").read_text())
    assert "max_skipped_updates=3" in marker["error"] and marker["step"] == 5
    assert not (run_dir / "eval.json").exists()
    # The stable run was evaluated with the mechanism measures.
    assert "mechanisms/sink_combined" in ok["mechanisms"]
    cell = results["table"][arm]
    assert cell["0.003"]["diverged"] == 0 and cell["1e+30"]["diverged"] == 1
    assert cell["1e+30"]["skipped_updates"] == 4
    assert results["verdict"][arm]["largest_stable"] == 3e-3
  assert results["data_check"]["ok"], results["data_check"]
  report = (workdir / "report.md").read_text()
  assert "**1/1 diverged**" in report and "1/1 · 4 ·" in report
  assert "stopped on non-finite updates" in report
  assert (workdir / "sweep_loss.png").stat().st_size > 0
  for name in ("lr=0.003", "lr=1e+30"):
    assert (workdir / "sweep" / name / "report.md").exists()


def test_a_rerun_skips_diverged_and_finished_runs(swept, capsys):
  workdir, _ = swept
  lines = []
  compare.run_comparison(_mini(), str(workdir), log=lines.append)
  assert sum("diverged earlier at step 5: skipping training" in l for l in lines) == 2
  assert sum("finished earlier at step 6" in l for l in lines) == 2


def test_a_sweep_of_the_steps_checks_each_values_own_and_pairs_only_arms_it_trained(tmp_path):
  """Each value's comparison checks the batches of its own steps (the base's 6 gave a false
  mismatch at 3), an integer key scaled with it stays an integer, and a sweep whose arms leave
  out report.baseline reports (it stopped on a missing reference after training)."""
  c = _mini()
  c.arms = ("v2_nosig",)
  c.sweep.update(dict(key="num_steps", values=(3, 6), scaled=("optim.decay_steps",)))
  c.eval.mode = "none"
  workdir = tmp_path / "out"
  results = compare.run_comparison(c, str(workdir), log=lambda _m: None)
  assert results["data_check"] == {"ok": True, "problems": []}, results["data_check"]
  assert results["paired"] == {}
  assert {(r["point"], r["step"]) for r in results["runs"]} == {
    ("num_steps=3", 3),
    ("num_steps=6", 6),
  }
  for steps in (3, 6):
    point = workdir / "sweep" / f"num_steps={steps}"
    check = json.loads((point / "results.json").read_text())["data_check"]
    assert check["ok"] and check["per_seed"]["0"]["steps_compared"] == steps, check
    written = json.loads((point / "compare_config.json").read_text())["base"]
    assert written["num_steps"] == written["optim"]["decay_steps"] == steps
  report = (workdir / "report.md").read_text()
  assert "each run 3 / 6 (by value) steps x 4 x 32 tokens" in report, report


def test_without_allow_divergence_a_diverging_run_stops_the_comparison(tmp_path):
  c = _mini(values=(1e30, 3e-3))
  c.allow_divergence = False
  from diffjax.train.trainer import TrainingError

  with pytest.raises(TrainingError, match="max_skipped_updates=3"):
    compare.run_comparison(c, str(tmp_path / "out"), log=lambda _m: None)


def test_sweep_points_set_the_key_and_scale_min_lr():
  points = sweep_points(compare.check_comparison_config(_mini(values=(1e-3, 3e-2))))
  assert [n for n, _, _ in points] == ["lr=0.001", "lr=0.03"]
  for _, value, cfg in points:
    assert cfg.base.optim.lr == value
    assert cfg.base.optim.min_lr == pytest.approx(value / 10)
    assert not cfg.sweep.key
    # A point's compare_config.json: the comparison's, at its base and without a sweep.
    written = json.loads(cfg.to_json())
    assert written["sweep"] == {"key": "", "values": [], "scaled": []}
    assert written["base"]["optim"]["lr"] == value and written["report"]["spike_window"] == 3
  plain = compare.check_comparison_config(compare.comparison_config(base_config()))
  assert sweep_points(plain) == [("", None, plain)]


def test_a_variant_changes_only_the_fields_it_names():
  c = compare.check_comparison_config(_mini())
  plain, variant = run_config(c, "transformer", 0), run_config(c, "v2_nosig", 0)
  assert variant.model.arm == "diff_v2" and variant.model.v2_lambda == "identity"
  v2 = run_config(c, "transformer", 0)
  v2.model.arm = "diff_v2"
  a, b = resolve_model(variant.model.to_dict()).config, resolve_model(v2.model.to_dict()).config
  assert a.replace(v2_lambda="sigmoid") == b and count_params(a) == count_params(b)
  assert plain.to_dict()["optim"] == variant.to_dict()["optim"]


@pytest.mark.parametrize(
  "edit,needle",
  [
    (lambda c: c.variants.update(dict(diff_v1=dict(arm="diff_v2"))), "cannot reuse an arm"),
    (lambda c: c.variants.update(dict(x=dict(arm="gpt"))), "variants.x.arm='gpt'"),
    (
      lambda c: c.variants.update(dict(x=dict(arm="diff_v2", model=dict(size="small")))),
      "a variant is matched as its arm",
    ),
    (lambda c: c.variants.v2_nosig.update(dict(model=dict(v2_lambda="tanh"))), "v2_lambda='tanh'"),
    (lambda c: c.sweep.update(dict(key="optim.learning_rate")), "sweep.key='optim.learning_rate'"),
    (lambda c: c.sweep.update(dict(values=())), "sweep.values is empty"),
    (lambda c: c.sweep.update(dict(values=(1e-3, 1e-3))), "repeats a value"),
    (lambda c: c.sweep.update(dict(scaled=("optim.floor",))), "'optim.floor'"),
    (lambda c: c.sweep.update(dict(values=(1e-3, -1.0))), "lr=-1"),
  ],
)
def test_bad_variants_and_sweeps_are_named(edit, needle):
  c = _mini()
  edit(c)
  with pytest.raises(ValueError, match=None) as e:
    compare.check_comparison_config(c)
  assert needle.lower() in str(e.value).lower(), str(e.value)


def test_spikes_and_unigram_divergence_follow_their_definitions():
  norms = [1.0] * 10 + [3.5, 1.0, 2.9, 1.0]
  rows = [{"step": i + 1, "train/grad_norm": g, "train/loss": 2.0} for i, g in enumerate(norms)]
  assert sweep_lib.spike_steps(rows, 3.0, 5) == [11]
  run = {"diverged": None, "eval": {"scalars": {"val/final_eval_loss": 2.0}}, "metrics": rows}
  assert sweep_lib.divergence(run, 3.0, 0, 4) is None
  high = [dict(r, **{"train/loss": 3.5 if 5 <= r["step"] <= 9 else 2.0}) for r in rows]
  why = sweep_lib.divergence(dict(run, metrics=high), 3.0, 0, 4)
  # Windows of 4 from step 4 on are below 3.0; steps 4-7 (2.0, 3.5, 3.5, 3.5) are the first
  # whose mean, 3.125, is back above it.
  assert why is not None and "back above the unigram baseline" in why and "3.125 at step 7" in why
  # A run still above the baseline when warm-up ends, that then trains, did not diverge: only
  # windows after warm-up count, and the first of them is above it (a slow start).
  assert sweep_lib.divergence(dict(run, metrics=high), 3.0, 4, 4) is None
  slow = [dict(r, **{"train/loss": 3.5 if r["step"] <= 6 else 2.0}) for r in rows]
  assert sweep_lib.divergence(dict(run, metrics=slow), 3.0, 0, 4) is None
  final_high = dict(run, eval={"scalars": {"val/final_eval_loss": 3.1}})
  assert "final loss" in sweep_lib.divergence(final_high, 3.0, 0, 4)


def test_lr_stability_config_is_valid_and_parameter_matched():
  config = compare.check_comparison_config(
    load_config(f"{REPO}/configs/compare/lr_stability_cpu.py")
  )
  assert len(config.seeds) >= 2 and 4 <= len(config.sweep.values) <= 6
  counts = {
    arm: count_params(resolve_model(run_config(config, arm, 0).model.to_dict()).config)
    for arm in config.arms
  }
  assert counts["diff_v2_cross_group"] == counts["diff_v2"] == counts["diff_v2_no_sigmoid"]
  for arm in ("diff_v1", "diff_v2"):
    assert abs(counts[arm] / counts["transformer"] - 1) <= 0.005, counts
  assert config.base.model.num_kv_heads >= 2  # so a V2 pair can straddle two groups


def test_the_definitions_name_the_unigram_criterion_only_when_it_counts():
  config = compare.check_comparison_config(
    load_config(f"{REPO}/configs/compare/lr_stability_cpu.py")
  )
  s = sweep_lib._Sweep(
    key="optim.lr", arms=["transformer"], values=[1e-3], baseline="transformer", factor=3.0,
    spike_window=50, div_window=20, warmup=(10,), unigram=3.25,
  )  # fmt: skip
  on = " ".join(sweep_lib._introduction(config, s))
  assert "above the unigram baseline (3.25 nats), or after warm-up" in on
  off = " ".join(sweep_lib._introduction(config, dataclasses.replace(s, unigram=float("nan"))))
  assert "above the unigram" not in off and "divergence_above_unigram` is off" in off
  # --dry_run names the swept values, not only the base's.
  shown = describe_comparison(config).splitlines()[1]
  assert shown.startswith(f"sweep of optim.lr over {len(config.sweep.values)} values (lr="), shown


def test_the_plot_keeps_arms_that_diverged_at_the_same_value_apart(tmp_path, monkeypatch):
  """Two arms diverge at the same two values (one of them on every seed): each arm's diverged
  markers are drawn at their own places, with the count of diverged seeds beside them."""
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  from matplotlib.collections import PathCollection  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  drawn = []
  save = Figure.savefig
  monkeypatch.setattr(
    Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k))
  )

  def cell(mean, diverged):
    return {"n": 3, "diverged": diverged, "mean": mean, "min": mean - 0.1, "max": mean + 0.1}

  nan = float("nan")
  values = [0.01, 0.1, 1.0]
  table = {
    "transformer": {"0.01": cell(2.0, 0), "0.1": cell(2.5, 2), "1": cell(nan, 3)},
    "diff_v2": {"0.01": cell(1.9, 0), "0.1": cell(nan, 3), "1": cell(nan, 3)},
    "diff_v1": {"0.01": cell(2.2, 0), "0.1": cell(2.6, 0), "1": cell(2.9, 0)},
  }
  assert sweep_lib._plot(str(tmp_path), "optim.lr", list(table), values, table, 3.2)
  assert (tmp_path / "sweep_loss.png").stat().st_size > 0
  (fig,) = drawn
  fig.canvas.draw()
  marks = []  # display positions of every diverged marker
  for ax in fig.axes:
    for coll in ax.collections:
      if isinstance(coll, PathCollection):
        marks += [tuple(p) for p in coll.get_offset_transform().transform(coll.get_offsets())]
  assert len(marks) == 4, marks  # two values for each of the two arms that diverged
  for i, a in enumerate(marks):
    for b in marks[i + 1 :]:
      assert abs(a[0] - b[0]) + abs(a[1] - b[1]) > 10, (a, b)  # apart by more than a marker
  texts = sorted(t.get_text() for ax in fig.axes for t in ax.texts)
  assert texts == ["2/3", "3/3", "3/3", "3/3"], texts
