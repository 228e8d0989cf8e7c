"""The token-shard file that `python -m diffjax.data.prepare` writes and the streaming pipeline
reads: documents of token ids with an offset table, readable at random in O(1).

The layout of a `.tokens` file and why not ArrayRecord: docs/data.md.
"""

from __future__ import annotations

import hashlib
import os
import struct

import numpy as np

MAGIC = b"DJXTOKS\0"
VERSION = 1
SUFFIX = ".tokens"
_HEADER = struct.Struct("<8sIIQQ")
HEADER_BYTES = _HEADER.size  # 32
_DTYPES = {2: "<u2", 4: "<i4"}
_RANGES = {2: (0, 2**16 - 1), 4: (-(2**31), 2**31 - 1)}


def token_bytes_for(vocab_size: int) -> int:
  """Bytes per stored token for a vocabulary: 2 up to 65,536 ids, else 4."""
  return 2 if vocab_size <= 2**16 else 4


def shard_bytes(num_documents: int, num_tokens: int, token_bytes: int = 4) -> int:
  """Size in bytes of a shard holding `num_documents` documents of `num_tokens` tokens."""
  return HEADER_BYTES + token_bytes * num_tokens + 8 * (num_documents + 1)


class TokenShardWriter:
  """Appends documents to a new `.tokens` file; `close()` writes the offsets and the header.

  Output is a pure function of the documents written (byte-identical on a rerun).
  """

  def __init__(self, path: str | os.PathLike, token_bytes: int = 4):
    if token_bytes not in _DTYPES:
      raise ValueError(f"token_bytes={token_bytes}; a token shard stores 2 or 4 bytes per token.")
    self.path = os.fspath(path)
    self.token_bytes = token_bytes
    self._f = open(self.path, "wb")
    self._f.write(b"\0" * HEADER_BYTES)
    self._offsets = [0]
    self._sha256 = hashlib.sha256()  # of the tokens, then the offsets

  @property
  def num_documents(self) -> int:
    return len(self._offsets) - 1

  @property
  def num_tokens(self) -> int:
    return self._offsets[-1]

  def write(self, ids) -> None:
    """Appends one document (a 1-D sequence of token ids in the range of `token_bytes`)."""
    ids_N = np.asarray(ids)
    if ids_N.ndim != 1 or (ids_N.size and not np.issubdtype(ids_N.dtype, np.integer)):
      raise ValueError(
        f"A document must be a 1-D sequence of integer token ids; got shape "
        f"{ids_N.shape} and dtype {ids_N.dtype} for {self.path}."
      )
    lo, hi = _RANGES[self.token_bytes]
    if ids_N.size and (ids_N.min() < lo or ids_N.max() > hi):
      raise ValueError(
        f"Token ids must lie in [{lo}, {hi}] for {self.token_bytes}-byte tokens; got "
        f"[{ids_N.min()}, {ids_N.max()}] for {self.path}."
      )
    data = ids_N.astype(_DTYPES[self.token_bytes]).tobytes()
    self._f.write(data)
    self._sha256.update(data)
    self._offsets.append(self._offsets[-1] + int(ids_N.size))

  @property
  def sha256(self) -> str:
    """The SHA-256 of the shard's tokens and document offsets (once closed): what the manifest
    records, so that a resume can tell a changed corpus of the same size."""
    return self._sha256.hexdigest()

  def close(self) -> None:
    if self._f.closed:
      return
    offsets = np.asarray(self._offsets, "<u8").tobytes()
    self._f.write(offsets)
    self._sha256.update(offsets)
    self._f.seek(0)
    self._f.write(
      _HEADER.pack(MAGIC, VERSION, self.token_bytes, self.num_documents, self.num_tokens)
    )
    self._f.close()

  def __enter__(self) -> TokenShardWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class TokenShard:
  """Random access to the documents of a `.tokens` file (one file descriptor, no buffers)."""

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    try:
      self._fd = os.open(self.path, os.O_RDONLY)
    except FileNotFoundError:
      raise FileNotFoundError(
        f"The token shard {self.path} is missing (its manifest lists it): the prepared "
        "directory is incomplete; copy it whole, or prepare the corpus again."
      ) from None
    try:
      head = os.pread(self._fd, HEADER_BYTES, 0)
      if len(head) < HEADER_BYTES or head[:8] != MAGIC:
        raise ValueError(
          f"{self.path} is not a diffjax token shard (bad header); prepare the "
          "corpus again with `python -m diffjax.data.prepare`."
        )
      _, version, self.token_bytes, self.num_documents, self.num_tokens = _HEADER.unpack(head)
      if version != VERSION or self.token_bytes not in _DTYPES:
        raise ValueError(
          f"{self.path} has token-shard version {version} with {self.token_bytes}-"
          f"byte tokens; this diffjax reads version {VERSION} with 2- or 4-byte "
          "tokens. Prepare the corpus again."
        )
      size = os.fstat(self._fd).st_size
      want = shard_bytes(self.num_documents, self.num_tokens, self.token_bytes)
      if size != want:
        raise ValueError(
          f"{self.path} is {size} bytes but its header ({self.num_documents} "
          f"documents, {self.num_tokens} tokens) needs {want}: the shard is "
          "truncated or damaged; prepare the corpus again."
        )
    except BaseException:
      os.close(self._fd)
      raise
    self._dtype = _DTYPES[self.token_bytes]
    self._offsets_at = HEADER_BYTES + self.token_bytes * self.num_tokens

  def __len__(self) -> int:
    return self.num_documents

  def __getitem__(self, i: int) -> np.ndarray:
    """Document `i`'s token ids, int32."""
    i = int(i)
    if not 0 <= i < self.num_documents:
      raise IndexError(f"Document {i} is outside {self.path}'s {self.num_documents} documents.")
    start, stop = struct.unpack("<QQ", os.pread(self._fd, 16, self._offsets_at + 8 * i))
    if not start <= stop <= self.num_tokens:
      raise ValueError(
        f"{self.path}: document {i} has offsets [{start}, {stop}) outside its "
        f"{self.num_tokens} tokens: the shard is damaged; prepare the corpus again."
      )
    n = stop - start
    b = self.token_bytes
    data = os.pread(self._fd, b * n, HEADER_BYTES + b * start)
    return np.frombuffer(data, self._dtype).astype(np.int32)

  def close(self) -> None:
    if self._fd >= 0:
      os.close(self._fd)
      self._fd = -1

  def __del__(self):
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except
      pass


def shard_documents(path: str | os.PathLike) -> list[np.ndarray]:
  """Every document of a `.tokens` file, in order (for tests and small files)."""
  shard = TokenShard(path)
  try:
    return [shard[i] for i in range(len(shard))]
  finally:
    shard.close()
