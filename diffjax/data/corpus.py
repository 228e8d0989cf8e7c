"""What the training pipeline reads: documents by global id, from shards or from memory.

A prepared corpus's shards (:class:`ShardCorpus`); the embedded corpus and text files, prepared
into the data cache on first use (:func:`cached_corpus`) and then read like a prepared corpus; or
a document source in memory such as a task mixed into training (:class:`SourceCorpus`).
"""

from __future__ import annotations

import collections
import fcntl
import functools
import glob
import hashlib
import json
import os
import sys
import sysconfig
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from diffjax.data.manifest import Manifest, read_manifest, tokenizer_fingerprint
from diffjax.data.shards import TokenShard
from diffjax.data.sources import stdlib_files
from diffjax.data.tokenizers import Tokenizer, load_tokenizer

# Where the embedded corpus and text files are prepared on first use.
CACHE_ENV = "DIFFJAX_DATA_CACHE"
# Bumped when the cached preparation would differ for the same inputs.
_CACHE_VERSION = 2


class Corpus(Protocol):
  """Documents by global id, ``num_documents`` of them in a fixed order, grouped into ``groups``
  (the shards; an epoch visits them in groups, `diffjax.data.streaming.EpochOrder`).
  ``tokens(d)`` is document d's ids, ``weights(d)`` its per-token loss weights or None;
  `capped` keeps a prefix (``data.max_documents``, ``data.max_tokens``)."""

  name: str
  num_documents: int
  num_tokens: int
  groups: tuple[int, ...]

  def tokens(self, doc: int) -> np.ndarray: ...

  def weights(self, doc: int) -> np.ndarray | None: ...


class ShardCorpus:
  """The documents of a prepared corpus, keeping at most ``max_open`` shards open (least
  recently used closed first). Opening a ``.tokens`` shard reads its 32-byte header, so touching
  a whole group of shards for the first batch costs about as much as touching one."""

  def __init__(self, manifest: Manifest, max_open: int = 34):
    self.manifest = manifest
    self.name = manifest.directory
    self.groups = tuple(s.num_documents for s in manifest.shards)
    self.num_documents = manifest.num_documents
    self.num_tokens = manifest.num_tokens
    self._offsets_Sp1 = manifest.doc_offsets_Sp1
    self.max_open = max(1, int(max_open))
    self._open: collections.OrderedDict = collections.OrderedDict()
    # The training lanes read in a background thread while evaluation reads in the main one: a
    # read holds the lock, since another thread's open may close the shard it reads (and the
    # file descriptor's number, reused, would then read another file).
    self._lock = threading.Lock()

  def _shard_locked(self, s: int) -> TokenShard:
    reader = self._open.get(s)
    if reader is not None:
      self._open.move_to_end(s)
      return reader
    shard = self.manifest.shards[s]
    reader = TokenShard(shard.path)
    if len(reader) != shard.num_documents:
      n = len(reader)
      reader.close()
      raise ValueError(
        f"Shard {shard.path} holds {n} documents but the manifest says "
        f"{shard.num_documents}: the prepared directory is inconsistent; prepare "
        "it again."
      )
    self._open[s] = reader
    while len(self._open) > self.max_open:
      self._open.popitem(last=False)[1].close()
    return reader

  def tokens(self, doc: int) -> np.ndarray:
    s = int(np.searchsorted(self._offsets_Sp1, doc, side="right")) - 1
    with self._lock:
      return self._shard_locked(s)[int(doc - self._offsets_Sp1[s])]

  def weights(self, doc: int) -> None:
    del doc
    return None

  def shard_digests(self) -> tuple[str, ...] | None:
    """The SHA-256 of each shard's contents, as prepare recorded them (None for a corpus
    prepared before it recorded them)."""
    digests = tuple(s.sha256 for s in self.manifest.shards)
    return None if None in digests else digests

  # A DocumentSource too (e.g. the filler text of a retrieval task).
  def __len__(self) -> int:
    return self.num_documents

  def __getitem__(self, doc: int) -> np.ndarray:
    if not 0 <= doc < self.num_documents:
      raise IndexError(f"document {doc} out of range for {self.num_documents} documents")
    return self.tokens(doc)

  def __repr__(self) -> str:
    return (
      f"ShardCorpus({self.name!r}, documents={self.num_documents:,}, tokens={self.num_tokens:,})"
    )


