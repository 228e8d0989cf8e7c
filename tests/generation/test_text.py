"""TextStream: a sequence's text released token by token, whole characters only, ending before a
stop string; and the generation command's stream, which writes it."""

from __future__ import annotations

import io

import numpy as np
import pytest

from diffjax.data import ByteTokenizer
from diffjax.generation.command import _Stream
from diffjax.generation.text import TextStream


@pytest.mark.parametrize(
  "tokens, stops, want_pieces, want_text",
  [
    (b"hello world", ["wor"], None, "hello "),
    (b"abcabc", ["ca"], None, "ab"),
    ("héllo".encode(), [], None, "héllo"),  # a cut UTF-8 character waits for its second byte
    (b"abcdef", ["xyz", "dex"], None, "abcdef"),
  ],
)
def test_text_is_released_whole_and_ends_before_a_stop(tokens, stops, want_pieces, want_text):
  stream = TextStream(ByteTokenizer(), stops)
  pieces = [stream.add(t) for t in tokens]
  pieces.append(stream.finish())
  assert "".join(pieces) == want_text == stream.text
  assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("kind", ["hf", "sentencepiece"])
def test_text_from_a_real_tokenizer_decodes_a_few_ids_per_token(kind, tmp_path):
  """Each token decodes a short window of ids, not the whole sequence (which would make a long
  answer quadratic), and the pieces add up to the full decode, stop strings included."""
  from diffjax.data import load_tokenizer  # pylint: disable=import-outside-toplevel

  text = "déjà vu: the quick brown fox 日本 jumps over the lazy dog, twice.  Spaces  kept!"
  corpus = [text, "the quick brown fox jumps over the lazy dog"] * 20
  if kind == "hf":
    from helpers import write_bpe_tokenizer  # pylint: disable=import-outside-toplevel

    pytest.importorskip("tokenizers")
    write_bpe_tokenizer(tmp_path / "tok.json", texts=corpus)
    tok = load_tokenizer(str(tmp_path / "tok.json"))
  else:
    spm = pytest.importorskip("sentencepiece")
    (tmp_path / "corpus.txt").write_text("\n".join(corpus))
    spm.SentencePieceTrainer.train(
      input=str(tmp_path / "corpus.txt"),
      model_prefix=str(tmp_path / "sp"),
      vocab_size=320,
      hard_vocab_limit=False,
      remove_extra_whitespaces=False,
      model_type="bpe",
      character_coverage=1.0,
      byte_fallback=True,
      minloglevel=2,
    )
    tok = load_tokenizer(str(tmp_path / "sp.model"))
  ids = [int(i) for i in tok.encode(text)]
  assert tok.decode(ids) == text and len(ids) > 30

  windows = []

  class Counting:
    eos_id, vocab_size = tok.eos_id, tok.vocab_size

    def decode(self, some):
      windows.append(len(some))
      return tok.decode(some)

  for stops, want in [((), text), (("lazy",), text[: text.index("lazy")])]:
    windows.clear()
    stream = TextStream(Counting(), stops)
    pieces = [stream.add(t) for t in ids]
    stream_windows = list(windows)
    pieces.append(stream.finish())
    assert "".join(pieces) == want == stream.text
    assert max(stream_windows) <= 6, stream_windows  # byte-fallback pieces of 日本 need a few


def test_the_generation_command_writes_whole_characters_with_a_bpe_tokenizer(tmp_path):
  from helpers import write_bpe_tokenizer  # pylint: disable=import-outside-toplevel

  from diffjax.data import load_tokenizer  # pylint: disable=import-outside-toplevel

  pytest.importorskip("tokenizers")
  text = "héllo 日本語 ok"
  write_bpe_tokenizer(tmp_path / "tok.json", texts=["hello world ok"] * 20)
  tok = load_tokenizer(str(tmp_path / "tok.json"))
  ids = [int(i) for i in tok.encode(text)]
  assert tok.decode(ids) == text and len(ids) > len(text)  # characters split over byte tokens
  for tokenizer, tokens in ((tok, ids), (ByteTokenizer(), list(text.encode()))):
    out = io.StringIO()
    stream = _Stream(tokenizer, out)
    for t in tokens:
      stream(0, np.array([t]), np.array([True]))
      assert "\ufffd" not in out.getvalue()
    stream.close()
    assert out.getvalue() == text + "\n"


