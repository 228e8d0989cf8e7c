"""Starting DIFF from a trained Transformer on a CPU, against continuing it and against DIFF V2 from scratch.

    python benchmarks/retrofit_cpu.py --workdir=runs/retrofit_cpu [--pretrain 400 --cont 300 --seeds 0,1]

``--seeds`` (default one), the default config's model and data (configs/default.py: width 192,
3 layers, byte tokens of the standard library): a Transformer is trained for ``--pretrain``
steps, then

  (a) continued as a Transformer,
  (b) retrofitted to DIFF V2 (``diffjax.convert.retrofit``, exact: the source's function) and
      continued; (b2)-(b4) the same with the second query heads mixed in over ``--mix_steps``
      (copied, zero, small noise; also the source's function at step 0),
  (c) retrofitted to DIFF V1 (the lambda = 0 start) and continued,

each for ``--cont`` steps from the source's weights (``checkpoint.init_from``: a fresh
optimizer and learning-rate schedule, the same data order as the source's first steps), and
(d) DIFF V2 (matched by heads, the retrofitted model's shape) is trained from scratch for
``--pretrain + --cont`` steps, the same total tokens. The table gives the validation loss at the
retrofit point (each model's own, before any step), after the first 50 steps and at the end;
the plot the validation curves. Everything is written under ``--workdir`` (the table as
``retrofit.md``, the plot as ``retrofit_curves.png``); finished runs are reused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(arm: str, steps: int, eval_every: int, seed: int, init_from: str = ""):
  from diffjax.presets import load_config  # pylint: disable=import-outside-toplevel

  c = load_config(os.path.join(REPO, "configs", "default.py"))
  c.model.arm = arm
  c.model.v2_match = "heads"
  c.num_steps = steps
  c.eval_every = eval_every
  c.seed = seed
  c.optim.decay_steps = steps
  c.optim.warmup_steps = min(int(c.optim.warmup_steps), steps)
  c.checkpoint.init_from = init_from
  c.tensorboard = False
  return c


def _val_loss(workdir: str, config) -> float:
  """The validation loss of the newest checkpoint of ``workdir`` on ``config``'s split, as the
  trainer's step 0 computes it (a mixed-in DIFF V2 with its ramp at 0)."""
  # pylint: disable=import-outside-toplevel
  import jax

  from diffjax.data import DataConfig, build_datasets
  from diffjax.eval.scoring import validation_loss
  from diffjax.train import load_model

  model, _, _ = load_model(workdir)
  mix = model.config.v2_mix(0)
  forward = jax.jit(lambda t, p, s: model(t, p, s, **({} if mix is None else {"v2_mix": mix})))
  data_cfg = DataConfig.from_dict(config.data.to_dict())
  data = build_datasets(
    data_cfg,
    seq_len=int(config.seq_len),
    global_batch_size=int(config.global_batch_size),
    seed=int(config.seed),
  )
  return validation_loss(
    lambda t, p=None, s=None: np.asarray(forward(t, p, s)),
    data.val_batches(int(config.eval_batches)),
  )["loss"]


def _train(config, workdir: str, log) -> float:
  from diffjax.train.trainer import train_and_evaluate  # pylint: disable=import-outside-toplevel

  if os.path.exists(os.path.join(workdir, "DONE")):
    log(f"{workdir}: finished earlier, reused")
    return 0.0
  t0 = time.perf_counter()
  train_and_evaluate(config, workdir)
  return time.perf_counter() - t0


def _curve(workdir: str) -> dict[int, float]:
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8")]
  return {int(r["step"]): float(r["eval/loss"]) for r in rows if "eval/loss" in r}


ARMS = (
  ("(a) Transformer, continued", "transformer", {}),
  ("(b) DIFF V2, retrofitted (exact)", "diff_v2", dict(init="exact")),
  ("(b2) DIFF V2, mixed in (second head copied)", "diff_v2", dict(init="mixed", second="copy")),
  ("(b3) DIFF V2, mixed in (second head zero)", "diff_v2", dict(init="mixed", second="zeros")),
  (
    "(b4) DIFF V2, mixed in (second head small noise)",
    "diff_v2",
    dict(init="mixed", second="noise"),
  ),
  ("(c) DIFF V1, retrofitted (lambda = 0 start)", "diff_v1", {}),
)
SCRATCH = "(d) DIFF V2 from scratch"


