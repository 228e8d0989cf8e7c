"""``python -m diffjax.generation``: continue a prompt with a trained run's model.

    python -m diffjax.generation --workdir=runs/default --prompt="def main(" \\
        [--max_new_tokens=200] [--temperature=0.8] [--top_k=40] [--top_p=0.95] [--seed=0]
        [--step=N] [--max_length=N] [--tokenizer=byte]

Loads the newest good checkpoint of the ``train.py`` workdir (or ``--step``), encodes the
prompt with the run's tokenizer, streams the continuation to stdout as the tokens come
(stopping at the tokenizer's end-of-document token) and then prints the prefill and
decode speed (compilation excluded). Greedy unless ``--temperature`` > 0. A mistake in
the arguments prints one ``error:`` line and exits 2.
"""

from __future__ import annotations

import argparse
import codecs
import os
import sys
from collections.abc import Sequence

import numpy as np

from diffjax import cli
from diffjax.data import ByteTokenizer
from diffjax.errors import run_guarded
from diffjax.generation.engine import generate
from diffjax.generation.loading import load_model, model_tokenizer
from diffjax.generation.sampling import SamplingOptions


def _parser() -> argparse.ArgumentParser:
  p = cli.ArgumentParser(
    prog="python -m diffjax.generation",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("--workdir", required=True, help="a train.py run directory")
  p.add_argument("--prompt", required=True, help="the text to continue")
  p.add_argument("--max_new_tokens", type=int, default=200, help="tokens to add (default 200)")
  p.add_argument(
    "--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)"
  )
  p.add_argument("--top_k", type=int, default=None, help="sample from the k likeliest tokens")
  p.add_argument(
    "--top_p", type=float, default=None, help="sample from the likeliest tokens of mass p"
  )
  p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  p.add_argument(
    "--max_length",
    type=int,
    default=None,
    help="KV cache slots (default: the padded prompt + new tokens)",
  )
  p.add_argument(
    "--tokenizer", default=None, help="tokenizer spec (default: the run's own, else 'byte')"
  )
  return p


class _Stream:
  """Writes each new token's text as it comes; bytes are decoded as UTF-8 incrementally."""

  def __init__(self, tokenizer, out=None):
    self.tokenizer = tokenizer
    self.out = sys.stdout if out is None else out  # the stream of the call, not of the import
    self.byte_level = isinstance(tokenizer, ByteTokenizer)
    self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    self.ids: list[int] = []
    self.text = ""

  def __call__(self, step: int, tokens_B: np.ndarray, active_B: np.ndarray) -> None:
    if not active_B[0]:
      return
    tok = int(tokens_B[0])
    if self.byte_level:
      piece = self.utf8.decode(bytes([tok])) if tok < 256 else ""
    else:  # decode the whole continuation: pieces may merge across tokens
      self.ids.append(tok)
      text = self.tokenizer.decode(self.ids)
      piece, self.text = text[len(self.text) :], text
    self.out.write(piece)
    self.out.flush()

  def close(self) -> None:
    if self.byte_level:
      self.out.write(self.utf8.decode(b"", final=True))
    self.out.write("\n")
    self.out.flush()


def _main(args: argparse.Namespace) -> None:
  SamplingOptions(
    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
  )  # refuses bad options before anything loads
  if args.max_new_tokens < 1:
    raise ValueError(f"--max_new_tokens={args.max_new_tokens} must be at least 1.")
  if not os.path.isdir(args.workdir):
    raise FileNotFoundError(
      f"--workdir={args.workdir!r} is not a directory: pass the --workdir of a train.py run."
    )
  loaded = load_model(workdir=args.workdir, step=args.step)
  model, cfg, step = loaded.model, loaded.model.config, loaded.step
  tokenizer = model_tokenizer(loaded, model, args.tokenizer)
  prompt = tokenizer.encode(args.prompt)
  if not len(prompt):
    raise ValueError("--prompt is empty: give at least one character to continue.")
  stream = _Stream(tokenizer)
  sys.stdout.write(args.prompt)
  sys.stdout.flush()
  out = generate(
    model,
    [prompt.tolist()],
    max_new_tokens=args.max_new_tokens,
    temperature=args.temperature,
    top_k=args.top_k,
    top_p=args.top_p,
    seed=args.seed,
    stop_tokens=[tokenizer.eos_id],
    max_length=args.max_length,
    on_tokens=stream,
  )
  stream.close()
  n_prompt, n_new = out.prompt_tokens[0], len(out.tokens[0])
  decode_tok = out.decode_steps
  print(
    f"[{cfg.attention}, step {step}] prefill {n_prompt} tokens in "
    f"{out.prefill_seconds * 1e3:.1f} ms ({n_prompt / out.prefill_seconds:,.0f} tokens/s); "
    f"decode {decode_tok} tokens in {out.decode_seconds:.2f} s "
    f"({decode_tok / max(out.decode_seconds, 1e-9):,.1f} tokens/s); "
    f"{n_new} new tokens{' (stopped at end of document)' if out.stopped[0] else ''}; "
    f"compile {out.compile_seconds:.1f} s",
    file=sys.stderr,
  )


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  return run_guarded(lambda: _main(args))
