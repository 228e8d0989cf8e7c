"""The comparison's checks and report lines that need no training: what a config may not ask
(widths in a variant, seeds past what the trainer seeds with, a batch that does not split into
its micro-batches, a sweep that makes an integer key fractional), and what the reports say of
diverged runs, unmatched parameter counts and sweeps."""

import json
import math

import pytest
from helpers import REPO

from diffjax import compare
from diffjax.compare import sweep as sweep_lib
from diffjax.compare.config import sweep_points
from diffjax.compare.summary import _matching_line
from diffjax.model import count_params, resolve_model
from diffjax.presets import base_config

pytestmark = pytest.mark.filterwarnings(
  "ignore:the load_module\\(\\) method is deprecated:DeprecationWarning"
)

TINY = f"{REPO}/configs/compare/tiny.py"


def _config(**values):
  """A comparison of two one-layer arms, no evaluation; ``values`` set its keys."""
  base = base_config()
  base.model.update(
    dict(arm="transformer", size="tiny", d_model=64, num_layers=1, mlp_dim=128, head_dim=16)
  )
  base.seq_len, base.global_batch_size, base.num_steps = 32, 4, 6
  base.log_every, base.eval_every, base.eval_batches = 2, 3, 2
  base.optim.update(dict(warmup_steps=2, decay_steps=6))
  c = compare.comparison_config(base, seeds=(0, 1), arms=("transformer", "diff_v1"))
  c.eval.mode = "none"
  c.update(values)
  return c


def _error_line(tmp_path, capsys, *flags):
  """The status and the one ``error:`` line of the command on configs/compare/tiny.py."""
  workdir = tmp_path / "wd"
  code = compare.main(["compare", f"--config={TINY}", f"--workdir={workdir}", *flags])
  err = capsys.readouterr().err
  lines = [l for l in err.splitlines() if l.startswith("error:")]
  assert len(lines) == 1, err
  assert not workdir.exists(), "nothing may be written for a bad config"
  return code, lines[0]


# ---- what a config may not ask ---------------------------------------------------------------


@pytest.mark.parametrize("width", ["d_model", "num_layers", "mlp_dim", "num_kv_heads"])
def test_a_variant_cannot_set_a_width(width):
  """A width in a variant would match it to another Transformer than base's, while the report
  says the arms are matched."""
  c = _config()
  c.variants.wide = dict(arm="diff_v2", model={width: 128})
  with pytest.raises(ValueError) as e:
    compare.check_comparison_config(c)
  msg = str(e.value)
  assert f"variants.wide.model sets ['{width}']" in msg, msg
  assert "--config.model.unmatched.<width>" in msg and "diffjax.eval.report" in msg, msg


@pytest.mark.parametrize("seed", [2**32, 2**64])
def test_a_seed_the_weights_cannot_tell_apart_is_refused(tmp_path, capsys, seed):
  code, line = _error_line(tmp_path, capsys, f"--config.seeds=(0, {seed})", "--dry_run")
  assert code == 2 and f"must be below 2**32; got [{seed}]" in line, line
  assert compare.check_comparison_config(_config(seeds=(0, 2**32 - 1))).seeds == (0, 2**32 - 1)


def test_a_batch_that_does_not_split_into_micro_batches_is_refused_before_anything_is_written(
  tmp_path, capsys
):
  # configs/tiny.py trains batches of 16 sequences.
  code, line = _error_line(tmp_path, capsys, "--config.base.grad_accum_steps=3", "--dry_run")
  assert code == 2, line
  assert "global_batch_size=16 must be divisible by grad_accum_steps=3" in line, line
  assert compare.check_comparison_config(_config()).base.grad_accum_steps == 1
  ok = _config()
  ok.base.grad_accum_steps = 2
  compare.check_comparison_config(ok)


