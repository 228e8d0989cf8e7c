"""Trains a diffjax language model.

  python train.py                                # configs/default.py into runs/default
  python train.py --config=configs/default.py --workdir=runs/default \
      [--config.model.arm=transformer --config.num_steps=2000 ...]
  python train.py --config=configs/tiny.py --dry_run   # check the config, print the run
  python train.py --help                         # usage, shipped configs, overrides

Without --config the default config (configs/default.py) is trained; without --workdir the
run writes to runs/<config name>[_<config argument>][_<arm>] under the current directory
(the arm when --config.model.arm is given).
Rerunning the same command resumes from the latest checkpoint in the workdir; a run that
already finished is left unchanged (a larger --config.num_steps extends it). One training
writes a workdir at a time: a second one in the same workdir is refused.

Exit status:
  0   the run finished (the workdir holds a DONE marker), or --help / --dry_run;
  2   a mistake in the flags, the config or the data, a non-finite loss, another
      training holding the workdir, or a process group that cannot form (its coordinator's
      port in use or out of reach, a process id given twice): one ``error:`` line says what
      to change;
  75  (EXIT_PREEMPTED, sysexits' EX_TEMPFAIL) stopped by SIGTERM or SIGINT (Ctrl-C):
      from the restore on (the first compile included) after saving the next step, at
      the end after the final save, during start-up (config, data) at once (while
      the libraries load, once they are loaded), with one line; or one of several
      processes stopped
      answering (one ``error:`` line names it): rerun the same command to resume.
      tpu_setup/babysit.sh relaunches on it.

With several processes (a pod, DIFFJAX_COORDINATOR, SLURM) the training runs in a child
process of this one; see diffjax/train/supervise.py.
"""

import contextlib
import os
import signal
import sys
import threading
import time

EXIT_PREEMPTED = 75
DEFAULT_CONFIG = os.path.join("configs", "default.py")
USAGE = (
  "usage: python train.py [--config=configs/<file>.py[:ARG]] [--workdir=<dir>] "
  "[--config.<key>=<value> ...] [--dry_run]"
)
SUMMARY = """\
Trains one run of a config: an arm (model.arm: transformer, diff_v1, diff_v2, gda_v1, gda_v2 or
one added with diffjax.arms.register) matched to the Transformer of a size, on the config's data,
with checkpoints, metrics.jsonl and TensorBoard logs in the workdir (and, on a local disk, the
compiled programs a rerun loads: compile_cache/, unless JAX_COMPILATION_CACHE_DIR names another
place). Rerunning the same command resumes from the newest good checkpoint; a finished run is left
unchanged (a larger --config.num_steps extends it, with --config.optim.decay_steps to stretch the
decay), and a second training in a workdir that one is writing is refused."""


# While the imports run, a stop signal waits until they are done: an interrupt raised while a
# C extension (jaxlib) sets itself up crashes the interpreter (status 139 or 134, no line).
_HELD = {"holding": False, "signum": None, "in_hook": 0}


def _raise_interrupt(signum, frame):
  del frame
  if _HELD["holding"]:
    _HELD["signum"] = signum
    return
  if _HELD["in_hook"]:  # raised inside the hook below it would be lost: the hook's thread resends
    return
  raise KeyboardInterrupt(signum)


@contextlib.contextmanager
def _held_while_importing():
  _HELD["holding"] = True
  try:
    yield
  finally:
    _HELD["holding"] = False
  if _HELD["signum"] is not None:
    raise KeyboardInterrupt(_HELD["signum"])


def _redeliver_lost_interrupt(unraisable):
  # An interrupt raised where Python ignores exceptions (jax's gc callback, a finalizer) would
  # be lost and the run would go on: the signal is sent to the main thread again a moment
  # later, from another thread (as diffjax.cli.stop_signals_raise does for the other commands;
  # this one acts before the package is imported).
  exc = unraisable.exc_value
  if not (isinstance(exc, KeyboardInterrupt) and exc.args and isinstance(exc.args[0], int)):
    sys.__unraisablehook__(unraisable)
    return
  signum, main = exc.args[0], threading.main_thread().ident
  left = threading.Event()

  def again():  # once the hook has returned: a signal that arrives inside it is dropped
    left.wait()
    time.sleep(0.01)
    if signal.getsignal(signum) not in (signal.SIG_DFL, signal.SIG_IGN, None):
      signal.pthread_kill(main, signum)

  _HELD["in_hook"] += 1
  try:
    threading.Thread(target=again, daemon=True).start()
  finally:
    _HELD["in_hook"] -= 1
    left.set()


