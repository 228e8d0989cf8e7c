"""Raw corpora for `prepare` and the tokenizer trainer: JSONL (a text field), Parquet (a text
column) and plain text files, split into deterministic work units.

How one text file becomes documents (`split_text`) and what a work unit is: docs/data.md.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
from collections.abc import Iterator, Sequence

from diffjax.data.sources import resolve_paths, stdlib_files

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
# The documents of a single-file text corpus without blank lines (or its paragraphs of over twice
# this size): chunks of about this size.
CHUNK_BYTES = 64 * 1024
_BLANK_LINES = re.compile(rb"\r?\n(?:[ \t\r]*\n)+")


@dataclasses.dataclass(frozen=True)
class Unit:
  """Files read together into consecutive shards. kind: "jsonl", "parquet", "text" (a document
  per file) or "text_split" (the one file of a single-file text corpus, split by `split_text`)."""

  index: int
  kind: str
  files: tuple[str, ...]


def file_kind(path: str) -> str:
  if path.endswith(JSONL_SUFFIXES):
    return "jsonl"
  if path.endswith(PARQUET_SUFFIXES):
    return "parquet"
  return "text"


def is_single_text_file(files: Sequence[str]) -> bool:
  """Whether ``files`` is a corpus of one plain text file (which `split_text` splits)."""
  return len(files) == 1 and file_kind(files[0]) == "text"


def split_text(data: bytes) -> list[bytes]:
  """The documents of a single-file text corpus: its paragraphs (the text between blank lines),
  a paragraph of over twice `CHUNK_BYTES` (or a file without blank lines) cut by `_chunks`."""
  paragraphs = [p for p in _BLANK_LINES.split(data) if p.strip()]
  if len(paragraphs) < 2:
    return _chunks(data)
  return [c for p in paragraphs for c in (_chunks(p) if len(p) > 2 * CHUNK_BYTES else [p])]


def _chunks(data: bytes) -> list[bytes]:
  """Consecutive chunks of whole lines of at least `CHUNK_BYTES` (the last may be shorter; a
  line longer than that is cut at a character boundary)."""
  docs, start = [], 0
  while start < len(data):
    end = min(start + CHUNK_BYTES, len(data))
    if end < len(data):
      # To the end of the line, unless the line runs on past twice the size: then here, but
      # not inside a character.
      newline = data.find(b"\n", end, start + 2 * CHUNK_BYTES)
      if newline >= 0:
        end = newline + 1
      else:
        while end > start + 1 and (data[end] & 0xC0) == 0x80:
          end -= 1
    if data[start:end].strip():
      docs.append(data[start:end])
    start = end
  return docs


def plan_units(
  inputs: Sequence[str], files_per_unit: int = 256, exclude: str | None = None
) -> list[Unit]:
  """Work units of `inputs` (files, directories, globs, or "stdlib" for the default corpus),
  without the files under the directory `exclude` (an output written inside an input)."""
  patterns: list[str] = []
  for spec in inputs:
    patterns.extend(stdlib_files() if spec == "stdlib" else [spec])
  files = resolve_paths(patterns)
  if exclude is not None:
    inside = os.path.join(os.path.realpath(exclude), "")
    files = [f for f in files if not os.path.realpath(f).startswith(inside)]
    if not files:
      raise FileNotFoundError(
        f"The inputs {list(inputs)} hold no file outside the output {exclude!r}: name the "
        "files to prepare."
      )
  if is_single_text_file(files):
    return [Unit(0, "text_split", (files[0],))]
  units: list[Unit] = []
  run: list[str] = []
  for path in files:
    if file_kind(path) == "text":
      run.append(path)
      if len(run) == files_per_unit:
        units.append(Unit(len(units), "text", tuple(run)))
        run = []
      continue
    if run:
      units.append(Unit(len(units), "text", tuple(run)))
      run = []
    units.append(Unit(len(units), file_kind(path), (path,)))
  if run:
    units.append(Unit(len(units), "text", tuple(run)))
  return units


def require_pyarrow():
  try:
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ImportError(
      "Reading Parquet needs pyarrow, which is not installed: "
      "pip install pyarrow (or convert the files to JSONL)."
    ) from None
  return pq


def _jsonl_texts(path: str, text_field: str) -> Iterator[str]:
  """The ``text_field`` of each line of a JSONL file; a null is an empty document."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    for line_no, raw in enumerate(f, 1):
      try:  # a byte-order mark may open the file
        line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(
          f"{path}:{line_no}: not UTF-8 ({e.reason} at byte {e.start}); JSONL must be UTF-8: "
          "convert the file (e.g. iconv -f latin1 -t utf-8)."
        ) from None
      if not line.strip():
        continue
      try:
        text = json.loads(line)[text_field]
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(
          f"{path}:{line_no}: not a JSON object with a {text_field!r} field "
          f"({type(e).__name__}: {e}); another field is chosen by diffjax.data.prepare's "
          "--text_field=<name>, and train.py reads its output with data.kind='prepared'."
        ) from None
      if text is not None and not isinstance(text, str):
        raise ValueError(
          f"{path}:{line_no}: the {text_field!r} field is a {type(text).__name__}, not a "
          "string (or null, an empty document)."
        )
      yield _without_lone_surrogates(text) if text else ""


# A JSON escape such as "\ud800" that is not half of a pair decodes to a lone surrogate, which
# is no text (UTF-8 cannot encode it): scraped data has them.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _without_lone_surrogates(text: str) -> str:
  """``text`` with each lone surrogate replaced by U+FFFD, the replacement character."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError:
    return _LONE_SURROGATE.sub("\ufffd", text)
  return text


def iter_documents(unit: Unit, text_field: str = "text") -> Iterator[str | bytes]:
  """The documents of `unit` in order: str for JSONL / Parquet, raw bytes for text files."""
  if unit.kind == "text":
    for path in unit.files:
      with open(path, "rb") as f:
        yield f.read()
  elif unit.kind == "text_split":
    with open(unit.files[0], "rb") as f:
      yield from split_text(f.read())
  elif unit.kind == "jsonl":
    yield from _jsonl_texts(unit.files[0], text_field)
  else:
    pq = require_pyarrow()
    table = pq.ParquetFile(unit.files[0])
    if text_field not in table.schema_arrow.names:
      raise ValueError(
        f"{unit.files[0]} has no column {text_field!r} (columns: {table.schema_arrow.names}); "
        "another column is chosen by diffjax.data.prepare's --text_field=<name>, and train.py "
        "reads its output with data.kind='prepared'."
      )
    for batch in table.iter_batches(columns=[text_field], batch_size=1024):
      for text in batch.column(0).to_pylist():
        yield text or ""


def iter_texts(inputs: Sequence[str], text_field: str = "text") -> Iterator[str]:
  """Every document of `inputs` as text (bytes decoded as UTF-8, errors replaced)."""
  for unit in plan_units(inputs):
    for doc in iter_documents(unit, text_field):
      yield doc.decode("utf-8", errors="replace") if isinstance(doc, bytes) else doc
