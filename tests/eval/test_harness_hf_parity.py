"""An exported run evaluated by lm-eval's own ``hf`` model (transformers on torch) scores every
request as the project's harness scores the run: the export carries the tokenizer, special ids
and context an evaluator needs, with no file added by hand.

Needs torch (its CPU build), transformers and accelerate beside the ``[harness]`` extra; slow.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval", reason="needs the [harness] extra")
for _module in ("torch", "transformers", "accelerate"):
  pytest.importorskip(_module, reason="lm-eval's hf model needs torch, transformers, accelerate")

from helpers import REPO, WAIT_LIMIT_S  # noqa: E402

from diffjax.convert.command import main as convert_main  # noqa: E402
from diffjax.eval.harness import command as harness_command  # noqa: E402

FIXTURES = os.path.join("tests", "fixtures", "harness")
TASKS = "diffjax_fixture_choice,diffjax_fixture_perplexity,diffjax_fixture_generate"
RTOL = 1e-5


def _samples(directory):
  out = {}
  for path in glob.glob(os.path.join(directory, "*", "samples_*.jsonl")):
    task = os.path.basename(path)[len("samples_") :].rsplit("_", 1)[0]
    with open(path, encoding="utf-8") as f:
      out[task] = {s["doc_id"]: s for s in map(json.loads, f)}
  return out


def _number(resp):
  return float(resp[0] if isinstance(resp, list) else resp)


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["transformer", "diff_v1", "diff_v2"])
def test_lm_eval_hf_on_the_export_equals_the_harness_on_the_run(
  arm, tmp_path, monkeypatch, trained_run
):
  monkeypatch.chdir(REPO)
  workdir, exported = trained_run(arm, small=True), str(tmp_path / "hf")
  assert convert_main(["export", f"--workdir={workdir}", f"--hf={exported}"]) == 0

  common = [f"--include_path={FIXTURES}", f"--tasks={TASKS}", "--log_samples", "--batch_size=4"]
  ours = harness_command.main(
    [f"--workdir={workdir}", f"--output_path={tmp_path / 'ours'}", "--bootstrap_iters=0", *common]
  )
  assert ours == 0
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "lm_eval",
      "--model=hf",
      # A DIFF V2 export carries its own modeling code.
      f"--model_args=pretrained={exported},dtype=float32"
      + (",trust_remote_code=True" if arm == "diff_v2" else ""),
      "--device=cpu",
      f"--output_path={tmp_path / 'theirs'}",
      *common,
    ],
    capture_output=True,
    text=True,
    cwd=REPO,
    env=dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="0"),
    timeout=WAIT_LIMIT_S,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  mine, theirs = _samples(tmp_path / "ours"), _samples(tmp_path / "theirs")
  assert set(mine) == set(theirs) == set(TASKS.split(","))
  compared, worst = 0, 0.0
  for task, docs in mine.items():
    assert docs.keys() == theirs[task].keys()
    for doc_id, sample in docs.items():
      other = theirs[task][doc_id]
      assert sample["arguments"] == other["arguments"], (task, doc_id)  # the same requests
      for a, b in zip(sample["resps"], other["resps"]):
        if task.endswith("generate"):
          assert a == b, (task, doc_id)  # the same greedy text
          continue
        x, y = _number(a[0]), _number(b[0])
        worst = max(worst, abs(x - y) / max(abs(y), 1.0))
        if isinstance(a[0], list):
          assert a[0][1] == b[0][1], (task, doc_id)  # greedy or not
        compared += 1
  assert compared == 22 and worst <= RTOL, (compared, worst)
