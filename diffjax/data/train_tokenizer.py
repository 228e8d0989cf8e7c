"""`python -m diffjax.data.train_tokenizer`: train a byte-level BPE tokenizer and save tokenizer.json.

Inputs as for `python -m diffjax.data.prepare`; the special tokens and their ids:
docs/data.md#prepared-corpora-of-any-size.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Sequence

from diffjax import cli
from diffjax.data.raw import iter_texts
from diffjax.errors import import_extra
from diffjax.model.sizes import PAPER_VOCAB

SPECIAL_TOKENS = ("<|endoftext|>", "<pad>")


def train_bpe(texts: Iterable[str], vocab_size: int = PAPER_VOCAB, min_frequency: int = 2):
  """Returns a trained byte-level BPE `tokenizers.Tokenizer` of at most `vocab_size` ids."""
  import_extra("tokenizers", "tokenizers", "training a tokenizer")
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel

  if vocab_size < 256 + len(SPECIAL_TOKENS):
    raise ValueError(
      f"--vocab_size={vocab_size} must be at least {256 + len(SPECIAL_TOKENS)} "
      "(256 bytes plus the special tokens)."
    )
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    min_frequency=min_frequency,
    special_tokens=list(SPECIAL_TOKENS),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  tok.train_from_iterator(texts, trainer=trainer)
  return tok


def main(argv: Sequence[str] | None = None) -> int:
  p = cli.ArgumentParser(
    prog="python -m diffjax.data.train_tokenizer", description=__doc__.split("\n")[0]
  )
  p.add_argument(
    "--input",
    action="append",
    required=True,
    help="file, directory, glob, or 'stdlib'; repeat for several",
  )
  p.add_argument("--output", default="tokenizer.json")
  p.add_argument("--vocab_size", type=int, default=PAPER_VOCAB)
  p.add_argument("--min_frequency", type=int, default=2)
  p.add_argument("--text_field", default="text", help="JSONL field / Parquet column")
  args = p.parse_args(argv)
  folder = os.path.dirname(os.path.abspath(args.output))
  if not os.path.isdir(folder) or os.path.isdir(args.output):
    print(
      f"error: --output={args.output!r} cannot be written: "
      + ("it is a directory" if os.path.isdir(args.output) else f"no directory {folder!r}")
      + "; name a file in an existing directory.",
      file=sys.stderr,
    )
    return 2
  t0 = time.perf_counter()
  try:
    tok = train_bpe(iter_texts(args.input, args.text_field), args.vocab_size, args.min_frequency)
  except (ValueError, FileNotFoundError, ImportError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  tok.save(args.output)
  print(
    f"tokenizer: wrote {args.output}: vocabulary {tok.get_vocab_size()} in "
    f"{time.perf_counter() - t0:.1f} s",
    file=sys.stderr,
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
