"""diffjax.eval.aggregate: which way each measure is better."""

from __future__ import annotations

import pytest

# flax warns about its own deprecated metadata names when models are built; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_directions_of_training_and_low_bit_measures():
  from diffjax.eval.aggregate import direction

  assert direction("lowbit/kv4/loss_increase") is False  # less added loss is better
  assert direction("lowbit/kv4/loss") is False and direction("lowbit/kv4/accuracy") is True
  assert direction("train/steps_to_learn") is False and direction("train/learned") is True
  assert direction("probe/map_correlation_mean") is None  # descriptive


def _run(arm, seed, loss, name):
  return {"arm": arm, "seed": seed, "name": name, "eval": {"scalars": {"val/loss": loss}}}


def test_two_runs_of_one_arm_and_seed_are_refused_naming_both():
  from diffjax.eval.aggregate import aggregate

  runs = [_run("transformer", 0, 3.0, "a.json"), _run("transformer", 0, 4.0, "b.json")]
  with pytest.raises(
    ValueError, match=r"'a.json' and 'b.json' are both transformer runs with seed 0"
  ):
    aggregate(runs)
  # The same seed in different arms pairs; runs without a seed are all kept and averaged.
  agg = aggregate(
    [_run("transformer", 0, 3.0, "a"), _run("diff_v1", 0, 2.0, "b")]
    + [_run("diff_v1", None, v, f"n{v}") for v in (1.0, 3.0)]
  )
  assert agg["per_arm"]["diff_v1"]["val/loss"]["n"] == 3
  assert agg["per_arm"]["diff_v1"]["val/loss"]["mean"] == pytest.approx(2.0)
  assert agg["paired"]["diff_v1"]["val/loss"]["n"] == 1


def test_the_report_command_refuses_a_repeated_seed_in_one_line(capsys, tmp_path):
  import json  # pylint: disable=import-outside-toplevel

  from diffjax.eval import report  # pylint: disable=import-outside-toplevel

  paths = []
  for name, loss in (("a", 3.0), ("b", 4.0)):
    path = tmp_path / f"{name}.json"
    meta = {"arm": "transformer", "seed": 0}
    path.write_text(json.dumps({"meta": meta, "scalars": {"val/loss": loss}, "sections": {}}))
    paths.append(str(path))
  assert report.main([*paths, "--out", str(tmp_path / "rep")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1, err
  assert paths[0] in err and paths[1] in err and "seed 0" in err
  assert not (tmp_path / "rep" / "report.md").exists()
