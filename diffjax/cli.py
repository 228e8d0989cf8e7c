"""The command line every diffjax command shares, and loading config files.

``--config=configs/<file>.py[:ARG]``, ``--config.<key>=<value>``, a command's own flags and
``--help`` (docs/training.md); a mistake is one ``error:`` line and exit status 2. This module
knows no config schema: a command passes its own override help and renamed keys.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import difflib
import functools
import glob
import importlib.util
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS_DIR = os.path.join(REPO_ROOT, "configs")
HELP_FLAGS = ("-h", "--help", "--helpfull", "-help")


@dataclasses.dataclass(frozen=True)
class Flag:
  """A plain (non-config) flag of a command: ``--name=<value>``.

  Attributes:
    name: the flag's name.
    default: its value when not given; a bool makes a switch (``--name``).
    help: one line for ``--help``.
    kind: the value's type where ``default`` does not say it (an int flag with a None default);
      None: the default's type, a string for None.
  """

  name: str
  default: Any
  help: str
  kind: type | None = None


@dataclasses.dataclass(frozen=True)
class RenamedKey:
  """A config key that is not a key any more, and the line that names its replacement.

  Attributes:
    old: the old dotted key; it also matches under a prefix (``base.model.attention``).
    new: the key to use instead, at the same place as ``old``.
    text: the explanation; ``{new}`` there becomes ``--<flag>.<prefix><new>``.
  """

  old: str
  new: str
  text: str


class ArgumentParser(argparse.ArgumentParser):
  """``argparse.ArgumentParser`` for the commands without a config file: a mistake in the
  arguments is one ``error:`` line naming it and where the usage is, and exit status 2 (not
  the usage block argparse prints). Its subcommands' parsers are of this class too."""

  def error(self, message: str):
    self.exit(2, f"error: {message} (see {self.prog} --help).\n")


# ----------------------------------------------------------------------------------------------
# Config files.


def use_compile_cache(path: str, *, every_program: bool = False) -> bool:
  """Points JAX's persistent compilation cache at ``path`` unless one is chosen already
  (``JAX_COMPILATION_CACHE_DIR`` wins); returns whether it did. ``every_program`` keeps programs
  however quickly they compiled (unless ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` is set),
  for a command that compiles the same programs at every start."""
  import jax  # pylint: disable=import-outside-toplevel

  if jax.config.jax_compilation_cache_dir:
    return False
  jax.config.update("jax_compilation_cache_dir", path)
  if every_program and "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return True


def nearest_existing(path: str) -> str:
  """``path`` (made absolute) or its nearest ancestor that exists: where writing ``path`` would
  first meet the file system."""
  path = os.path.abspath(path)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  return path


def load_config(path: str, arg: str | None = None):
  """``get_config(arg)`` (or ``get_config()``) of the config file at ``path``.

  For config files that build on another one (a comparison on a run config).
  """
  path = os.path.abspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"No config file at {path}.")
  name = "diffjax_config_" + "".join(ch if ch.isalnum() else "_" for ch in path)
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module.get_config() if arg is None else module.get_config(arg)


def first_sentence(doc: str) -> str:
  """The first sentence of a docstring's first paragraph, its lines joined (the whole
  paragraph when it holds one sentence)."""
  paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split()) if doc else ""
  return re.split(r"(?<=\.)\s+(?=[A-Z])", paragraph, maxsplit=1)[0]


def shipped_configs(pattern: str = "*.py") -> list[tuple[str, str]]:
  """(path relative to the repository, first sentence of its docstring) of each shipped config."""
  out = []
  for path in sorted(glob.glob(os.path.join(CONFIGS_DIR, "**", pattern), recursive=True)):
    try:
      doc = ast.get_docstring(ast.parse(open(path, encoding="utf-8").read())) or ""
    except SyntaxError:
      doc = ""
    out.append((os.path.relpath(path, REPO_ROOT), first_sentence(doc)))
  return out