def test_a_scaled_integer_key_stays_an_integer_or_is_refused(tmp_path, capsys):
  c = _config()
  c.sweep.update(dict(key="num_steps", values=(3, 12), scaled=("optim.decay_steps",)))
  points = sweep_points(compare.check_comparison_config(c))
  steps = [(p.base.num_steps, p.base.optim.decay_steps) for _, _, p in points]
  assert steps == [(3, 3), (12, 12)] and all(isinstance(d, int) for _, d in steps), steps
  # A whole float is the integer; a fractional one is named.
  c.sweep.values = (3.0, 4)
  c.base.optim.decay_steps = 9  # 9 x 4 / 6 = 6, 9 x 3 / 6 = 4.5
  with pytest.raises(ValueError, match=r"optim.decay_steps scaled by num_steps=3 gives 4.5 to an"):
    compare.check_comparison_config(c)
  c.sweep.update(dict(values=(4, 8.5), scaled=()))
  with pytest.raises(ValueError, match=r"sweep.values: num_steps=8.5 gives 8.5 to an integer"):
    compare.check_comparison_config(c)
  # From the command line, --dry_run included: one line.
  flags = ("--config.sweep.key=num_steps", "--config.sweep.values=(250, 750)")
  scaled = "--config.sweep.scaled=('optim.decay_steps',)"
  code, line = _error_line(tmp_path, capsys, *flags, scaled, "--config.base.optim.decay_steps=501")
  assert code == 2 and "optim.decay_steps scaled by num_steps=250 gives 250.5" in line, line


def test_a_key_error_past_the_config_is_a_bug_not_a_config_key(tmp_path, monkeypatch):
  from diffjax.compare import command

  def broken(config, workdir):
    return {}["transformer"]

  monkeypatch.setattr(command, "run_comparison", broken)
  with pytest.raises(RuntimeError, match="missing key 'transformer'; this is a bug"):
    compare.main(["compare", f"--config={TINY}", f"--workdir={tmp_path / 'wd'}"])


# ---- what the reports say --------------------------------------------------------------------


def _run(arm, seed, params, eval_loss, diverged_at=None):
  """A run record as the comparison collects it (runs.collect_run), of 4 steps."""
  metrics = [
    {"step": k, "train/loss": 3.0 - 0.1 * k, "data/batch_hash": 100 * seed + k}
    for k in (1, 2, 3, 4)
  ]
  scalars = {"train/final_loss": 2.65, "train/skipped_updates": 0.0}
  final = {}
  if diverged_at is None:
    scalars["val/final_eval_loss"] = eval_loss
    final = {"step": 4, "train/loss": 2.6, "eval/loss": eval_loss}
  else:
    scalars.update({"val/final_eval_loss": float("nan"), "train/final_loss": float("nan")})
  return {
    "arm": arm,
    "seed": seed,
    "name": f"{arm}_seed{seed}",
    "workdir": f"runs/{arm}_seed{seed}",
    "step": diverged_at or 4,
    "params": params,
    "vocab_size": 258,
    "final_metrics": final,
    "diverged": None if diverged_at is None else {"step": diverged_at, "error": "non-finite"},
    "metrics": metrics,
    "eval": {"scalars": scalars},
    "eval_file": None,
    "train_seconds": 1.0,
    "eval_seconds": 0.0,
  }


def test_diverged_runs_are_counted_listed_and_recorded(tmp_path):
  config = compare.check_comparison_config(_config(allow_divergence=True))
  n = count_params(resolve_model(compare.run_config(config, "transformer", 0).model).config)
  runs = [
    _run("transformer", 0, n, 2.5),
    _run("diff_v1", 0, n, 2.4),
    _run("transformer", 1, n, 2.7),
    _run("diff_v1", 1, n, 2.0, diverged_at=3),
  ]
  check = compare.check_batches(
    {(r["arm"], r["seed"]): compare.batch_hashes(r["metrics"]) for r in runs},
    ["transformer", "diff_v1"],
    [0, 1],
    3,
  )
  results = compare.write_outputs(config, str(tmp_path), runs, check, {"total": 1.0})
  report = (tmp_path / "report.md").read_text()
  assert "| arm | params | seeds | diverged |" in report, report
  row = next(l for l in report.splitlines() if l.startswith("| diff_v1 | "))
  assert row.split(" | ")[3] == "1/2", row
  assert "**1 of 4 runs diverged**" in report
  assert "- diff_v1 seed 1: stopped on non-finite updates at step 3" in report
  # The means are over the runs that trained: diff_v1's eval loss is seed 0's alone.
  summary = results["summary"]["diff_v1"]
  assert summary["diverged"] == [1] and summary["val/final_eval_loss"]["n"] == 1
  assert summary["val/final_eval_loss"]["mean"] == pytest.approx(2.4)
  assert summary["train/final_loss"]["n"] == 1
  written = json.loads((tmp_path / "results.json").read_text())
  gone = {r["name"]: (r["diverged"], r["why"]) for r in written["runs"]}
  assert gone["diff_v1_seed1"] == (True, "stopped on non-finite updates at step 3")
  assert gone["transformer_seed0"] == (False, None)
  # Without a diverged run there is no such column.
  runs[-1] = _run("diff_v1", 1, n, 2.0)
  compare.write_outputs(config, str(tmp_path), runs, check, {"total": 1.0})
  summary = (tmp_path / "report.md").read_text().split("## Runs")[0]
  assert "| arm | params | seeds | train loss (last 2 steps) |" in summary
  assert "diverged" not in summary and "Not matched" not in summary, summary


