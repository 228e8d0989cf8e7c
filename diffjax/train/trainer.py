"""``train_and_evaluate``: the training loop behind ``train.py``.

Phases, in order:
  1. validate the config and build the data (bad input fails here, before anything
     is written to the workdir);
  2. build the mesh, the abstract train state and its shardings;
  3. restore the latest checkpoint if the workdir has one (model config checked
     first), else initialise;
  4. loop: train step, metrics, periodic evaluation, periodic and on-signal saves;
  5. final save, final evaluation, the goodput summary, ``DONE`` marker.

Every phase runs under a :class:`diffjax.train.perf.Clock`, so the log lines carry the step
time, tokens/s, MFU and where the time went (``perf/...``), and the run ends with the goodput
summary (``goodput.json``). ``profile.steps=(a, b)`` writes a profiler trace of steps a..b on
process 0 and ``profile.dump_hlo`` the compiled train step's HLO.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from diffjax import arms
from diffjax import sharding as shd
from diffjax.cpu import keep_freed_memory
from diffjax.data import DataConfig, build_datasets, tokens_per_byte
from diffjax.errors import UserError
from diffjax.model import count_params
from diffjax.model.flops import flops_per_token, peak_flops
from diffjax.train import checkpoint as ckpt
from diffjax.train import distributed
from diffjax.train.config_utils import check_config, mesh_context_options, resolved_model
from diffjax.train.loading import initial_params
from diffjax.train.perf import Clock, Profile, Throughput, goodput, goodput_line
from diffjax.train.progress import Progress
from diffjax.train.records import MetricsWriter, read_metrics, rewrite_metrics, write_json
from diffjax.train.setup import build_train_setup, with_mesh_rules
from diffjax.train.steps import lambda_summary
from diffjax.train.task_mix import run_source


def _stderr_line(text: str) -> None:
  print(text, file=sys.stderr, flush=True)


class TrainingError(UserError, RuntimeError):
  """Training stopped for a reason the user must act on (e.g. a non-finite loss)."""


class _StopFlag:
  """Turns SIGTERM/SIGINT into a request to save and stop at the next step."""

  def __init__(self):
    self.signum = None
    self._old = {}

  def __enter__(self):
    for s in (signal.SIGTERM, signal.SIGINT):
      try:
        self._old[s] = signal.signal(s, self._handle)
      except ValueError:  # not the main thread
        pass
    return self

  def _handle(self, signum, frame):
    del frame
    self.signum = signum

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)


def _to_global(
  batch: dict[str, np.ndarray], sharding, row_start: int, global_rows: int
) -> dict[str, jax.Array]:
  """Assembles the global batch from each process's whole rows ``[row_start, ...)``; each
  device takes its block (a part of the sequence, under context parallelism)."""

  def one(local):
    local = np.asarray(local)
    shape = (global_rows, local.shape[1])
    return jax.make_array_from_callback(
      shape,
      sharding,
      lambda idx: local[
        (slice((idx[0].start or 0) - row_start, (idx[0].stop or global_rows) - row_start), idx[1])
      ],
    )

  return {k: one(v) for k, v in batch.items()}


def evaluate_loss(eval_step, params, batches, to_global, step: int = 0) -> float:
  total, count = 0.0, 0.0
  for b in batches:
    s, c = eval_step(params, to_global(b), jnp.int32(step))
    total += float(s)
    count += float(c)
  return total / max(count, 1.0)


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Trains ``config`` in ``workdir`` (resuming if it holds checkpoints).

  Returns the final metrics (train loss, eval loss, steps, wall time), or, when a
  SIGTERM/SIGINT stopped the run after saving, ``{"step", "stopped": True, "train/loss"}``.

  On a CPU backend it also makes glibc's ``malloc`` keep freed memory for the next step
  (:func:`diffjax.cpu.keep_freed_memory`; ``DIFFJAX_KEEP_FREED_MEMORY=0`` opts out).
  """
  clock = Clock()
  clock.enter("setup")
  distributed.maybe_initialize(config)
  if jax.default_backend() == "cpu":
    keep_freed_memory()
  check_config(config)
  is_main = jax.process_index() == 0
  # The mesh decides which rows each process loads (processes of one context group share
  # theirs); building it touches nothing.
  mesh = shd.make_mesh(tuple(config.mesh.shape))
  rules = shd.rules_from_config(config.mesh.get("rules"))
  batch_shard = shd.batch_sharding(mesh, rules)
  row_slot, row_slots = shd.process_rows(batch_shard, (config.global_batch_size, config.seq_len))
  row_start = row_slot * (config.global_batch_size // row_slots)

  # 1. Data first: a bad path or corpus fails before the workdir is touched.
  data_cfg = DataConfig.from_dict(config.data.to_dict())
  source, tokenizer = run_source(config, data_cfg)
  data = build_datasets(
    data_cfg,
    seq_len=config.seq_len,
    global_batch_size=config.global_batch_size,
    seed=config.seed,
    process_index=row_slot,
    process_count=row_slots,
    source=source,
    tokenizer=tokenizer,
  )
  arm_model = resolved_model(config, data.tokenizer.vocab_size)
  model_cfg = arm_model.config

  # 2. Mesh, state layout and the compiled steps (compiled on first use).
  setup = build_train_setup(
    model_cfg,
    config.optim,
    seed=config.seed,
    mesh=mesh,
    rules=rules,
    grad_accum_steps=config.grad_accum_steps,
    global_batch_size=config.global_batch_size,
    **mesh_context_options(config),
  )
  graphdef = setup.graphdef

  # 3. Restore or initialise.
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  manager = ckpt.make_manager(
    os.path.join(workdir, "checkpoints"),
    keep=config.checkpoint.keep,
    async_save=config.checkpoint.async_save,
  )
  meta = {
    "model_config": model_cfg.to_dict(),
    "config": json.loads(config.to_json_best_effort()),
    # The module that registered the arm: what loading the run imports to know the arm.
    "arm_module": arms.module_of(model_cfg.attention),
  }
  train_iter = data.new_train_iter()
  progress = Progress(config.num_steps, 0, log_every=config.log_every, enabled=is_main)
  # Each fused kernel the model chose, once on this device against XLA before the steps
  # trace it: one that fails is switched to the stock path, said and recorded.
  checks = arms.preflight(
    model_cfg, enabled=bool(config.get("kernels", {}).get("preflight", True)), log=progress.message
  )
  if is_main and checks:
    write_json(os.path.join(workdir, "preflight.json"), [c.as_dict() for c in checks])

  clock.leave("setup")

  def check_meta(saved: dict) -> None:
    # A changed model config is refused (the parameters would not fit), not skipped.
    ckpt.check_model_config(saved.get("model_config", {}), meta["model_config"], manager.directory)

  clock.enter("restore")
  latest, state = ckpt.restore_newest_good(
    manager, setup.abstract_state, train_iter, check_meta=check_meta, message=progress.message
  )
  if latest is not None:
    progress.start = latest
    progress.message(f"Resumed from step {latest} in {manager.directory}")
  else:
    if "init_from" in config.checkpoint and config.checkpoint.init_from is None:
      raise ValueError(
        "checkpoint.init_from is required by this config to start a run: pass "
        "the --workdir of the run to start from "
        "(--config.checkpoint.init_from=PATH)."
      )
    state = setup.init_fn()
    init_from = config.checkpoint.get("init_from") or ""
    if init_from:
      params, from_step = initial_params(
        init_from,
        model_cfg,
        state["params"],
        setup.state_shardings["params"],
        message=progress.message,
      )
      state = dict(state, params=params)
      progress.message(
        f"Initialised the parameters from step {from_step} of {init_from} "
        "(fresh optimizer state and data order)"
      )
  start_step = int(state["step"])
  clock.leave("restore")
  # Steps an earlier attempt trained past the checkpoint this one resumes from.
  logged = [r["step"] for r in read_metrics(workdir) if "train/loss" in r] if is_main else []
  recomputed = max(0, max(logged, default=start_step) - start_step)
  if is_main:
    # The steps after the restored one run again: drop their old metrics lines so
    # metrics.jsonl keeps one line per step. A finished run's final evaluation also
    # runs again, so its old eval line goes too.
    rewrite_metrics(
      workdir,
      lambda row: (
        row["step"] < start_step
        or (row["step"] == start_step and (start_step < config.num_steps or "train/loss" in row))
      ),
    )
  n_params = count_params(model_cfg)
  # Updates skipped as non-finite so far (the steps kept in metrics.jsonl), and how many the
  # run may skip before it stops.
  max_skipped = int(config.get("max_skipped_updates", 0))
  skipped = [sum(1 for r in read_metrics(workdir) if r.get("train/skipped")) if is_main else 0]
  if is_main:
    write_json(os.path.join(workdir, "model_config.json"), model_cfg.to_dict())
    progress.message("diffjax: " + arm_model.describe())
    progress.message(
      f"diffjax: arm={model_cfg.attention} params={n_params:,} devices={jax.device_count()} "
      f"mesh={dict(mesh.shape)} train_tokens={data.num_train_tokens:,} "
      # A streamed corpus is never read whole, so it has no unigram baseline (nan).
      + (
        f"unigram_val_loss={data.unigram_entropy_nats:.4f} nats "
        if math.isfinite(data.unigram_entropy_nats)
        else ""
      )
      + f"workdir={workdir}"
    )

  # 4. Steps.
  eval_step = setup.eval_step
  tokens_per_step = config.global_batch_size * config.seq_len
  flops = flops_per_token(model_cfg, config.seq_len)
  peak = config.get("peak_flops") or peak_flops(jax.devices()[0].device_kind)
  throughput = Throughput(
    clock,
    tokens_per_step=tokens_per_step,
    model_flops_per_token=flops.model,
    num_devices=jax.device_count(),
    peak_flops_per_device=peak,
  )
  profile = Profile(config, workdir, enabled=is_main, clock=clock)
  # Under the mesh rules like the steps (for DIFF V2 it runs the blocks over a batch).
  lambda_fn = jax.jit(
    with_mesh_rules(
      lambda p, b: lambda_summary(graphdef, p, b), mesh, rules, **mesh_context_options(config)
    )
  )
  val_batches = data.val_batches(config.eval_batches)
  writer = MetricsWriter(workdir, enabled=is_main, tensorboard=config.get("tensorboard", True))
  # Bits per byte compares runs across tokenizers: the validation targets' tokens per byte,
  # counted once on the host (for byte tokens exactly 1, so it is the loss in bits).
  val_tokens_per_byte = tokens_per_byte(val_batches, data.tokenizer)

  def to_global(local):
    return _to_global(local, batch_shard, row_start, config.global_batch_size)

  def run_eval(step, params):
    with clock.phase("eval"):
      return _eval(step, params)

  def _eval(step, params):
    loss = evaluate_loss(eval_step, params, val_batches, to_global, step)
    vals = {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}
    if val_tokens_per_byte is not None:
      vals["eval/bits_per_byte"] = loss * val_tokens_per_byte / math.log(2.0)
    if arms.get(model_cfg.attention).lambda_report != "none":
      b = to_global(val_batches[0])
      vals.update({k: float(v) for k, v in lambda_fn(params, b).items()})
    writer.write(step, vals)
    return vals

  # Optional: a CRC32 of every batch's tokens in metrics.jsonl, to check that runs
  # (e.g. the arms of a comparison) saw the same data in the same order.
  log_hash = bool(config.get("log_batch_hash", False))
  step = start_step
  last_train_loss = float("nan")
  last_eval: dict[str, float] = {}
  pending: list[tuple[int, dict]] = []

  def flush_metrics():
    nonlocal last_train_loss
    if not pending:
      return
    for s, m in pending:
      if not bool(m["finite"]):
        skipped[0] += 1
        vals = {"train/skipped": 1.0, "train/skipped_updates": float(skipped[0])}
        if "batch_hash" in m:
          vals["data/batch_hash"] = m["batch_hash"]
        writer.write(s, vals)
        what = (
          f"Non-finite loss, gradient or update at step {s} (loss={float(m['loss'])}, "
          f"grad_norm={float(m['grad_norm'])})"
        )
        if skipped[0] > max_skipped:
          writer.close()  # the skipped step's line is kept
          raise TrainingError(
            f"{what}: {skipped[0]} skipped update{'s' if skipped[0] > 1 else ''}, more than "
            f"max_skipped_updates={max_skipped}. The update was skipped and the last good "
            f"checkpoint in {manager.directory} is intact; lower optim.lr, check the data, "
            "or allow more skips (--config.max_skipped_updates=N)."
          )
        progress.message(f"{what}: update skipped ({skipped[0]} of at most {max_skipped})")
        continue
      last_train_loss = float(m["loss"])
      vals = {
        "train/loss": last_train_loss,
        "train/grad_norm": float(m["grad_norm"]),
        "train/lr": float(m["lr"]),
        "train/tokens": float(m["tokens"]),
      }
      if "batch_hash" in m:
        vals["data/batch_hash"] = m["batch_hash"]
      writer.write(s, vals)
    perf = throughput.interval(pending[-1][0])
    if perf:
      writer.write(pending[-1][0], perf)
      progress.extra = f" step {perf['perf/step_time_s']:.3f}s" + (
        f" mfu {perf['perf/mfu']:.1%}" if "perf/mfu" in perf else ""
      )
    pending.clear()

  def save(step_, state_):
    with clock.phase("checkpoint"):
      ckpt.save(manager, step_, state_, train_iter, meta, force=True)

  # A save started but unfinished (an async one, or one a lost peer never joined) is not one
  # to resume from: the line names the newest finished one.
  distributed.watch_peers(
    lambda: ckpt.newest_finished_step(manager.directory),
    message=_stderr_line,
    timeout_s=distributed.peer_timeout(config),
  )
  train_step = None

  with _StopFlag() as stop:
    try:
      while step < config.num_steps:
        with clock.phase("data"):
          local = next(train_iter)
          batch = to_global(local)
        if train_step is None:
          # Compiled ahead of the first step, so its compile time is measured and the HLO of
          # what runs can be written.
          with clock.phase("compile"):
            train_step = setup.train_step.lower(state, batch).compile()
          profile.dump_hlo(train_step)
          throughput.restart(step)
        if profile.before(step + 1):
          # The profiler records the programs compiled while it runs (their HLO carries the
          # named scopes the trace viewer groups by): compile the step again inside the trace,
          # with an option that also keeps a persistent compilation cache from answering.
          with clock.phase("profile"):
            train_step = setup.train_step.lower(state, batch).compile(
              {"xla_embed_ir_in_executable": True}
            )
        with clock.phase("train"):
          state, metrics = train_step(state, batch)
        step += 1
        profile.after(step, state)
        if log_hash:
          metrics = dict(metrics, batch_hash=zlib.crc32(np.ascontiguousarray(local["inputs"])))
        pending.append((step, metrics))
        is_log = step % config.log_every == 0 or step == config.num_steps
        is_save = step % config.checkpoint.every == 0
        if is_log or is_save or stop.signum is not None:
          with clock.phase("train"):  # waits for the queued steps
            flush_metrics()
        progress.update(
          step, float(metrics["loss"]) if progress.tty or is_log else 0.0, float(tokens_per_step)
        )
        if config.eval_every and step % config.eval_every == 0 and step < config.num_steps:
          last_eval = run_eval(step, state["params"])
          progress.message(f"step {step}: eval loss {last_eval['eval/loss']:.4f}")
        if is_save or stop.signum is not None:
          save(step, state)
        if stop.signum is not None:
          with clock.phase("checkpoint"):
            manager.wait_until_finished()
          progress.message(
            f"Signal {stop.signum}: saved step {step}; rerun the same command to resume."
          )
          writer.close()
          return {"step": step, "stopped": True, "train/loss": last_train_loss}
      with clock.phase("train"):
        flush_metrics()
    except Exception:
      # A collective with a lost peer fails here first; the watchdog then says which.
      distributed.wait_for_lost_peer()
      raise
    finally:
      profile.close()
      progress.close()

    # 5. Final save and evaluation.
    if manager.latest_step() != step:
      save(step, state)
    with clock.phase("checkpoint"):
      manager.wait_until_finished()
    last_eval = run_eval(step, state["params"])
  distributed.stop_watching()
  summary = goodput(clock, steps_trained=step - start_step, steps_recomputed=recomputed)
  result = {
    "step": step,
    "train/loss": last_train_loss,
    **last_eval,
    "unigram/loss": data.unigram_entropy_nats,
    "params": n_params,
    "train/skipped_updates": skipped[0],
    "wall_s": summary["wall_s"],
    **{f"perf/{k}": v for k, v in throughput.summary().items()},
    "perf/model_flops_per_token": flops.model,
    "perf/hardware_flops_per_token": flops.hardware,
  }
  if checks:
    result["preflight/fallbacks"] = sum(not c.ok for c in checks)
  if is_main:
    progress.message(
      "final: "
      + " ".join(
        f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
        for k, v in result.items()
        if not k.startswith("lambda")
      )
    )
    progress.message(goodput_line(summary))
    write_json(os.path.join(workdir, "goodput.json"), summary)
    write_json(os.path.join(workdir, "final_metrics.json"), result)
    # The completion marker: tpu_setup/babysit.sh stops relaunching when it appears.
    epath.Path(workdir, "DONE").write_text(f"{step}\n")
  writer.close()
  manager.close()
  return result