class SourceCorpus:
  """A document source in memory (``len``, ``source[i]``, and optionally ``weighted(i)`` giving
  (tokens, per-token 0/1 loss weights)) as a corpus of one group."""

  def __init__(self, source):
    self.source = source
    self.name = getattr(source, "name", type(source).__name__)
    self.num_documents = len(source)
    self.groups = (self.num_documents,)
    self._weighted = getattr(source, "weighted", None)
    self._tokens_cache: int | None = None

  @property
  def num_tokens(self) -> int:
    if self._tokens_cache is None:
      self._tokens_cache = sum(int(np.size(self.source[i])) for i in range(self.num_documents))
    return self._tokens_cache

  def tokens(self, doc: int) -> np.ndarray:
    return _ids(self.source[doc], doc, self.name)

  def weights(self, doc: int) -> np.ndarray | None:
    if self._weighted is None:
      return None
    return np.asarray(self._weighted(doc)[1]).reshape(-1)

  def __len__(self) -> int:
    return self.num_documents

  def __getitem__(self, doc: int) -> np.ndarray:
    return self.tokens(doc)


def _ids(doc, index: int, name: str) -> np.ndarray:
  arr = np.asarray(doc)
  if arr.ndim != 1:
    raise ValueError(
      f"Document {index} of {name!r} has shape {arr.shape}; documents must be 1-D "
      "arrays of token ids."
    )
  return arr.astype(np.int32, copy=False)


class CappedCorpus:
  """The first documents of ``corpus`` up to ``max_documents`` and ``max_tokens`` tokens (the
  last kept document cut), without empty documents' effect on the counts."""

  def __init__(self, corpus: Corpus, max_documents: int | None, max_tokens: int | None):
    self.corpus = corpus
    self.name = corpus.name
    n = corpus.num_documents if max_documents is None else min(max_documents, corpus.num_documents)
    self._last_len = None
    if max_tokens is not None:
      total = 0
      for d in range(n):
        size = int(corpus.tokens(d).size)
        if total + size >= max_tokens:
          n, self._last_len = d + 1, max_tokens - total
          break
        total += size
    self.num_documents = n
    self.groups = _cut_groups(corpus.groups, n)
    self._num_tokens = None

  @property
  def num_tokens(self) -> int:
    if self._num_tokens is None:
      self._num_tokens = sum(int(self.tokens(d).size) for d in range(self.num_documents))
    return self._num_tokens

  def tokens(self, doc: int) -> np.ndarray:
    ids = self.corpus.tokens(doc)
    return (
      ids[: self._last_len] if doc == self.num_documents - 1 and self._last_len is not None else ids
    )

  def weights(self, doc: int) -> np.ndarray | None:
    w = self.corpus.weights(doc)
    if w is None or doc != self.num_documents - 1 or self._last_len is None:
      return w
    return w[: self._last_len]

  def __len__(self) -> int:
    return self.num_documents

  def __getitem__(self, doc: int) -> np.ndarray:
    return self.tokens(doc)

  def shard_digests(self) -> tuple[str, ...] | None:
    """The digests of the shards the prefix reads (the last one whole), if its corpus has them."""
    digests = getattr(self.corpus, "shard_digests", lambda: None)()
    return None if digests is None else digests[: len(self.groups)]


def _cut_groups(groups: Sequence[int], n: int) -> tuple[int, ...]:
  out, left = [], n
  for g in groups:
    if left <= 0:
      break
    out.append(min(g, left))
    left -= g
  return tuple(out)


