"""No function in ``diffjax/`` runs past 80 lines of code without saying why.

The docstring does not count. A longer function states its reason in a comment that starts
with ``# One function:`` between its signature and its first statement (the Pallas kernels,
whose warpgroups or stages close over the refs and sizes their function sets up).
"""

from __future__ import annotations

import ast
import os

from helpers import REPO

LIMIT = 80
REASON = "# One function:"


def _long_functions(path: str):
  """(name, line, lines of code, whether a reason is stated) of each function over LIMIT."""
  with open(path, encoding="utf-8") as f:
    source = f.read()
  lines = source.splitlines()
  for node in ast.walk(ast.parse(source)):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    body, doc = node.body, 0
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and len(body) > 1:
      if isinstance(first.value.value, str):
        doc, body = first.end_lineno - first.lineno + 1, body[1:]
    length = node.end_lineno - node.lineno + 1 - doc
    if length > LIMIT:
      head = lines[node.lineno - 1 : body[0].lineno - 1]
      stated = any(line.strip().startswith(REASON) for line in head)
      yield node.name, node.lineno, length, stated


def test_long_functions_state_a_reason():
  unexplained = []
  for folder, _, files in os.walk(os.path.join(REPO, "diffjax")):
    for name in sorted(files):
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        for fn, line, length, stated in _long_functions(path):
          if not stated:
            unexplained.append(f"{os.path.relpath(path, REPO)}:{line} {fn} ({length} lines)")
  assert not unexplained, (
    f"functions over {LIMIT} lines of code without a {REASON!r} comment before their first "
    "statement; split them or state why they are one:\n" + "\n".join(unexplained)
  )


def test_the_rule_sees_a_long_function_and_its_reason(tmp_path):
  body = "".join(f"  x{i} = {i}\n" for i in range(LIMIT + 1))
  plain = tmp_path / "plain.py"
  plain.write_text(f'def f():\n  """Doc."""\n{body}')
  stated = tmp_path / "stated.py"
  stated.write_text(f'def f():\n  """Doc."""\n  {REASON} a reason.\n{body}')
  short = tmp_path / "short.py"
  short_body = "".join(f"  x{i} = {i}\n" for i in range(LIMIT - 1))  # with its def: LIMIT
  short.write_text(f'def f():\n  """Doc."""\n{short_body}')
  assert [(n, s) for n, _, _, s in _long_functions(str(plain))] == [("f", False)]
  assert [(n, s) for n, _, _, s in _long_functions(str(stated))] == [("f", True)]
  assert list(_long_functions(str(short))) == []
