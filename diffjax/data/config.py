"""`DataConfig`: which corpus to read, how to tokenize and split it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

KINDS = ("stdlib", "text", "prepared")


@dataclasses.dataclass(frozen=True, init=False)
class DataConfig:
  """Where the training data comes from.

  Attributes:
    kind: "stdlib", "text" or "prepared" (docs/data.md, "Corpora").
    paths: files, directories or globs for "text"; the prepared directory (or its
      manifest.json) for "prepared"; must be empty for "stdlib".
    tokenizer: "byte", or a path to an HF tokenizers ".json" or a SentencePiece ".model"; for
      "prepared" the one its shards were written with (checked).
    val_fraction: fraction of documents held out for validation, chosen by a keyed hash of
      each document's global id (independent of `seed`, so runs with different seeds share it).
      With val_fraction > 0 at least one document is held out; 0 disables validation.
    split_seed: key of that hash; change it to draw a different validation split.
    max_documents: keep only the first this many documents (in corpus order) before splitting.
    max_tokens: then keep only the first this many tokens (the last kept document is cut).
    shuffle: visit documents in a seeded order, different every epoch. Off: corpus order.
    streams_per_row: documents each batch row streams in turn (batch n takes stream n mod this),
      so a long document does not fill a row for many consecutive steps; lowered automatically
      when the training split has fewer than global_batch_size x this many documents.
    prefetch_batches: how many batches a background thread keeps ready (0: none).
    shards_per_group: an epoch visits the shards in groups of this many, shuffling the
      documents of a group together (that many shards are open at a time).

  Construct with keywords, e.g. `DataConfig(**config.data.to_dict())` or `DataConfig.from_dict`;
  unknown keys raise ValueError naming them.
  """

  kind: str
  paths: tuple[str, ...]
  tokenizer: str
  val_fraction: float
  split_seed: int
  max_documents: int | None
  max_tokens: int | None
  shuffle: bool
  streams_per_row: int
  prefetch_batches: int
  shards_per_group: int

  def __init__(
    self,
    *,
    kind: str = "stdlib",
    paths: tuple[str, ...] | list[str] | str = (),
    tokenizer: str = "byte",
    val_fraction: float = 0.01,
    split_seed: int = 0,
    max_documents: int | None = None,
    max_tokens: int | None = None,
    shuffle: bool = True,
    streams_per_row: int = 16,
    prefetch_batches: int = 4,
    shards_per_group: int = 16,
    **unknown: Any,
  ):
    if unknown:
      raise ValueError(
        f"Unknown DataConfig keys {sorted(unknown)}; accepted keys are "
        f"{[f.name for f in dataclasses.fields(DataConfig)]}."
      )
    paths = (paths,) if isinstance(paths, str) else tuple(str(p) for p in paths)
    values = dict(
      kind=kind,
      paths=paths,
      tokenizer=tokenizer,
      val_fraction=float(val_fraction),
      split_seed=int(split_seed),
      max_documents=max_documents,
      max_tokens=max_tokens,
      shuffle=bool(shuffle),
      streams_per_row=int(streams_per_row),
      prefetch_batches=int(prefetch_batches),
      shards_per_group=int(shards_per_group),
    )
    for name, value in values.items():
      object.__setattr__(self, name, value)
    self._validate()

  @classmethod
  def from_dict(cls, values: Mapping[str, Any] | None) -> DataConfig:
    """Builds a config from a mapping (a dict, or an ml_collections ConfigDict)."""
    if values is None:
      return cls()
    to_dict = getattr(values, "to_dict", None)
    return cls(**(to_dict() if to_dict is not None else dict(values)))

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def _validate(self) -> None:
    if self.kind not in KINDS:
      raise ValueError(f"DataConfig kind={self.kind!r} is not one of {KINDS}.")
    if self.kind == "stdlib" and self.paths:
      raise ValueError(
        f"DataConfig kind='stdlib' takes no paths, got paths={self.paths}; "
        "use kind='text' to read files."
      )
    if self.kind == "prepared":
      missing = [
        n for n, v in (("data.paths", self.paths), ("data.tokenizer", self.tokenizer)) if not v
      ]
      if missing:
        raise ValueError(
          f"data.kind='prepared' needs data.paths=<directory written by python -m "
          f"diffjax.data.prepare> and data.tokenizer=<the tokenizer.json it used>; missing: "
          f"{', '.join(missing)} (e.g. --config.data.paths=\"('data/prepared',)\" "
          "--config.data.tokenizer=tokenizer.json)."
        )
    if self.kind != "stdlib" and not self.paths:
      raise ValueError(f"DataConfig kind={self.kind!r} needs paths (files, directories or globs).")
    if self.shards_per_group < 1 or self.streams_per_row < 1:
      raise ValueError(
        f"data.shards_per_group={self.shards_per_group} and data.streams_per_row="
        f"{self.streams_per_row} must be >= 1."
      )
    if not 0.0 <= self.val_fraction < 1.0:
      raise ValueError(f"DataConfig val_fraction={self.val_fraction} must be in [0, 1).")
    for name in ("max_documents", "max_tokens"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"DataConfig {name}={value!r} must be a positive int or None.")
    if self.prefetch_batches < 0:
      raise ValueError(
        f"data.prefetch_batches={self.prefetch_batches} must be >= 0 (0 builds "
        "batches in the training loop)."
      )


def check_batch_split(global_batch_size: int, process_index: int, process_count: int) -> None:
  """Refuses a global batch that the processes cannot split into equal row blocks."""
  if global_batch_size < 1:
    raise ValueError(f"global_batch_size={global_batch_size} must be at least 1.")
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(
      f"process_index={process_index} must be in [0, process_count={process_count})."
    )
  if global_batch_size % process_count:
    raise ValueError(
      f"global_batch_size={global_batch_size} is not divisible by process_count={process_count}; "
      f"use a multiple of {process_count}."
    )