def _one_seed(args, seed: int, root: str, log) -> tuple[dict, dict, dict]:
  """(rows {label: (at start, after 50, end, seconds)}, curves {label: {step: loss}}, the
  source's pretraining curve) of one seed."""
  from diffjax.convert import retrofit  # pylint: disable=import-outside-toplevel

  source = os.path.join(root, "transformer_pretrain")
  log(f"seed {seed}: pretraining the Transformer for {args.pretrain} steps")
  _train(_config("transformer", args.pretrain, args.eval_every, seed), source, log)
  rows, curves = {}, {}
  for k, (label, arm, init) in enumerate(ARMS):
    start = source if arm == "transformer" else os.path.join(root, f"retrofit_{k}_{arm}")
    if arm != "transformer" and not os.path.isdir(os.path.join(start, "checkpoints")):
      extra = dict(init, mix_steps=args.mix_steps, seed=seed) if init else {}
      retrofit(source, start, arm=arm, **extra)
    cfg = _config(arm, args.cont, args.eval_every, seed, init_from=start)
    if init.get("init") == "mixed":
      cfg.model.v2_mix_steps = args.mix_steps
    at_start = _val_loss(start, cfg)
    run = os.path.join(root, f"continued_{k}_{arm}")
    log(
      f"seed {seed} {label}: validation loss at the retrofit point {at_start:.4f}; training "
      f"{args.cont} steps"
    )
    seconds = _train(cfg, run, log)
    curve = _curve(run)
    curves[label] = {args.pretrain + s: v for s, v in curve.items()}
    curves[label][args.pretrain] = at_start
    rows[label] = (at_start, curve.get(50, float("nan")), curve[max(curve)], seconds)
  total = args.pretrain + args.cont
  scratch = os.path.join(root, "diff_v2_scratch")
  log(f"seed {seed} {SCRATCH} for {total} steps")
  seconds = _train(_config("diff_v2", total, args.eval_every, seed), scratch, log)
  curve = _curve(scratch)
  curves[SCRATCH] = curve
  rows[SCRATCH] = (
    float("nan"),
    curve.get(args.pretrain + 50, float("nan")),
    curve[max(curve)],
    seconds,
  )
  return rows, curves, _curve(source)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--workdir", default="runs/retrofit_cpu")
  p.add_argument("--pretrain", type=int, default=400)
  p.add_argument("--cont", type=int, default=300)
  p.add_argument("--eval_every", type=int, default=50)
  p.add_argument("--mix_steps", type=int, default=100, help="ramp of the mixed-in DIFF V2 starts")
  p.add_argument("--seeds", default="0", help="comma-separated seeds, e.g. 0,1")
  args = p.parse_args(argv)
  log = lambda msg: print(f"[retrofit_cpu] {msg}", flush=True)
  seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
  t_start = time.perf_counter()
  per_seed = {}
  for seed in seeds:
    root = args.workdir if seeds == [0] else os.path.join(args.workdir, f"seed{seed}")
    per_seed[seed] = _one_seed(args, seed, root, log)
  total = args.pretrain + args.cont
  fmt = lambda v: "–" if not np.isfinite(v) else f"{v:.4f}"
  pre_final = [c[max(c)] for _, _, c in per_seed.values()]
  lines = [
    f"Transformer pretrained {args.pretrain} steps (final validation loss "
    f"{', '.join(f'{v:.4f}' for v in pre_final)} nats/byte), then {args.cont} steps each; "
    f"mixed-in ramps of {args.mix_steps} steps; seeds {seeds}; "
    f"{time.perf_counter() - t_start:.0f} s in all. Mean over seeds"
    + (" (each seed's value in brackets)" if len(seeds) > 1 else ""),
    "",
    "| run | val loss at the retrofit point | after 50 more steps | at the end "
    f"(step {total} in all) | train time (s) |",
    "|---|---|---|---|---|",
  ]
  for label in [a[0] for a in ARMS] + [SCRATCH]:
    vals = np.asarray([per_seed[s][0][label] for s in seeds], np.float64)
    cells = []
    for j in range(3):
      col = vals[:, j]
      cell = fmt(float(np.mean(col)))
      if len(seeds) > 1 and np.isfinite(col).all():
        cell += " [" + ", ".join(fmt(v) for v in col) + "]"
      cells.append(cell)
    lines.append(f"| {label} | " + " | ".join(cells) + f" | {np.mean(vals[:, 3]):.0f} |")
  table = "\n".join(lines)
  print(table)
  with open(os.path.join(args.workdir, "retrofit.md"), "w", encoding="utf-8") as f:
    f.write(table + "\n")
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  fig, ax = plt.subplots(figsize=(7.5, 4.5))
  _, curves, pre = per_seed[seeds[0]]
  ax.plot(
    sorted(pre), [pre[s] for s in sorted(pre)], color="gray", label="Transformer, pretraining"
  )
  for label, curve in curves.items():
    steps = sorted(curve)
    ax.plot(steps, [curve[s] for s in steps], label=label)
  ax.axvline(args.pretrain, color="gray", linestyle=":")
  ax.set_xlabel(f"training step (pretraining + continuation), seed {seeds[0]}")
  ax.set_ylabel("validation loss (nats/byte)")
  ax.set_ylim(top=min(3.5, ax.get_ylim()[1]))
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(args.workdir, "retrofit_curves.png"), dpi=120)
  return 0


if __name__ == "__main__":
  sys.exit(main())