def help_text(
  usage: str,
  summary: str,
  flags: Sequence[Flag],
  configs: str = "*.py",
  subdir: str | None = None,
  overrides_help: str = "",
  with_config_file: bool = True,
) -> str:
  """The ``--help`` text: usage, summary, flags, the shipped configs (for a command that reads
  a config file) and the override grammar."""
  lines = [usage, "", summary.strip(), "", "Flags:"]
  if with_config_file:
    lines.append("  --config=<file>.py[:ARG]  the run's config file")
  for f in flags:
    spelled = f"--{f.name}" if isinstance(f.default, bool) else f"--{f.name}=<value>"
    lines.append(
      f"  {spelled}  {f.help}"
      + (f" [default: {f.default}]" if f.default not in (None, "", False) else "")
    )
  if with_config_file:
    lines += ["", "Configs shipped with diffjax:"]
    found = [
      c
      for c in shipped_configs(configs)
      if (subdir is None and os.sep + "compare" + os.sep not in c[0])
      or (subdir is not None and (os.sep + subdir + os.sep) in c[0])
    ]
    width = max((len(p) for p, _ in found), default=0)
    lines += [f"  {p:<{width}}  {d}" for p, d in found]
  if overrides_help:
    lines += ["", overrides_help.rstrip()]
  return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Unknown --config.<key> overrides.


def _is_section(value: Any) -> bool:
  """A ConfigDict section (a dict value is a value, not a section)."""
  return hasattr(value, "keys") and not isinstance(value, dict)


def _get(config, dotted: str) -> tuple[bool, Any]:
  node = config
  for part in dotted.split("."):
    if not hasattr(node, "keys") or part not in node:
      return False, None
    node = node[part]
  return True, node


def flat_keys(config, prefix: str = "") -> Iterator[str]:
  """Every value key of a (nested) ConfigDict as a dotted path (sections are descended
  into, not listed)."""
  for k in config.keys():
    path = f"{prefix}{k}"
    value = config[k]
    if _is_section(value):
      yield from flat_keys(value, path + ".")
    else:
      yield path


def unknown_key(config, dotted: str) -> str | None:
  """The first prefix of ``dotted`` that is not a key of ``config``, or None if all are."""
  node, parts = config, dotted.split(".")
  for i, part in enumerate(parts):
    if not _is_section(node) or part not in node:
      return ".".join(parts[: i + 1])
    node = node[part]
  return None


# Names other trainers give a setting (Optax, transformers, lightning) -> the last part of the key
# that holds it here, suggested first.
_OTHER_NAMES = {
  "learning_rate": "lr",
  "max_steps": "num_steps",
  "train_steps": "num_steps",
  "steps": "num_steps",
  "batch_size": "global_batch_size",
  "train_batch_size": "global_batch_size",
  "warmup": "warmup_steps",
  "max_seq_len": "seq_len",
  "seq_length": "seq_len",
  "context_length": "seq_len",
  "gradient_accumulation_steps": "grad_accum_steps",
  "max_grad_norm": "clip_norm",
}


def _other_name_keys(keys: Sequence[str], key: str) -> list[str]:
  """The keys of ``keys`` that hold what another trainer calls ``key``'s last part."""
  other = _OTHER_NAMES.get(key.rsplit(".", 1)[-1])
  return [k for k in keys if other is not None and k.rsplit(".", 1)[-1] == other]


def suggest_keys(config, key: str, n: int = 3) -> list[str]:
  """The valid dotted keys nearest to ``key`` (the key holding a setting another trainer calls
  by its last part, then by spelling of the whole path or of its last part), at most ``n``."""
  keys = list(flat_keys(config))
  close = _other_name_keys(keys, key)
  close += [k for k in difflib.get_close_matches(key, keys, n=n, cutoff=0.6) if k not in close]
  if len(close) < n:
    last = key.rsplit(".", 1)[-1]
    by_leaf: dict[str, list[str]] = {}
    for k in keys:
      by_leaf.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    for leaf in difflib.get_close_matches(last, list(by_leaf), n=n, cutoff=0.75):
      close += [k for k in by_leaf[leaf] if k not in close]
  return close[:n]


