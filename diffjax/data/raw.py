"""Raw corpora for `prepare` and the tokenizer trainer: JSONL (a text field), Parquet (a text
column) and plain text files (one document per file), split into deterministic work units.

A work unit is one JSONL or Parquet file, or up to `files_per_unit` consecutive text files;
units are numbered in input order, so the n-th document of the corpus is the same on every run.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections.abc import Iterator, Sequence

from diffjax.data.sources import resolve_paths, stdlib_files

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)


@dataclasses.dataclass(frozen=True)
class Unit:
  """Files read together into consecutive shards. kind: "jsonl", "parquet" or "text"."""

  index: int
  kind: str
  files: tuple[str, ...]


def file_kind(path: str) -> str:
  if path.endswith(JSONL_SUFFIXES):
    return "jsonl"
  if path.endswith(PARQUET_SUFFIXES):
    return "parquet"
  return "text"


def plan_units(inputs: Sequence[str], files_per_unit: int = 256) -> list[Unit]:
  """Work units of `inputs` (files, directories, globs, or "stdlib" for the default corpus)."""
  files: list[str] = []
  for spec in inputs:
    files.extend(stdlib_files() if spec == "stdlib" else resolve_paths([spec]))
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


def iter_documents(unit: Unit, text_field: str = "text") -> Iterator[str | bytes]:
  """The documents of `unit` in order: str for JSONL / Parquet, raw bytes for text files."""
  if unit.kind == "text":
    for path in unit.files:
      with open(path, "rb") as f:
        yield f.read()
  elif unit.kind == "jsonl":
    path = unit.files[0]
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
      for line_no, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          text = json.loads(line)[text_field]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
          raise ValueError(
            f"{path}:{line_no}: not a JSON object with a {text_field!r} field "
            f"({type(e).__name__}: {e}); pass --text_field=<name>."
          ) from None
        yield text if isinstance(text, str) else str(text)
  else:
    pq = require_pyarrow()
    table = pq.ParquetFile(unit.files[0])
    if text_field not in table.schema_arrow.names:
      raise ValueError(
        f"{unit.files[0]} has no column {text_field!r} (columns: "
        f"{table.schema_arrow.names}); pass --text_field=<name>."
      )
    for batch in table.iter_batches(columns=[text_field], batch_size=1024):
      for text in batch.column(0).to_pylist():
        yield text or ""


def iter_texts(inputs: Sequence[str], text_field: str = "text") -> Iterator[str]:
  """Every document of `inputs` as text (bytes decoded as UTF-8, errors replaced)."""
  for unit in plan_units(inputs):
    for doc in iter_documents(unit, text_field):
      yield doc.decode("utf-8", errors="replace") if isinstance(doc, bytes) else doc
