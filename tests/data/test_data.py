"""The data pipeline: one streamed pipeline for every corpus, its windows by hand, streams per
row, one validation rule, exact resume, processes, the cache of the embedded corpus, bad input."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest

from diffjax.data import (
  AnswersOnly,
  AssociativeRecallTask,
  ByteTokenizer,
  DataConfig,
  HFTokenizer,
  ShardCorpus,
  build_datasets,
  resolve_paths,
  stdlib_files,
)
from diffjax.data import corpus as corpus_lib
from diffjax.data.manifest import read_manifest
from diffjax.data.prepare import prepare
from diffjax.data.shards import shard_documents
from diffjax.data.streaming import BATCH_KEYS, EpochOrder, doc_is_val

EOS = ByteTokenizer.eos_id


class ListSource:
  """An in-memory DocumentSource, as a synthetic task would provide."""

  def __init__(self, docs, name="list"):
    self.docs = [np.asarray(d, dtype=np.int32) for d in docs]
    self.name = name

  def __len__(self):
    return len(self.docs)

  def __getitem__(self, i):
    return self.docs[i]


def marked_docs(num_docs: int, seed: int = 0, max_len: int = 60) -> list[np.ndarray]:
  """Documents whose first token is a unique id (d < 200) and whose other tokens are >= 200."""
  rng = np.random.default_rng(seed)
  return [
    np.concatenate([[d % 200], rng.integers(200, 256, size=int(rng.integers(1, max_len)))]).astype(
      np.int32
    )
    for d in range(num_docs)
  ]


def build(docs, seq_len=16, batch=4, seed=0, **cfg):
  cfg.setdefault("val_fraction", 0.0)
  cfg.setdefault("prefetch_batches", 0)
  return build_datasets(
    DataConfig(**cfg), seq_len, batch, seed, source=ListSource(docs), tokenizer=ByteTokenizer()
  )


def take(iterator, n):
  return [next(iterator) for _ in range(n)]


def same(a, b) -> bool:
  return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def windows_by_hand(docs, seq_len):
  """The windows of one stream over ``docs`` in order, written out independently: the stream
  is each document followed by eos; window w covers stream[w*T : w*T + T + 1]."""
  stream, seg_of, pos_of, is_eos = [], [], [], []
  for i, d in enumerate(docs):
    for j, tok in enumerate(list(d) + [EOS]):
      stream.append(int(tok))
      seg_of.append(i)
      pos_of.append(j)
      is_eos.append(j == len(d))
  out = []
  for w in range((len(stream) - 1) // seq_len):
    lo = w * seq_len
    seg = np.array(seg_of[lo : lo + seq_len])
    pos = np.array(pos_of[lo : lo + seq_len])
    out.append(
      {
        "inputs": np.array(stream[lo : lo + seq_len], np.int32),
        "targets": np.array(stream[lo + 1 : lo + seq_len + 1], np.int32),
        "segment_ids": (seg - seg[0] + 1).astype(np.int32),
        # The running document counts from the window's first token.
        "positions": np.where(seg == seg[0], pos - pos[0], pos).astype(np.int32),
        "loss_mask": (~np.array(is_eos[lo : lo + seq_len])).astype(np.float32),
      }
    )
  return out


# --- windows and streams -----------------------------------------------------------------------


def test_one_stream_in_corpus_order_is_the_packed_stream_by_hand():
  docs = marked_docs(12, max_len=30)
  data = build(docs, seq_len=8, batch=1, shuffle=False, streams_per_row=1)
  want = windows_by_hand(docs, 8)
  got = take(data.train_iter, len(want))
  for w, (a, b) in enumerate(zip(got, want)):
    for k in BATCH_KEYS:
      assert a[k].dtype == b[k].dtype and np.array_equal(a[k][0], b[k]), (w, k)


def test_each_row_takes_its_streams_in_turn():
  """Row r's window at batch n is the next window of stream n mod S, the lane over the
  documents at epoch positions r + B s, r + B s + B S, ..."""
  docs = marked_docs(60, max_len=40)
  b, s, t = 2, 3, 8
  data = build(docs, seq_len=t, batch=b, shuffle=False, streams_per_row=s)
  assert data.streams_per_row == s
  batches = take(data.train_iter, 30)
  for r in range(b):
    for k in range(s):
      lane_docs = [docs[i] for i in range(r + b * k, len(docs), b * s)]
      want = windows_by_hand(lane_docs, t)
      got = [batches[n][key][r] for n in range(k, 30, s) for key in ("inputs",)]
      for n, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g, w["inputs"]), (r, k, n)


def test_streams_are_lowered_when_the_split_has_too_few_documents():
  data = build(marked_docs(20), batch=4, streams_per_row=16)
  assert data.streams_per_row == 5  # 20 training documents, 4 rows
  with pytest.raises(ValueError, match="3 training documents, fewer than global_batch_size=4"):
    build(marked_docs(3), batch=4)


def test_an_epoch_reads_every_training_document_once_and_never_a_validation_one():
  docs = marked_docs(200, max_len=12)  # first token of document d is d
  data = build(docs, seq_len=16, batch=4, val_fraction=0.1, streams_per_row=2)
  is_val = doc_is_val(np.arange(200), 0.1, 0)
  assert data.num_val_documents == int(is_val.sum()) >= 1
  assert data.num_train_documents + data.num_val_documents == 200

  def starts(batches):
    ids = []
    for bt in batches:
      x = bt["inputs"]
      first = np.concatenate([np.ones((x.shape[0], 1), bool), x[:, :-1] == EOS], axis=1)
      ids += x[first & (x < 200)].tolist()
    return ids

  # Enough batches for every lane to finish its first epoch.
  train = starts(take(data.train_iter, 120))
  assert set(train) == set(np.nonzero(~is_val)[0].tolist())
  val = starts(data.val_batches(4))
  assert val and set(val) <= set(np.nonzero(is_val)[0].tolist())


def test_validation_batches_ignore_the_seed_and_the_streams():
  docs = marked_docs(100)
  a = build(docs, val_fraction=0.2, seed=1).val_batches(3)
  b = build(docs, val_fraction=0.2, seed=7, streams_per_row=3).val_batches(3)
  assert all(same(x, y) for x, y in zip(a, b))
  assert len(build(docs, val_fraction=0.2).val_batches(50)) == 50  # cycles when it runs out


def test_same_seed_same_batches_other_seed_other_order():
  docs = marked_docs(60)
  first = take(build(docs, seed=1).train_iter, 6)
  assert all(same(x, y) for x, y in zip(first, take(build(docs, seed=1).train_iter, 6)))
  assert not all(same(x, y) for x, y in zip(first, take(build(docs, seed=2).train_iter, 6)))


def test_epoch_order_visits_every_document_once():
  order = EpochOrder(np.array([5, 0, 7, 3, 9]), seed=3, shuffle=True, shards_per_group=2)
  for epoch in (0, 1):
    ids = [order.doc_at(epoch, k) for k in range(order.total)]
    assert sorted(ids) == list(range(24))
    assert order.doc_at(epoch, order.total) is None
  assert [order.doc_at(0, k) for k in range(24)] != [order.doc_at(1, k) for k in range(24)]


# --- resume and processes ----------------------------------------------------------------------


@pytest.mark.parametrize("stop", [3, 40])  # mid-epoch; after lanes wrapped into later epochs
def test_resume_is_exact(stop):
  docs = marked_docs(40)
  straight = take(build(docs, seed=5, prefetch_batches=2).train_iter, stop + 6)
  it = build(docs, seed=5, prefetch_batches=2).train_iter
  take(it, stop)
  state = json.loads(json.dumps(it.get_state()))  # as grain writes it in a checkpoint
  if stop == 40:
    assert max(lane[0] for lane in state["lanes"]) >= 1, "the test must cross an epoch"
  fresh = build(docs, seed=5).new_train_iter()
  fresh.set_state(state)
  assert all(same(w, g) for w, g in zip(straight[stop:], take(fresh, 6)))


def test_resume_through_an_orbax_checkpoint(tmp_path):
  import grain  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  docs = marked_docs(40)
  data = build(docs, seed=3)
  take(data.train_iter, 5)
  checkpointer = ocp.Checkpointer(grain.checkpoint.CheckpointHandler())
  checkpointer.save(tmp_path / "ckpt", args=grain.checkpoint.CheckpointSave(data.train_iter))
  expected = take(data.train_iter, 3)
  fresh = build(docs, seed=3).new_train_iter()
  restored = checkpointer.restore(tmp_path / "ckpt", args=grain.checkpoint.CheckpointRestore(fresh))
  assert all(same(a, b) for a, b in zip(take(restored, 3), expected))


@pytest.mark.parametrize("count", [2, 4])
def test_processes_read_disjoint_rows_forming_the_global_batch(count):
  docs = marked_docs(80)
  kw = dict(source=ListSource(docs), tokenizer=ByteTokenizer())
  cfg = DataConfig(val_fraction=0.1, prefetch_batches=0, streams_per_row=2)
  whole = build_datasets(cfg, 16, 8, 0, **kw)
  parts = [build_datasets(cfg, 16, 8, 0, p, count, **kw) for p in range(count)]
  assert all(p.per_process_batch_size == 8 // count for p in parts)
  want = take(whole.train_iter, 9)
  got = [take(p.train_iter, 9) for p in parts]
  for b, w in enumerate(want):
    assert same(w, {k: np.concatenate([got[p][b][k] for p in range(count)]) for k in w})
  union = [np.concatenate([p.val_batches(2)[i]["inputs"] for p in parts]) for i in range(2)]
  assert np.array_equal(np.stack(union), np.stack([b["inputs"] for b in whole.val_batches(2)]))
  other = parts[0].new_train_iter()
  with pytest.raises(ValueError, match="same number of processes"):
    other.set_state(whole.train_iter.get_state())


# --- counts, caps, weights ---------------------------------------------------------------------


def test_unigram_entropy_matches_a_direct_computation():
  docs = marked_docs(100)
  data = build(docs, val_fraction=0.2)
  is_val = doc_is_val(np.arange(100), 0.2, 0)
  counts = np.ones(258)
  for d in np.nonzero(~is_val)[0]:
    np.add.at(counts, np.append(docs[d], EOS), 1)
  val_tokens = np.concatenate([np.append(docs[d], EOS) for d in np.nonzero(is_val)[0]])
  expected = -np.mean(np.log(counts[val_tokens] / counts.sum()))
  assert math.isclose(data.unigram_entropy_nats, expected, rel_tol=1e-9)
  assert math.isclose(data.unigram_entropy_bits, expected / math.log(2), rel_tol=1e-9)


def test_the_training_split_counts_its_own_tokens_and_refuses_a_longer_window():
  """Documents of very different lengths: the training split's tokens are its documents', not
  the corpus's times its share of documents (which let a window longer than the split through,
  a few documents then repeated in every window)."""
  docs = [np.full(1 + 50 * (d % 3 == 0) * d, d + 1, np.int32) for d in range(40)]
  data = build(docs, seq_len=4, batch=1, val_fraction=0.2)
  is_val = doc_is_val(np.arange(40), 0.2, 0)
  assert 0 < is_val.sum() < 40
  want = sum(len(docs[d]) + 1 for d in np.nonzero(~is_val)[0])
  assert data.num_train_tokens == want
  short = [np.full(2, d + 1, np.int32) for d in range(3)] + [np.full(1000, 9, np.int32)]
  held = np.nonzero(doc_is_val(np.arange(4), 0.25, 13))[0].tolist()
  assert held == [3], held  # the long document is the one held out
  with pytest.raises(ValueError, match=r"longer than the training split .*: 9 tokens"):
    build(short, seq_len=100, batch=1, val_fraction=0.25, split_seed=13)


def test_caps_limit_documents_and_tokens():
  docs = [np.full(10, i + 1, np.int32) for i in range(20)]
  assert build(docs, seq_len=4, batch=1, max_documents=5).num_train_tokens == 5 * 11
  capped = build(docs, seq_len=4, batch=1, max_tokens=25)  # 10 + 10 + 5 tokens, one eos each
  assert capped.num_train_tokens == 25 + 3 and capped.corpus.num_documents == 3
  assert capped.corpus.tokens(2).tolist() == [3] * 5


def test_answers_only_task_data_scores_exactly_the_answer_tokens():
  task = AssociativeRecallTask(6, 2, 1, num_examples=24, seed=4)
  cfg = DataConfig(val_fraction=0.2, shuffle=False, prefetch_batches=0)
  data = build_datasets(
    cfg,
    seq_len=64,
    global_batch_size=2,
    seed=0,
    source=AnswersOnly(task),
    tokenizer=ByteTokenizer(),
  )
  digits = set(range(ord("0"), ord("9") + 1))
  scored = 0
  for batch in take(data.train_iter, 40):
    for row in range(2):
      for t in np.flatnonzero(batch["loss_mask"][row]):
        # Every scored target is a value digit of the query part: after "key:" or a digit.
        assert int(batch["targets"][row, t]) in digits
        assert chr(int(batch["inputs"][row, t])) in ":0123456789"
        scored += 1
  assert scored > 0
  # The weights mark 2 queries x 3 digits per example, and the tokens are the task's.
  for i in range(len(task)):
    tokens, weights = AnswersOnly(task).weighted(i)
    assert int(weights.sum()) == 6 and np.array_equal(tokens, task[i])


# --- the embedded corpus and text files: prepared once into the cache ------------------------


def test_stdlib_corpus_is_prepared_once_and_holds_the_files(tmp_path, monkeypatch):
  monkeypatch.setenv(corpus_lib.CACHE_ENV, str(tmp_path / "cache"))
  files = stdlib_files()
  assert len(files) > 300 and files == sorted(files)
  parts = {
    p for f in files for p in os.path.relpath(f, os.path.dirname(os.__file__)).split(os.sep)[:-1]
  }
  assert not parts & {"test", "tests", "idle_test", "site-packages"}
  data = build_datasets(DataConfig(), seq_len=256, global_batch_size=8, seed=0)
  assert isinstance(data.corpus, ShardCorpus)
  assert data.corpus.manifest.directory.startswith(str(tmp_path / "cache"))
  nonempty = [f for f in files if os.path.getsize(f)]  # empty files are no document
  assert data.corpus.num_documents == len(nonempty)
  i = nonempty.index(os.path.join(os.path.dirname(os.__file__), "os.py"))
  with open(nonempty[i], "rb") as f:
    assert (
      data.corpus.tokens(i).tobytes()
      == np.frombuffer(f.read(), np.uint8).astype(np.int32).tobytes()
    )
  assert data.num_train_tokens > 5_000_000 and data.num_val_documents >= 1
  assert 2.0 < data.unigram_entropy_nats < math.log(256)

  def refuse(*a, **k):
    raise AssertionError("the cached corpus was prepared again")

  monkeypatch.setattr("diffjax.data.prepare.prepare", refuse)
  again = build_datasets(DataConfig(), seq_len=256, global_batch_size=8, seed=0)
  assert again.corpus.manifest.directory == data.corpus.manifest.directory


def test_text_files_are_prepared_again_when_one_changes(tmp_path, monkeypatch):
  monkeypatch.setenv(corpus_lib.CACHE_ENV, str(tmp_path / "cache"))
  (tmp_path / "docs").mkdir()
  for i in range(12):
    (tmp_path / "docs" / f"{i:02d}.txt").write_text(f"document {i} " * (i + 3))
  cfg = DataConfig(kind="text", paths=(str(tmp_path / "docs"),), val_fraction=0.0)
  first = build_datasets(cfg, 8, 2, 0)
  os.utime(tmp_path / "docs" / "03.txt", ns=(1, 1))
  second = build_datasets(cfg, 8, 2, 0)
  assert first.corpus.manifest.directory != second.corpus.manifest.directory
  entries = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]  # and their .lock files
  assert len(entries) == 2


def test_text_corpus_end_to_end_with_an_hf_tokenizer(tmp_path, monkeypatch):
  from helpers import write_bpe_tokenizer  # pylint: disable=import-outside-toplevel

  monkeypatch.setenv(corpus_lib.CACHE_ENV, str(tmp_path / "cache"))
  write_bpe_tokenizer(tmp_path / "tok.json", ["<pad>", "</s>"])
  (tmp_path / "docs").mkdir()
  for i in range(30):
    (tmp_path / "docs" / f"{i:02d}.txt").write_text(
      f"document {i}: the quick brown fox " * (i % 5 + 1)
    )
  cfg = DataConfig(
    kind="text",
    paths=[str(tmp_path / "docs")],
    tokenizer=str(tmp_path / "tok.json"),
    val_fraction=0.1,
  )
  data = build_datasets(cfg, 8, 2, 0)
  batch = next(data.train_iter)
  tok = data.tokenizer
  assert isinstance(tok, HFTokenizer) and batch["inputs"].max() < tok.vocab_size
  assert (batch["loss_mask"] == 0).sum() == (batch["inputs"] == tok.eos_id).sum()


# --- prepared directories ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """60 text files of 5-120 bytes, each distinct, prepared into several shards."""
  tmp = tmp_path_factory.mktemp("prepared")
  rng = np.random.default_rng(0)
  (tmp / "raw").mkdir()
  for i in range(60):
    body = f"doc{i:04d} " + "".join(rng.choice(list("abcdefgh \n"), size=int(rng.integers(0, 115))))
    (tmp / "raw" / f"{i:04d}.txt").write_text(body)
  prepare(
    [str(tmp / "raw")],
    str(tmp / "out"),
    "byte",
    shard_tokens=700,
    files_per_unit=16,
    progress=False,
  )
  return str(tmp / "out")


def test_a_prepared_directory_streams_like_the_same_documents_in_memory(prepared):
  m = read_manifest(prepared)
  docs = [d for s in m.shards for d in shard_documents(s.path)]
  assert len(m.shards) > 4 and len(docs) == 60
  cfg = dict(shards_per_group=2, prefetch_batches=0, streams_per_row=2, val_fraction=0.1)
  streamed = build_datasets(DataConfig(kind="prepared", paths=(prepared,), **cfg), 32, 4, 0)
  in_memory = build_datasets(
    DataConfig(**cfg),
    32,
    4,
    0,
    source=corpus_lib.ShardCorpus(read_manifest(prepared)),
    tokenizer=ByteTokenizer(),
  )
  assert all(
    same(a, b) for a, b in zip(take(streamed.train_iter, 8), take(in_memory.train_iter, 8))
  )


def test_the_shard_corpus_keeps_at_most_max_open_shards(prepared):
  m = read_manifest(prepared)
  want = [d for s in m.shards for d in shard_documents(s.path)]
  corpus = ShardCorpus(m, max_open=3)
  for d in list(range(m.num_documents)) + list(range(m.num_documents))[::-1]:
    assert np.array_equal(corpus.tokens(d), want[d]), d
    assert len(corpus._open) <= 3  # pylint: disable=protected-access


def test_two_threads_reading_a_shard_corpus_that_closes_shards_get_their_own_documents(prepared):
  """Training reads in a background thread while evaluation reads in the main one; with one
  shard open at a time, each read closes the other thread's shard."""
  import threading  # pylint: disable=import-outside-toplevel

  m = read_manifest(prepared)
  want = [d for s in m.shards for d in shard_documents(s.path)]
  corpus = ShardCorpus(m, max_open=1)
  wrong, errors = [], []

  def read(seed):
    rng = np.random.default_rng(seed)
    for d in rng.integers(m.num_documents, size=3000).tolist():
      try:
        if not np.array_equal(corpus.tokens(d), want[d]):
          wrong.append(d)
      except Exception as e:  # pylint: disable=broad-exception-caught
        errors.append(repr(e))

  threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors and not wrong, (errors[:3], wrong[:3])