def override_keys(argv: Sequence[str], flag: str = "config") -> list[tuple[str, str]]:
  """``(key, argument)`` of every ``--<flag>.<key>[=value]`` argument in ``argv``."""
  out = []
  for arg in argv:
    for start in (f"--{flag}.", f"-{flag}."):
      if arg.startswith(start):
        out.append((arg[len(start) :].split("=", 1)[0], arg))
        break
  return out


def _renamed_message(
  key: str, arg: str, bad: str, renamed: Sequence[RenamedKey], flag: str
) -> str | None:
  for r in renamed:
    if bad == r.old or bad.endswith("." + r.old):
      prefix = bad.removesuffix(r.old)
      return f"unknown config key {key!r} in {arg}: " + r.text.format(
        new=f"--{flag}.{prefix}{r.new}"
      )
  return None


def unknown_override_message(
  config, argv: Sequence[str], flag: str = "config", renamed: Sequence[RenamedKey] = ()
) -> str | None:
  """One line naming the first ``--config.<key>`` override whose key ``config`` lacks,
  with the nearest valid keys (or the keys of its section if none is near; a key of
  ``renamed`` names its replacement); None if every override names an existing key."""
  for key, arg in override_keys(argv, flag):
    bad = unknown_key(config, key)
    if bad is None:
      continue
    said = _renamed_message(key, arg, bad, renamed, flag)
    if said is not None:
      return said
    parent = bad.rsplit(".", 1)[0] if "." in bad else ""
    _, node = _get(config, parent) if parent else (True, config)
    if parent and not _is_section(node):
      return (
        f"unknown config key {key!r} in {arg}: {parent} is a value, not a section; "
        f"set it with --{flag}.{parent}=<value>."
      )
    # A typo in one part: the same key with that part corrected, then near spellings.
    parts, depth = key.split("."), bad.count(".")
    if parent and not node.keys():  # an empty section: a dict the config sets whole
      return (
        f"unknown config key {key!r} in {arg}: {parent} is empty, so a flag cannot add "
        f"{parts[depth]!r} to it; set it whole, e.g. "
        f"--{flag}.{parent}=\"{{'{parts[depth]}': <value>}}\"."
      )
    near = _other_name_keys(list(flat_keys(config)), bad)
    for fix in difflib.get_close_matches(parts[depth], list(node.keys()), n=3, cutoff=0.6):
      fixed = ".".join(parts[:depth] + [fix] + parts[depth + 1 :])
      if unknown_key(config, fixed) is None and fixed not in near:
        near.append(fixed)
    near += [k for k in suggest_keys(config, bad) if k not in near]
    near = near[:3]
    if near:
      hint = "did you mean " + " or ".join(f"--{flag}.{k}" for k in near) + "?"
    else:
      scope = f"{parent}." if parent else ""
      hint = (
        f"the keys{' of ' + parent if parent else ''} are "
        + ", ".join(f"{scope}{k}" for k in node.keys())
        + "."
      )
    return f"unknown config key {key!r} in {arg}; {hint}"
  return None


