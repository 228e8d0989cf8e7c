"""Tests of diffjax.data: tokenizers, sources, packing, splitting, sharding and exact resume."""

from __future__ import annotations

import math
import os
import sys
import time

import numpy as np
import pytest

from diffjax.data import (
    ArrayRecordSource,
    ByteTokenizer,
    DataConfig,
    DocumentSource,
    HFTokenizer,
    Packer,
    PackedCorpus,
    SentencePieceTokenizer,
    TextFileSource,
    build_datasets,
    load_tokenizer,
    resolve_paths,
    stdlib_corpus,
    stdlib_files,
    write_array_record,
)

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
  """Documents whose first token is a unique id (d % 200) and whose length varies."""
  rng = np.random.default_rng(seed)
  docs = []
  for d in range(num_docs):
    body = rng.integers(200, 256, size=int(rng.integers(1, max_len)))
    docs.append(np.concatenate([[d % 200], body]).astype(np.int32))
  return docs


def build(docs, seq_len=16, batch=4, seed=0, **cfg):
  cfg.setdefault("val_fraction", 0.0)
  return build_datasets(DataConfig(**cfg), seq_len, batch, seed, source=ListSource(docs),
                        tokenizer=ByteTokenizer())


def take(iterator, n):
  return [next(iterator) for _ in range(n)]


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


# --- tokenizers ------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip_non_ascii():
  tok = load_tokenizer("byte")
  text = "déjà vu — 日本語 🙂\n\ttabs"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and ids.size == len(text.encode("utf-8"))
  assert tok.decode(ids) == text
  assert tok.decode(np.concatenate([ids, [tok.eos_id, tok.pad_id]])) == text  # specials dropped
  assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (258, 256, 257)
  with pytest.raises(ValueError, match="300"):
    tok.decode([300])


def _write_hf_tokenizer(path, special_tokens):
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special_tokens, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer=trainer)
  tok.save(str(path))
  return tok


def test_hf_tokenizer_round_trip_and_special_ids(tmp_path):
  raw = _write_hf_tokenizer(tmp_path / "tok.json", ["<pad>", "</s>"])
  tok = load_tokenizer(str(tmp_path / "tok.json"))
  assert isinstance(tok, HFTokenizer)
  text = "The lazy fox — déjà 日本!\n  two  spaces"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and tok.decode(ids) == text
  assert tok.eos_id == raw.token_to_id("</s>") and tok.pad_id == raw.token_to_id("<pad>")
  assert tok.eos_id not in ids  # encode adds no special tokens; packing appends eos itself
  assert tok.decode(np.concatenate([ids, [tok.eos_id, tok.pad_id]])) == text
  assert tok.vocab_size == raw.get_vocab_size()
  assert [a.tolist() for a in tok.encode_batch([text, "fox"])] == [ids.tolist(), tok.encode("fox").tolist()]


def test_hf_tokenizer_without_specials_appends_ids(tmp_path):
  raw = _write_hf_tokenizer(tmp_path / "plain.json", [])
  tok = HFTokenizer(tmp_path / "plain.json")
  base = raw.get_vocab_size()
  assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (base, base + 1, base + 2)
  assert tok.decode(list(tok.encode("lazy dog")) + [tok.eos_id]) == "lazy dog"


def test_sentencepiece_round_trip(tmp_path):
  spm = pytest.importorskip("sentencepiece")
  corpus = tmp_path / "corpus.txt"
  corpus.write_text(("the quick brown fox jumps over the lazy dog\n"
                     "pack my box with five dozen liquor jugs\n") * 10)
  spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=60,
                                 model_type="bpe", character_coverage=1.0, minloglevel=2, pad_id=3)
  tok = load_tokenizer(str(tmp_path / "sp.model"))
  assert isinstance(tok, SentencePieceTokenizer)
  text = "the lazy fox packs my jugs"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and ids.size < len(text)  # merges happened
  assert tok.decode(ids) == text
  assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (2, 3, 60)
  assert tok.decode(list(ids) + [tok.eos_id, tok.pad_id]) == text


