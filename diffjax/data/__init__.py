"""Data: tokenizers, corpora, the one streamed, checkpointable training pipeline, and the
synthetic retrieval tasks, which serve both as training sources and as evaluation sets.
See docs/data.md.
"""

from diffjax.data.config import DataConfig
from diffjax.data.corpus import (
  Corpus,
  ShardCorpus,
  SourceCorpus,
  cache_root,
  cached_corpus,
  stdlib_corpus,
)
from diffjax.data.pipeline import Datasets, build_datasets, open_corpus
from diffjax.data.shards import TokenShard, TokenShardWriter, shard_documents
from diffjax.data.sources import DocumentSource, resolve_paths, stdlib_files
from diffjax.data.streaming import BATCH_KEYS
from diffjax.data.tasks import (
  ANSWER,
  CONTEXT,
  DEPTHS,
  NEEDLE_GRID,
  QUERY,
  REGION_NAMES,
  SINK,
  AnswersOnly,
  AssociativeRecallMix,
  AssociativeRecallTask,
  ContextTooShort,
  MultiNeedleTask,
  RetrievalExample,
  collate,
)
from diffjax.data.tokenizers import (
  ByteTokenizer,
  HFTokenizer,
  SentencePieceTokenizer,
  Tokenizer,
  load_tokenizer,
  token_byte_lengths,
  tokens_per_byte,
)

__all__ = [
  "BATCH_KEYS",
  "DataConfig",
  "Datasets",
  "build_datasets",
  "open_corpus",
  "Corpus",
  "ShardCorpus",
  "SourceCorpus",
  "cache_root",
  "cached_corpus",
  "DocumentSource",
  "resolve_paths",
  "stdlib_corpus",
  "stdlib_files",
  "TokenShard",
  "TokenShardWriter",
  "shard_documents",
  "ByteTokenizer",
  "HFTokenizer",
  "SentencePieceTokenizer",
  "Tokenizer",
  "load_tokenizer",
  "token_byte_lengths",
  "tokens_per_byte",
  "MultiNeedleTask",
  "AssociativeRecallTask",
  "AssociativeRecallMix",
  "AnswersOnly",
  "RetrievalExample",
  "ContextTooShort",
  "collate",
  "DEPTHS",
  "NEEDLE_GRID",
  "REGION_NAMES",
  "SINK",
  "CONTEXT",
  "ANSWER",
  "QUERY",
]
