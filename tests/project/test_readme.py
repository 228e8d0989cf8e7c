"""The documentation works as written: the README and docs/ are read, not trusted.

* Every ```python block of README.md and of docs/*.md runs. The blocks of one file share a
  namespace, in order; each file starts from a fresh one.
* Every relative link in README.md and docs/**/*.md points at a file or directory that
  exists, and every #anchor at a heading of the file it names.
* The ```bash blocks: :func:`shell_blocks` returns their command lines, every ``python``
  command in them names a script or module that exists (and a ``--config`` file that
  exists), and every one of them runs here, in this process, as far as it can without the
  hours of work it starts: ``train.py`` and ``python -m diffjax.compare`` with ``--dry_run``
  (the config loaded, overridden, matched and checked), the others up to the end of their
  argument parsing (argparse's ``parse_args`` or ``parse_known_args``, or the config
  commands' ``cli.parse``, after which ``python -m diffjax.aot``'s config is checked the
  way ``--dry_run`` checks it) and stopped there, so that a flag a command does not take,
  a bad value or a config key that does not exist fails the test. Installs (``pip``,
  ``venv``) are checked for the extras and files they name; the README's two commands are
  the ones ``.ci/run`` runs.
* ``--help`` works on every command the docs give.

Blocks that are output, transcripts or signatures use a plain ``` fence and are not read.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
from unittest import mock

import pytest
from helpers import REPO, WAIT_LIMIT_S  # noqa: E402

ROOT = REPO
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")

_FENCE = re.compile(r"^[ \t]*```([^\n`]*)\n(.*?)^[ \t]*```[ \t]*$", re.S | re.M)
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_SEPARATORS = {"&&", "||", ";", "|", "&"}
# Commands of other programs that the pages show beside the project's (an HTTP request, a shell
# loop waiting for a server, lm-eval's own command line): nothing here can run them.
_OTHER_PROGRAMS = {"curl", "until", "do", "done", "sleep", "kill", "lm-eval"}


def _rel(path: str) -> str:
  return os.path.relpath(path, ROOT)


def doc_pages(recursive: bool = True) -> list[str]:
  """README.md and the Markdown files under docs/ (docs/*.md only when not ``recursive``)."""
  pattern = os.path.join(DOCS, "**", "*.md") if recursive else os.path.join(DOCS, "*.md")
  return [README] + sorted(glob.glob(pattern, recursive=recursive))


def _read(path: str) -> str:
  with open(path, encoding="utf-8") as f:
    return f.read()


def fenced_blocks(path: str, language: str) -> list[str]:
  """The bodies of the ```<language> blocks of ``path``, in order."""
  return [body for lang, body in _FENCE.findall(_read(path)) if lang.strip() == language]


def python_blocks(path: str) -> list[str]:
  return fenced_blocks(path, "python")


def shell_blocks(path: str) -> list[list[str]]:
  """The command lines of each ```bash block of ``path``: backslash continuations joined,
  comments and blank lines dropped, one string per command line."""
  out = []
  for body in fenced_blocks(path, "bash"):
    joined = re.sub(r"\\\n\s*", " ", body)
    lines = []
    for line in joined.splitlines():
      words = shlex.split(line, comments=True)
      if words:
        lines.append(shlex.join(words))
    out.append(lines)
  return out


def commands(command_line: str) -> list[list[str]]:
  """The words of each command in one shell command line (split at ``&&``, ``||``, ``;``
  and ``|``; leading ``VAR=value`` assignments skipped)."""
  words = []
  for w in shlex.split(command_line):  # "x;" is "x" then ";"
    words += [w[:-1], ";"] if len(w) > 1 and w.endswith(";") else [w]
  out, current = [], []
  for w in words + ["&&"]:
    if w in _SEPARATORS:
      while current and _ENV_ASSIGNMENT.match(current[0]):
        current = current[1:]
      if current:
        out.append(current)
      current = []
    else:
      current.append(w)
  return out


def python_invocations(command_line: str) -> list[list[str]]:
  """The argument lists of the ``python ...`` commands in one shell command line."""
  return [cmd[1:] for cmd in commands(command_line) if _PYTHON.match(cmd[0])]


def _module_exists(name: str) -> bool:
  if name.split(".")[0] == "diffjax":
    base = os.path.join(ROOT, *name.split("."))
    return os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__main__.py"))
  return importlib.util.find_spec(name) is not None


def missing_targets(args: list[str]) -> list[str]:
  """What a ``python`` command's arguments name that does not exist: its module (``-m``),
  its script, or its ``--config`` file. ``-c`` programs are not read."""
  missing = []
  if not args or args[0] == "-c":
    return missing
  if args[0] == "-m":
    if len(args) < 2 or not _module_exists(args[1]):
      missing.append("module " + (args[1] if len(args) > 1 else "(none)"))
  elif not os.path.isfile(os.path.join(ROOT, args[0])):
    missing.append("script " + args[0])
  for a in args:
    if a.startswith("--config="):
      path = a.split("=", 1)[1].split(":", 1)[0]
      if path.endswith(".py") and not os.path.isfile(os.path.join(ROOT, path)):
        missing.append("config " + path)
  return missing


def _outside_code(text: str) -> str:
  """``text`` without fenced blocks and inline code spans."""
  text = _FENCE.sub("", text)
  return re.sub(r"`[^`\n]*`", "", text)


def heading_anchors(path: str) -> set[str]:
  """The anchors GitHub gives the headings of ``path`` (lower case, punctuation dropped,
  spaces to hyphens, repeats numbered)."""
  anchors: set[str] = set()
  for line in _FENCE.sub("", _read(path)).splitlines():
    m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
    if not m:
      continue
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).replace("`", "")
    slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
    anchor, n = slug, 0
    while anchor in anchors:
      n += 1
      anchor = f"{slug}-{n}"
    anchors.add(anchor)
  return anchors


def relative_links(path: str) -> list[str]:
  """The link targets in ``path`` that are not URLs (http, https, mailto)."""
  targets = _LINK.findall(_outside_code(_read(path)))
  return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def broken_links(path: str) -> list[str]:
  broken = []
  for target in relative_links(path):
    file_part, _, anchor = target.partition("#")
    dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
    if not os.path.exists(dest):
      broken.append(f"{target}: no file {_rel(dest)}")
    elif anchor and (not dest.endswith(".md") or anchor not in heading_anchors(dest)):
      broken.append(f"{target}: no heading #{anchor} in {_rel(dest)}")
  return broken


@pytest.mark.integration
def test_readme_python_examples_run():
  blocks = python_blocks(README)
  assert len(blocks) >= 2
  namespace: dict = {}
  for block in blocks:
    exec(compile(block, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  out = namespace["out"]
  assert out.shape == (2, 128, 16, 64)
  assert namespace["y"].shape == (2, 16, 512)
  assert set(namespace["aux"]) >= {"probs1", "probs2", "lambda"}


_DOCS_WITH_PYTHON = [p for p in doc_pages(recursive=False)[1:] if python_blocks(p)]
# JAX reads the number of CPU devices once, when it starts: a page whose examples set it runs
# them in a fresh process, with no device count from the tests' environment.
_SETS_DEVICES = "jax_num_cpu_devices"


def needs_own_process(path: str) -> bool:
  return any(_SETS_DEVICES in block for block in python_blocks(path))


def _run_in_own_process(path: str, tmp_path) -> None:
  script = tmp_path / "example.py"
  script.write_text("\n".join(python_blocks(path)))  # one namespace, the blocks in order
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
  env["XLA_FLAGS"] = " ".join(
    f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f
  )
  env.update(
    JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, (ROOT, env.get("PYTHONPATH"))))
  )
  proc = subprocess.run(
    [sys.executable, str(script)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=WAIT_LIMIT_S,
  )
  assert proc.returncode == 0, f"{_rel(path)}: " + proc.stderr[-4000:]


@pytest.mark.integration
@pytest.mark.parametrize("path", _DOCS_WITH_PYTHON, ids=_rel)
def test_docs_python_examples_run(path, monkeypatch, tmp_path):
  if needs_own_process(path):
    _run_in_own_process(path, tmp_path)
    return
  # An example may register an arm: the registry is restored afterwards.
  from diffjax.arms import spec

  monkeypatch.setattr(spec, "_ARMS", dict(spec._ARMS))
  monkeypatch.setattr(spec, "_MODULES", dict(spec._MODULES))
  namespace: dict = {}
  for block in python_blocks(path):
    exec(compile(block, _rel(path), "exec"), namespace)  # pylint: disable=exec-used


def test_relative_links_point_at_existing_files_and_headings():
  broken = {_rel(p): b for p in doc_pages() if (b := broken_links(p))}
  assert not broken, broken


def test_python_commands_in_shell_blocks_name_existing_scripts_and_modules():
  missing = {}
  for path in doc_pages():
    for lines in shell_blocks(path):
      for line in lines:
        for args in python_invocations(line):
          if m := missing_targets(args):
            missing.setdefault(_rel(path), []).append(f"{line!r}: {', '.join(m)}")
  assert not missing, missing


def test_the_checks_see_what_they_check():
  # The readers find the README's blocks and links, so an empty scan cannot pass.
  assert shell_blocks(README) and all(shell_blocks(README))
  assert python_invocations("JAX_PLATFORMS=cpu python -m diffjax.aot --x=1 && python3.11 t.py") == [
    ["-m", "diffjax.aot", "--x=1"],
    ["t.py"],
  ]
  assert missing_targets(["-m", "diffjax.no_such_module"]) == ["module diffjax.no_such_module"]
  assert missing_targets(["no_such_script.py", "--config=configs/nope.py:diff_v1"]) == [
    "script no_such_script.py",
    "config configs/nope.py",
  ]
  assert not missing_targets(["train.py", "--config=configs/default.py"])
  assert "docs/getting_started.md" in relative_links(README)
  assert heading_anchors(README) >= {"what-is-exact", "what-has-run-on-hardware"}
  # The sharding example (8 CPU devices) runs in a process of its own.
  scaling = os.path.join(DOCS, "scaling.md")
  assert scaling in _DOCS_WITH_PYTHON and needs_own_process(scaling)


# ---- Running the shell blocks' commands --------------------------------------------------

# Commands whose own --dry_run does all the checking a run does before its first step.
_DRY_RUN = {"train.py", "diffjax.compare"}


class _Parsed(Exception):
  """Raised where a command has parsed and checked its arguments: the rest is its work."""


def _target(args: list[str]) -> str:
  """The module (``-m``) or script a ``python`` command runs."""
  return args[1] if args[0] == "-m" else args[0]


@contextlib.contextmanager
def _stop_after_parsing():
  """Makes argparse's ``parse_args`` and ``parse_known_args`` and the config commands'
  ``cli.parse`` raise :class:`_Parsed` once they succeed (a config with a model is checked
  as --dry_run would)."""
  from diffjax import cli  # pylint: disable=import-outside-toplevel
  from diffjax.train.config_utils import describe_run  # pylint: disable=import-outside-toplevel

  parser = argparse.ArgumentParser
  real_parse_args, real_parse_known_args, real_parse = (
    parser.parse_args,
    parser.parse_known_args,
    cli.parse,
  )
  inside_parse_args = []

  def parse_args(self, args=None, namespace=None):
    inside_parse_args.append(True)
    try:
      result = real_parse_args(self, args, namespace)
    finally:
      inside_parse_args.pop()
    raise _Parsed(result)

  def parse_known_args(self, args=None, namespace=None):
    result = real_parse_known_args(self, args, namespace)
    if inside_parse_args:
      return result
    raise _Parsed(result)

  def parse(argv, **kwargs):
    result = real_parse(argv, **kwargs)
    if isinstance(result, int):
      return result
    if "model" in result[0]:
      describe_run(result[0])
    raise _Parsed(result)

  with (
    mock.patch.object(parser, "parse_args", parse_args),
    mock.patch.object(parser, "parse_known_args", parse_known_args),
    mock.patch.object(cli, "parse", parse),
  ):
    yield


def run_in_process(args: list[str], *, stop_after_parsing: bool = True) -> tuple[str, str]:
  """Runs ``python <args>`` in this process, from the repository root, as ``__main__``.

  Returns how it ended (``"parsed"``, or ``"exit <status>"``) and what it printed. The
  environment, ``sys.path``, ``sys.argv`` and the working directory are restored after.
  """
  saved = (dict(os.environ), list(sys.path), list(sys.argv), os.getcwd(), set(sys.modules))
  out = io.StringIO()
  target = _target(args)
  try:
    os.chdir(ROOT)
    sys.argv = [target] + args[2 if args[0] == "-m" else 1 :]
    if args[0] != "-m":
      sys.path.insert(0, os.path.dirname(os.path.join(ROOT, target)))
    guard = _stop_after_parsing() if stop_after_parsing else contextlib.nullcontext()
    with guard, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
      try:
        if args[0] == "-m":
          runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
          runpy.run_path(os.path.join(ROOT, target), run_name="__main__")
        ended = "exit 0"
      except _Parsed:
        ended = "parsed"
      except SystemExit as e:
        ended = f"exit {0 if e.code is None else e.code}"
  finally:
    env, path, argv, cwd, modules = saved
    os.environ.clear()
    os.environ.update(env)
    sys.path[:], sys.argv[:] = path, argv
    os.chdir(cwd)
    for name in set(sys.modules) - modules:  # the scripts' sibling modules (benchmarks/*.py)
      module_file = getattr(sys.modules[name], "__file__", None) or ""
      if module_file.startswith(os.path.join(ROOT, "benchmarks")):
        del sys.modules[name]
  return ended, out.getvalue()


def _pyproject_extras() -> set[str]:
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    return set(tomllib.load(f)["project"]["optional-dependencies"])


def _console_scripts() -> dict[str, str]:
  """The scripts ``pyproject.toml`` installs: name -> ``module:function``."""
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["project"].get("scripts", {})


def _install_problems(cmd: list[str]) -> list[str]:
  """What a ``pip install`` names that the project does not have (extras, files)."""
  problems, extras = [], _pyproject_extras()
  for i, w in enumerate(cmd):
    named = cmd[i + 1] if w in ("-c", "-r") and i + 1 < len(cmd) else None
    if named and not os.path.isfile(os.path.join(ROOT, named)):
      problems.append(f"no file {named}")
    m = re.fullmatch(r"\.\[([\w,\-]+)\]", w)
    if m:
      problems += [
        f"no extra [{e}] in pyproject.toml" for e in m.group(1).split(",") if e not in extras
      ]
  return problems


def _run_command(cmd: list[str]) -> str | None:
  """Runs one command of a shell block as far as these checks do; what went wrong, or None."""
  if cmd[0] == "." or cmd[:3] in (["python3.11", "-m", "venv"], ["python", "-m", "venv"]):
    return None  # making and entering a virtual environment
  if cmd[0] == "pip":
    return "; ".join(_install_problems(cmd)) or None
  if cmd[0] in _OTHER_PROGRAMS:
    return None
  if cmd[0] in _console_scripts():  # an installed script runs its module's main
    cmd = ["python", "-m", _console_scripts()[cmd[0]].split(":")[0], *cmd[1:]]
  if not _PYTHON.match(cmd[0]):
    return f"not a command these checks know how to run: {cmd[0]}"
  args = cmd[1:]
  if args[:2] == ["-m", "pytest"]:
    missing = [
      a.split("::")[0]
      for a in args[2:]
      if a.startswith("tests") and not os.path.exists(os.path.join(ROOT, a.split("::")[0]))
    ]
    return f"no test path {missing}" if missing else None
  if missing := missing_targets(args):
    return ", ".join(missing)
  dry = _target(args) in _DRY_RUN
  ended, printed = run_in_process(args + (["--dry_run"] if dry else []), stop_after_parsing=not dry)
  if ended != ("exit 0" if dry else "parsed"):
    return f"{ended}: {printed.strip()[-600:]}"
  return None


_SHELL_PAGES = [p for p in doc_pages() if shell_blocks(p)]


@pytest.mark.parametrize("path", _SHELL_PAGES, ids=_rel)
def test_shell_block_commands_run(path):
  failed = {}
  for lines in shell_blocks(path):
    for line in lines:
      for cmd in commands(line):
        if problem := _run_command(cmd):
          failed[shlex.join(cmd)] = problem
  assert not failed, failed


def test_the_readme_commands_are_the_ones_ci_runs():
  with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
    ci = [shlex.join(shlex.split(line)) for line in f if line.strip() and not line.startswith("#")]
  (train_line,), (test_line, full_line) = shell_blocks(README)[:2]
  install, unit = commands(test_line)[2:]
  assert shlex.join(install).replace("pip install", "pip install -q") in ci
  # The README's full suite is the unit tier, then the rest; on the main set CI runs both, in
  # that order, before the newer sets (their own venvs) follow.
  full = [shlex.join(c) for c in commands(full_line)]
  assert full[0] == shlex.join(unit) and len(full) == 2, full
  assert "integration" in full[1] and "slow" in full[1], full
  at = [ci.index(c) for c in full]
  assert at == sorted(at) and at[-1] < ci.index("deactivate"), (at, ci)
  assert commands(train_line)[2][:4] == install[:4]  # the same constraints


def _documented_commands() -> list[str]:
  found = set()
  for path in doc_pages():
    for lines in shell_blocks(path):
      for line in lines:
        for args in python_invocations(line):
          if args and args[0] != "-c" and args[:2] not in (["-m", "pytest"], ["-m", "venv"]):
            found.add(" ".join(args[:2]) if args[0] == "-m" else args[0])
  return sorted(found)


@pytest.mark.parametrize("command", _documented_commands())
def test_every_documented_command_answers_help(command):
  args = command.split() + ["--help"]
  ended, printed = run_in_process(args, stop_after_parsing=False)
  assert ended == "exit 0", (ended, printed[-600:])
  assert "usage" in printed.lower(), printed[:600]
  if _target(args) in ("train.py", "diffjax.compare", "diffjax.aot"):
    assert "Configs shipped with diffjax:" in printed and "--config.<key>=<value>" in printed


def test_a_broken_command_fails_the_check():
  # The runner stops commands after parsing, and says when one does not parse.
  assert _run_command(["python", "train.py", "--config=configs/tiny.py"]) is None
  assert "modle" in _run_command(
    ["python", "train.py", "--config=configs/tiny.py", "--config.modle.arm=diff_v2"]
  )
  assert "exit 2" in _run_command(["python", "-m", "diffjax.generation", "--no_such_flag=1"])
  assert "no extra [nope]" in _run_command(["pip", "install", "-e", ".[test,nope]"])
  assert _run_command(["python", "-m", "diffjax.eval.toy"]) is None  # parsed, not run


# ---- The examples --help gives ------------------------------------------------------------

# Each config command with a config file its examples can run on.
_HELP_COMMANDS = {
  "train.py": "configs/default.py",
  "-m diffjax.compare": "configs/compare/tiny.py",
  "-m diffjax.aot": "configs/default.py",
  "-m diffjax.eval": None,
}


def help_examples(text: str) -> list[list[str]]:
  """The override examples of a ``--help`` text: after its ``Overrides:`` line, the
  ``--config.<key>=<value>`` words of each line (placeholders in ``<>`` left out), one list
  per line that has any."""
  _, _, after = text.partition("Overrides:")
  out = []
  for line in after.splitlines():
    words = [shlex.split(w.rstrip(";,"))[0] for w in re.findall(r"--config\.\S+", line)]
    words = [w for w in words if "<" not in w]
    if words:
      out.append(words)
  return out


@pytest.mark.parametrize("command", sorted(_HELP_COMMANDS))
def test_every_override_example_in_help_runs(command):
  args = command.split()
  ended, printed = run_in_process(args + ["--help"], stop_after_parsing=False)
  assert ended == "exit 0", printed[-600:]
  examples = help_examples(printed)
  assert examples, printed
  config = _HELP_COMMANDS[command]
  failed = {}
  for words in examples:
    cmd = ["python", *args, *([f"--config={config}"] if config else []), *words]
    if problem := _run_command(cmd):
      failed[shlex.join(words)] = problem
  assert not failed, failed


def test_help_examples_are_found_and_a_bad_one_fails():
  text = "Flags:\n  --config.x=1\nOverrides: --config.<key>=<value>, the runs' keys\n  --config.a=1 b --config.c='(1,2)';\n"
  assert help_examples(text) == [["--config.a=1", "--config.c=(1,2)"]]
  bad = [
    "python",
    "-m",
    "diffjax.compare",
    "--config=configs/compare/tiny.py",
    "--config.model.arm=diff_v2",
  ]
  assert "model" in _run_command(bad)


def test_help_lists_each_config_by_a_whole_sentence():
  from diffjax import cli  # pylint: disable=import-outside-toplevel

  described = dict(cli.shipped_configs())
  assert described and all(d.endswith(".") for d in described.values()), described
  assert cli.first_sentence("A b\nc d. E f.\n\nG.") == "A b c d."


_INLINE_CODE = re.compile(r"`(python3?(?:\.\d+)? [^`\n]+)`")


def inline_python_commands(path: str) -> list[str]:
  """The ``python ...`` commands the prose of ``path`` names in inline code spans."""
  return _INLINE_CODE.findall(_FENCE.sub("", _read(path)))


def test_python_commands_named_in_the_prose_exist():
  missing = {}
  for path in doc_pages():
    for command_line in inline_python_commands(path):
      try:
        invocations = python_invocations(command_line)
      except ValueError:  # a fragment with an unclosed quote: nothing to check
        continue
      for args in invocations:
        # A config file of the reader's own may be named; the program must exist.
        if m := [t for t in missing_targets(args) if not t.startswith("config ")]:
          missing.setdefault(_rel(path), []).append(f"{command_line!r}: {', '.join(m)}")
  assert not missing, missing
  assert inline_python_commands(README), "the README names commands in its prose"
  assert missing_targets(["-m", "diffjax.generate"]) == ["module diffjax.generate"]
