"""Tokenizers: text <-> int32 token ids, all loaded from local files.

Each is a `Tokenizer` (`encode`, `decode`, `vocab_size`, `eos_id`, `pad_id`); `encode` adds no
special tokens, since the data pipeline appends `eos_id` after every document (docs/data.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from diffjax.errors import import_extra

TokenIds = Sequence[int] | np.ndarray

# Names an HF tokenizer file may use for its end-of-document and padding tokens, tried in order.
_HF_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<EOS>")
_HF_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<PAD>")


@runtime_checkable
class Tokenizer(Protocol):
  """What the data pipeline and the trainer need from a tokenizer.

  Implementations may also provide `encode_batch(texts) -> list[np.ndarray]`; sources use it when
  present to tokenize many documents in one call.
  """

  @property
  def vocab_size(self) -> int:
    """Number of embedding rows the model needs: every id is in [0, vocab_size)."""
    ...

  @property
  def eos_id(self) -> int:
    """Id appended after every document; closes it."""
    ...

  @property
  def pad_id(self) -> int:
    """Id reserved for padding; never produced by `encode`."""
    ...

  def encode(self, text: str) -> np.ndarray:
    """Returns the (N,) int32 ids of `text`, without special tokens."""
    ...

  def decode(self, ids: TokenIds) -> str:
    """Returns the text of `ids`; special ids (eos, pad) are dropped."""
    ...


class ByteTokenizer:
  """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is eos, 257 is pad (vocab_size 258).

  Needs no file and no training, and works on any text, so it is the default for small
  experiments. `encode_bytes` tokenizes raw file contents without decoding them first.
  """

  vocab_size: int = 258
  eos_id: int = 256
  pad_id: int = 257

  def encode(self, text: str) -> np.ndarray:
    """Returns the (N,) int32 UTF-8 bytes of `text` (N = its length in bytes)."""
    return self.encode_bytes(text.encode("utf-8"))

  def encode_bytes(self, data: bytes) -> np.ndarray:
    """Returns the (N,) int32 ids of raw bytes `data`; no Python loop over bytes."""
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """Encodes every text in `texts`; returns a list of (N_i,) int32 arrays."""
    return [self.encode(t) for t in texts]

  def decode(self, ids: TokenIds) -> str:
    """Decodes byte ids to text; eos/pad are dropped and a cut multi-byte char becomes U+FFFD."""
    ids_N = np.asarray(ids, dtype=np.int64).reshape(-1)
    bad = ids_N[(ids_N < 0) | (ids_N >= self.vocab_size)]
    if bad.size:
      raise ValueError(
        f"ByteTokenizer ids must be in [0, {self.vocab_size}); got {bad[:5].tolist()}. "
        "Were these ids produced by a different tokenizer?"
      )
    return ids_N[ids_N < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

  def __repr__(self) -> str:
    return "ByteTokenizer()"


def _first_known_id(lookup, names: Sequence[str]) -> int | None:
  for name in names:
    token_id = lookup(name)
    if token_id is not None:
      return int(token_id)
  return None


class _FileTokenizer:
  """What the tokenizers read from a file share: the file's path, eos and pad ids that are the
  file's own or appended after its vocabulary, and decoding only the file's ordinary ids."""

  def __init__(self, path: str | os.PathLike, kind: str, expected: str):
    """Keeps `path`; FileNotFoundError naming the `kind` of file and the `expected` path
    when it is missing."""
    self.path = os.fspath(path)
    self._kind, self._expected = kind, expected
    if not os.path.isfile(self.path):
      raise FileNotFoundError(f"{kind} {self.path!r} does not exist; pass a {expected}.")

  def _read(self, read: Callable[[str], Any]) -> Any:
    """``read(path)``; ValueError naming the file when its library cannot read it."""
    try:
      return read(self.path)
    except Exception as e:  # noqa: BLE001 - each library raises its own types for a bad file
      raise ValueError(
        f"{self._kind} {self.path!r} cannot be read ({type(e).__name__}: {e}); it is damaged "
        f"or of another kind: pass a {self._expected}."
      ) from None

  def _set_special_ids(self, base_size: int, eos: int | None, pad: int | None) -> None:
    """Sets `eos_id`, `pad_id` and `vocab_size` for a file of `base_size` ids; an eos or pad the
    file lacks (None) takes the next id after its vocabulary."""
    next_free = base_size
    if eos is None:
      eos, next_free = next_free, next_free + 1
    if pad is None:
      pad, next_free = next_free, next_free + 1
    self.eos_id: int = int(eos)
    self.pad_id: int = int(pad)
    self.vocab_size: int = next_free
    self._base_size = base_size

  def _decodable(self, ids: TokenIds) -> list[int]:
    """`ids` without eos, pad and ids appended past the file's vocabulary."""
    ids_N = np.asarray(ids, dtype=np.int64).reshape(-1)
    keep = (ids_N < self._base_size) & (ids_N != self.eos_id) & (ids_N != self.pad_id)
    return ids_N[keep].tolist()

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.path!r})"