def capped(corpus: Corpus, max_documents: int | None, max_tokens: int | None) -> Corpus:
  """``corpus`` itself, or its prefix when a cap is given."""
  if max_documents is None and max_tokens is None:
    return corpus
  return CappedCorpus(corpus, max_documents, max_tokens)


def cache_root() -> str:
  """The directory prepared copies of the embedded corpus and of text files are cached in:
  ``$DIFFJAX_DATA_CACHE``, else ``~/.cache/diffjax/data``."""
  root = os.path.expanduser(
    os.environ.get(CACHE_ENV) or os.path.join("~", ".cache", "diffjax", "data")
  )
  if os.path.exists(root) and not os.path.isdir(root):
    raise NotADirectoryError(
      f"The data cache {root!r} is a file, not a directory: point ${CACHE_ENV} at a directory."
    )
  return root


def _fingerprint(files: Sequence[str], tokenizer: Tokenizer) -> str:
  """A key for a preparation: the files (path, size, modification time), the tokenizer and the
  preparation format. A changed file gives another key, hence a fresh preparation."""
  h = hashlib.sha256(f"diffjax-cache/{_CACHE_VERSION}".encode())
  h.update(tokenizer_fingerprint(tokenizer).encode())
  for f in files:
    st = os.stat(f)
    h.update(json.dumps([os.path.abspath(f), st.st_size, st.st_mtime_ns]).encode())
  return h.hexdigest()[:20]


def cached_corpus(
  files: Sequence[str],
  tokenizer: Tokenizer,
  tokenizer_spec: str,
  name: str,
  *,
  progress: bool = True,
) -> ShardCorpus:
  """The prepared copy of ``files`` (one document each) in the cache, preparing it if absent.

  Preparation is the one ``python -m diffjax.data.prepare`` runs (resumable, atomic per unit),
  so an interrupted first use finishes on the next; the manifest, written last, marks it
  complete. Files already prepared are read back without touching the inputs' contents.
  """
  from diffjax.data.prepare import prepare  # pylint: disable=import-outside-toplevel

  directory = os.path.join(cache_root(), f"{name}-{_fingerprint(files, tokenizer)}")
  manifest_file = os.path.join(directory, "manifest.json")
  if not os.path.isfile(manifest_file):
    os.makedirs(cache_root(), exist_ok=True)
    # Processes starting together (test workers, the runs of a comparison) prepare it once.
    with open(directory + ".lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      if not os.path.isfile(manifest_file):
        if progress:
          print(
            f"diffjax: preparing {name} ({len(files):,} files) into {directory} (once)",
            file=sys.stderr,
            flush=True,
          )
        # The files as named: a name holding glob characters is no pattern here.
        prepare([glob.escape(f) for f in files], directory, tokenizer_spec, progress=False)
  return ShardCorpus(read_manifest(directory))


def stdlib_corpus(tokenizer: str = "byte"):
  """The default corpus: one document per standard-library `.py` file (see `stdlib_files`),
  about 730 files and 12 M bytes on CPython 3.11, prepared into the data cache on first use
  (`diffjax.data.corpus.cached_corpus`) and read from there after.

  Args:
    tokenizer: a `load_tokenizer` spec: "byte", or a path to a .json / .model file.
  Returns:
    A `diffjax.data.corpus.ShardCorpus` (also a `DocumentSource`).
  """
  return _stdlib_corpus(tokenizer)


@functools.lru_cache(maxsize=4)
def _stdlib_corpus(tokenizer: str):
  files = stdlib_files()
  if not files:
    raise FileNotFoundError(
      f"No standard-library .py files found under {sysconfig.get_paths()['stdlib']!r}. "
      "Use data.kind='text' with data.paths=... to train on your own files instead."
    )
  return cached_corpus(files, load_tokenizer(tokenizer), tokenizer, "stdlib")
