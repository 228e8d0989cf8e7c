"""The package's layers: no import cycle, and no import from a lower layer to a higher one.

Every ``import`` statement in ``diffjax/`` counts, those inside functions included
(a lazy import is still a dependency). The layers, lowest first, are the table in
docs/architecture.md.
"""

from __future__ import annotations

import ast
import os

import pytest
from helpers import REPO

ROOT = REPO
PKG = os.path.join(ROOT, "diffjax")

# Lowest first. A module may import modules of its own layer or of lower layers.
LAYERS: tuple[tuple[str, ...], ...] = (
  (
    "diffjax.errors",
    "diffjax.compat",
    "diffjax.hardware",
    "diffjax.core",
    "diffjax.sharding",
    "diffjax.cpu",
    "diffjax.cli",
  ),
  ("diffjax.kernels",),
  ("diffjax.ops",),
  ("diffjax.nn",),
  ("diffjax.arms",),
  ("diffjax.model",),
  ("diffjax.data",),
  ("diffjax.presets", "diffjax.train"),
  ("diffjax.eval",),
  # The lm-eval model generates and loads HF directories, so it sits above both.
  (
    "diffjax.compare",
    "diffjax.aot",
    "diffjax.generation",
    "diffjax.convert",
    "diffjax.eval.harness",
  ),
  # The server runs the generation layer's programs over runs and HF directories.
  ("diffjax.serve",),
)


def _modules() -> dict[str, str]:
  """Module name -> file path for every module of the package."""
  out = {}
  for dirpath, _, files in os.walk(PKG):
    for f in files:
      if not f.endswith(".py"):
        continue
      rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
      out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
  return out


def _imports(path: str, name: str, modules: dict[str, str]) -> set[str]:
  """The package modules that ``name`` imports anywhere in its file."""
  is_pkg = path.endswith("__init__.py")
  tree = ast.parse(open(path, encoding="utf-8").read())
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = name.split(".")
        base = base if is_pkg else base[:-1]
        base = base[: len(base) - node.level + 1]
        mod = ".".join(base + ([node.module] if node.module else []))
      else:
        mod = node.module or ""
      # `from pkg import sub` names a submodule when one exists.
      targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
    elif (
      isinstance(node, ast.Call)
      and getattr(node.func, "attr", getattr(node.func, "id", ""))
      in ("import_module", "__import__")
      and node.args
      and isinstance(node.args[0], ast.Constant)
      and isinstance(node.args[0].value, str)
    ):
      targets = [node.args[0].value]  # importlib.import_module("diffjax.x")
    else:
      continue
    for t in targets:
      while t and t not in modules:
        t = t.rpartition(".")[0]
      if t.startswith("diffjax") and t != name:
        found.add(t)
  return found


def _layer(module: str) -> int | None:
  """The layer of the longest name in the table that is ``module`` or a package above it."""
  best = None
  for i, names in enumerate(LAYERS):
    for n in names:
      if (module == n or module.startswith(n + ".")) and (best is None or len(n) > best[0]):
        best = (len(n), i)
  return None if best is None else best[1]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
  modules = _modules()
  return {m: _imports(p, m, modules) for m, p in modules.items()}


def test_every_module_has_a_layer(graph):
  missing = sorted(m for m in graph if m != "diffjax" and _layer(m) is None)
  assert not missing, f"modules outside the layer table: {missing}"


def test_no_import_runs_up_a_layer(graph):
  bad = []
  for mod, deps in graph.items():
    if mod == "diffjax":  # the package face re-exports the public API
      continue
    for dep in deps:
      if dep != "diffjax" and (_layer(dep) or 0) > (_layer(mod) or 0):
        bad.append(f"{mod} (layer {_layer(mod)}) imports {dep} (layer {_layer(dep)})")
      if dep == "diffjax":
        bad.append(f"{mod} imports the package face 'diffjax' itself")
  assert not bad, "\n".join(sorted(bad))


def test_no_import_cycle(graph):
  # Tarjan's strongly connected components; any component of more than one module
  # is a cycle.
  index, low, stack, on_stack, cycles = {}, {}, [], set(), []
  counter = [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        cycles.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  assert not cycles, f"import cycles: {cycles}"


def test_checker_sees_lazy_and_relative_imports(tmp_path):
  # The checker itself must see imports inside functions and relative imports.
  pkg = tmp_path / "diffjax" / "sub"
  pkg.mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text(
    "import importlib\ndef f():\n  from . import b\n  import diffjax.other\n"
    "  importlib.import_module('diffjax.third')\n"
  )
  (pkg / "b.py").write_text("")
  modules = {
    "diffjax.sub": str(pkg / "__init__.py"),
    "diffjax.sub.a": str(pkg / "a.py"),
    "diffjax.sub.b": str(pkg / "b.py"),
    "diffjax.other": "x",
    "diffjax.third": "y",
  }
  assert _imports(str(pkg / "a.py"), "diffjax.sub.a", modules) == {
    "diffjax.sub.b",
    "diffjax.other",
    "diffjax.third",
  }
