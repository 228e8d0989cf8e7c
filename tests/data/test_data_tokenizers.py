"""Tokenizers: byte, HF tokenizers JSON and SentencePiece round trips, special ids, byte counts."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import write_bpe_tokenizer

from diffjax.data import ByteTokenizer, HFTokenizer, SentencePieceTokenizer, load_tokenizer


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
  pytest.importorskip("tokenizers")
  return write_bpe_tokenizer(path, special_tokens)


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
  assert [a.tolist() for a in tok.encode_batch([text, "fox"])] == [
    ids.tolist(),
    tok.encode("fox").tolist(),
  ]


def test_hf_tokenizer_encodes_the_names_of_its_special_tokens_as_text(tmp_path):
  """A corpus that mentions `</s>` or `<pad>` gets neither id from encode (only the pipeline
  places eos), and decoding gives the text back."""
  _write_hf_tokenizer(tmp_path / "tok.json", ["<pad>", "</s>"])
  tok = load_tokenizer(str(tmp_path / "tok.json"))
  text = "a </s> b <pad> c</s>"
  for ids in (tok.encode(text), tok.encode_batch([text])[0]):
    assert tok.eos_id not in ids and tok.pad_id not in ids, ids
    assert tok.decode(ids) == text
  # A prompt (serving, the harness) reads them as the tokens they name.
  prompt = tok.encode_with_specials(text).tolist()
  assert prompt.count(tok.eos_id) == 2 and prompt.count(tok.pad_id) == 1, prompt


def test_hf_tokenizer_without_specials_appends_ids(tmp_path):
  raw = _write_hf_tokenizer(tmp_path / "plain.json", [])
  tok = HFTokenizer(tmp_path / "plain.json")
  base = raw.get_vocab_size()
  assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (base, base + 1, base + 2)
  assert tok.decode(list(tok.encode("lazy dog")) + [tok.eos_id]) == "lazy dog"


def test_sentencepiece_round_trip(tmp_path):
  spm = pytest.importorskip("sentencepiece")
  corpus = tmp_path / "corpus.txt"
  corpus.write_text(
    ("the quick brown fox jumps over the lazy dog\npack my box with five dozen liquor jugs\n") * 10
  )
  spm.SentencePieceTrainer.train(
    input=str(corpus),
    model_prefix=str(tmp_path / "sp"),
    vocab_size=60,
    model_type="bpe",
    character_coverage=1.0,
    minloglevel=2,
    pad_id=3,
  )
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