def test_the_matching_line_names_an_arm_not_matched_by_parameters():
  config = compare.check_comparison_config(_config())
  model = compare.run_config(config, "transformer", 0).model.to_dict()
  ref = count_params(resolve_model(model, vocab_size=258).config)
  runs = [
    {"arm": "transformer", "params": ref, "vocab_size": 258},
    {"arm": "diff_v1", "params": ref + ref // 1000, "vocab_size": 258},
  ]
  line = _matching_line(config, runs)
  assert line.startswith("Arms matched to one Transformer") and "Not matched" not in line, line
  runs.append({"arm": "fat", "params": ref + ref // 5, "vocab_size": 258})
  line = _matching_line(config, runs)
  assert f"**Not matched by parameters**: fat +20.0% against the Transformer's {ref:,}" in line
  assert "diff_v1 +" not in line, line


# ---- the sweep report ------------------------------------------------------------------------


def test_the_sweep_report_gives_each_values_steps_and_pairs_only_arms_it_trained():
  c = _config(arms=("diff_v1", "diff_v2"))
  c.report.also_against = ("diff_v2",)
  c.sweep.update(dict(key="num_steps", values=(3, 8)))
  config = compare.check_comparison_config(c)
  s = sweep_lib._settings(config, [("num_steps=3", 3, []), ("num_steps=8", 8, [])])
  intro = " ".join(sweep_lib._introduction(config, s))
  assert "each run 3 / 8 (by value) steps x 4 x 32 tokens = 384 / 1,024 (by value)" in intro
  # The baseline (transformer) is not among the arms: only diff_v2 is a reference.
  rec = {"seed": 0, "final_eval_loss": 2.0, "diverged": False}
  cells = {arm: {"3": [rec], "8": [rec]} for arm in s.arms}
  paired = sweep_lib._paired(config.report, s, cells)
  assert list(paired) == ["diff_v2"] and list(paired["diff_v2"]) == ["diff_v1"], paired
  # A swept warm-up is each value's own.
  c.sweep.update(dict(key="optim.warmup_steps", values=(0, 4)))
  s = sweep_lib._settings(compare.check_comparison_config(c), [("a", 0, []), ("b", 4, [])])
  assert s.warmup == (0, 4) and s.warmup_at(4) == 4


def test_the_sweep_plot_draws_a_value_of_zero(tmp_path, monkeypatch):
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  drawn = []
  save = Figure.savefig
  monkeypatch.setattr(
    Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k))
  )
  cell = lambda mean: {"n": 1, "diverged": 0, "mean": mean, "min": mean, "max": mean}
  for values, scale in (([0.0, 0.1], "linear"), ([1e-3, 1e-2], "log")):
    table = {"transformer": {f"{v:g}": cell(2.0 + v) for v in values}}
    sweep_lib._plot(str(tmp_path), "optim.weight_decay", ["transformer"], values, table, math.nan)
    ax = drawn[-1].axes[0]
    assert ax.get_xscale() == scale, values
    xs = [x for line in ax.get_lines() for x in line.get_xdata()]
    assert sorted(set(xs)) == values, xs
