"""A run's tokenizer as the files transformers reads, so that an exported directory encodes text
to the ids the model was trained on: byte tokenizers are written, HF tokenizer files copied,
SentencePiece models refused (docs/hf_conversion.md, what an export carries).
"""

from __future__ import annotations

import json
import os
from typing import Any

from diffjax.convert.files import write_json_file
from diffjax.data import Tokenizer
from diffjax.data.tokenizers import (
  ByteTokenizer,
  HFTokenizer,
  SentencePieceTokenizer,
  byte_level_alphabet,
)
from diffjax.errors import import_extra

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
SENTENCEPIECE_MODEL = "tokenizer.model"  # an imported checkpoint's, read back
GENERATION_CONFIG = "generation_config.json"
# tokenizer_config.json key naming the diffjax tokenizer an export was written from.
MARKER = "diffjax_tokenizer"
EOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<pad>"


def token_ids(tokenizer: Tokenizer) -> dict[str, int | None]:
  """config.json's special-token ids for a model trained with ``tokenizer``."""
  return {
    "bos_token_id": None,
    "eos_token_id": int(tokenizer.eos_id),
    "pad_token_id": int(tokenizer.pad_id),
  }


def generation_config(ids: dict[str, int | None]) -> dict[str, Any]:
  """``generation_config.json``: greedy decoding that stops at the end-of-document token."""
  return {**ids, "do_sample": False}


def _added(token_id: int, content: str) -> dict[str, Any]:
  return {
    "id": token_id,
    "content": content,
    "single_word": False,
    "lstrip": False,
    "rstrip": False,
    "normalized": False,
    "special": True,
  }


def byte_tokenizer_json() -> dict[str, Any]:
  """A ``tokenizers`` file equal to :class:`ByteTokenizer`: the whole text is one byte-level
  word (no regex split, no prefix space) and BPE without merges leaves one token per byte."""
  vocab = {char: b for char, b in sorted(byte_level_alphabet().items(), key=lambda kv: kv[1])}
  byte_level = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": False,
    "use_regex": False,
  }
  tok = ByteTokenizer()
  return {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [_added(tok.eos_id, EOS_TOKEN), _added(tok.pad_id, PAD_TOKEN)],
    "normalizer": None,
    "pre_tokenizer": byte_level,
    "post_processor": None,
    "decoder": byte_level,
    "model": {
      "type": "BPE",
      "dropout": None,
      "unk_token": None,
      "continuing_subword_prefix": None,
      "end_of_word_suffix": None,
      "fuse_unk": False,
      "byte_fallback": False,
      "ignore_merges": False,
      "vocab": vocab,
      "merges": [],
    },
  }


def _hf_file_with_specials(tokenizer: HFTokenizer) -> tuple[str, str, str]:
  """(tokenizer.json text, eos string, pad string); appended ids become added special tokens."""
  tokenizers = import_extra("tokenizers", "tokenizers", "exporting an HF tokenizer")
  tok = tokenizers.Tokenizer.from_file(tokenizer.path)
  names = {}
  for token_id, fallback in ((tokenizer.eos_id, EOS_TOKEN), (tokenizer.pad_id, PAD_TOKEN)):
    name = tok.id_to_token(token_id)
    if name is None:  # diffjax appended this id after the file's vocabulary
      if tok.token_to_id(fallback) is not None:
        raise ValueError(
          f"{tokenizer.path!r} holds {fallback!r} as an ordinary token; its special ids cannot be "
          "written into the export: export with --tokenizer=none and add a tokenizer yourself."
        )
      tok.add_special_tokens([tokenizers.AddedToken(fallback, special=True, normalized=False)])
      if tok.token_to_id(fallback) != token_id:
        raise ValueError(
          f"adding {fallback!r} to {tokenizer.path!r} gave id {tok.token_to_id(fallback)}, not "
          f"the model's {token_id}: export with --tokenizer=none and add a tokenizer yourself."
        )
      name = fallback
    names[token_id] = name
  return tok.to_str(), names[tokenizer.eos_id], names[tokenizer.pad_id]


def write_tokenizer_files(
  directory: str, tokenizer: Tokenizer, *, model_max_length: int
) -> list[str]:
  """Writes ``tokenizer`` into ``directory`` as transformers reads it; returns the file names.

  Raises ``ValueError`` for a tokenizer type this module does not know.
  """
  config: dict[str, Any] = {
    "add_bos_token": False,
    "add_eos_token": False,
    "bos_token": None,
    "clean_up_tokenization_spaces": False,
    "model_max_length": int(model_max_length),
  }
  written = []
  if isinstance(tokenizer, ByteTokenizer):
    write_json_file(os.path.join(directory, TOKENIZER_JSON), byte_tokenizer_json())
    eos, pad = EOS_TOKEN, PAD_TOKEN
    config.update(tokenizer_class="PreTrainedTokenizerFast", **{MARKER: "byte"})
    written.append(TOKENIZER_JSON)
  elif isinstance(tokenizer, HFTokenizer):
    text, eos, pad = _hf_file_with_specials(tokenizer)
    with open(os.path.join(directory, TOKENIZER_JSON), "w", encoding="utf-8") as f:
      f.write(text)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    written.append(TOKENIZER_JSON)
  elif isinstance(tokenizer, SentencePieceTokenizer):
    raise ValueError(
      f"the run's SentencePiece tokenizer {tokenizer.path!r} has no exact transformers form "
      "(transformers does not apply its whitespace normalisation): export with "
      "--tokenizer=none and evaluate with that .model file as the tokenizer."
    )
  else:
    raise ValueError(
      f"tokenizer {tokenizer!r} has no transformers form here: export with --tokenizer=none."
    )
  config.update(eos_token=eos, pad_token=pad)
  write_json_file(os.path.join(directory, TOKENIZER_CONFIG), config)
  write_json_file(os.path.join(directory, SPECIAL_TOKENS_MAP), {"eos_token": eos, "pad_token": pad})
  return written + [TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP]


def tokenizer_spec(directory: str) -> str | None:
  """The diffjax tokenizer spec of an HF directory: "byte" for a byte tokenizer diffjax exported,
  its ``tokenizer.json`` or ``tokenizer.model``, else None."""
  path = os.path.join(directory, TOKENIZER_CONFIG)
  if os.path.isfile(path):
    try:
      with open(path, encoding="utf-8") as f:
        if json.load(f).get(MARKER) == "byte":
          return "byte"
    except (OSError, ValueError, AttributeError):
      pass
  for name in (TOKENIZER_JSON, SENTENCEPIECE_MODEL):
    if os.path.isfile(os.path.join(directory, name)):
      return os.path.join(directory, name)
  return None