def test_a_shard_disagreeing_with_its_manifest_is_refused(prepared, tmp_path):
  copy = tmp_path / "copy"
  shutil.copytree(prepared, copy)
  raw = json.loads((copy / "manifest.json").read_text())
  raw["shards"][1]["num_documents"] += 1
  (copy / "manifest.json").write_text(json.dumps(raw))
  m = read_manifest(str(copy))
  with pytest.raises(ValueError, match=r"holds \d+ documents but the manifest says .*prepare"):
    ShardCorpus(m).tokens(int(m.doc_offsets_Sp1[1]))


def test_a_prepared_corpus_of_another_tokenizer_is_refused_in_one_line(prepared, tmp_path):
  raw = json.loads(open(f"{prepared}/manifest.json").read())
  raw["tokenizer"]["sha256"] = "0" * 64
  raw["shards"] = [dict(s, path=f"{prepared}/{s['path']}") for s in raw["shards"]]
  (tmp_path / "m.json").write_text(json.dumps(raw))
  with pytest.raises(ValueError) as e:
    build_datasets(DataConfig(kind="prepared", paths=(str(tmp_path / "m.json"),)), 32, 4, 0)
  assert "\n" not in str(e.value) and "data.tokenizer='byte'" in str(e.value)


# --- configuration and bad input ---------------------------------------------------------------


