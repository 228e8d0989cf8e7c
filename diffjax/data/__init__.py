"""Data: tokenizers, corpora, the one streamed, checkpointable training pipeline, and the
synthetic retrieval tasks (multi-needle retrieval in real text, associative recall), which serve
both as training sources and as evaluation sets.

Typical use:

    from diffjax.data import DataConfig, build_datasets
    data = build_datasets(DataConfig(), seq_len=256, global_batch_size=32, seed=0)
    batch = next(data.train_iter)      # dict of (32, 256) numpy arrays
    val = data.val_batches(4)          # the same 4 batches on every call and for every seed

    from diffjax.data import MultiNeedleTask
    task = MultiNeedleTask(context_len=512, num_needles=4, num_queries=2, num_examples=100)
    tokens = task[0]                   # (L,) int32: a document like any other source's
    batch = task.batch([0, 1, 2])      # tokens, answer spans and regions stacked for a model
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
