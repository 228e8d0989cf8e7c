"""``train_and_evaluate``: the trainer behind ``train.py``, one method per phase.

A :class:`Trainer` runs one :class:`~diffjax.train.config.RunConfig` in a workdir through
``_setup``, ``_restore_or_init``, ``_reconcile_records``, ``_train`` and ``_finish``, each under
a :class:`diffjax.train.perf.Clock` phase (docs/training.md).
"""

from __future__ import annotations

import contextlib
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
from diffjax.data import build_datasets, tokens_per_byte
from diffjax.errors import UserError
from diffjax.model import count_params
from diffjax.model.flops import flops_per_token, peak_flops
from diffjax.train import checkpoint as ckpt
from diffjax.train import distributed
from diffjax.train.config import RunConfig
from diffjax.train.config_utils import resolved_model
from diffjax.train.loading import initial_params
from diffjax.train.perf import Clock, Profile, Throughput, goodput, goodput_line
from diffjax.train.progress import Progress
from diffjax.train.records import MetricsWriter, read_metrics, rewrite_metrics, write_json
from diffjax.train.setup import build_train_setup, with_mesh_rules
from diffjax.train.steps import lambda_summary
from diffjax.train.task_mix import run_source
from diffjax.train.workdir import DONE_FILE, WorkdirLock, done_step, finished_result


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