class HFTokenizer(_FileTokenizer):
  """A Hugging Face `tokenizers` JSON file (as written by `Tokenizer.save`), read from disk.

  eos/pad are the file's own special tokens when it has one of the usual names (`</s>`,
  `<|endoftext|>`, `<pad>`, ...); otherwise fresh ids are appended after the file's vocabulary,
  so `vocab_size` may exceed the file's own size by one or two.
  """

  def __init__(self, path: str | os.PathLike):
    super().__init__(path, "HF tokenizer file", "tokenizer.json path")
    tokenizers = import_extra("tokenizers", "tokenizers", f"reading the HF tokenizer {self.path}")
    self._tok = self._read(tokenizers.Tokenizer.from_file)
    # A special token's name in the text (a corpus that mentions `<|endoftext|>`) is encoded as
    # text: only the pipeline places eos, and pad is never produced.
    self._tok.encode_special_tokens = True
    self._prompt_tok = None  # the same file reading those names as their tokens, when asked
    self._set_special_ids(
      self._tok.get_vocab_size(with_added_tokens=True),
      eos=_first_known_id(self._tok.token_to_id, _HF_EOS_NAMES),
      pad=_first_known_id(self._tok.token_to_id, _HF_PAD_NAMES),
    )

  def encode(self, text: str) -> np.ndarray:
    """Returns the (N,) int32 ids of `text`, without special tokens."""
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """Encodes every text in `texts` (in parallel, inside the Rust library)."""
    encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

  def encode_with_specials(self, text: str) -> np.ndarray:
    """The ids of a prompt `text` in which the names of the file's special tokens stand for
    those tokens (a chat template's markers, the eos name), as the tokenizers library reads a
    prompt by default; :meth:`encode`, for corpora, reads them as text."""
    if self._prompt_tok is None:
      import tokenizers  # pylint: disable=import-outside-toplevel  (read by __init__ already)

      self._prompt_tok = self._read(tokenizers.Tokenizer.from_file)
    return np.asarray(self._prompt_tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

  def decode(self, ids: TokenIds) -> str:
    """Decodes ids to text, dropping eos, pad and other special tokens."""
    return self._tok.decode(self._decodable(ids), skip_special_tokens=True)


class SentencePieceTokenizer(_FileTokenizer):
  """A SentencePiece `.model` file, read from disk.

  eos/pad are the model's own ids when it defines them (`eos_id`/`pad_id` at training time);
  otherwise fresh ids are appended after its vocabulary.
  """

  def __init__(self, path: str | os.PathLike):
    super().__init__(path, "SentencePiece model", ".model file path")
    sentencepiece = import_extra(
      "sentencepiece", "tokenizers", f"reading the SentencePiece model {self.path}"
    )
    self._sp = self._read(lambda path: sentencepiece.SentencePieceProcessor(model_file=path))
    eos, pad = self._sp.eos_id(), self._sp.pad_id()  # -1: the model has none
    self._set_special_ids(
      self._sp.get_piece_size(), eos=eos if eos >= 0 else None, pad=pad if pad >= 0 else None
    )

  def encode(self, text: str) -> np.ndarray:
    """Returns the (N,) int32 ids of `text`, without bos/eos."""
    return np.asarray(self._sp.encode(text, out_type=int), dtype=np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """Encodes every text in `texts`."""
    return [np.asarray(ids, dtype=np.int32) for ids in self._sp.encode(list(texts), out_type=int)]

  def decode(self, ids: TokenIds) -> str:
    """Decodes ids to text, dropping eos, pad and ids appended past the model's vocabulary."""
    return self._sp.decode(self._decodable(ids))


def load_tokenizer(spec: str) -> Tokenizer:
  """Returns the tokenizer named by `spec`.

  Accepted forms: "byte" (`ByteTokenizer`), a path ending in ".json" (an HF `tokenizers` file,
  `HFTokenizer`) or a path ending in ".model" (a SentencePiece model, `SentencePieceTokenizer`).
  """
  if not isinstance(spec, str):
    raise ValueError(
      f"tokenizer spec must be a string; got {spec!r} of type {type(spec).__name__}."
    )
  if spec == "byte":
    return ByteTokenizer()
  if spec.endswith(".json"):
    return HFTokenizer(spec)
  if spec.endswith(".model"):
    return SentencePieceTokenizer(spec)
  raise ValueError(
    f"Unknown tokenizer spec {spec!r}. Accepted: 'byte', a path to an HF tokenizers file "
    "ending in '.json', or a path to a SentencePiece model ending in '.model'."
  )


def byte_level_alphabet() -> dict[str, int]:
  """The printable stand-in of every byte in byte-level BPE token strings, mapped to the byte.

  Bytes that are printable Latin-1 (33-126, 161-172, 174-255) stand for themselves; the other
  68 take the code points from 256 upwards, in byte order.
  """
  printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[chr(b)] = b
    else:
      chars[chr(256 + extra)] = b
      extra += 1
  return chars


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray | None:
  """[vocab_size] int: how many bytes of UTF-8 text each id stands for.

  Used to turn a loss per token into bits per byte, so runs with different tokenizers compare.
  Special ids (eos, pad, added tokens) count as one byte, the byte-level convention, under which
  the loss of `ByteTokenizer` tokens in bits is already bits per byte. Exact for byte-level BPE
  files; for SentencePiece the space it prefixes to each text counts too, and other HF
  tokenizers are measured by decoding each id alone.
  Returns None for a tokenizer type this function does not know.
  """
  if not isinstance(tokenizer, (ByteTokenizer, HFTokenizer, SentencePieceTokenizer)):
    return None
  lengths = np.ones(tokenizer.vocab_size, np.int64)
  if isinstance(tokenizer, ByteTokenizer):
    return lengths
  if isinstance(tokenizer, HFTokenizer):
    tok = tokenizer._tok  # pylint: disable=protected-access
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    byte_level = type(tok.decoder).__name__ == "ByteLevel"
    alphabet = byte_level_alphabet()
    for i in range(tokenizer._base_size):  # pylint: disable=protected-access
      piece = tok.id_to_token(i)
      if piece is None or piece in special:
        continue
      if byte_level and all(c in alphabet for c in piece):
        lengths[i] = len(piece)
      else:
        lengths[i] = len(tok.decode([i], skip_special_tokens=False).encode("utf-8"))
    return lengths
  sp = tokenizer._sp  # pylint: disable=protected-access
  for i in range(tokenizer._base_size):  # pylint: disable=protected-access
    if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i):
      continue
    lengths[i] = len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
  return lengths


def tokens_per_byte(batches, tokenizer: Tokenizer) -> float | None:
  """Scored target tokens per byte of text in `batches` (dicts with "targets" and "loss_mask").

  A loss in nats per token times this over ln 2 is bits per byte (see `token_byte_lengths`);
  None when the tokenizer's byte lengths are unknown or the batches score nothing.
  """
  lengths = token_byte_lengths(tokenizer)
  if lengths is None:
    return None
  count = sum(float(np.sum(b["loss_mask"])) for b in batches)
  nbytes = sum(float(np.sum(lengths[b["targets"]] * b["loss_mask"])) for b in batches)
  return count / nbytes if nbytes > 0 else None