def test_token_byte_lengths_count_the_bytes_of_the_text(tmp_path):
  """Summed over an encoding, the lengths give the text's UTF-8 size (the bits-per-byte
  denominator); specials count one byte, as eos does for byte tokens."""
  from diffjax.data import token_byte_lengths
  text = "The lazy fox \u2014 d\u00e9j\u00e0 \u65e5\u672c!\n  two  spaces\t\u2603"
  byte = token_byte_lengths(ByteTokenizer())
  assert byte.shape == (258,) and np.all(byte == 1)
  _write_hf_tokenizer(tmp_path / "tok.json", ["<pad>", "</s>"])
  tok = load_tokenizer(str(tmp_path / "tok.json"))
  lengths = token_byte_lengths(tok)
  ids = tok.encode(text)
  assert ids.size < len(text.encode("utf-8"))  # merges happened, so lengths above 1 matter
  assert lengths.shape == (tok.vocab_size,) and int(lengths[ids].sum()) == len(text.encode("utf-8"))
  assert lengths[tok.eos_id] == lengths[tok.pad_id] == 1
  assert token_byte_lengths(object.__new__(type("Other", (), {}))) is None


def test_load_tokenizer_rejects_unknown_spec_and_missing_file(tmp_path):
  with pytest.raises(ValueError, match=r"'gpt2'.*'byte'.*\.json.*\.model"):
    load_tokenizer("gpt2")
  missing = str(tmp_path / "nope.json")
  with pytest.raises(FileNotFoundError, match="nope.json"):
    load_tokenizer(missing)
  with pytest.raises(FileNotFoundError, match="nope.model"):
    load_tokenizer(str(tmp_path / "nope.model"))


# --- sources -------------------------------------------------------------------------------


def test_text_source_resolves_dirs_globs_in_sorted_order(tmp_path):
  (tmp_path / "d" / "sub").mkdir(parents=True)
  (tmp_path / "d" / ".hidden").mkdir()
  files = {"d/b.txt": "bee", "d/a.txt": "ay", "d/sub/c.txt": "sea ☃", "d/.hidden/x.txt": "no",
           "e.md": "ee", "f.txt": "ef"}
  for rel, text in files.items():
    (tmp_path / rel).write_text(text, encoding="utf-8")
  src = TextFileSource([str(tmp_path / "f.txt"), str(tmp_path / "d"), str(tmp_path / "*.txt")], "byte")
  rel_paths = [os.path.relpath(p, tmp_path) for p in src.paths]
  assert rel_paths == ["f.txt", "d/a.txt", "d/b.txt", "d/sub/c.txt"]  # f.txt only once
  assert isinstance(src, DocumentSource)
  assert [ByteTokenizer().decode(src[i]) for i in range(len(src))] == ["ef", "ay", "bee", "sea ☃"]
  assert src.num_tokens == sum(len(files[r].encode()) for r in rel_paths)


def test_text_source_bad_paths_name_the_pattern(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"missing_dir/x\.txt.*does not exist.*glob"):
    resolve_paths([str(tmp_path / "missing_dir" / "x.txt")])
  with pytest.raises(FileNotFoundError, match=r"\*\.parquet.*matched no files"):
    TextFileSource(str(tmp_path / "*.parquet"))
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="empty.*contains no files"):
    resolve_paths(str(tmp_path / "empty"))


def test_array_record_write_read_round_trip(tmp_path):
  docs = [np.array([1, 2, 3]), np.array([], dtype=np.int64), np.array([70000, 2**31 - 1, 0])]
  path = tmp_path / "docs.array_record"
  assert write_array_record(path, docs) == 3
  src = ArrayRecordSource(str(path))
  assert len(src) == 3
  for i, doc in enumerate(docs):
    np.testing.assert_array_equal(src[i], doc)
    assert src[i].dtype == np.int32
  np.testing.assert_array_equal(src.read_all()[2], docs[2])
  with pytest.raises(ValueError, match="2-D|shape"):
    write_array_record(tmp_path / "bad.array_record", [np.zeros((2, 2), np.int32)])


def test_array_record_rejects_records_that_are_not_int32(tmp_path):
  from array_record.python import array_record_module

  writer = array_record_module.ArrayRecordWriter(str(tmp_path / "raw.array_record"), "group_size:1")
  writer.write(b"abc")
  writer.close()
  with pytest.raises(ValueError, match="3 bytes.*multiple of 4"):
    ArrayRecordSource(str(tmp_path / "raw.array_record"))[0]