def test_config_from_configdict_and_unknown_keys():
  import ml_collections  # pylint: disable=import-outside-toplevel

  cd = ml_collections.ConfigDict(
    {
      "kind": "text",
      "paths": ["a.txt"],
      "tokenizer": "byte",
      "val_fraction": 0.05,
      "max_tokens": 1000,
    }
  )
  cfg = DataConfig(**cd.to_dict())
  assert cfg == DataConfig.from_dict(cd) and cfg.paths == ("a.txt",) and cfg.max_tokens == 1000
  with pytest.raises(ValueError, match=r"\['seq_length'\].*accepted keys"):
    DataConfig.from_dict({"kind": "stdlib", "seq_length": 5})
  with pytest.raises(ValueError, match="'array_record'"):
    DataConfig(kind="array_record", paths=("x",))
  with pytest.raises(ValueError, match="takes no paths"):
    DataConfig(kind="stdlib", paths=("x",))
  with pytest.raises(ValueError, match="val_fraction=1.5"):
    DataConfig(val_fraction=1.5)
  with pytest.raises(ValueError, match="streams_per_row=0"):
    DataConfig(streams_per_row=0)
  with pytest.raises(ValueError, match="missing: data.paths, data.tokenizer"):
    DataConfig(kind="prepared", paths=(), tokenizer="")


