"""A corpus that is one text file: split into documents at blank lines, else into chunks of
lines, and trained on; one too small for a validation split is named by the user's path."""

import os

import pytest
from helpers import tiny_config  # noqa: E402

from diffjax.data.raw import CHUNK_BYTES, plan_units, split_text
from diffjax.train import train_and_evaluate


def test_paragraphs_are_the_documents():
  data = b"first para\nline two\n\n\nsecond\n  \nthird\r\n\r\nfourth\n"
  assert split_text(data) == [b"first para\nline two", b"second", b"third", b"fourth\n"]


def test_without_blank_lines_chunks_of_whole_lines():
  line = b"x" * 99 + b"\n"
  data = line * (3 * CHUNK_BYTES // 100)
  docs = split_text(data)
  assert len(docs) == 3 and b"".join(docs) == data
  assert all(d.endswith(b"\n") and len(d) >= CHUNK_BYTES for d in docs[:-1])


def test_a_paragraph_of_over_twice_the_chunk_is_cut_like_a_file_without_blank_lines():
  """A book shaped "Title, blank line, body without blank lines" is not two documents, one of
  which (the body) the validation split may take whole."""
  line = b"y" * 99 + b"\n"
  body = line * (5 * CHUNK_BYTES // 100)
  docs = split_text(b"A Title\n\n" + body + b"\n\nshort\n")
  assert docs[0] == b"A Title" and docs[-1] == b"short\n"
  assert b"".join(docs[1:-1]) + b"\n" == body and len(docs) == 2 + len(split_text(body))
  assert all(len(d) < 2 * CHUNK_BYTES for d in docs)
  medium = line * (2 * CHUNK_BYTES // 100)  # up to twice the chunk, a paragraph stays whole
  assert split_text(b"A Title\n\n" + medium)[1] == medium


def test_one_long_line_is_cut_between_characters():
  data = "é".encode() * CHUNK_BYTES  # two bytes each, no newline
  docs = split_text(data)
  assert len(docs) >= 2 and b"".join(docs) == data
  for d in docs:
    d.decode("utf-8")  # every piece is whole characters


def test_only_a_single_text_file_is_split(tmp_path):
  one = tmp_path / "book.txt"
  one.write_text("a\n\nb\n")
  (tmp_path / "two.txt").write_text("c\n")
  assert [u.kind for u in plan_units([str(one)])] == ["text_split"]
  assert [u.kind for u in plan_units([str(tmp_path / "*.txt")])] == ["text"]


def _text_config(path):
  c = tiny_config(steps=2)
  c.data.kind, c.data.paths, c.data.max_documents = "text", (str(path),), None
  return c


@pytest.mark.integration
def test_a_single_text_file_trains(tmp_path):
  book = tmp_path / "book.txt"
  paragraph = "".join(f"line {i} of a paragraph of the book\n" for i in range(20))
  book.write_text("\n".join(paragraph for _ in range(300)))  # ~200 KB, 300 paragraphs
  wd = tmp_path / "run"
  result = train_and_evaluate(_text_config(book), str(wd))
  assert result["step"] == 2 and (wd / "DONE").exists()


def test_a_file_too_small_to_split_names_the_file(tmp_path):
  small = tmp_path / "note.txt"
  small.write_text("just one paragraph\nof two lines\n")
  with pytest.raises(ValueError, match="too small") as e:
    train_and_evaluate(_text_config(small), str(tmp_path / "run"))
  assert str(small) in str(e.value) and "blank lines" in str(e.value)
  assert os.environ.get("DIFFJAX_DATA_CACHE", "~") not in str(e.value)
