"""Awkward inputs on the data side: file names with glob characters, one file named twice, JSONL
values that are not text, unreadable tokenizer files, a data cache that is a file, inputs that
changed under a preparation, and what the errors name."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest

from diffjax.data import DataConfig, build_datasets, resolve_paths, train_tokenizer
from diffjax.data import corpus as corpus_lib
from diffjax.data.manifest import read_manifest
from diffjax.data.prepare import prepare
from diffjax.data.raw import Unit, iter_documents
from diffjax.data.shards import shard_documents
from diffjax.data.tokenizers import load_tokenizer


def _folder(tmp_path, names):
  folder = tmp_path / "corpus"
  folder.mkdir()
  for name in names:
    (folder / name).write_text(f"the document called {name}\n" * 20)
  return folder


def _texts(manifest_dir) -> list[str]:
  m = read_manifest(manifest_dir)
  return [bytes(d.astype(np.uint8)).decode() for s in m.shards for d in shard_documents(s.path)]


def test_file_names_with_glob_characters_are_one_document_each(tmp_path, monkeypatch):
  monkeypatch.setenv(corpus_lib.CACHE_ENV, str(tmp_path / "cache"))
  names = ["d1.txt", "d2.txt", "d3.txt", "d*.txt", "notes[draft].txt", "q?.txt"]
  folder = _folder(tmp_path, names)
  cfg = DataConfig(kind="text", paths=(str(folder),), val_fraction=0.0)
  data = build_datasets(cfg, seq_len=16, global_batch_size=2, seed=0)
  # Each file once: the cache's preparation takes the files found as named, not as patterns.
  assert data.corpus.num_documents == len(names)
  texts = _texts(data.corpus.manifest.directory)
  assert sorted(t.split("\n")[0].rsplit(" ", 1)[1] for t in texts) == sorted(names)
  # A glob that matches nothing names the file of that name.
  assert resolve_paths([str(folder / "notes[draft].txt")]) == [str(folder / "notes[draft].txt")]
  assert resolve_paths([glob.escape(str(folder / "d*.txt"))]) == [str(folder / "d*.txt")]
  assert len(resolve_paths([str(folder / "d*.txt")])) == 4  # a pattern is still a pattern


def test_a_file_named_twice_is_one_document_at_its_first_place(tmp_path, monkeypatch):
  folder = _folder(tmp_path, ["a.txt", "b.txt", "c.txt"])
  os.symlink(folder / "b.txt", tmp_path / "link.txt")
  monkeypatch.chdir(tmp_path)
  spellings = [
    str(folder / "*.txt"),
    f"{folder}/./",
    f"{tmp_path}//corpus/../corpus/a.txt",
    "corpus/c.txt",
    str(tmp_path / "link.txt"),
  ]
  files = resolve_paths(spellings)
  assert files == [str(folder / n) for n in ("a.txt", "b.txt", "c.txt")]
  out = prepare(spellings, str(tmp_path / "p"), progress=False)
  assert read_manifest(out).num_documents == 3


def test_a_changed_corpus_gets_another_identity(tmp_path, monkeypatch):
  monkeypatch.setenv(corpus_lib.CACHE_ENV, str(tmp_path / "cache"))
  folder = _folder(tmp_path, [f"f{i}.txt" for i in range(6)])
  cfg = DataConfig(kind="text", paths=(str(folder),), val_fraction=0.0)

  def identity():
    return build_datasets(cfg, seq_len=16, global_batch_size=2, seed=0).identity()

  first = identity()
  assert first == identity()  # the same files: the same identity
  moved = tmp_path / "moved"
  os.rename(folder, moved)
  cfg = DataConfig(kind="text", paths=(str(moved),), val_fraction=0.0)
  assert identity() == first  # another path, the same corpus
  (moved / "f3.txt").write_text((moved / "f3.txt").read_text().upper())  # same length
  changed = identity()
  assert changed["tokens"] == first["tokens"] and changed["sha256"] != first["sha256"]


def _jsonl_unit(tmp_path, raw: bytes):
  path = tmp_path / "docs.jsonl"
  path.write_bytes(raw)
  return str(path), Unit(0, "jsonl", (str(path),))


def test_jsonl_null_is_an_empty_document_and_other_values_are_refused(tmp_path):
  lines = [{"text": "one"}, {"text": None}, {"text": "two"}]
  path, unit = _jsonl_unit(tmp_path, "".join(json.dumps(x) + "\n" for x in lines).encode())
  assert list(iter_documents(unit)) == ["one", "", "two"]
  out = prepare([path], str(tmp_path / "p"), progress=False)
  assert _texts(out) == ["one", "two"]  # the null dropped, as an empty Parquet row is
  for value in (["x", "y"], {"a": 1}, 7):
    _, unit = _jsonl_unit(
      tmp_path, (json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": value})).encode()
    )
    with pytest.raises(ValueError, match=r"docs\.jsonl:2: the 'text' field is a "):
      list(iter_documents(unit))


def test_jsonl_encoding_errors_name_the_line_and_a_byte_order_mark_is_read(tmp_path):
  _, unit = _jsonl_unit(tmp_path, b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
  with pytest.raises(ValueError, match=r"docs\.jsonl:2: not UTF-8 .*convert the file"):
    list(iter_documents(unit))
  _, unit = _jsonl_unit(tmp_path, b'\xef\xbb\xbf{"text": "with a mark"}\n')
  assert list(iter_documents(unit)) == ["with a mark"]
  _, unit = _jsonl_unit(tmp_path, b'{"body": "x"}\n')
  with pytest.raises(ValueError, match=r"--text_field=<name>.*data.kind='prepared'"):
    list(iter_documents(unit))


def test_a_lone_surrogate_escape_in_jsonl_is_read_as_the_replacement_character(tmp_path):
  """Scraped JSONL may hold "\\ud800" without its pair: no character, so no UTF-8; a pair stays
  the character it spells."""
  raw = b'{"text": "bad \\ud800 x"}\n{"text": "pair \\ud83d\\ude00"}\n'
  path, unit = _jsonl_unit(tmp_path, raw)
  assert list(iter_documents(unit)) == ["bad \ufffd x", "pair \U0001f600"]
  assert _texts(prepare([path], str(tmp_path / "p"), progress=False)) == [
    "bad \ufffd x",
    "pair \U0001f600",
  ]


@pytest.mark.parametrize("name", ["tokenizer.json", "spm.model"])
def test_an_unreadable_tokenizer_file_is_a_one_line_error_naming_it(tmp_path, name):
  pytest.importorskip("tokenizers" if name.endswith(".json") else "sentencepiece")
  path = tmp_path / name
  path.write_bytes(b"\x00not a tokenizer at all\xff" * 4)
  with pytest.raises(ValueError, match=rf"'{path}' cannot be read .*damaged or of another kind"):
    load_tokenizer(str(path))


def test_a_data_cache_that_is_a_file_is_named(tmp_path, monkeypatch):
  afile = tmp_path / "cache"
  afile.write_text("")
  monkeypatch.setenv(corpus_lib.CACHE_ENV, str(afile))
  with pytest.raises(NotADirectoryError, match=r"DIFFJAX_DATA_CACHE at a directory"):
    build_datasets(DataConfig(), seq_len=16, global_batch_size=2, seed=0)


def test_a_rerun_of_prepare_on_changed_inputs_is_refused(tmp_path):
  folder = _folder(tmp_path, ["a.txt", "b.txt"])
  out = str(tmp_path / "p")
  prepare([str(folder)], out, progress=False)
  prepare([str(folder)], out, progress=False)  # unchanged: the same preparation
  (folder / "a.txt").write_text("edited")
  with pytest.raises(ValueError, match=r"as they were before .*delete it to prepare them again"):
    prepare([str(folder)], out, progress=False)
  # A plan written before file sizes and times were recorded is taken as it is.
  plan_path = os.path.join(out, "prepare_plan.json")
  plan = json.load(open(plan_path))
  del plan["file_stats"]
  json.dump(plan, open(plan_path, "w"))
  prepare([str(folder)], out, progress=False)


def test_train_tokenizer_refuses_an_output_it_cannot_write_before_training(tmp_path, capsys):
  folder = _folder(tmp_path, ["a.txt"])
  status = train_tokenizer.main(
    ["--input", str(folder), "--output", str(tmp_path / "missing" / "tok.json")]
  )
  assert status == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --output=") and "no directory" in err and err.count("\n") == 1


def test_a_corpus_too_small_is_named_by_its_paths(tmp_path, monkeypatch):
  monkeypatch.setenv(corpus_lib.CACHE_ENV, str(tmp_path / "cache"))
  folder = _folder(tmp_path, ["only.txt"])
  cfg = DataConfig(kind="text", paths=(str(folder),), val_fraction=0.0)
  with pytest.raises(ValueError, match=rf"Corpus '{folder}' has 1 training documents"):
    build_datasets(cfg, seq_len=16, global_batch_size=2, seed=0)


def test_a_missing_shard_is_named_with_what_to_do(tmp_path):
  folder = _folder(tmp_path, ["a.txt", "b.txt"])
  out = prepare([str(folder)], str(tmp_path / "p"), progress=False)
  shard = read_manifest(out).shards[0].path
  os.remove(shard)
  cfg = DataConfig(kind="prepared", paths=(str(tmp_path / "p"),), tokenizer="byte")
  with pytest.raises(FileNotFoundError, match=rf"token shard {shard} is missing .*prepare the"):
    build_datasets(cfg, seq_len=16, global_batch_size=1, seed=0)
