"""Document sources: random-access sequences of tokenized documents.

A `DocumentSource` is anything with `name`, `__len__` and `__getitem__(i) -> (N,) int32 array`.
The pipeline reads every document once, appends eos after each and packs them into training
windows, so a synthetic task (for example a retrieval benchmark generator) only has to implement
these three members to be trained or evaluated on.

Implementations here:
  * `TextFileSource`: one document per text file; files, directories and globs.
  * `ArrayRecordSource`: one document per ArrayRecord record of little-endian int32 token ids
    (`write_array_record` converts any sequence of documents to that format).
  * `stdlib_corpus()`: the `.py` files of the running Python's standard library, the default
    corpus, so a fresh machine can train without downloading anything.
"""

from __future__ import annotations

import functools
import glob
import os
import sysconfig
from typing import Iterable, Protocol, Sequence, runtime_checkable

import numpy as np

from diffjax.data.packing import PackedCorpus
from diffjax.data.tokenizers import Tokenizer, load_tokenizer

_GLOB_CHARS = frozenset("*?[")


@runtime_checkable
class DocumentSource(Protocol):
  """A random-access sequence of documents, each a (N,) int32 array of token ids."""

  name: str

  def __len__(self) -> int:
    """Number of documents."""
    ...

  def __getitem__(self, index: int) -> np.ndarray:
    """Returns document `index` as a (N,) int32 array (N may be 0)."""
    ...


def _walk_sorted(directory: str) -> list[str]:
  """All regular files under `directory`, recursively, sorted; hidden files and dirs skipped."""
  found = []
  for root, dirs, files in os.walk(directory):
    dirs[:] = [d for d in dirs if not d.startswith(".")]
    found.extend(os.path.join(root, f) for f in files if not f.startswith("."))
  return sorted(found)


def resolve_paths(patterns: Sequence[str] | str) -> list[str]:
  """Expands files, directories and globs into a deterministic list of files.

  Each pattern is one of: a file; a directory (every non-hidden file below it, recursively); a
  glob (`*`, `?`, `[...]`, and `**` for any depth). Each pattern's matches are sorted, patterns
  keep their given order, and a file matched twice is kept at its first position.

  Raises:
    FileNotFoundError: a pattern names nothing, or matches no file.
  """
  if isinstance(patterns, (str, os.PathLike)):
    patterns = [patterns]
  patterns = [os.fspath(p) for p in patterns]
  if not patterns:
    raise ValueError("No paths given. Pass files, directories or globs, e.g. ('data/*.txt',).")
  accepted = "Accepted: an existing file, a directory (read recursively) or a glob such as 'data/**/*.txt'."
  files: list[str] = []
  for pattern in patterns:
    expanded = os.path.expanduser(pattern)
    if _GLOB_CHARS & set(expanded):
      matches = sorted(m for m in glob.glob(expanded, recursive=True) if os.path.isfile(m))
      if not matches:
        raise FileNotFoundError(f"Glob {pattern!r} matched no files. {accepted}")
    elif os.path.isdir(expanded):
      matches = _walk_sorted(expanded)
      if not matches:
        raise FileNotFoundError(f"Directory {pattern!r} contains no files. {accepted}")
    elif os.path.isfile(expanded):
      matches = [expanded]
    else:
      raise FileNotFoundError(f"Path {pattern!r} does not exist. {accepted}")
    files.extend(matches)
  return list(dict.fromkeys(files))


class TextFileSource:
  """One document per text file, tokenized once at construction and kept in memory.

  Args:
    patterns: files, directories (recursive, sorted) and globs (sorted); see `resolve_paths`.
    tokenizer: a `Tokenizer`, or a spec for `load_tokenizer` ("byte", "x.json", "x.model").
    name: shown in logs; defaults to the patterns.

  Files are read as UTF-8 with undecodable bytes replaced by U+FFFD, except with the
  byte tokenizer, which tokenizes the raw bytes exactly.
  """

  def __init__(self, patterns: Sequence[str] | str, tokenizer: Tokenizer | str = "byte", *,
               name: str | None = None):
    self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    self.paths = resolve_paths(patterns)
    self.name = name or f"text:{','.join(map(str, [patterns] if isinstance(patterns, str) else patterns))}"
    self._docs = PackedCorpus.from_documents(_tokenize_files(self.paths, self.tokenizer),
                                            self.tokenizer.eos_id)

  @property
  def num_tokens(self) -> int:
    """Total tokens over all documents (no eos counted)."""
    return int(self._docs.tokens_N.size)

  def __len__(self) -> int:
    return self._docs.num_documents

  def __getitem__(self, index: int) -> np.ndarray:
    if not -len(self) <= index < len(self):
      raise IndexError(f"document index {index} out of range for {len(self)} documents in {self.name}")
    return self._docs.document(index % len(self))

  def __repr__(self) -> str:
    return f"TextFileSource({self.name!r}, documents={len(self)}, tokens={self.num_tokens})"


def _tokenize_files(paths: Sequence[str], tokenizer: Tokenizer) -> list[np.ndarray]:
  raw = []
  for path in paths:
    with open(path, "rb") as f:
      raw.append(f.read())
  encode_bytes = getattr(tokenizer, "encode_bytes", None)
  if encode_bytes is not None:
    return [encode_bytes(b) for b in raw]
  texts = [b.decode("utf-8", errors="replace") for b in raw]
  encode_batch = getattr(tokenizer, "encode_batch", None)
  if encode_batch is not None:
    return list(encode_batch(texts))
  return [tokenizer.encode(t) for t in texts]