def explain_flag_error(
  argv: Sequence[str], flag: str = "config", renamed: Sequence[RenamedKey] = ()
) -> str | None:
  """After a failed flag parse: :func:`unknown_override_message` for ``argv``.

  Loads the config file named by ``--<flag>=`` alone (without the overrides) to learn
  its keys. Returns None when the config cannot be loaded or every key exists (the
  parse failed for another reason, e.g. a value of the wrong type).
  """
  from absl import flags as absl_flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  prefixes = (f"--{flag}.", f"-{flag}.")
  plain = [a for a in argv if not a.startswith(prefixes)]
  values = absl_flags.FlagValues()
  holder = config_flags.DEFINE_config_file(flag, None, "", flag_values=values)
  # ml_collections reads the overrides from sys.argv too: hide them while loading.
  saved, sys.argv = sys.argv, plain
  try:
    values(plain, known_only=True)
    config = holder.value
  except Exception:  # pylint: disable=broad-except  # the caller reports the original error
    return None
  finally:
    sys.argv = saved
  return None if config is None else unknown_override_message(config, argv, flag, renamed)


# ----------------------------------------------------------------------------------------------
# Parsing.


def _one_line(e: BaseException) -> str:
  return " ".join(line.strip() for line in str(e).splitlines() if line.strip())


def usage_error(text: str) -> int:
  """Prints ``error: <text>`` on stderr (a mistake in the command line); returns exit status 2."""
  print(f"error: {text}", file=sys.stderr)
  return 2


class _CommandLineError(Exception):
  """A mistake in the command line: :func:`parse` prints its one line and returns 2."""


DRY_RUN = Flag(
  "dry_run",
  False,
  "check the config and print what it resolves to (each run's "
  "model and its parameter counts), then exit; reads no data",
)


def _define_flags(fv, flags: Sequence[Flag]) -> dict[str, Any]:
  from absl import flags as absl_flags  # pylint: disable=import-outside-toplevel

  by_kind = {
    bool: absl_flags.DEFINE_bool,
    int: absl_flags.DEFINE_integer,
    float: absl_flags.DEFINE_float,
  }
  holders = {}
  for f in flags:
    kind = f.kind or (type(f.default) if f.default is not None else str)
    define = by_kind.get(kind, absl_flags.DEFINE_string)
    holders[f.name] = define(f.name, f.default, f.help, flag_values=fv)
  return holders


def parse(
  argv: Sequence[str],
  *,
  usage: str,
  summary: str,
  flags: Sequence[Flag] = (),
  default_config: str | None = None,
  subdir: str | None = None,
  config_prefix: str = "config",
  describe: Callable[[Any], str] | None = None,
  overrides_help: str = "",
  renamed: Sequence[RenamedKey] = (),
  fields: Sequence[str] | None = None,
):
  """Parses a command's ``argv`` (argv[0] is the program).

  Args:
    argv: the command line.
    usage, summary: the first lines of ``--help`` (and ``usage`` of every error line).
    flags: the command's plain flags.
    default_config: the config file when no ``--config=`` is given (None: it is required).
    subdir: the folder of ``configs/`` whose files ``--help`` lists (None: the run configs).
    config_prefix: the flag that names the config (``config``).
    describe: with it, the command also takes ``--dry_run``: print ``describe(config)`` and
      return its status.
    overrides_help: the override grammar's lines in ``--help``.
    renamed: keys that are no longer keys, each answered with the line naming its successor.
    fields: a command without a config file: ``--config.<field>=<value>`` sets one of these
      names (the value a Python literal, else a string; lists become tuples).

  Returns:
    ``(config, values, config_arg)``: the loaded config (overrides applied), the plain flags'
    values by name, and the ``--config`` argument as given; with ``fields``, ``(overrides,
    values, None)`` where ``overrides`` holds the fields given. Or an int exit status: 0 after
    printing ``--help``, 2 after one ``error:`` line.
  """
  if describe is not None:
    flags = (*flags, DRY_RUN)
  argv = list(argv)
  if any(a in HELP_FLAGS for a in argv[1:]):
    print(
      help_text(
        usage,
        summary,
        flags,
        subdir=subdir,
        overrides_help=overrides_help,
        with_config_file=fields is None,
      )
    )
    return 0
  try:
    if fields is not None:
      return _parse_fields(argv, usage, flags, fields, config_prefix)
    return _parse_config_file(argv, usage, flags, default_config, config_prefix, describe, renamed)
  except _CommandLineError as e:
    return usage_error(str(e))


