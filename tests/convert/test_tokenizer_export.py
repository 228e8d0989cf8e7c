"""A run's tokenizer written in transformers' form (diffjax.convert.tokenizer_files): the files
encode text to exactly the ids diffjax encodes, read back by diffjax itself, by the tokenizers
library and, where it is installed, by transformers' AutoTokenizer."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from diffjax.convert.tokenizer_files import tokenizer_spec, write_tokenizer_files
from diffjax.data import load_tokenizer
from diffjax.data.tokenizers import ByteTokenizer

tokenizers = pytest.importorskip("tokenizers", reason="needs the [tokenizers] extra")

from helpers import write_bpe_tokenizer  # noqa: E402

TEXTS = [
  "Hello, world!",
  "  two  spaces\tand a tab\n\nnew paragraph ",
  "d\u00e9j\u00e0 vu \u2014 \u65e5\u672c\u8a9e \u2603 \U0001f600",
  "",
  "x" * 300,
]


def _random_texts(n=20, seed=0):
  rng = np.random.default_rng(seed)
  pools = [range(0x20, 0x7F), range(0x00, 0x20), range(0xA0, 0x800), range(0x4E00, 0x4F00)]
  out = []
  for _ in range(n):
    chars = [chr(int(rng.choice(list(pools[rng.integers(len(pools))])))) for _ in range(40)]
    out.append("".join(chars))
  return out


def _auto_tokenizer(directory):
  transformers = pytest.importorskip("transformers")
  return transformers.AutoTokenizer.from_pretrained(directory)


def test_the_byte_tokenizer_export_is_one_token_per_byte_everywhere(tmp_path):
  tok = ByteTokenizer()
  names = write_tokenizer_files(str(tmp_path), tok, model_max_length=96)
  assert names == ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
  assert tokenizer_spec(str(tmp_path)) == "byte"  # diffjax reads it back as its own
  file_tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
  assert file_tok.get_vocab_size(with_added_tokens=True) == tok.vocab_size
  as_hf_file = load_tokenizer(str(tmp_path / "tokenizer.json"))  # diffjax's reader of such files
  assert (as_hf_file.eos_id, as_hf_file.pad_id, as_hf_file.vocab_size) == (256, 257, 258)
  for text in TEXTS + _random_texts():
    want = tok.encode(text).tolist()
    assert file_tok.encode(text, add_special_tokens=False).ids == want, text
    assert file_tok.decode(want) == text
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  assert config["model_max_length"] == 96 and config["bos_token"] is None
  hf = _auto_tokenizer(str(tmp_path))
  assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id) == (256, 257, None)
  for text in TEXTS + _random_texts(seed=1):
    # lm-eval's hf model encodes without special tokens; with them nothing is added either.
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text).tolist(), text
    assert hf.encode(text) == tok.encode(text).tolist(), text
    assert hf.decode(tok.encode(text)) == text


@pytest.mark.parametrize("specials", [("</s>", "<pad>"), ()])
def test_an_hf_tokenizer_export_keeps_the_ids_diffjax_appended(specials, tmp_path):
  """A file without end-of-document and padding tokens: diffjax appended ids for them, and the
  export must name those ids as special tokens, or transformers would not know them."""
  source = tmp_path / "bpe.json"
  write_bpe_tokenizer(source, special_tokens=specials)
  tok = load_tokenizer(str(source))
  out = tmp_path / "out"
  out.mkdir()
  write_tokenizer_files(str(out), tok, model_max_length=64)
  again = load_tokenizer(tokenizer_spec(str(out)))
  assert (again.eos_id, again.pad_id, again.vocab_size) == (tok.eos_id, tok.pad_id, tok.vocab_size)
  text = "the quick brown fox jumps over the lazy dog, again"
  assert again.encode(text).tolist() == tok.encode(text).tolist()
  hf = _auto_tokenizer(str(out))
  assert (hf.eos_token_id, hf.pad_token_id) == (tok.eos_id, tok.pad_id)
  assert hf.encode(text, add_special_tokens=False) == tok.encode(text).tolist()


def test_a_sentencepiece_run_is_refused_rather_than_exported_with_other_ids(tmp_path):
  """transformers' tokenizers from a .model file skip SentencePiece's whitespace normalisation,
  so they encode some text to other ids: the export refuses naming the way out."""
  spm = pytest.importorskip("sentencepiece")
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 10)
  spm.SentencePieceTrainer.train(
    input=str(corpus),
    model_prefix=str(tmp_path / "sp"),
    vocab_size=40,
    model_type="bpe",
    character_coverage=1.0,
    minloglevel=2,
  )
  with pytest.raises(ValueError, match="export with --tokenizer=none"):
    write_tokenizer_files(
      str(tmp_path), load_tokenizer(str(tmp_path / "sp.model")), model_max_length=8
    )
  assert not os.path.exists(tmp_path / "tokenizer_config.json")
