"""``python -m diffjax.eval`` speaks the shared command line: its flags, ``--config.<field>=``
for the EvalConfig fields, ``--help``, and one ``error:`` line with status 2 for a mistake
(before any checkpoint is read)."""

from __future__ import annotations

import pytest
from helpers import WAIT_LIMIT_S

from diffjax.eval import command
from diffjax.eval.config import EvalConfig


def _run(capsys, *argv) -> tuple[int, str, str]:
  status = command.main(list(argv))
  out = capsys.readouterr()
  return status, out.out, out.err


def test_help_lists_the_flags_and_the_fields(capsys):
  status, out, _ = _run(capsys, "--help")
  assert status == 0
  for flag in ("--workdir", "--out", "--step", "--quick", "--seq_len", "--seed", "--sections"):
    assert flag in out, flag
  assert "--config.<field>=<value>" in out and "samples_per_depth" in out
  assert "Configs shipped" not in out  # the command reads no config file


@pytest.mark.parametrize(
  "argv,wanted",
  [
    (
      ["--workdir=/nowhere", "--config.samples_per_dept=5"],
      "did you mean --config.samples_per_depth",
    ),
    (["--workdir=/nowhere", "--config.depths"], "--config.depths has no value"),
    (["--workdir=/nowhere", "--step=last"], "invalid command line"),
    (["--quick"], "--workdir is required"),
    (["--workdir=/nowhere", "extra"], "unexpected arguments ['extra']"),
    (
      ["--workdir=/nowhere", "--config.samples_per_depth=abc"],
      "--config.samples_per_depth='abc' must be of type int; e.g. --config.samples_per_depth=10",
    ),
    (["--workdir=/nowhere", "--config.heatmap_lengths=256"], "heatmap_lengths=256 must be"),
    (["--workdir=/nowhere", "--config.heatmap_samples=None"], "is not a directory"),
    (
      ["--workdir=/nowhere", "--sections=retrievl"],
      "unknown eval section 'retrievl'; did you mean 'retrieval'?",
    ),
    (["--workdir=/nowhere", "--config.options={'heatmapp': {}}"], "'heatmapp'"),
    (["--workdir=/nowhere"], "'/nowhere' is not a directory"),
  ],
)
def test_a_mistake_is_one_error_line_with_status_2(capsys, argv, wanted):
  status, _, err = _run(capsys, *argv)
  lines = [line for line in err.splitlines() if line.strip()]
  assert status == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
  assert wanted in lines[0], lines[0]


def test_field_values_are_python_literals_and_lists_become_tuples():
  from diffjax import cli  # pylint: disable=import-outside-toplevel

  fields = tuple(EvalConfig.__dataclass_fields__)
  got, error = cli.field_overrides(
    [
      "--config.needle_grid=[[1, 1], [2, 2]]",
      "--config.probe_task=mqar",
      "--config.samples_per_depth=3",
      "--config.mqar={'num_pairs': 4}",
    ],
    fields,
  )
  assert error is None
  assert got == {
    "needle_grid": ((1, 1), (2, 2)),
    "probe_task": "mqar",
    "samples_per_depth": 3,
    "mqar": {"num_pairs": 4},
  }
  EvalConfig.quick(64, **got)  # what the command builds from them


@pytest.mark.integration
def test_a_step_the_run_lacks_is_one_error_line_with_status_2(trained_run):
  """In a fresh process: the exit status and the whole stderr, not only the first line."""
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  from helpers import REPO, own_stderr  # pylint: disable=import-outside-toplevel

  wd = trained_run("diff_v1")
  r = subprocess.run(
    [sys.executable, "-m", "diffjax.eval", f"--workdir={wd}", "--step=7", "--quick"],
    capture_output=True,
    text=True,
    cwd=REPO,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    timeout=WAIT_LIMIT_S,
  )
  lines = [line for line in own_stderr(r.stderr) if line.strip()]
  assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-2000:])
  assert "step=7 is not among the checkpoints" in lines[0] and "[2]" in lines[0], lines[0]


def test_an_output_that_cannot_be_written_is_refused_before_the_evaluation(capsys, tmp_path):
  run = tmp_path / "run"  # no checkpoint: the --out check comes first
  run.mkdir()
  (tmp_path / "afile").write_text("")
  for out, wanted in (
    (tmp_path / "afile" / "x.json", "is a file, not a directory"),
    (run, "is a directory; name the JSON file"),
  ):
    status, _, err = _run(capsys, f"--workdir={run}", f"--out={out}")
    assert status == 2 and err.startswith("error: --out=") and wanted in err, err
    assert err.count("\n") == 1


