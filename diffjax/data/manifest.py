"""The manifest of a prepared corpus: which shards hold how many documents and tokens, and
which tokenizer produced them. `python -m diffjax.data.prepare` writes `manifest.json` next to
its shards, and it is all the pipeline reads at start-up; its layout: docs/data.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from diffjax.data.sources import refuse_cloud_path
from diffjax.data.tokenizers import Tokenizer

FORMAT = "diffjax-prepared/1"
MANIFEST_NAME = "manifest.json"


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
  """SHA-256 naming a tokenizer: of its file for HF / SentencePiece, of its class otherwise.

  Two tokenizers with the same fingerprint map text to the same ids.
  """
  path = getattr(tokenizer, "path", None)
  h = hashlib.sha256()
  if path is not None and os.path.isfile(path):
    with open(path, "rb") as f:
      for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
  else:
    h.update(f"{type(tokenizer).__name__}:{tokenizer.vocab_size}:{tokenizer.eos_id}".encode())
  return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Shard:
  path: str  # absolute (resolved against the manifest's directory when read)
  num_documents: int
  num_tokens: int  # without eos
  sha256: str | None = None  # of its tokens and offsets (TokenShardWriter.sha256); older: None


@dataclasses.dataclass(frozen=True)
class Manifest:
  """A prepared corpus. `doc_offsets_Sp1[s]` is the global id of shard s's first document."""

  directory: str
  shards: tuple[Shard, ...]
  tokenizer: dict[str, Any]

  @property
  def num_documents(self) -> int:
    return sum(s.num_documents for s in self.shards)

  @property
  def num_tokens(self) -> int:
    return sum(s.num_tokens for s in self.shards)

  @property
  def doc_offsets_Sp1(self) -> np.ndarray:
    """(S + 1,) int64 cumulative document counts over shards in manifest order."""
    out = np.zeros(len(self.shards) + 1, np.int64)
    np.cumsum([s.num_documents for s in self.shards], out=out[1:])
    return out

  def check_tokenizer(self, tokenizer: Tokenizer, spec: str) -> None:
    """Raises ValueError (one line) unless `tokenizer` is the one the shards were written with."""
    want, got = self.tokenizer.get("sha256"), tokenizer_fingerprint(tokenizer)
    if want != got:
      raise ValueError(
        f"Prepared data {self.directory!r} was tokenized with {self.tokenizer.get('spec')!r} "
        f"(sha256 {str(want)[:12]}), but data.tokenizer={spec!r} has sha256 {got[:12]}: pass "
        "the tokenizer used by prepare, or prepare the data again with this one."
      )


def manifest_path(path: str) -> str:
  """`path` itself if it is a file, else `path/manifest.json`."""
  return path if os.path.isfile(path) else os.path.join(path, MANIFEST_NAME)


def read_manifest(path: str) -> Manifest:
  """Reads a manifest from a prepared directory or a manifest file (one-line errors)."""
  refuse_cloud_path(path)
  file = manifest_path(os.path.expanduser(path))
  if not os.path.isfile(file):
    raise FileNotFoundError(
      f"No prepared corpus at {path!r} ({file} does not exist); create one with "
      "`python -m diffjax.data.prepare --input ... --output DIR` and pass data.paths=DIR."
    )
  with open(file) as f:
    raw = json.load(f)
  if raw.get("format") != FORMAT:
    raise ValueError(
      f"{file} has format {raw.get('format')!r}, expected {FORMAT!r}; prepare the "
      "data again with this version of diffjax."
    )
  directory = os.path.dirname(os.path.abspath(file))
  shards = tuple(
    Shard(
      os.path.join(directory, s["path"]),
      int(s["num_documents"]),
      int(s["num_tokens"]),
      s.get("sha256"),
    )
    for s in raw["shards"]
  )
  return Manifest(directory, shards, dict(raw["tokenizer"]))


def write_manifest(
  directory: str,
  shards: Sequence[dict[str, Any]],
  tokenizer: dict[str, Any],
  extra: dict[str, Any] | None = None,
) -> str:
  """Writes `directory/manifest.json` atomically; shard paths must be relative. Returns its path."""
  body = {
    "format": FORMAT,
    "tokenizer": tokenizer,
    "num_documents": sum(int(s["num_documents"]) for s in shards),
    "num_tokens": sum(int(s["num_tokens"]) for s in shards),
    **(extra or {}),
    "shards": list(shards),
  }
  file = os.path.join(directory, MANIFEST_NAME)
  tmp = file + ".tmp"
  with open(tmp, "w") as f:
    json.dump(body, f, indent=1)
  os.replace(tmp, file)
  return file
