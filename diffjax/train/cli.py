"""The command line shared by every command that runs a config file (train.py,
``python -m diffjax.compare``, ``python -m diffjax.aot``).

One grammar: ``--config=configs/<file>.py[:ARG]`` names the config file (``ARG`` goes to its
``get_config``), ``--config.<key>=<value>`` sets any key it defines, and ``--help`` prints the
usage, the config files that ship with diffjax and how to override them. A mistake gets one
``error:`` line naming the flag or key (with the nearest valid keys) and exit status 2.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS_DIR = os.path.join(REPO_ROOT, "configs")

OVERRIDE_HELP = """\
Overrides: --config.<key>=<value> sets any key of the config (values are Python literals):
  --config.model.arm=diff_v2          the arm; its widths are derived again from the
                                      Transformer it is matched to (model.size and the
                                      model.d_model/num_heads/... baseline widths)
  --config.model.size=small           another baseline size (model.sizes)
  --config.model.v2_match=heads       how DIFF V2 is matched: params (default) or heads
  --config.model.unmatched.num_heads=2  an arm width set on purpose: the run is then
                                      reported as UNMATCHED, with its parameter counts
  --config.num_steps=2000 --config.optim.lr=1e-3 --config.data.paths="('corpus/',)"
"""


@dataclasses.dataclass(frozen=True)
class Flag:
  """A plain (non-config) flag of a command: ``--name=<value>``."""

  name: str
  default: Any
  help: str


def shipped_configs(pattern: str = "*.py") -> list[tuple[str, str]]:
  """(path relative to the repository, first line of its docstring) of each shipped config."""
  out = []
  for path in sorted(glob.glob(os.path.join(CONFIGS_DIR, "**", pattern), recursive=True)):
    try:
      doc = ast.get_docstring(ast.parse(open(path, encoding="utf-8").read())) or ""
    except SyntaxError:
      doc = ""
    out.append((os.path.relpath(path, REPO_ROOT), doc.strip().splitlines()[0] if doc else ""))
  return out


def help_text(
  usage: str, summary: str, flags: Sequence[Flag], configs: str = "*.py", subdir: str | None = None
) -> str:
  """The ``--help`` text: usage, summary, flags, the shipped configs and the override grammar."""
  lines = [usage, "", summary.strip(), "", "Flags:"]
  lines.append("  --config=<file>.py[:ARG]  the run's config file")
  for f in flags:
    spelled = f"--{f.name}" if isinstance(f.default, bool) else f"--{f.name}=<value>"
    lines.append(
      f"  {spelled}  {f.help}"
      + (f" [default: {f.default}]" if f.default not in (None, "", False) else "")
    )
  lines += ["", "Configs shipped with diffjax:"]
  found = [
    c
    for c in shipped_configs(configs)
    if (subdir is None and os.sep + "compare" + os.sep not in c[0])
    or (subdir is not None and (os.sep + subdir + os.sep) in c[0])
  ]
  width = max((len(p) for p, _ in found), default=0)
  lines += [f"  {p:<{width}}  {d}" for p, d in found]
  lines += ["", OVERRIDE_HELP.rstrip()]
  return "\n".join(lines)


def _one_line(e: BaseException) -> str:
  return " ".join(line.strip() for line in str(e).splitlines() if line.strip())


DRY_RUN = Flag(
  "dry_run",
  False,
  "check the config and print what it resolves to (each run's "
  "model and its parameter counts), then exit; reads no data",
)


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
):
  """Parses a config command's ``argv`` (argv[0] is the program).

  Returns ``(config, values, config_arg)``: the loaded config (overrides applied), the plain
  flags' values by name, and the ``--config`` argument as given; or an int exit status
  (0 after printing ``--help``, 2 after one ``error:`` line). With ``describe``, the command
  also takes ``--dry_run``: print ``describe(config)`` and return its status.
  """
  if describe is not None:
    flags = (*flags, DRY_RUN)
  from absl import flags as absl_flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  from diffjax.train.config_utils import explain_flag_error  # pylint: disable=import-outside-toplevel

  argv = list(argv)
  if any(a in ("-h", "--help", "--helpfull", "-help") for a in argv[1:]):
    print(help_text(usage, summary, flags, subdir=subdir))
    return 0
  config_arg = _config_arg(argv[1:])
  if config_arg is None:
    if default_config is None:
      print(f"error: --config is required; {usage}", file=sys.stderr)
      return 2
    config_arg = default_config
    argv.insert(1, "--config=" + os.path.join(REPO_ROOT, default_config))
  fv = absl_flags.FlagValues()
  holder = config_flags.DEFINE_config_file(
    config_prefix, None, "the run's config file", flag_values=fv, lock_config=True, sys_argv=argv
  )
  plain = {}
  for f in flags:
    define = (
      absl_flags.DEFINE_bool
      if isinstance(f.default, bool)
      else absl_flags.DEFINE_integer
      if isinstance(f.default, int)
      else absl_flags.DEFINE_string
    )
    plain[f.name] = define(f.name, f.default, f.help, flag_values=fv)
  try:
    rest = fv(argv)
  except Exception as e:  # absl and ml_collections raise several types for bad flags
    print(
      f"error: {explain_flag_error(argv, config_prefix) or 'invalid command line: ' + _one_line(e)}"
      f" ({usage})",
      file=sys.stderr,
    )
    return 2
  try:
    config = holder.value
    _ = config is not None and "model" in config  # loading errors surface on first access
  except Exception as e:  # a config file that is missing or fails to import
    detail = str(e).splitlines()[-1].strip() if str(e).strip() else type(e).__name__
    print(f"error: cannot load --config={config_arg}: {detail}", file=sys.stderr)
    return 2
  if len(rest) > 1 or config is None:
    print(f"error: unexpected arguments {rest[1:]}; {usage}", file=sys.stderr)
    return 2
  values = {name: holder_.value for name, holder_ in plain.items()}
  if describe is not None and values.pop("dry_run"):
    from diffjax.errors import run_guarded  # pylint: disable=import-outside-toplevel

    return run_guarded(lambda: print(describe(config)))
  return config, values, config_arg


def _config_arg(argv: Sequence[str], name: str = "config") -> str | None:
  """The value of ``--config`` in ``argv`` (``--config=X`` or ``--config X``), or None."""
  for i, a in enumerate(argv):
    if a.startswith(f"--{name}="):
      return a.split("=", 1)[1]
    if a == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def default_workdir(config_arg: str, argv: Sequence[str]) -> str:
  """runs/<file stem>[_<argument>] for ``--config=<path>[:<argument>]``, with ``_<arm>`` added
  when the command line sets ``--config.model.arm`` (another arm is another run)."""
  path, _, arg = config_arg.partition(":")
  name = os.path.splitext(os.path.basename(path))[0] + (f"_{arg}" if arg else "")
  for a in argv:
    if a.startswith("--config.model.arm="):
      name += "_" + a.split("=", 1)[1]
  return os.path.join("runs", "".join(c if c.isalnum() or c in "._-" else "_" for c in name))
