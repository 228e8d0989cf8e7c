"""The documentation works as written: the README and docs/ are read, not trusted.

* Every ```python block of README.md and of docs/*.md runs. The blocks of one file share a
  namespace, in order; each file starts from a fresh one.
* Every relative link in README.md and docs/**/*.md points at a file or directory that
  exists, and every #anchor at a heading of the file it names.
* The ```bash blocks: :func:`shell_blocks` returns their command lines, and every ``python``
  command in them names a script or module that exists (and a ``--config`` file that
  exists). Running the commands is left to heavier checks.

Blocks that are output, transcripts or signatures use a plain ``` fence and are not read.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shlex

import pytest
from helpers import REPO  # noqa: E402

ROOT = REPO
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")

_FENCE = re.compile(r"^[ \t]*```([^\n`]*)\n(.*?)^[ \t]*```[ \t]*$", re.S | re.M)
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_SEPARATORS = {"&&", "||", ";", "|"}


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


def python_invocations(command_line: str) -> list[list[str]]:
  """The argument lists of the ``python ...`` commands in one shell command line (split at
  ``&&``, ``||``, ``;`` and ``|``; leading ``VAR=value`` assignments skipped)."""
  words = shlex.split(command_line)
  commands, current = [], []
  for w in words:
    if w in _SEPARATORS:
      commands.append(current)
      current = []
    else:
      current.append(w)
  commands.append(current)
  out = []
  for cmd in commands:
    while cmd and _ENV_ASSIGNMENT.match(cmd[0]):
      cmd = cmd[1:]
    if cmd and _PYTHON.match(cmd[0]):
      out.append(cmd[1:])
  return out


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


@pytest.mark.parametrize("path", _DOCS_WITH_PYTHON, ids=_rel)
def test_docs_python_examples_run(path):
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
      ["-m", "diffjax.aot", "--x=1"], ["t.py"]]
  assert missing_targets(["-m", "diffjax.no_such_module"]) == ["module diffjax.no_such_module"]
  assert missing_targets(["no_such_script.py", "--config=configs/nope.py:diff_v1"]) == [
      "script no_such_script.py", "config configs/nope.py"]
  assert not missing_targets(["train.py", "--config=configs/default.py"])
  assert "docs/getting_started.md" in relative_links(README)
  assert heading_anchors(README) >= {"what-is-exact", "what-has-run-on-hardware"}
