"""`python -m diffjax.convert`: Hugging Face checkpoint directory <-> diffjax workdir.

    python -m diffjax.convert import --hf=path/to/llama_dir --workdir=runs/imported
    python -m diffjax.convert export --workdir=runs/default --hf=path/to/out_dir [--step=N]
        [--dtype=bfloat16] [--max_shard_size=5GB] [--tokenizer=none]
    python -m diffjax.convert retrofit --source=runs/transformer --workdir=runs/retro_v2
        [--arm=diff_v2|diff_v1] [--step=N]

`import` reads an HF Llama, DiffLlama, diffjax DIFF V2 or Motif-2 directory into a new workdir;
`export` writes a Transformer, DIFF V1, DIFF V2 or Motif workdir's checkpoint as such a directory,
with the run's tokenizer and context, for transformers and lm-eval; `retrofit` turns a Transformer
into a DIFF V2 (or V1) workdir and prints the `train.py` command that continues it. A problem with
the input is one `error:` line, and nothing is written. More: docs/hf_conversion.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from diffjax import arms, cli
from diffjax.arms.diff_v2 import DEFAULT_MIX_STEPS, SECOND_HEADS, V2_INITS
from diffjax.convert import motif
from diffjax.convert.api import hf_to_workdir, workdir_to_hf
from diffjax.convert.files import ConversionError
from diffjax.convert.retrofit import retrofit_run
from diffjax.train.checkpoint import CheckpointError


def _parser() -> argparse.ArgumentParser:
  p = cli.ArgumentParser(
    prog="python -m diffjax.convert",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  sub = p.add_subparsers(dest="command", required=True)
  imp = sub.add_parser("import", help="HF checkpoint directory -> new diffjax workdir")
  imp.add_argument(
    "--hf",
    required=True,
    help="directory with config.json and *.safetensors (Llama, DiffLlama or Motif-2)",
  )
  imp.add_argument("--workdir", required=True, help="new diffjax run directory")
  exp = sub.add_parser("export", help="diffjax workdir -> new HF checkpoint directory")
  exp.add_argument("--workdir", required=True, help="diffjax run directory with checkpoints/")
  exp.add_argument("--hf", required=True, help="new output directory")
  exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  exp.add_argument("--dtype", default=None, help="float32 (default), bfloat16 or float16")
  exp.add_argument("--max_shard_size", default=None, help="e.g. 5GB (default), 500MB")
  exp.add_argument(
    "--tokenizer",
    default=None,
    help="tokenizer written with the weights: 'byte', a tokenizers .json, a SentencePiece "
    ".model, or 'none' (default: the run's own)",
  )
  exp.add_argument(
    "--remote_code",
    action="store_true",
    help="write the project's own transformers code for the Transformer and DIFF V1 too "
    "(loaded with trust_remote_code=True; DIFF V2 always has it)",
  )
  for name in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings"):
    exp.add_argument(
      f"--{name}",
      type=int,
      default=None,
      help="written to config.json (default: the run's tokenizer and seq_len, or the "
      "imported checkpoint's)",
    )
  ret = sub.add_parser("retrofit", help="Transformer workdir or HF Llama dir -> new DIFF workdir")
  ret.add_argument(
    "--source",
    required=True,
    help="a Transformer-arm train.py workdir or an HF LlamaForCausalLM directory",
  )
  ret.add_argument("--workdir", required=True, help="new diffjax run directory")
  ret.add_argument(
    "--arm",
    default="diff_v2",
    choices=tuple(a.name for a in arms.all_arms() if a.retrofit is not None),
  )
  ret.add_argument("--step", type=int, default=None, help="source checkpoint (default: newest)")
  ret.add_argument(
    "--init",
    default=None,
    choices=V2_INITS,
    help="DIFF V2: 'mixed' (the default: the subtraction ramped in over "
    "--mix_steps) or 'exact' (second head = first, W_o doubled)",
  )
  ret.add_argument(
    "--second",
    default=None,
    choices=SECOND_HEADS,
    help="DIFF V2 mixed in: the second query head of each pair (default noise)",
  )
  ret.add_argument(
    "--mix_steps",
    type=int,
    default=None,
    help=f"DIFF V2 mixed in: training steps of the ramp (default {DEFAULT_MIX_STEPS})",
  )
  ret.add_argument("--seed", type=int, default=0, help="seed of --second=noise")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  try:
    if args.command == "retrofit":
      cfg, command = retrofit_run(
        args.source,
        args.workdir,
        arm=args.arm,
        step=args.step,
        init=args.init,
        second=args.second,
        mix_steps=args.mix_steps,
        seed=args.seed,
      )
      print(
        f"Retrofitted {args.source} into {cfg.attention} ({cfg.num_layers} layers, "
        f"{cfg.num_heads} heads, {cfg.num_kv_heads} kv heads of {cfg.head_dim}) in "
        f"{args.workdir}; continue it with:\n  {command}"
      )
    elif args.command == "import":
      cfg = hf_to_workdir(args.hf, args.workdir)
      print(
        f"Imported {args.hf} as attention={cfg.attention!r} ({cfg.num_layers} layers, "
        f"d_model {cfg.d_model}) into {args.workdir}"
      )
      if motif.is_motif_model(cfg):
        print(
          f"Continue it with train.py {motif.train_flags(cfg)} "
          f"--config.checkpoint.init_from={args.workdir} (and the checkpoint's tokenizer.json "
          "as --config.data.tokenizer)"
        )
    else:
      export = {
        k: getattr(args, k)
        for k in (
          "dtype",
          "max_shard_size",
          "bos_token_id",
          "eos_token_id",
          "pad_token_id",
          "max_position_embeddings",
          "tokenizer",
        )
        if getattr(args, k) is not None
      }
      if args.remote_code:
        export["remote_code"] = True
      files = workdir_to_hf(args.workdir, args.hf, step=args.step, **export)
      print(f"Exported {args.workdir} to {args.hf}: {', '.join(files)}")
  except (ConversionError, CheckpointError, ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0
