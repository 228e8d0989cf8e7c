"""Starting DIFF from a trained Transformer on a CPU, against continuing it and against DIFF V2 from scratch.

    python benchmarks/retrofit_cpu.py --workdir=runs/retrofit_cpu [--pretrain 400 --cont 300]

One seed, the default config's model and data (configs/default.py: width 192, 3 layers, byte
tokens of the standard library): a Transformer is trained for ``--pretrain`` steps, then

  (a) continued as a Transformer,
  (b) retrofitted to DIFF V2 (``diffjax.convert.retrofit``, exact: the source's function) and
      continued,
  (c) retrofitted to DIFF V1 (the closest start its layout allows) and continued,

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
  """The validation loss of the newest checkpoint of ``workdir`` on ``config``'s split."""
  # pylint: disable=import-outside-toplevel
  from diffjax.data import DataConfig, build_datasets
  from diffjax.eval.runner import ModelRunner
  from diffjax.eval.scoring import validation_loss
  from diffjax.train import load_model
  model, _, _ = load_model(workdir)
  data_cfg = DataConfig.from_dict(config.data.to_dict())
  data = build_datasets(data_cfg, seq_len=int(config.seq_len),
                        global_batch_size=int(config.global_batch_size), seed=int(config.seed))
  return validation_loss(ModelRunner(model).logits_fn(),
                         data.val_batches(int(config.eval_batches)))["loss"]


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


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workdir", default="runs/retrofit_cpu")
  p.add_argument("--pretrain", type=int, default=400)
  p.add_argument("--cont", type=int, default=300)
  p.add_argument("--eval_every", type=int, default=50)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  from diffjax.convert import retrofit  # pylint: disable=import-outside-toplevel
  log = lambda msg: print(f"[retrofit_cpu] {msg}", flush=True)
  root = args.workdir
  t_start = time.perf_counter()
  source = os.path.join(root, "transformer_pretrain")
  log(f"pretraining the Transformer for {args.pretrain} steps")
  _train(_config("transformer", args.pretrain, args.eval_every, args.seed), source, log)
  starts = {"transformer": source}
  for arm in ("diff_v2", "diff_v1"):
    out = os.path.join(root, f"retrofit_{arm}")
    if not os.path.isdir(os.path.join(out, "checkpoints")):
      retrofit(source, out, arm=arm)
    starts[arm] = out
  rows = []
  curves = {}
  for label, arm in (("(a) Transformer, continued", "transformer"),
                     ("(b) DIFF V2, retrofitted (exact)", "diff_v2"),
                     ("(c) DIFF V1, retrofitted (closest start)", "diff_v1")):
    cfg = _config(arm, args.cont, args.eval_every, args.seed, init_from=starts[arm])
    at_start = _val_loss(starts[arm], cfg)
    run = os.path.join(root, f"continued_{arm}")
    log(f"{label}: validation loss at the retrofit point {at_start:.4f}; training {args.cont} steps")
    seconds = _train(cfg, run, log)
    curve = _curve(run)
    curves[label] = {args.pretrain + s: v for s, v in curve.items()}
    curves[label][args.pretrain] = at_start
    rows.append((label, at_start, curve.get(50, float("nan")), curve[max(curve)], seconds))
  total = args.pretrain + args.cont
  scratch = os.path.join(root, "diff_v2_scratch")
  log(f"(d) DIFF V2 from scratch for {total} steps")
  seconds = _train(_config("diff_v2", total, args.eval_every, args.seed), scratch, log)
  curve = _curve(scratch)
  curves["(d) DIFF V2 from scratch"] = curve
  rows.append(("(d) DIFF V2 from scratch", float("nan"), curve.get(args.pretrain + 50, float("nan")),
               curve[max(curve)], seconds))
  pre = _curve(source)
  lines = [f"Transformer pretrained {args.pretrain} steps (final validation loss "
           f"{pre[max(pre)]:.4f} nats/byte), then {args.cont} steps each; seed {args.seed}; "
           f"{time.perf_counter() - t_start:.0f} s in all",
           "",
           "| run | val loss at the retrofit point | after 50 more steps | at the end "
           f"(step {total} in all) | train time (s) |",
           "|---|---|---|---|---|"]
  for label, start, after50, end, secs in rows:
    fmt = lambda v: "–" if not np.isfinite(v) else f"{v:.4f}"
    lines.append(f"| {label} | {fmt(start)} | {fmt(after50)} | {fmt(end)} | {secs:.0f} |")
  table = "\n".join(lines)
  print(table)
  with open(os.path.join(root, "retrofit.md"), "w", encoding="utf-8") as f:
    f.write(table + "\n")
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(sorted(pre), [pre[s] for s in sorted(pre)], color="gray", label="Transformer, pretraining")
  for label, curve in curves.items():
    steps = sorted(curve)
    ax.plot(steps, [curve[s] for s in steps], label=label)
  ax.axvline(args.pretrain, color="gray", linestyle=":")
  ax.set_xlabel("training step (pretraining + continuation)")
  ax.set_ylabel("validation loss (nats/byte)")
  ax.set_ylim(top=min(3.5, ax.get_ylim()[1]))
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(root, "retrofit_curves.png"), dpi=120)
  return 0


if __name__ == "__main__":
  sys.exit(main())