def _take_stop_signals():
  # SIGTERM stops start-up as Ctrl-C does (by default it would kill the process silently).
  # SIGINT is set too: Python raises KeyboardInterrupt on it only when the process did not
  # inherit it ignored, and a job started in the background of a script inherits it so.
  signal.signal(signal.SIGTERM, _raise_interrupt)
  signal.signal(signal.SIGINT, _raise_interrupt)
  sys.unraisablehook = _redeliver_lost_interrupt


def main(argv) -> int:
  """Runs the command; SIGINT or SIGTERM before the training loop (which saves and stops on
  them itself) ends it with one line and status 75, and the next run resumes."""
  _take_stop_signals()
  try:
    return _main(argv)
  except KeyboardInterrupt as e:
    signum = e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT
    print(
      f"diffjax: stopped by signal {int(signum)}; rerun the same command to resume from the "
      "newest complete checkpoint.",
      file=sys.stderr,
      flush=True,
    )
    sys.stdout.flush()
    # No interpreter shutdown: the runtime's threads may be mid-compile or mid-read, and
    # tearing them down from here can crash. Files this attempt wrote are whole (written
    # through renames) and the workdir's lock goes with the process.
    os._exit(EXIT_PREEMPTED)


def _main(argv) -> int:
  with _held_while_importing():
    from absl import logging  # pylint: disable=import-outside-toplevel

    from diffjax import cli  # pylint: disable=import-outside-toplevel
    from diffjax.train import supervise  # pylint: disable=import-outside-toplevel

  supervise.follow_parent()  # a supervised child dies with its supervisor
  with _held_while_importing():
    from diffjax.train import config_utils  # pylint: disable=import-outside-toplevel

  parsed = cli.parse(
    argv,
    usage=USAGE,
    summary=SUMMARY,
    default_config=DEFAULT_CONFIG,
    describe=config_utils.describe_run,
    overrides_help=config_utils.OVERRIDE_HELP,
    renamed=config_utils.RENAMED_KEYS,
    flags=(
      cli.Flag(
        "workdir",
        None,
        "directory for checkpoints and metrics "
        "[default: runs/<config name>[_<config argument>][_<arm>]]",
      ),
    ),
  )
  if isinstance(parsed, int):
    return parsed
  config, values, config_arg = parsed
  from diffjax.errors import run_guarded  # pylint: disable=import-outside-toplevel
  from diffjax.train.config import RunConfig  # pylint: disable=import-outside-toplevel

  workdir = values["workdir"]
  if workdir is None:
    workdir = config_utils.default_workdir(config_arg, argv)
    print(
      f"diffjax: training {config_arg} into {workdir} (choose with --config=... and --workdir=...)",
      flush=True,
    )
  # The one place the config is resolved into its typed sections (and checked).
  resolved = []
  status = run_guarded(lambda: resolved.append(RunConfig.from_config(config)))
  if status:
    return status
  run = resolved[0]
  from diffjax.errors import require_filesystem  # pylint: disable=import-outside-toplevel

  status = run_guarded(
    lambda: (
      require_filesystem(workdir, "--workdir"),
      require_filesystem(run.checkpoint.init_from or "", "checkpoint.init_from"),
    )
  )
  if status:
    return status
  if supervise.wanted(run.distributed):
    # One of several processes: train in a child, so that even the runtime's abort on losing
    # process 0 becomes one line and status 75 (diffjax/train/supervise.py).
    child = supervise.child_command(os.path.abspath(__file__), argv[1:])
    if values["workdir"] is None:
      child.append(f"--workdir={workdir}")
    return supervise.run(child, workdir)
  # Orbax and grain log every checkpoint step at INFO; keep the terminal for progress.
  logging.set_verbosity(logging.WARNING)
  with _held_while_importing():
    from diffjax.train import train_and_evaluate  # pylint: disable=import-outside-toplevel

    if "://" not in workdir:
      # A resumed run loads the programs its earlier attempts compiled instead of compiling
      # them again (JAX_COMPILATION_CACHE_DIR, when set, names another place).
      cli.use_compile_cache(os.path.join(workdir, "compile_cache"))

  result = {}
  status = run_guarded(lambda: result.update(train_and_evaluate(run, workdir)))
  if status == 0 and result.get("stopped"):
    return EXIT_PREEMPTED
  return status


if __name__ == "__main__":
  sys.exit(main(sys.argv))
