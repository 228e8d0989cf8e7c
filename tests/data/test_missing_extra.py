"""A tokenizer file read without the ``[tokenizers]`` extra installed, or a ``gs://`` workdir
without the ``[gcs]`` extra: one ``error:`` line that names the extra to install, exit status 2,
in train.py and in generation; a ``gs://`` data path is refused naming the mount to use."""

import os
import subprocess
import sys

import pytest
from helpers import REPO, WAIT_LIMIT_S, own_stderr, tiny_config, write_bpe_tokenizer  # noqa: E402

from diffjax.errors import MissingExtra, import_extra


def _without_packages(argv, module=None, path=None, missing=("tokenizers", "sentencepiece")):
  """Runs ``argv`` as ``python <path>`` or ``python -m <module>`` in a fresh process in which
  the ``missing`` packages (``tokenizers`` and ``sentencepiece``) cannot be imported (as without
  the extra)."""
  runner = (
    f"runpy.run_path({path!r}, run_name='__main__')"
    if path
    else f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
  )
  code = (
    "import runpy, sys\n"
    + "".join(f"sys.modules[{m!r}] = None\n" for m in missing)
    + f"sys.argv = {[path or module, *argv]!r}\n"
    + runner
  )
  return subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    cwd=REPO,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    timeout=WAIT_LIMIT_S,
  )


def _one_error_line(r):
  lines = [line for line in own_stderr(r.stderr) if line.strip()]
  assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-3000:])
  assert lines[0].startswith("error: "), lines[0]
  return lines[0]


def test_import_extra_names_the_extra():
  assert import_extra("json", "tokenizers", "x").dumps(1) == "1"
  try:
    import_extra("diffjax_no_such_package", "tokenizers", "reading x.json")
    raise AssertionError("no error")
  except MissingExtra as e:
    assert "reading x.json needs the 'diffjax_no_such_package' package" in str(e)
    assert "pip install -e '.[tokenizers]'" in str(e)


def test_train_with_an_hf_tokenizer_and_no_extra_is_one_line(tmp_path):
  tok = tmp_path / "tok.json"
  write_bpe_tokenizer(tok)
  r = _without_packages(
    [
      f"--config={os.path.join(REPO, 'configs', 'tiny.py')}",
      f"--workdir={tmp_path / 'run'}",
      f"--config.data.tokenizer={tok}",
      "--config.data.max_documents=40",
    ],
    path=os.path.join(REPO, "train.py"),
  )
  line = _one_error_line(r)
  assert str(tok) in line and "[tokenizers]" in line, line
  assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow  # a fresh training process; the same path is checked by a default test
def test_generation_with_an_hf_tokenizer_and_no_extra_is_one_line(tmp_path):
  from diffjax.train import train_and_evaluate  # pylint: disable=import-outside-toplevel

  tok = tmp_path / "tok.json"
  write_bpe_tokenizer(tok)
  wd = tmp_path / "run"
  c = tiny_config(steps=2)
  c.data.tokenizer = str(tok)  # the run's own tokenizer: generation needs the extra to read it
  train_and_evaluate(c, str(wd))
  r = _without_packages(
    [f"--workdir={wd}", f"--tokenizer={tok}", "--prompt=hello", "--max_new_tokens=2"],
    module="diffjax.generation",
  )
  line = _one_error_line(r)
  assert str(tok) in line and "pip install -e '.[tokenizers]'" in line, line


def test_a_gs_workdir_without_the_gcs_extra_is_one_line_before_anything_is_written(tmp_path):
  r = _without_packages(
    [f"--config={os.path.join(REPO, 'configs', 'tiny.py')}", "--workdir=gs://no-bucket/run"],
    path=os.path.join(REPO, "train.py"),
    missing=("gcsfs",),
  )
  line = _one_error_line(r)
  assert "--workdir='gs://no-bucket/run'" in line and "pip install -e '.[gcs]'" in line, line


def test_the_checkpoint_directory_and_the_init_from_run_name_the_gcs_extra(monkeypatch):
  from diffjax.train import checkpoint as ckpt  # pylint: disable=import-outside-toplevel

  monkeypatch.setitem(sys.modules, "gcsfs", None)
  with pytest.raises(MissingExtra, match=r"the checkpoint directory='gs://b/run/checkpoints'"):
    ckpt.make_manager("gs://b/run/checkpoints", keep=1, async_save=False)


@pytest.mark.parametrize("kind", ["prepared", "text"])
def test_a_gs_data_path_is_refused_naming_a_mount(kind):
  from diffjax.data import DataConfig, build_datasets  # pylint: disable=import-outside-toplevel

  with pytest.raises(ValueError, match=r"'gs://b/prepared' is a cloud URI.*mount the bucket"):
    build_datasets(DataConfig(kind=kind, paths=("gs://b/prepared",)), 32, 2, 0)