# Directories of the standard library left out of the default corpus. `test`, `tests` and
# `idle_test` hold CPython's own test suites: many distributions ship them separately or not at
# all (so the corpus would differ between machines), they are dominated by repetitive
# assertion code, and they include deliberately broken inputs (files in legacy encodings, Python 2
# syntax under lib2to3's test data). `site-packages` is third-party code that depends on what
# happens to be installed. `__pycache__` holds no sources.
_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                                   "__pycache__"})


def stdlib_files(root: str | None = None) -> list[str]:
  """Sorted `.py` files of the standard library at `root` (default: the running Python's).

  Excludes the directories in `_STDLIB_EXCLUDED_DIRS` (test suites, installed packages) and the
  `_sysconfigdata_*` modules, which record how this particular interpreter was built.
  """
  root = root or sysconfig.get_paths()["stdlib"]
  found = []
  for dirpath, dirs, files in os.walk(root):
    dirs[:] = [d for d in dirs if d not in _STDLIB_EXCLUDED_DIRS and not d.startswith(".")]
    found.extend(os.path.join(dirpath, f) for f in files
                 if f.endswith(".py") and not f.startswith("_sysconfigdata"))
  return sorted(found)


@functools.lru_cache(maxsize=4)
def _cached_stdlib(tokenizer_spec: str, root: str | None) -> TextFileSource:
  files = stdlib_files(root)
  if not files:
    raise FileNotFoundError(
        f"No standard-library .py files found under {root or sysconfig.get_paths()['stdlib']!r}. "
        "Use DataConfig(kind='text', paths=...) to train on your own files instead."
    )
  return TextFileSource(files, tokenizer_spec, name=f"stdlib:{root or 'python'}")


def stdlib_corpus(tokenizer: str = "byte", root: str | None = None) -> TextFileSource:
  """The default corpus: one document per standard-library `.py` file (see `stdlib_files`).

  About 1,900 files and 12 M bytes on CPython 3.11. The tokenized corpus is cached in memory per
  (tokenizer spec, root), so building datasets again in the same process costs nothing.

  Args:
    tokenizer: a `load_tokenizer` spec: "byte", or a path to a .json / .model file.
    root: the standard-library directory; defaults to `sysconfig.get_paths()["stdlib"]`.
  """
  return _cached_stdlib(tokenizer, root)


class ArrayRecordSource:
  """One document per record of one or more ArrayRecord files.

  Record encoding: the document's token ids as little-endian int32 (`np.dtype('<i4')`), with no
  header; a record of 4 * N bytes is a document of N tokens. `write_array_record` produces it.
  Records are read lazily, so the files may be larger than memory until the pipeline packs them.
  """

  def __init__(self, paths: Sequence[str] | str, *, name: str | None = None):
    from array_record.python import array_record_data_source  # Optional heavy import.

    self.paths = resolve_paths(paths)
    self.name = name or f"array_record:{','.join(self.paths)}"
    self._source = array_record_data_source.ArrayRecordDataSource(self.paths)

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> np.ndarray:
    if not -len(self) <= index < len(self):
      raise IndexError(f"document index {index} out of range for {len(self)} documents in {self.name}")
    return _decode_record(self._source[index % len(self)], index, self.name)

  def read_all(self) -> list[np.ndarray]:
    """Every document, in order, read in one batched call."""
    records = self._source.__getitems__(range(len(self)))
    return [_decode_record(r, i, self.name) for i, r in enumerate(records)]

  def __repr__(self) -> str:
    return f"ArrayRecordSource({self.paths!r}, documents={len(self)})"


def _decode_record(record: bytes, index: int, name: str) -> np.ndarray:
  if len(record) % 4:
    raise ValueError(
        f"Record {index} of {name} has {len(record)} bytes, not a multiple of 4: it is not "
        "little-endian int32 token ids. Write documents with diffjax.data.write_array_record."
    )
  return np.frombuffer(record, dtype="<i4").astype(np.int32)


def write_array_record(path: str | os.PathLike, docs: Iterable[Sequence[int] | np.ndarray]) -> int:
  """Writes `docs` (each a 1-D sequence of token ids) to an ArrayRecord file, one record each.

  Ids are stored as little-endian int32 (see `ArrayRecordSource`); each record is its own group
  so random access reads one record. Returns the number of documents written.
  """
  from array_record.python import array_record_module

  path = os.fspath(path)
  writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
  count = 0
  try:
    for doc in docs:
      ids = np.asarray(doc)
      if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) and ids.size:
        raise ValueError(
            f"Document {count} has shape {ids.shape} and dtype {ids.dtype}; each document must be a "
            "1-D sequence of integer token ids."
        )
      if ids.size and (ids.min() < np.iinfo(np.int32).min or ids.max() > np.iinfo(np.int32).max):
        raise ValueError(f"Document {count} has ids outside int32: min {ids.min()}, max {ids.max()}.")
      writer.write(ids.astype("<i4").tobytes())
      count += 1
  finally:
    writer.close()
  return count


def read_documents(source: DocumentSource) -> list[np.ndarray]:
  """Every document of `source` as a (N_i,) int32 array, using a batched reader if it has one."""
  read_all = getattr(source, "read_all", None)
  docs = read_all() if read_all is not None else [source[i] for i in range(len(source))]
  out = []
  for i, doc in enumerate(docs):
    arr = np.asarray(doc)
    if arr.ndim != 1:
      raise ValueError(f"Document {i} of source {getattr(source, 'name', source)!r} has shape "
                       f"{arr.shape}; documents must be 1-D arrays of token ids.")
    out.append(arr.astype(np.int32, copy=False))
  return out


__all__ = [
    "ArrayRecordSource", "DocumentSource", "TextFileSource", "read_documents",
    "resolve_paths", "stdlib_corpus", "stdlib_files", "write_array_record",
]