def test_array_record_pipeline_matches_in_memory_source(tmp_path):
  docs = marked_docs(30)
  write_array_record(tmp_path / "a.array_record", docs[:12])
  write_array_record(tmp_path / "b.array_record", docs[12:])
  from_files = build_datasets(DataConfig(kind="array_record", paths=[str(tmp_path / "*.array_record")],
                                         val_fraction=0.0), 16, 4, seed=3)
  in_memory = build(docs, seed=3)
  assert_batches_equal(take(from_files.train_iter, 5), take(in_memory.train_iter, 5))


# --- packing -------------------------------------------------------------------------------


def test_packing_by_hand():
  corpus = PackedCorpus.from_documents([np.array([10, 11, 12]), np.array([20, 21]),
                                        np.array([30, 31, 32, 33, 34])], eos_id=99)
  packer = Packer(corpus, seq_len=4, seed=0, shuffle=False)
  # Stream: 10 11 12 99 | 20 21 99 | 30 31 32 33 34 99 (13 tokens) -> (13 - 1) // 4 = 3 windows.
  assert packer.windows_per_epoch == 3
  b = packer.examples(np.arange(3))
  np.testing.assert_array_equal(b["inputs"], [[10, 11, 12, 99], [20, 21, 99, 30], [31, 32, 33, 34]])
  np.testing.assert_array_equal(b["targets"], [[11, 12, 99, 20], [21, 99, 30, 31], [32, 33, 34, 99]])
  np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 1], [1, 1, 1, 2], [1, 1, 1, 1]])
  np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 3]])
  np.testing.assert_array_equal(b["loss_mask"], [[1, 1, 1, 0], [1, 1, 0, 1], [1, 1, 1, 1]])
  assert b["loss_mask"].dtype == np.float32 and b["inputs"].dtype == np.int32
  # Without shuffle, epoch 1 repeats epoch 0.
  assert_batches_equal([packer.examples(np.arange(3, 6))], [b])


def test_packing_invariants_on_shuffled_epoch():
  docs = marked_docs(80, max_len=40)
  corpus = PackedCorpus.from_documents(docs, eos_id=EOS)
  t = 32
  packer = Packer(corpus, seq_len=t, seed=5, shuffle=True)
  w = packer.windows_per_epoch
  b = packer.examples(np.arange(w))
  x, y, seg, pos, mask = (b[k] for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask"))
  np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
  assert (seg[:, 0] == 1).all() and (pos[:, 0] == 0).all()
  new_doc = np.diff(seg, axis=1) != 0
  assert (np.diff(seg, axis=1) >= 0).all() and (np.diff(seg, axis=1) <= 1).all()
  # A new segment starts exactly after an eos, and positions restart at 0 there.
  np.testing.assert_array_equal(new_doc, x[:, :-1] == EOS)
  np.testing.assert_array_equal(pos[:, 1:] == 0, new_doc)
  np.testing.assert_array_equal(np.diff(pos, axis=1)[~new_doc], 1)
  # The loss is masked exactly where the input is eos (target = next document's first token).
  np.testing.assert_array_equal(mask == 0, x == EOS)
  # Every stream token is a target exactly once per epoch (up to the dropped tail).
  layout = packer.layout(0)
  stream = np.concatenate([np.append(docs[d], EOS) for d in layout.order_D])
  by_window = np.empty_like(y)
  by_window[layout.window_order_W] = y
  np.testing.assert_array_equal(by_window.reshape(-1), stream[1:w * t + 1])
  assert sorted(layout.window_order_W.tolist()) == list(range(w))
  assert layout.window_order_W.tolist() != list(range(w))  # windows are visited shuffled


# --- pipeline ------------------------------------------------------------------------------


def test_batch_format_and_counts():
  docs = marked_docs(50)
  data = build(docs, seq_len=16, batch=4)
  batch = next(data.train_iter)
  assert set(batch) == {"inputs", "targets", "segment_ids", "positions", "loss_mask"}
  for key, value in batch.items():
    assert value.shape == (4, 16), key
  assert data.num_train_tokens == sum(d.size + 1 for d in docs)
  assert data.windows_per_epoch == (data.num_train_tokens - 1) // 16


def test_same_seed_same_batches_other_seed_other_order_and_epochs_reshuffle():
  docs = marked_docs(40)
  first = take(build(docs, seed=1).train_iter, 6)
  assert_batches_equal(first, take(build(docs, seed=1).train_iter, 6))
  other = take(build(docs, seed=2).train_iter, 6)
  assert not all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(first, other))
  data = build(docs, seed=1)
  w = data.windows_per_epoch
  epoch0, epoch1 = (data.train.packer.examples(np.arange(e * w, (e + 1) * w))["inputs"] for e in (0, 1))
  assert not np.array_equal(epoch0, epoch1)  # each epoch has its own document and window order
  # Never stops: far beyond one epoch batches still come.
  assert data.train[10 * w + 3]["inputs"].shape == (4, 16)


