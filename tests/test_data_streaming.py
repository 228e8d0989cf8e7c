"""Streaming a prepared corpus: exact resume, process independence, split, packing format."""

import json

import numpy as np
import pytest

from diffjax.data import DataConfig, Packer, PackedCorpus, build_datasets
from diffjax.data import streaming
from diffjax.data.manifest import read_manifest
from diffjax.data.prepare import prepare
from diffjax.data.shards import shard_documents
from diffjax.data.streaming import EpochOrder


def _corpus(tmp_path, num_docs=60, seed=0):
  """Text files of 5-120 bytes, each distinct; returns the prepared directory."""
  rng = np.random.default_rng(seed)
  src = tmp_path / "raw"
  src.mkdir()
  for i in range(num_docs):
    body = f"doc{i:04d} " + "".join(rng.choice(list("abcdefgh \n"), size=int(rng.integers(0, 115))))
    (src / f"{i:04d}.txt").write_text(body)
  out = str(tmp_path / "prepared")
  prepare([str(src)], out, "byte", shard_tokens=700, files_per_unit=16, progress=False)
  return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return _corpus(tmp_path_factory.mktemp("stream"))


def _data(path, process_index=0, process_count=1, **kw):
  cfg = dict(kind="prepared", paths=(path,), shards_per_group=2, prefetch_batches=2)
  seed = kw.pop("seed", 0)
  gb = kw.pop("global_batch_size", 4)
  cfg.update(kw)
  return build_datasets(DataConfig(**cfg), seq_len=32, global_batch_size=gb, seed=seed,
                        process_index=process_index, process_count=process_count)


def _take(it, n):
  return [next(it) for _ in range(n)]


def _same(a, b):
  return all(np.array_equal(a[k], b[k]) for k in a)


def test_manifest_counts_match_shards(corpus):
  m = read_manifest(corpus)
  assert len(m.shards) > 4 and m.num_documents == 60


def test_epoch_order_visits_every_document_once():
  order = EpochOrder(np.array([5, 0, 7, 3, 9]), seed=3, shuffle=True, shards_per_group=2)
  for epoch in (0, 1):
    ids = [order.doc_at(epoch, k) for k in range(order.total)]
    assert sorted(ids) == list(range(24))
    assert order.doc_at(epoch, order.total) is None
  assert [order.doc_at(0, k) for k in range(24)] != [order.doc_at(1, k) for k in range(24)]


@pytest.mark.parametrize("stop", [3, 40])  # mid-epoch; after several lanes wrapped into epoch 1+
def test_resume_is_exact(corpus, stop):
  straight = _take(_data(corpus).train_iter, stop + 6)
  it = _data(corpus).train_iter
  _take(it, stop)
  state = json.loads(json.dumps(it.get_state()))  # as grain writes it in a checkpoint
  if stop == 40:
    assert max(lane[0] for lane in state["lanes"]) >= 1, "the test must cross an epoch boundary"
  fresh = _data(corpus).new_train_iter()
  fresh.set_state(state)
  for want, got in zip(straight[stop:], _take(fresh, 6)):
    assert _same(want, got)