def _parse_flags(
  fv, argv: list[str], usage: str, explain: Callable[[], str | None] = lambda: None
) -> list[str]:
  """``fv(argv)``: the arguments left after the flags. A flag it refuses is a
  :class:`_CommandLineError`: ``explain()``'s line where it has one, else absl's."""
  try:
    return fv(argv)
  except Exception as e:  # absl and ml_collections raise several types for bad flags
    raise _CommandLineError(
      f"{explain() or 'invalid command line: ' + _one_line(e)} ({usage})"
    ) from None


def _unexpected_arguments(rest: list[str], usage: str) -> _CommandLineError:
  return _CommandLineError(f"unexpected arguments {rest[1:]}; {usage}")


def _parse_config_file(argv, usage, flags, default_config, config_prefix, describe, renamed):
  from absl import flags as absl_flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  config_arg = _config_arg(argv[1:], config_prefix)
  if config_arg is None:
    if default_config is None:
      raise _CommandLineError(f"--{config_prefix} is required; {usage}")
    config_arg = default_config
    argv.insert(1, f"--{config_prefix}=" + os.path.join(REPO_ROOT, default_config))
  fv = absl_flags.FlagValues()
  holder = config_flags.DEFINE_config_file(
    config_prefix, None, "the run's config file", flag_values=fv, lock_config=True, sys_argv=argv
  )
  plain = _define_flags(fv, flags)
  rest = _parse_flags(fv, argv, usage, lambda: explain_flag_error(argv, config_prefix, renamed))
  try:
    config = holder.value
    _ = config is not None and "model" in config  # loading errors surface on first access
  except Exception as e:  # a config file that is missing or fails to import
    detail = str(e).splitlines()[-1].strip() if str(e).strip() else type(e).__name__
    raise _CommandLineError(f"cannot load --{config_prefix}={config_arg}: {detail}") from None
  if len(rest) > 1 or config is None:
    raise _unexpected_arguments(rest, usage)
  values = {name: holder_.value for name, holder_ in plain.items()}
  if describe is not None and values.pop("dry_run"):
    from diffjax.errors import run_guarded  # pylint: disable=import-outside-toplevel

    return run_guarded(lambda: print(describe(config)))
  return config, values, config_arg


def _literal(value: str) -> Any:
  """A ``--config.<field>=`` value: a Python literal (lists become tuples), else the string."""
  try:
    out = ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return value
  if isinstance(out, list):
    out = tuple(tuple(v) if isinstance(v, list) else v for v in out)
  return out


def field_overrides(
  argv: Sequence[str], fields: Sequence[str], flag: str = "config"
) -> tuple[dict[str, Any], str | None]:
  """``({field: value}, None)`` from the ``--<flag>.<field>=<value>`` arguments of ``argv``,
  or ``({}, error)``: one line naming an override without a value or of an unknown field
  (with the nearest fields)."""
  out = {}
  for key, arg in override_keys(argv, flag):
    if "=" not in arg:
      return {}, f"{arg} has no value; set it with --{flag}.{key}=<value>."
    if key not in fields:
      near = difflib.get_close_matches(key, list(fields), n=3)
      hint = (
        "did you mean " + " or ".join(f"--{flag}.{k}" for k in near) + "?"
        if near
        else f"the keys are {', '.join(sorted(fields))}."
      )
      return {}, f"unknown config key {key!r} in {arg}; {hint}"
    out[key] = _literal(arg.split("=", 1)[1])
  return out, None