def test_resume_mid_epoch_and_across_epochs_via_state():
  docs = marked_docs(40)
  data = build(docs, seed=7, batch=8)
  per_epoch = data.windows_per_epoch // 8
  take(data.train_iter, per_epoch - 2)  # stop two batches before the epoch ends
  state = data.train_iter.get_state()
  expected = take(data.train_iter, 6)  # crosses into the next epoch
  resumed = build(docs, seed=7, batch=8).new_train_iter()
  resumed.set_state(state)
  assert_batches_equal(take(resumed, 6), expected)
  assert state == {"next_index": per_epoch - 2}  # the whole state is one integer


def test_resume_through_orbax_checkpoint(tmp_path):
  grain = pytest.importorskip("grain")
  ocp = pytest.importorskip("orbax.checkpoint")
  docs = marked_docs(40)
  data = build(docs, seed=3)
  take(data.train_iter, 5)
  checkpointer = ocp.Checkpointer(grain.checkpoint.CheckpointHandler())
  checkpointer.save(tmp_path / "ckpt", args=grain.checkpoint.CheckpointSave(data.train_iter))
  expected = take(data.train_iter, 3)
  fresh = build(docs, seed=3).new_train_iter()
  restored = checkpointer.restore(tmp_path / "ckpt", args=grain.checkpoint.CheckpointRestore(fresh))
  assert_batches_equal(take(restored, 3), expected)


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_shards_union_is_global_batch(process_count):
  docs = marked_docs(60)
  cfg = DataConfig(val_fraction=0.1)
  kwargs = dict(source=ListSource(docs), tokenizer=ByteTokenizer())
  whole = build_datasets(cfg, 16, 8, 0, **kwargs)
  shards = [build_datasets(cfg, 16, 8, 0, p, process_count, **kwargs) for p in range(process_count)]
  assert all(s.per_process_batch_size == 8 // process_count for s in shards)
  for step in (0, 1, whole.windows_per_epoch // 8 + 1):
    for key, value in whole.train[step].items():
      np.testing.assert_array_equal(np.concatenate([s.train[step][key] for s in shards]), value)
  union = [np.concatenate([s.val_batches(2)[i]["inputs"] for s in shards]) for i in range(2)]
  np.testing.assert_array_equal(np.stack(union), np.stack([b["inputs"] for b in whole.val_batches(2)]))


def test_train_and_val_share_no_document_and_val_ignores_seed():
  docs = marked_docs(200)  # the first token of document d is d: a document id
  data = build(docs, seq_len=16, batch=4, val_fraction=0.1)
  assert data.num_val_documents >= 1 and data.num_train_documents + data.num_val_documents == 200

  def doc_ids(batches):
    b = np.concatenate([x["inputs"] for x in batches])
    starts = np.concatenate([np.ones((b.shape[0], 1), bool), b[:, :-1] == EOS], axis=1)
    return set(b[starts & (b < 200)].tolist())

  epoch = [data.train[i] for i in range(data.windows_per_epoch // 4 + 1)]
  val = data.val_batches()
  train_docs, val_docs = doc_ids(epoch), doc_ids(val)
  assert val_docs and not train_docs & val_docs
  assert len(train_docs) >= data.num_train_documents - 8  # windows cut some document starts
  other_seed = build(docs, seq_len=16, batch=4, val_fraction=0.1, seed=99)
  assert_batches_equal(other_seed.val_batches(), val)
  assert len(data.val_batches(len(val) + 2)) == len(val) + 2  # more than available: cycles


def test_unigram_entropy_matches_direct_computation():
  docs = marked_docs(100)
  data = build(docs, val_fraction=0.2)
  # Recover the split from the batches' token stream is awkward; recompute it from the corpus.
  from diffjax.data import split_documents
  corpus = PackedCorpus.from_documents(docs, EOS)
  train_ids, val_ids = split_documents(corpus, 0.2, 0)
  counts = np.ones(258)
  for d in train_ids:
    np.add.at(counts, np.append(docs[d], EOS), 1)
  val_tokens = np.concatenate([np.append(docs[d], EOS) for d in val_ids])
  expected = -np.mean(np.log(counts[val_tokens] / counts.sum()))
  assert math.isclose(data.unigram_entropy_nats, expected, rel_tol=1e-9)
  assert math.isclose(data.unigram_entropy_bits, expected / math.log(2), rel_tol=1e-9)
  assert data.unigram_entropy_nats < math.log(258)


def test_caps_limit_documents_and_tokens():
  docs = [np.full(10, i + 1, np.int32) for i in range(20)]
  assert build(docs, seq_len=4, max_documents=5).num_train_tokens == 5 * 11
  capped = build(docs, seq_len=4, max_tokens=25)  # 10 + 10 + 5 tokens, one eos each
  assert capped.num_train_tokens == 25 + 3


def test_text_corpus_end_to_end_with_hf_tokenizer(tmp_path):
  _write_hf_tokenizer(tmp_path / "tok.json", ["<pad>", "</s>"])
  for i in range(30):
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "docs" / f"{i:02d}.txt").write_text(f"document {i}: the quick brown fox " * (i % 5 + 1))
  cfg = DataConfig(kind="text", paths=[str(tmp_path / "docs")], tokenizer=str(tmp_path / "tok.json"),
                   val_fraction=0.1)
  data = build_datasets(cfg, 8, 2, 0)
  batch = next(data.train_iter)
  tok = data.tokenizer
  assert isinstance(tok, HFTokenizer) and batch["inputs"].max() < tok.vocab_size
  assert (batch["loss_mask"] == 0).sum() == (batch["inputs"] == tok.eos_id).sum()


# --- configuration and bad input --------------------------------------------------------------


def test_config_from_configdict_and_unknown_keys():
  ml_collections = pytest.importorskip("ml_collections")
  cd = ml_collections.ConfigDict({"kind": "text", "paths": ["a.txt"], "tokenizer": "byte",
                                  "val_fraction": 0.05, "max_tokens": 1000})
  cfg = DataConfig(**cd.to_dict())
  assert cfg == DataConfig.from_dict(cd) and cfg.paths == ("a.txt",) and cfg.max_tokens == 1000
  with pytest.raises(ValueError, match=r"\['seq_length'\].*accepted keys"):
    DataConfig.from_dict({"kind": "stdlib", "seq_length": 5})
  with pytest.raises(ValueError, match="'parquet'"):
    DataConfig(kind="parquet")
  with pytest.raises(ValueError, match="takes no paths"):
    DataConfig(kind="stdlib", paths=("x",))
  with pytest.raises(ValueError, match="val_fraction=1.5"):
    DataConfig(val_fraction=1.5)


def test_bad_pipeline_inputs_name_the_values(tmp_path):
  docs = marked_docs(10, max_len=5)
  total = sum(d.size + 1 for d in docs)
  with pytest.raises(ValueError, match=rf"seq_len \+ 1 = 1001.*{total} tokens"):
    build(docs, seq_len=1000)
  with pytest.raises(ValueError, match="global_batch_size=6.*process_count=4"):
    build_datasets(DataConfig(val_fraction=0.0), 4, 6, 0, 0, 4, source=ListSource(docs),
                   tokenizer=ByteTokenizer())
  with pytest.raises(ValueError, match="no tokens"):
    build([np.zeros(0, np.int32)] * 3)
  (tmp_path / "empty.txt").write_text("")
  with pytest.raises(ValueError, match="no tokens"):
    build_datasets(DataConfig(kind="text", paths=[str(tmp_path / "empty.txt")]), 4, 2, 0)
  with pytest.raises(FileNotFoundError, match="nothing_here"):
    build_datasets(DataConfig(kind="text", paths=[str(tmp_path / "nothing_here" / "*.txt")]), 4, 2, 0)
  with pytest.raises(ValueError, match=r"\[0, 300\].*vocab_size=258"):
    build([np.array([0, 300])])
  with pytest.raises(ValueError, match="No validation data"):
    build(docs, seq_len=4).val_batches(1)


def test_corpus_too_small_for_a_validation_split_says_how_large_it_must_be(tmp_path):
  (tmp_path / "one.txt").write_text("print('hello')\n")
  cfg = DataConfig(kind="text", paths=[str(tmp_path / "one.txt")], val_fraction=0.01)
  with pytest.raises(ValueError, match=r"too small.*1 document.*at least 2 documents.*"
                                       r"at least 2 x 33 = 66 tokens"):
    build_datasets(cfg, seq_len=32, global_batch_size=2, seed=0)
  # Two documents pass the split; each split still needs seq_len + 1 tokens.
  with pytest.raises(ValueError, match=r"seq_len \+ 1 = 33 tokens is longer"):
    build(marked_docs(2, max_len=5), seq_len=32, val_fraction=0.5)


# --- the default corpus ---------------------------------------------------------------------


def test_stdlib_corpus_builds_fast_and_excludes_tests():
  start = time.perf_counter()
  data = build_datasets(DataConfig(), seq_len=256, global_batch_size=8, seed=0)
  elapsed = time.perf_counter() - start
  files = stdlib_files()
  assert len(files) > 300 and files == sorted(files)
  parts = {p for f in files for p in os.path.relpath(f, os.path.dirname(os.__file__)).split(os.sep)[:-1]}
  assert not parts & {"test", "tests", "idle_test", "site-packages"}
  assert os.path.join(os.path.dirname(os.__file__), "os.py") in files
  src = stdlib_corpus()
  i = files.index(os.__file__) if os.__file__ in files else files.index(os.path.realpath(os.__file__))
  with open(files[i], "rb") as f:
    assert src[i].tobytes() == np.frombuffer(f.read(), np.uint8).astype(np.int32).tobytes()
  assert data.num_train_tokens + data.num_val_tokens > 5_000_000
  assert data.num_val_documents >= 1
  assert 2.0 < data.unigram_entropy_nats < math.log(256)
  assert elapsed < 20, f"building the stdlib datasets took {elapsed:.1f}s"
  print(f"\nstdlib corpus ({sys.version.split()[0]}): {len(files)} files, {src.num_tokens} bytes, "
        f"built in {elapsed:.2f}s")


# ----------------------------------------------------------------------------------------------
# Per-token loss weights (tasks scored on their answers only).


def test_loss_weights_mask_the_targets_they_mark():
  docs = [np.arange(1, 6), np.arange(10, 13), np.arange(20, 27)]
  weights = [np.array([0, 0, 1, 1, 0]), np.array([1, 0, 0]), np.array([0, 0, 0, 0, 0, 1, 1])]
  corpus = PackedCorpus.from_documents(docs, eos_id=0, weights=weights)
  packer = Packer(corpus, seq_len=4, seed=0, shuffle=False)
  stream = corpus.stream_tokens()
  scored_stream = np.concatenate([np.append(w, 0) for w in weights])  # eos targets: 0
  for g in range(packer.windows_per_epoch):
    b = packer.examples(np.array([g]))
    s0 = g * 4
    np.testing.assert_array_equal(b["targets"][0], stream[s0 + 1:s0 + 5])
    want = scored_stream[s0 + 1:s0 + 5] * (stream[s0:s0 + 4] != 0)
    np.testing.assert_array_equal(b["loss_mask"][0], want.astype(np.float32))
  # Subsets carry the weights; without weights nothing changes.
  sub = corpus.subset(np.array([2, 0]))
  np.testing.assert_array_equal(sub.document_weights(0), weights[2])
  plain = Packer(PackedCorpus.from_documents(docs, eos_id=0), 4, seed=0, shuffle=False)
  assert plain.examples(np.array([0]))["loss_mask"].tolist() == [[1, 1, 1, 1]]
  with pytest.raises(ValueError, match="one to one"):
    PackedCorpus.from_documents(docs, 0, weights[:2])
  with pytest.raises(ValueError, match="0 or 1"):
    PackedCorpus.from_documents(docs[:1], 0, [np.array([0, 2, 0, 0, 0])])


def test_answers_only_task_data_scores_exactly_the_answer_tokens():
  from diffjax.data import AnswersOnly, AssociativeRecallTask
  task = AssociativeRecallTask(6, 2, 1, num_examples=12, seed=4)
  cfg = DataConfig(val_fraction=0.2, shuffle=False)
  data = build_datasets(cfg, seq_len=64, global_batch_size=2, seed=0, source=AnswersOnly(task),
                        tokenizer=ByteTokenizer())
  digits = set(range(ord("0"), ord("9") + 1))
  scored = 0
  for _ in range(4):
    batch = next(data.train_iter)
    for row in range(2):
      for t in np.flatnonzero(batch["loss_mask"][row]):
        # Every scored target is a value digit of the query part: after "key:" or a digit.
        assert int(batch["targets"][row, t]) in digits
        assert chr(int(batch["inputs"][row, t])) in ":0123456789"
        scored += 1
  assert scored > 0
  # The weights mark 2 queries x 3 digits per example, and the tokens are the task's.
  docs, weights = AnswersOnly(task).read_weighted()
  assert [int(w.sum()) for w in weights] == [6] * len(task)
  assert all(np.array_equal(d, task[i]) for i, d in enumerate(docs))
  with pytest.raises(ValueError, match="fraction=1"):
    import ml_collections
    from diffjax.train.task_mix import mixed_source
    mixed_source(None, ml_collections.ConfigDict(dict(task="associative_recall", fraction=0.5,
                                                      loss="answers")), ByteTokenizer(), 0)


def test_a_task_only_run_is_validated_on_its_own_held_out_examples(monkeypatch, tmp_path):
  """A comparison scores a finished run on the held-out split of the data it trained on:
  task examples scored on their answers, not the text corpus of ``data``."""
  import ml_collections
  from diffjax.compare import runs
  from diffjax.eval.config import EvalConfig
  from diffjax.presets import load_config
  run = load_config(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                 "configs", "tiny.py"))
  run.model.arm = "transformer"
  run.seq_len, run.global_batch_size = 64, 2
  run.data.val_fraction = 0.1
  run.task_mix.update(dict(task="associative_recall", fraction=1.0, num_examples=200,
                           loss="answers", num_pairs=4, num_queries=2, key_len=2, value_len=1))
  seen = {}
  monkeypatch.setattr("diffjax.train.load_model", lambda *a, **k: (None, None, 7))
  def fake_evaluate(model, val, cfg, meta, log):
    seen["val"] = list(val)
    return {"meta": meta}
  monkeypatch.setattr("diffjax.eval.evaluate.evaluate_model", fake_evaluate)
  runs.evaluate_checkpoint(run, str(tmp_path), EvalConfig(val_batches=2), 7, True, print)
  digits = set(range(ord("0"), ord("9") + 1))
  assert len(seen["val"]) == 2
  for batch in seen["val"]:
    mask = np.asarray(batch["loss_mask"]) > 0
    # Answers only: one value digit after each "key:", a small share of the tokens.
    assert 0 < mask.sum() < 0.2 * mask.size
    assert set(np.asarray(batch["targets"])[mask].tolist()) <= digits
    assert (np.asarray(batch["inputs"])[mask] == ord(":")).all()
  # Without a task mix the run's text is what it is scored on (every token counts).
  run.task_mix.update(dict(task="none", fraction=0.0))
  run.data.max_documents = 20
  runs.evaluate_checkpoint(run, str(tmp_path), EvalConfig(val_batches=1), 7, True, print)
  assert np.asarray(seen["val"][0]["loss_mask"]).mean() > 0.9