def test_seed_decides_order(corpus):
  a, b, c = (_take(_data(corpus, seed=s).train_iter, 3) for s in (0, 0, 1))
  assert all(_same(x, y) for x, y in zip(a, b))
  assert not all(_same(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("count", [2, 4])
def test_processes_read_disjoint_rows_forming_the_global_batch(corpus, count):
  whole = _take(_data(corpus).train_iter, 8)
  parts = [_take(_data(corpus, p, count).train_iter, 8) for p in range(count)]
  for b, want in enumerate(whole):
    got = {k: np.concatenate([parts[p][b][k] for p in range(count)]) for k in want}
    assert _same(want, got)


def test_resume_on_other_process_count_is_refused(corpus):
  it = _data(corpus).train_iter
  next(it)
  other = _data(corpus, 0, 2).new_train_iter()
  with pytest.raises(ValueError, match="same number of processes"):
    other.set_state(it.get_state())


def test_no_document_in_both_splits(corpus, monkeypatch):
  seen = {"train": set(), "val": set()}
  split = ["train"]
  real = streaming.ShardReader.__getitem__

  def logged(self, doc):
    seen[split[0]].add(int(doc))
    return real(self, doc)

  monkeypatch.setattr(streaming.ShardReader, "__getitem__", logged)
  data = _data(corpus, val_fraction=0.2, prefetch_batches=0)
  _take(data.train_iter, 60)  # more than an epoch
  split[0] = "val"
  data.val_batches(3)
  assert seen["train"] and seen["val"] and not seen["train"] & seen["val"]
  is_val = streaming.doc_is_val(np.arange(60), 0.2, 0)
  assert seen["train"] == set(np.nonzero(~is_val)[0].tolist())  # a whole epoch: every train doc
  assert seen["val"] <= set(np.nonzero(is_val)[0].tolist())
  assert all(_same(a, b) for a, b in zip(data.val_batches(2), _data(corpus, val_fraction=0.2,
                                                                     seed=5).val_batches(2)))


def test_windows_match_in_memory_packing(corpus):
  """One row, corpus order: the stream's windows are Packer's (same keys, dtypes, values)."""
  data = _data(corpus, val_fraction=0.0, shuffle=False, global_batch_size=1)
  m = read_manifest(corpus)
  docs = [d for s in m.shards for d in shard_documents(s.path)]
  packer = Packer(PackedCorpus.from_documents(docs, 256), 32, seed=0, shuffle=False)
  for b, got in enumerate(_take(data.train_iter, packer.windows_per_epoch)):
    want = packer.examples(np.array([b]))
    for k in want:
      assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), (b, k)


def test_tokenizer_mismatch_is_refused_in_one_line(corpus, tmp_path):
  with open(f"{corpus}/manifest.json") as f:
    manifest = json.load(f)
  manifest["tokenizer"]["sha256"] = "0" * 64
  manifest["shards"] = [dict(s, path=f"{corpus}/{s['path']}") for s in manifest["shards"]]
  (tmp_path / "m.json").write_text(json.dumps(manifest))
  with pytest.raises(ValueError) as e:
    _data(str(tmp_path / "m.json"))
  assert "\n" not in str(e.value) and "data.tokenizer='byte'" in str(e.value)


def test_missing_paths_and_tokenizer_named_together():
  with pytest.raises(ValueError, match="missing: data.paths, data.tokenizer"):
    DataConfig(kind="prepared", paths=(), tokenizer="")


def test_shard_reader_keeps_at_most_max_open_shards_and_reads_every_document(corpus):
  m = read_manifest(corpus)
  assert len(m.shards) > 3
  want = [d for s in m.shards for d in shard_documents(s.path)]
  reader = streaming.ShardReader(m, max_open=3)
  for d in list(range(m.num_documents)) + list(range(m.num_documents))[::-1]:
    assert np.array_equal(reader[d], want[d]), d
    assert len(reader._open) <= 3  # pylint: disable=protected-access
  assert list(reader._open) == [2, 1, 0]  # pylint: disable=protected-access


def test_shard_disagreeing_with_its_manifest_is_refused(corpus, tmp_path):
  import shutil  # pylint: disable=import-outside-toplevel
  copy = tmp_path / "copy"
  shutil.copytree(corpus, copy)
  with open(copy / "manifest.json") as f:
    manifest = json.load(f)
  manifest["shards"][1]["num_documents"] += 1
  with open(copy / "manifest.json", "w") as f:
    json.dump(manifest, f)
  m = read_manifest(str(copy))
  reader = streaming.ShardReader(m, max_open=2)
  with pytest.raises(ValueError, match=r"holds \d+ documents but the manifest says .*prepare again"):
    reader[int(m.doc_offsets_Sp1[1])]