def test_the_prompt_is_written_with_the_first_token_so_a_refused_call_writes_nothing():
  out = io.StringIO()
  stream = _Stream(ByteTokenizer(), out, prefix="ab")
  assert out.getvalue() == ""
  stream(0, np.array([99]), np.array([True]))
  stream.close()
  assert out.getvalue() == "abc\n"


def _sentencepiece(tmp_path):
  """A small SentencePiece model (words start with U+2581, whose space a lone decode drops)."""
  spm = pytest.importorskip("sentencepiece")
  from diffjax.data import load_tokenizer  # pylint: disable=import-outside-toplevel

  (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 50)
  spm.SentencePieceTrainer.train(
    input=str(tmp_path / "corpus.txt"),
    model_prefix=str(tmp_path / "sp"),
    vocab_size=40,
    model_type="bpe",
    eos_id=2,
    pad_id=3,
    minloglevel=2,
  )
  return load_tokenizer(str(tmp_path / "sp.model"))


def test_tokens_after_a_prompt_are_the_text_they_add_to_it(tmp_path):
  """Cut anywhere, the prompt's text and the stream's add up to the whole decode: the first
  generated word keeps the space a SentencePiece decode of it alone would drop."""
  tok = _sentencepiece(tmp_path)
  text = "the quick brown fox jumps over the lazy dog"
  ids = [int(i) for i in tok.encode(text)]
  assert tok.decode(ids) == text
  for k in range(1, len(ids)):
    prompt, gen = ids[:k], ids[k:]
    for stops in ((), ("zy",)):
      stream = TextStream(tok, stops, context=prompt)
      got = "".join(stream.add(t) for t in gen) + stream.finish()
      want = text[len(tok.decode(prompt)) :]
      if stops and "zy" in want:
        want = want[: want.index("zy")]
      assert got == stream.text == want, (k, stops)


def test_the_generation_command_writes_the_completion_after_the_prompt(tmp_path, monkeypatch):
  """``python -m diffjax.generation``'s output is the decode of prompt and new tokens."""
  import types  # pylint: disable=import-outside-toplevel

  from diffjax.generation import command  # pylint: disable=import-outside-toplevel

  tok = _sentencepiece(tmp_path)
  gen = [int(i) for i in tok.encode("the quick brown fox")][len(tok.encode("the quick")) :]
  model = types.SimpleNamespace(config=types.SimpleNamespace(attention="transformer"))
  monkeypatch.setattr(
    command, "load_model", lambda **kw: types.SimpleNamespace(model=model, step=1)
  )
  monkeypatch.setattr(command, "model_tokenizer", lambda *a: tok)

  def generate(model, prompts, on_tokens, **kw):
    for step, t in enumerate(gen):
      on_tokens(step, np.array([t]), np.array([True]))
    return types.SimpleNamespace(
      prompt_tokens=[len(prompts[0])],
      tokens=[gen],
      decode_steps=len(gen),
      prefill_seconds=1.0,
      decode_seconds=1.0,
      compile_seconds=0.0,
      stopped=[False],
    )

  monkeypatch.setattr(command, "generate", generate)
  out = io.StringIO()
  monkeypatch.setattr(command.sys, "stdout", out)
  assert command.main([f"--workdir={tmp_path}", "--prompt=the quick"]) == 0
  assert out.getvalue() == "the quick brown fox\n"


class _Bytes:
  """A tokenizer whose tokens are byte strings (a token may end inside a UTF-8 character)."""

  eos_id, pad_id = 90, 91

  def __init__(self, pieces):
    self.pieces = pieces
    self.vocab_size = len(pieces)

  def decode(self, ids):
    return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_text_held_back_at_the_end_still_ends_before_a_stop():
  """A last token that ends inside a character is held back whole; released by ``finish``,
  its text is still cut before a stop string in it."""
  tok = _Bytes([b"ab", "na€".encode()[:3], "€".encode()[1:]])
  stream = TextStream(tok, ["na"])
  assert stream.add(0) == "ab" and stream.add(1) == ""
  assert stream.finish() == "" and stream.stopped and stream.text == "ab"
  stream = TextStream(tok, ["na"])  # the character completed: the same stop
  assert stream.add(0) + stream.add(1) + stream.add(2) + stream.finish() == "ab"
  stream = TextStream(tok, ["x"])
  assert "".join(stream.add(t) for t in (0, 1)) + stream.finish() == "abna\ufffd"