def _parse_fields(argv, usage, flags, fields, config_prefix):
  from absl import flags as absl_flags  # pylint: disable=import-outside-toplevel

  overrides, error = field_overrides(argv[1:], fields, config_prefix)
  if error is not None:
    raise _CommandLineError(f"{error} ({usage})")
  prefixes = (f"--{config_prefix}.", f"-{config_prefix}.")
  fv = absl_flags.FlagValues()
  plain = _define_flags(fv, flags)
  rest = _parse_flags(fv, [a for a in argv if not a.startswith(prefixes)], usage)
  if len(rest) > 1:
    raise _unexpected_arguments(rest, usage)
  return overrides, {name: holder.value for name, holder in plain.items()}, None


def _config_arg(argv: Sequence[str], name: str = "config") -> str | None:
  """The value of ``--config`` in ``argv`` (``--config=X`` or ``--config X``), or None."""
  for i, a in enumerate(argv):
    if a.startswith(f"--{name}="):
      return a.split("=", 1)[1]
    if a == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
  return None


# Stopping a long-running command (compare, eval) with Ctrl-C, kill -INT or kill -TERM.
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended


# Calls of the hook below in progress: a signal that arrives inside one is dropped there (an
# interrupt raised inside the hook would be lost), and the hook's thread sends it again after.
_IN_HOOK = [0]


def _raise_interrupt(signum, frame):
  del frame
  if _IN_HOOK[0]:
    return
  raise KeyboardInterrupt(signum)


def _redeliver_lost_interrupt(other_hook, unraisable) -> None:
  """``sys.unraisablehook`` while stop signals raise: an interrupt raised where Python ignores
  exceptions (a gc callback such as jax's, a finalizer) would be lost, and the command would
  run on; the signal is sent to the main thread again from another thread a moment later
  (sent from here, its handler would run inside this hook, where it is lost again), if a
  Python handler still takes it. Anything else goes to ``other_hook``."""
  exc = unraisable.exc_value
  if not (isinstance(exc, KeyboardInterrupt) and exc.args and isinstance(exc.args[0], int)):
    other_hook(unraisable)
    return
  signum, main = exc.args[0], threading.main_thread().ident
  left = threading.Event()

  def again():
    left.wait()  # sent while the hook runs, the handler would run inside it
    time.sleep(0.01)
    if signal.getsignal(signum) not in (signal.SIG_DFL, signal.SIG_IGN, None):
      signal.pthread_kill(main, signum)

  _IN_HOOK[0] += 1
  try:
    threading.Thread(target=again, daemon=True).start()
  finally:
    _IN_HOOK[0] -= 1
    left.set()


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
  """Inside, SIGINT and SIGTERM raise ``KeyboardInterrupt(signum)``; the handlers before are
  restored on the way out.

  SIGINT is set because Python raises KeyboardInterrupt on it only when the process did not
  inherit it ignored, and a job started in the background of a script inherits it so (Ctrl-C
  and ``kill -INT`` would then do nothing); SIGTERM so that it stops the command the same way
  rather than killing it without a word. Code inside that installs its own handlers (the
  trainer's save-and-stop) has them while it runs.
  """
  old = {}
  for s in (signal.SIGINT, signal.SIGTERM):
    try:
      old[s] = signal.signal(s, _raise_interrupt)
    except ValueError:  # not the main thread: signals are not ours to take
      pass
  old_hook = sys.unraisablehook
  if old:
    sys.unraisablehook = functools.partial(_redeliver_lost_interrupt, old_hook)
  try:
    yield
  finally:
    sys.unraisablehook = old_hook
    for s, h in old.items():
      signal.signal(s, h)


def interrupt_signal(e: KeyboardInterrupt) -> int:
  """The signal number a `stop_signals_raise` interrupt carries (SIGINT for a plain Ctrl-C)."""
  return e.args[0] if e.args and isinstance(e.args[0], int) else int(signal.SIGINT)


def exit_now(code: int) -> NoReturn:
  """Flushes stdout and stderr and ends the process with ``code`` at once, without the
  interpreter's shutdown: after an interrupt the runtime's threads may be mid-compile or
  mid-read, and tearing them down from there can crash."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)