def test_bad_pipeline_inputs_name_the_values(tmp_path, monkeypatch):
  monkeypatch.setenv(corpus_lib.CACHE_ENV, str(tmp_path / "cache"))
  docs = marked_docs(10, max_len=5)
  with pytest.raises(ValueError, match="global_batch_size=6.*process_count=4"):
    build_datasets(
      DataConfig(val_fraction=0.0),
      4,
      6,
      0,
      0,
      4,
      source=ListSource(docs),
      tokenizer=ByteTokenizer(),
    )
  with pytest.raises(ValueError, match="no documents"):
    build([], batch=1)
  with pytest.raises(FileNotFoundError, match="nothing_here"):
    build_datasets(
      DataConfig(kind="text", paths=[str(tmp_path / "nothing_here" / "*.txt")]), 4, 2, 0
    )
  with pytest.raises(ValueError, match=r"\[0, 300\].*vocab_size=258"):
    build([np.array([0, 300])] * 4)
  with pytest.raises(ValueError, match="No validation data"):
    build(docs, seq_len=4).val_batches(1)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    resolve_paths([str(tmp_path / "missing_dir" / "x.txt")])
  (tmp_path / "one.txt").write_text("print('hello')\n")
  with pytest.raises(ValueError, match=r"too small.*1 document.*at least 2"):
    build_datasets(DataConfig(kind="text", paths=[str(tmp_path / "one.txt")]), 32, 2, 0)


def test_a_script_that_ends_while_its_batches_prefetch_stops_the_thread_first(tmp_path):
  """The prefetch thread is stopped before the interpreter shuts down (a daemon thread left
  inside grain's C++ shuffle then aborted the process after the script's last line)."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  from helpers import REPO  # pylint: disable=import-outside-toplevel

  script = tmp_path / "ends.py"
  script.write_text(
    "import atexit, threading\n"
    "# Registered first, so it runs after the package's own exit handlers.\n"
    "atexit.register(lambda: print('threads at exit', threading.active_count()))\n"
    "from diffjax.data import DataConfig, build_datasets\n"
    "data = build_datasets(DataConfig(prefetch_batches=4), 64, 4, 0)\n"
    "next(data.train_iter)\n"
    "print('threads before', threading.active_count())\n"
  )
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run(
    [sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, env=env, timeout=300
  )
  assert r.returncode == 0, r.stderr[-3000:]
  lines = dict(line.rsplit(" ", 1) for line in r.stdout.splitlines() if line.startswith("threads"))
  assert int(lines["threads before"]) > int(lines["threads at exit"]), r.stdout
