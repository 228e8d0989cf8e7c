"""One-GPU matched comparison: the "350m" size (0.31B parameters, byte tokens), 3 arms x 2 seeds.

Each run: bf16 compute, sequence 2048, 64 x 2048 = 131K-token batches (4 micro-batches of 16),
20K steps = 2.6B byte tokens (about 8.5 tokens per parameter), AdamW 0.9/0.95, lr 1.5e-3 with
500 warm-up steps and cosine decay to 1.5e-4, then the full eval suite. DIFF V2 is matched by
parameters.

Budget (an estimate from FLOPs, not a measurement): about 2.4 GFLOP per token, so at 40% of an
H100's dense bf16 peak about 160K tokens/s and 4.5 hours per Transformer run; the DIFF arms pay
more for attention, so plan on 5-6 hours per run, about 1.5 GPU-days for the 6 runs plus about
half an hour of evaluation each. If a run goes out of memory, raise grad_accum_steps; the batch
and hence the comparison stay the same.

The embedded corpus (12M tokens) is far too small for this budget: prepare a byte-token corpus
first (any text files, JSONL or Parquet), then point the comparison at it:

  python -m diffjax.data.prepare --input /data/text --output /data/prepared_bytes --tokenizer byte
  python -m diffjax.compare --config=configs/compare/small.py --workdir=runs/compare_small \
      --config.base.data.paths="('/data/prepared_bytes',)"
"""

from diffjax.compare import comparison_config
from diffjax.presets import base_config


def get_config():
  base = base_config()
  base.model.arm = "transformer"
  base.model.size = "350m"
  base.model.v2_match = "params"
  base.model.dtype = "bfloat16"
  base.model.remat = "dots_no_batch"
  base.seq_len = 2048
  base.global_batch_size = 64
  base.grad_accum_steps = 4
  base.num_steps = 20_000
  base.optim.update(
    dict(
      lr=1.5e-3,
      min_lr=1.5e-4,
      warmup_steps=500,
      schedule="cosine",
      decay_steps=20_000,
      b1=0.9,
      b2=0.95,
      weight_decay=0.1,
    )
  )
  base.log_every = 50
  base.eval_every = 1000
  base.eval_batches = 16
  base.checkpoint.update(dict(every=1000, keep=2))
  base.data.update(dict(kind="prepared", paths=(), tokenizer="byte"))
  c = comparison_config(base, seeds=(0, 1))
  c.eval.mode = "full"
  c.report.title = "Small (350M-size) matched comparison"
  return c