def test_the_report_command_answers_bad_input_in_one_line(capsys, tmp_path):
  from diffjax.eval import report  # pylint: disable=import-outside-toplevel

  (tmp_path / "cut.json").write_text('{"meta": ')
  (tmp_path / "afile").write_text("")
  for argv, wanted in (
    ([str(tmp_path / "missing"), "--out", str(tmp_path / "r")], "neither a run directory"),
    ([str(tmp_path / "cut.json"), "--out", str(tmp_path / "r")], "is not whole JSON"),
    ([str(tmp_path), "--out", str(tmp_path / "afile")], "is a file; name a directory"),
  ):
    assert report.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and wanted in err and err.count("\n") == 1, err


def test_a_task_mix_run_is_scored_on_the_held_out_rows_of_its_mix():
  """The command's validation batches are the trainer's: the held-out share of the documents
  the run trained on (text with task examples mixed in), not of its text alone."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  from diffjax.data import DataConfig, build_datasets  # pylint: disable=import-outside-toplevel
  from diffjax.train.sections import TaskMixConfig  # pylint: disable=import-outside-toplevel
  from diffjax.train.task_mix import run_source  # pylint: disable=import-outside-toplevel

  data = {"kind": "stdlib", "max_documents": 60, "val_fraction": 0.2}
  mix = {"task": "associative_recall", "fraction": 0.5, "num_pairs": 4, "num_queries": 1}
  config = {"data": data, "task_mix": mix}
  got = command._val_batches(config, seq_len=64, batch_size=2, count=2, seed=3)

  data_cfg = DataConfig.from_dict(data)
  source, tokenizer = run_source(TaskMixConfig.from_config(mix), data_cfg, 3)
  kw = dict(seq_len=64, global_batch_size=2, seed=3)
  trainer = build_datasets(data_cfg, source=source, tokenizer=tokenizer, **kw).val_batches(2)
  text_alone = build_datasets(data_cfg, **kw).val_batches(2)
  tokens = lambda batches: np.stack([b["inputs"] for b in batches])
  assert np.array_equal(tokens(got), tokens(trainer))
  assert not np.array_equal(tokens(got), tokens(text_alone))
  # A run saved before task mixes existed (no task_mix key) is scored on its text.
  assert np.array_equal(
    tokens(command._val_batches({"data": data}, 64, 2, 2, 3)), tokens(text_alone)
  )


def test_a_context_too_short_for_the_needle_sections_is_one_error_line(
  capsys, tmp_path, monkeypatch, runners
):
  from diffjax.train import loading  # pylint: disable=import-outside-toplevel

  model = runners["transformer"].model
  monkeypatch.setattr(
    loading,
    "load_run",
    lambda workdir, step=None: loading.LoadedRun(model, model.config, {"seq_len": 48}, 1),
  )
  out = tmp_path / "eval.json"
  status, _, err = _run(capsys, f"--workdir={tmp_path}", f"--out={out}", "--sections=allocation")
  errors = [line for line in err.splitlines() if line.startswith("error: ")]
  assert status == 2 and len(errors) == 1 and err.rstrip().endswith(errors[0]), err
  assert "context_len=48 cannot hold even one needle" in errors[0] and "--sections" in errors[0]
  assert not out.exists()


@pytest.mark.parametrize(
  "field,value,wanted",
  [
    ("samples_per_depth", 0, "samples_per_depth=0 must be >= 1"),
    ("mqar_examples", 0, "mqar_examples=0 must be >= 1"),
    ("allocation_examples", 0, "allocation_examples=0 must be >= 1"),
    ("heatmap_samples", 0, "heatmap_samples=0 must be >= 1, or None"),
    ("batch_size", 0, "batch_size=0 must be >= 1"),
    ("capture_batch_size", 0, "capture_batch_size=0 must be >= 1"),
    ("probe_rows", 0, "probe_rows=0 must be >= 1"),
    ("val_batches", -1, "val_batches=-1 must be >= 0"),
  ],
)
def test_counts_a_section_cannot_run_with_are_refused(field, value, wanted):
  with pytest.raises(ValueError, match=wanted):
    EvalConfig.quick(256, **{field: value})
  # What may be zero: no validation batches, no salient keys; None heatmap samples.
  EvalConfig.quick(256, val_batches=0, corr_top_k=0, heatmap_samples=None)


def test_a_zero_count_override_is_one_error_line(capsys, tmp_path, monkeypatch, runners):
  from diffjax.train import loading  # pylint: disable=import-outside-toplevel

  model = runners["transformer"].model
  monkeypatch.setattr(
    loading,
    "load_run",
    lambda workdir, step=None: loading.LoadedRun(model, model.config, {"seq_len": 256}, 1),
  )
  status, _, err = _run(capsys, f"--workdir={tmp_path}", "--quick", "--config.samples_per_depth=0")
  assert status == 2 and err.startswith("error: bad --config override: samples_per_depth=0")
  assert err.count("\n") == 1, err