class _StopVote:
  """Makes the processes of a run stop after the same step. A signal reaches each host on its
  own (a Spot preemption, one ssh session per worker, SLURM), and a process that saves and stops
  alone leaves the others in a collective it no longer joins: no checkpoint, and an abort.

  Each step, the processes' signal numbers are reduced (max) by a small program queued after the
  step; its result is read one step later, so the host keeps a step queued, and a signal on any
  process stops every one after the same step. With one process the signal counts at once."""

  def __init__(self):
    self.many = jax.process_count() > 1
    self._queued = None
    if self.many:
      mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("all",))
      self._spread = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("all"))
      replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
      self._max = jax.jit(jnp.max, out_shardings=replicated)

  def _cast(self, signum: int | None) -> jax.Array:
    mine = np.full(len(jax.local_devices()), signum or 0, np.int32)
    return self._max(jax.make_array_from_process_local_data(self._spread, mine))

  @staticmethod
  def _read(votes: jax.Array) -> int | None:
    return int(np.asarray(votes.addressable_data(0))) or None

  def after_step(self, signum: int | None) -> int | None:
    """The signal every process stops on after this step, or None to go on."""
    if not self.many:
      return signum
    queued, self._queued = self._queued, self._cast(signum)
    return None if queued is None else self._read(queued)

  def now(self, signum: int | None) -> int | None:
    """The signal any process has received, every process's vote awaited (after the last step)."""
    return self._read(self._cast(signum)) if self.many else signum


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
  return total / count if count else math.nan  # nan: no target token was scored


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Trains ``config`` in ``workdir`` (resuming if it holds checkpoints).

  Args:
    config: the run config file's ConfigDict, or a :class:`~diffjax.train.config.RunConfig`;
      it is resolved and checked before anything else happens.
    workdir: the directory of the run's checkpoints and records.

  Returns:
    The final metrics (train loss, eval loss, steps, wall time), or, when a SIGTERM/SIGINT
    stopped the run after saving, ``{"step", "stopped": True, "train/loss"}``.

  On a CPU backend it also makes glibc's ``malloc`` keep freed memory for the next step
  (:func:`diffjax.cpu.keep_freed_memory`; ``DIFFJAX_KEEP_FREED_MEMORY=0`` opts out).
  """
  return Trainer(RunConfig.from_config(config), workdir).run()


class Trainer:
  """One training run of ``run`` in ``workdir``; :meth:`run` goes through the phases in order.
  Each phase leaves what the later ones use as attributes."""

  def __init__(self, run: RunConfig, workdir: str):
    self.cfg = run
    self.workdir = workdir
    self.clock = Clock()
    # The newest train loss and evaluation, and the steps whose metrics are not yet read back
    # from the devices (reading them waits for the step).
    self.last_train_loss = float("nan")
    self.last_eval: dict[str, float] = {}
    self.pending: list[tuple[int, dict]] = []
    self._said_unscored: set[str] = set()
    # The wall time of the attempts before this one, up to the checkpoint it resumes from.
    self.earlier_wall_s = 0.0

  def _unscored(self, kind: str, what: str) -> None:
    """Says once per run and ``kind`` (train, eval) that ``what`` scored no token."""
    if kind not in self._said_unscored:
      self._said_unscored.add(kind)
      self.progress.message(
        f"{what} scored no token: its loss is over nothing (an eval reports nan). With "
        "task_mix.loss='answers', an answer must fall inside a seq_len window: raise seq_len or "
        "shorten the task's examples."
      )

  def run(self) -> dict[str, Any]:
    """Trains (or resumes) the run and returns :func:`train_and_evaluate`'s result.

    A run that already finished (its DONE marker at or past ``num_steps``) is left as it is:
    one line says so and its recorded final metrics are returned.
    """
    with self.clock.phase("setup"):
      self._start()
    if self._finished():
      return self._leave_finished()
    # The process that writes the records holds the workdir's lock from its first write on.
    self.lock = WorkdirLock(self.workdir, enabled=self.is_main)
    try:
      with self.clock.phase("setup"):
        self._setup()
      if self._finished():  # another process finished it while this one prepared its data
        return self._leave_finished()
      # From the restore on, a signal asks to save and stop after the next step (a restore
      # cut short could look like a damaged checkpoint; the first compile is not cut either).
      with _StopFlag() as stop:
        with self.clock.phase("restore"):
          self._restore_or_init()
        if self.is_main and done_step(self.workdir) is not None:
          # Training past an earlier num_steps (the restore accepted the settings): the run
          # is not finished until the new one.
          epath.Path(self.workdir, DONE_FILE).unlink()
        self._reconcile_records()
        self._prepare_loop()
        vote = _StopVote()
        stopped = self._train(stop, vote)
        if stopped is not None:
          return stopped
        self._final_save()
        signum = vote.now(stop.signum)  # a signal during the final save counts too
        if signum is None:
          self.last_eval = self._evaluate(self.state["params"])
          signum = vote.now(stop.signum)  # and one during the evaluation
        if signum is not None:  # the last step is saved; the rerun evaluates it
          return self._stop(signum)
      return self._finish()
    except BaseException:
      # An error (a refused init_from, say) would leave the checkpoint manager's background work
      # to the interpreter's shutdown, which can no longer run it: a traceback after the error's
      # one line. Closed here, it finishes any save in flight first.
      if getattr(self, "manager", None) is not None:
        with contextlib.suppress(Exception):
          self.manager.close()
      raise
    finally:
      self.lock.release()

  # ---- 0. a run that has finished ------------------------------------------------------------

  def _finished(self) -> bool:
    done = done_step(self.workdir)
    return done is not None and done >= self.cfg.num_steps

  def _leave_finished(self) -> dict[str, Any]:
    done = done_step(self.workdir)
    if self.is_main:
      print(
        f"diffjax: the run in {self.workdir} already finished at step {done} "
        f"(num_steps={self.cfg.num_steps}); nothing to do, its files are unchanged "
        "(raise --config.num_steps to train further).",
        flush=True,
      )
    return finished_result(self.workdir)

  # ---- 1. setup ------------------------------------------------------------------------------

  def _start(self) -> None:
    distributed.maybe_initialize(self.cfg.distributed)
    if jax.default_backend() == "cpu":
      keep_freed_memory()
    self.is_main = jax.process_index() == 0

  def _setup(self) -> None:
    cfg = self.cfg
    # The mesh decides which rows each process loads (processes of one context group share
    # theirs); building it touches nothing.
    self.mesh = shd.make_mesh(
      cfg.mesh.shape, devices=cfg.mesh.devices(), dcn_shape=cfg.mesh.dcn_shape
    )
    self.rules = cfg.mesh.logical_rules
    self.batch_shard = shd.batch_sharding(self.mesh, self.rules)
    split = shd.batch_rows_multiple(self.mesh, self.rules)
    if cfg.global_batch_size % split:
      raise ValueError(
        f"global_batch_size={cfg.global_batch_size} does not split over the {split} devices "
        f"the mesh {dict(self.mesh.shape)} puts the batch on: use a multiple of {split}, or "
        "a --config.mesh.shape with fewer devices on data and fsdp."
      )
    row_slot, row_slots = shd.process_rows(self.batch_shard, (cfg.global_batch_size, cfg.seq_len))
    self.row_start = row_slot * (cfg.global_batch_size // row_slots)

    # Data first: a bad path or corpus fails before the workdir is touched.
    source, tokenizer = run_source(cfg.task_mix, cfg.data, cfg.seed)
    self.data = build_datasets(
      cfg.data,
      seq_len=cfg.seq_len,
      global_batch_size=cfg.global_batch_size,
      seed=cfg.seed,
      process_index=row_slot,
      process_count=row_slots,
      source=source,
      tokenizer=tokenizer,
    )
    self.arm_model = resolved_model(cfg.model, self.data.tokenizer.vocab_size)
    self.model_cfg = self.arm_model.config

    # The state layout and the compiled steps (compiled on first use).
    self.setup = build_train_setup(
      self.model_cfg,
      cfg.optim,
      seed=cfg.seed,
      mesh=self.mesh,
      rules=self.rules,
      grad_accum_steps=cfg.grad_accum_steps,
      grad_accum_reduce=cfg.grad_accum_reduce,
      global_batch_size=cfg.global_batch_size,
      seq_len=cfg.seq_len,
      **cfg.mesh.context_options(),
    )

    self.lock.acquire()  # refuses a second training before it writes anything
    epath.Path(self.workdir).mkdir(parents=True, exist_ok=True)
    self.manager = ckpt.make_manager(
      os.path.join(self.workdir, "checkpoints"),
      keep=cfg.checkpoint.keep,
      async_save=cfg.checkpoint.async_save,
    )
    self.meta = {
      "model_config": self.model_cfg.to_dict(),
      "config": json.loads(cfg.to_json()),
      # The module that registered the arm: what loading the run imports to know the arm.
      "arm_module": arms.module_of(self.model_cfg.attention),
      "data": self.data.identity(),
    }
    self.train_iter = self.data.new_train_iter()
    self.progress = Progress(cfg.num_steps, 0, log_every=cfg.log_every, enabled=self.is_main)
    # Each fused kernel the model chose, once on this device against XLA before the steps
    # trace it: one that fails is switched to the stock path, said and recorded.
    self.checks = arms.preflight(
      self.model_cfg, enabled=cfg.kernels.preflight, log=self.progress.message
    )
    if self.is_main and self.checks:
      write_json(os.path.join(self.workdir, "preflight.json"), [c.as_dict() for c in self.checks])

  # ---- 2. restore or initialise --------------------------------------------------------------

  def _check_meta(self, saved: dict) -> None:
    # A changed model config is refused (the parameters would not fit), not skipped.
    ckpt.check_model_config(
      saved.get("model_config", {}), self.meta["model_config"], self.manager.directory
    )
    # So is a change of what the steps read (the saved data position would mean other tokens).
    ckpt.check_data_order(saved.get("config") or {}, self.meta["config"], self.manager.directory)
    ckpt.check_corpus(saved.get("data"), self.meta["data"], self.manager.directory)
    self.earlier_wall_s = float(saved.get("wall_s", 0.0))  # the step restored is checked last

  def _restore_or_init(self) -> None:
    latest, state = ckpt.restore_newest_good(
      self.manager,
      self.setup.abstract_state,
      self.train_iter,
      check_meta=self._check_meta,
      message=self.progress.message,
    )
    if latest is not None:
      self.progress.start = latest
      self.progress.message(f"Resumed from step {latest} in {self.manager.directory}")
    else:
      state = self._initial_state()
    self.state = state
    self.start_step = int(state["step"])

  def _initial_state(self) -> dict:
    """A fresh state, with another run's parameters when ``checkpoint.init_from`` names one."""
    init_from = self.cfg.checkpoint.init_from
    if init_from is None:
      raise ValueError(
        "checkpoint.init_from is required by this config to start a run: pass "
        "the --workdir of the run to start from "
        "(--config.checkpoint.init_from=PATH)."
      )
    state = self.setup.init_fn()
    if init_from:
      params, from_step = initial_params(
        init_from,
        self.model_cfg,
        state["params"],
        self.setup.state_shardings["params"],
        message=self.progress.message,
        allowed_changes=self.cfg.checkpoint.init_changes,
      )
      state = dict(state, params=params)
      self.progress.message(
        f"Initialised the parameters from step {from_step} of {init_from} "
        "(fresh optimizer state and data order)"
      )
    return state

  # ---- 3. the records of earlier attempts ----------------------------------------------------

  def _reconcile_records(self) -> None:
    cfg, workdir, start_step = self.cfg, self.workdir, self.start_step
    # Steps an earlier attempt trained past the checkpoint this one resumes from.
    logged = [r["step"] for r in read_metrics(workdir) if "train/loss" in r] if self.is_main else []
    self.recomputed = max(0, max(logged, default=start_step) - start_step)
    if self.is_main:
      # The steps after the restored one run again: drop their old metrics lines so
      # metrics.jsonl keeps one line per step. A finished run's final evaluation also
      # runs again, so its old eval line goes too (its train and perf lines stay).
      rewrite_metrics(
        workdir,
        lambda row: (
          row["step"] < start_step
          or (
            row["step"] == start_step
            and (start_step < cfg.num_steps or not any(k.startswith("eval/") for k in row))
          )
        ),
      )
    if start_step == cfg.num_steps and self.is_main:  # nothing to train: the loss on record
      rows = [r for r in read_metrics(workdir) if r["step"] == start_step and "train/loss" in r]
      if rows:
        self.last_train_loss = float(rows[-1]["train/loss"])
    self.n_params = count_params(self.model_cfg)
    # Updates skipped as non-finite so far (the steps kept in metrics.jsonl); the run may skip
    # cfg.max_skipped_updates before it stops.
    self.skipped = (
      sum(1 for r in read_metrics(workdir) if r.get("train/skipped")) if self.is_main else 0
    )
    if self.is_main:
      write_json(os.path.join(workdir, "model_config.json"), self.model_cfg.to_dict())
      self._announce()

  def _announce(self) -> None:
    data, model_cfg = self.data, self.model_cfg
    self.progress.message("diffjax: " + self.arm_model.describe())
    self.progress.message(
      f"diffjax: arm={model_cfg.attention} params={self.n_params:,} "
      f"devices={self.mesh.size} mesh={dict(self.mesh.shape)} "
      f"train_tokens={data.num_train_tokens:,} "
      # A streamed corpus is never read whole, so it has no unigram baseline (nan).
      + (
        f"unigram_val_loss={data.unigram_entropy_nats:.4f} nats "
        if math.isfinite(data.unigram_entropy_nats)
        else ""
      )
      + f"workdir={self.workdir}"
    )
    note = self.cfg.optim.decay_note(self.cfg.num_steps)
    if note:
      self.progress.message("diffjax: " + note)

  # ---- 4. the steps --------------------------------------------------------------------------

  def _prepare_loop(self) -> None:
    cfg = self.cfg
    self.flops = flops_per_token(self.model_cfg, cfg.seq_len)
    self.throughput = Throughput(
      self.clock,
      tokens_per_step=cfg.tokens_per_step,
      model_flops_per_token=self.flops.model,
      num_devices=self.mesh.size,
      peak_flops_per_device=cfg.peak_flops or peak_flops(jax.devices()[0].device_kind),
    )
    self.profile = Profile(cfg.profile, self.workdir, enabled=self.is_main, clock=self.clock)
    graphdef = self.setup.graphdef
    # Under the mesh rules like the steps (for DIFF V2 it runs the blocks over a batch).
    self.lambda_fn = jax.jit(
      with_mesh_rules(
        lambda p, b: lambda_summary(graphdef, p, b),
        self.mesh,
        self.rules,
        **cfg.mesh.context_options(),
      )
    )
    self.val_batches = self.data.val_batches(cfg.eval_batches)
    self.writer = MetricsWriter(self.workdir, enabled=self.is_main, tensorboard=cfg.tensorboard)
    # Bits per byte compares runs across tokenizers: the validation targets' tokens per byte,
    # counted once on the host (for byte tokens exactly 1, so it is the loss in bits).
    self.val_tokens_per_byte = tokens_per_byte(self.val_batches, self.data.tokenizer)
    # A save started but unfinished (an async one, or one a lost peer never joined) is not one
    # to resume from: the line names the newest finished one.
    distributed.watch_peers(
      lambda: ckpt.newest_finished_step(self.manager.directory),
      message=_stderr_line,
      timeout_s=cfg.distributed.peer_timeout_s,
    )

  def _to_global(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return _to_global(local, self.batch_shard, self.row_start, self.cfg.global_batch_size)

  def _train(self, stop: _StopFlag, vote: _StopVote) -> dict[str, Any] | None:
    """Trains up to ``num_steps``; the early result when a signal stopped the run (after the
    step ``vote`` agrees on), else None."""
    self.step, train_step = self.start_step, None
    try:
      while self.step < self.cfg.num_steps:
        with self.clock.phase("data"):
          local = next(self.train_iter)
          batch = self._to_global(local)
        if train_step is None:
          train_step = self._compile(batch)
        if self.profile.before(self.step + 1):
          # The profiler records the programs compiled while it runs (their HLO carries the
          # named scopes the trace viewer groups by): compile the step again inside the trace,
          # with an option that also keeps a persistent compilation cache from answering.
          with self.clock.phase("profile"):
            train_step = self.setup.train_step.lower(self.state, batch).compile(
              {"xla_embed_ir_in_executable": True}
            )
        with self.clock.phase("train"):
          self.state, metrics = train_step(self.state, batch)
        self.step += 1
        self.profile.after(self.step, self.state)
        signum = vote.after_step(stop.signum)
        self._after_step(local, metrics, stopping=signum is not None)
        if signum is not None:
          return self._stop(signum)
      with self.clock.phase("train"):
        self._flush_metrics()
    except Exception as e:
      # A collective with a lost peer fails here first; the watchdog then says which.
      distributed.wait_for_lost_peer(e)
      raise
    finally:
      self.profile.close()
      self.progress.close()
    return None

  def _compile(self, batch):
    # Compiled ahead of the first step, so its compile time is measured and the HLO of what
    # runs can be written.
    with self.clock.phase("compile"):
      train_step = self.setup.train_step.lower(self.state, batch).compile()
    self.profile.dump_hlo(train_step)
    self.throughput.restart(self.step)
    return train_step

  def _after_step(self, local, metrics, stopping: bool) -> None:
    """Records a dispatched step: its metrics, the progress line, a periodic evaluation and
    save (also when ``stopping``: a signal stops the run after this step)."""
    cfg, step = self.cfg, self.step
    if cfg.log_batch_hash:
      metrics = dict(metrics, batch_hash=zlib.crc32(np.ascontiguousarray(local["inputs"])))
    self.pending.append((step, metrics))
    is_log = step % cfg.log_every == 0 or step == cfg.num_steps
    is_save = step % cfg.checkpoint.every == 0
    if is_log or is_save or stopping:
      with self.clock.phase("train"):  # waits for the queued steps
        self._flush_metrics()
    self.progress.update(
      step,
      float(metrics["loss"]) if self.progress.tty or is_log else 0.0,
      float(cfg.tokens_per_step),
    )
    if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.num_steps:
      self.last_eval = self._evaluate(self.state["params"])
      self.progress.message(f"step {step}: eval loss {self.last_eval['eval/loss']:.4f}")
    if is_save or stopping:
      self._save()

  def _stop(self, signum: int) -> dict[str, Any]:
    with self.clock.phase("checkpoint"):
      self.manager.wait_until_finished()
    self.progress.message(
      f"Signal {signum}: saved step {self.step}; rerun the same command to resume."
    )
    self.writer.close()
    return {"step": self.step, "stopped": True, "train/loss": self.last_train_loss}

  def _flush_metrics(self) -> None:
    """Writes the metrics of the pending steps (waiting for them), and the interval's perf."""
    if not self.pending:
      return
    for s, m in self.pending:
      if bool(m["finite"]):
        self.last_train_loss = float(m["loss"])
        vals = {
          "train/loss": self.last_train_loss,
          "train/grad_norm": float(m["grad_norm"]),
          "train/lr": float(m["lr"]),
          "train/tokens": float(m["tokens"]),
        }
        if not vals["train/tokens"]:
          self._unscored("train", f"Training step {s}")
        if "batch_hash" in m:
          vals["data/batch_hash"] = m["batch_hash"]
        self.writer.write(s, vals)
      else:
        self._skipped_update(s, m)
    perf = self.throughput.interval(self.pending[-1][0])
    if perf:
      self.writer.write(self.pending[-1][0], perf)
      self.progress.extra = f" step {perf['perf/step_time_s']:.3f}s" + (
        f" mfu {perf['perf/mfu']:.1%}" if "perf/mfu" in perf else ""
      )
    self.pending.clear()

  def _skipped_update(self, s: int, m: dict) -> None:
    """Records step ``s``, whose update was skipped as non-finite; stops the run past
    ``max_skipped_updates`` such steps."""
    self.skipped += 1
    skipped, most = self.skipped, self.cfg.max_skipped_updates
    vals = {"train/skipped": 1.0, "train/skipped_updates": float(skipped)}
    if "batch_hash" in m:
      vals["data/batch_hash"] = m["batch_hash"]
    self.writer.write(s, vals)
    what = (
      f"Non-finite loss, gradient or update at step {s} (loss={float(m['loss'])}, "
      f"grad_norm={float(m['grad_norm'])})"
    )
    if skipped > most:
      self.writer.close()  # the skipped step's line is kept
      raise TrainingError(
        f"{what}: {skipped} skipped update{'s' if skipped > 1 else ''}, more than "
        f"max_skipped_updates={most}. The update was skipped and the last good "
        f"checkpoint in {self.manager.directory} is intact; lower optim.lr, check the data, "
        "or allow more skips (--config.max_skipped_updates=N)."
      )
    self.progress.message(f"{what}: update skipped ({skipped} of at most {most})")

  def _evaluate(self, params) -> dict[str, float]:
    """The validation loss (and the lambdas of a DIFF model) at this step, written."""
    with self.clock.phase("eval"):
      loss = evaluate_loss(
        self.setup.eval_step, params, self.val_batches, self._to_global, self.step
      )
      vals = {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}
      if math.isnan(loss) and not any(b["loss_mask"].any() for b in self.val_batches):
        self._unscored("eval", f"The evaluation at step {self.step}")  # not a diverged model
      if self.val_tokens_per_byte is not None:
        vals["eval/bits_per_byte"] = loss * self.val_tokens_per_byte / math.log(2.0)
      if arms.get(self.model_cfg.attention).lambda_report != "none":
        b = self._to_global(self.val_batches[0])
        vals.update({k: float(v) for k, v in self.lambda_fn(params, b).items()})
      self.writer.write(self.step, vals)
      return vals

  def _save(self) -> None:
    with self.clock.phase("checkpoint"):
      meta = dict(self.meta, wall_s=self.earlier_wall_s + self.clock.wall())  # every attempt's
      ckpt.save(self.manager, self.step, self.state, self.train_iter, meta, force=True)

  # ---- 5. the end ----------------------------------------------------------------------------

  def _final_save(self) -> None:
    if self.manager.latest_step() != self.step:
      self._save()
    with self.clock.phase("checkpoint"):
      self.manager.wait_until_finished()

  def _finish(self) -> dict[str, Any]:
    distributed.stop_watching()
    step = self.step
    summary = goodput(
      self.clock, steps_trained=step - self.start_step, steps_recomputed=self.recomputed
    )
    result = {
      "step": step,
      "train/loss": self.last_train_loss,
      **self.last_eval,
      "unigram/loss": self.data.unigram_entropy_nats,
      "params": self.n_params,
      "train/skipped_updates": self.skipped,
      "wall_s": summary["wall_s"],
      # With the attempts before this one, each up to the checkpoint the next resumed from.
      "wall_s_all_attempts": self.earlier_wall_s + summary["wall_s"],
      **{f"perf/{k}": v for k, v in self.throughput.summary().items()},
      "perf/model_flops_per_token": self.flops.model,
      "perf/hardware_flops_per_token": self.flops.hardware,
    }
    if self.checks:
      result["preflight/fallbacks"] = sum(not c.ok for c in self.checks)
    if self.is_main:
      self.progress.message(
        "final: "
        + " ".join(
          f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
          for k, v in result.items()
          if not k.startswith("lambda")
        )
      )
      self.progress.message(goodput_line(summary))
      write_json(os.path.join(self.workdir, "goodput.json"), summary)
      write_json(os.path.join(self.workdir, "final_metrics.json"), result)
      # The completion marker: tpu_setup/babysit.sh stops relaunching when it appears.
      epath.Path(self.workdir, DONE_FILE).write_text(f"{step}\n")
    self.writer.close()
    self.manager.close()
    return result
