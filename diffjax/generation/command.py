"""``python -m diffjax.generation``: continue a prompt with a trained run's model.

    python -m diffjax.generation --workdir=runs/default --prompt="def main(" \\
        [--max_new_tokens=200] [--temperature=0.8] [--top_k=40] [--top_p=0.95] [--seed=0]
        [--step=N] [--max_length=N] [--tokenizer=byte]

Streams the continuation from the run's newest good checkpoint (or ``--step``) as the tokens come,
until the end-of-document token, then prints prefill and decode speed (compilation excluded).
Greedy unless ``--temperature`` > 0; a mistake in the arguments is one ``error:`` line (exit 2).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import numpy as np

from diffjax import cli
from diffjax.errors import run_guarded
from diffjax.generation.engine import generate
from diffjax.generation.loading import load_model, model_tokenizer
from diffjax.generation.sampling import SamplingOptions
from diffjax.generation.text import TextStream


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
  """Writes ``prefix`` (the prompt), then each new token's text as it comes (text is released
  only when whole; ``context``: the prompt's ids, which the first tokens' text follows);
  nothing before the first token, so a refused call writes nothing."""

  def __init__(self, tokenizer, out=None, prefix: str = "", context=()):
    self.text, self.prefix = TextStream(tokenizer, context=context), prefix
    self.out = sys.stdout if out is None else out  # the stream of the call, not of the import

  def _write(self, piece: str) -> None:
    self.out.write(self.prefix + piece)
    self.prefix = ""
    self.out.flush()

  def __call__(self, step: int, tokens_B: np.ndarray, active_B: np.ndarray) -> None:
    if active_B[0]:
      self._write(self.text.add(int(tokens_B[0])))

  def close(self) -> None:
    self._write(self.text.finish() + "\n")


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
  stream = _Stream(tokenizer, prefix=args.prompt, context=prompt.tolist())
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
