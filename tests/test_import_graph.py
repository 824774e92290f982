"""The project's import graph has no cycle.

Every import statement of every module of ``qsync_jax``, ``planners``, ``pallas_kernels``,
``examples`` and ``benchmarks`` is read with ``ast`` — at module level or inside a function — and
resolved to the project module it names (``from a.b import c`` names ``a.b.c`` where that is a
module, else ``a.b``; relative imports resolved; a benchmark script's bare ``import predictor``
names its sibling ``benchmarks.predictor``). A string literal that is a project module's name (as
handed to ``importlib.import_module``) counts as an import too. That the dependencies point
one way (library ← ``examples`` ← ``benchmarks``) is ``tests/test_dependency_direction.py``'s.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = (
  "qsync_jax",
  "planners",
  "pallas_kernels",
  "qsync_cli",
  "qsync_examples",
  "examples",
  "benchmarks",
)


def project_modules() -> dict[str, pathlib.Path]:
  """``{dotted module name: path}`` of every ``.py`` file of ``PACKAGES`` (a package by its
  ``__init__.py``)."""
  out = {}
  for package in PACKAGES:
    for path in sorted((ROOT / package).rglob("*.py")):
      parts = path.relative_to(ROOT).with_suffix("").parts
      out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def _project_module(name: str, modules) -> str | None:
  """The longest prefix of ``name`` that is a project module, else None."""
  parts = name.split(".")
  for end in range(len(parts), 0, -1):
    if ".".join(parts[:end]) in modules:
      return ".".join(parts[:end])
  return None


def _docstrings(tree: ast.AST) -> set[int]:
  """``id`` of every docstring node of ``tree`` (module, class and function docstrings)."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
      first = node.body[0]
      if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        out.add(id(first.value))
  return out


def imports_of(module: str, path: pathlib.Path, modules) -> set[str]:
  """The project modules ``module`` (at ``path``) imports; see the module docstring."""
  tree = ast.parse(path.read_text(), str(path))
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  sibling_scripts = module.startswith("benchmarks.")  # run as scripts: their folder is on sys.path
  named: list[str] = []
  docstrings = _docstrings(tree)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      named += [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
        base = f"{base}.{node.module}" if node.module else base
      else:
        base = node.module or ""
      # ``from a.b import c``: the module ``a.b.c`` where there is one, else ``a.b`` (``c`` a name in it)
      named += [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
      text = node.value.split(":")[0]
      if text in modules:
        named.append(text)
  out = set()
  for name in named:
    found = _project_module(name, modules)
    if found is None and sibling_scripts:
      found = _project_module(f"benchmarks.{name}", modules)
    if found is not None and found != module:
      out.add(found)
  return out


def import_graph() -> dict[str, set[str]]:
  modules = project_modules()
  return {m: imports_of(m, path, modules) for m, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of ``graph`` with more than one module (Tarjan's
  algorithm, iterative), each sorted: every import cycle lies within one."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  out = []
  for root in sorted(graph):
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on_stack.add(root)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = len(index)
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(sorted(graph.get(child, ())))))
        elif child in on_stack:
          low[node] = min(low[node], index[child])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[node])
      if low[node] == index[node]:
        component = []
        while True:
          member = stack.pop()
          on_stack.discard(member)
          component.append(member)
          if member == node:
            break
        if len(component) > 1:
          out.append(sorted(component))
  return out


def test_the_checks_see_what_they_look_for():
  # a cycle in a made-up graph is found; a chain is not a cycle
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
  assert cycles(graph) == [["a", "b", "c"]] and cycles({"a": {"b"}, "b": set()}) == []
  real = import_graph()
  assert "planners.predictor.replay" in real["planners.profiler.fit"]  # module-level import
  assert "planners.profile" in real["qsync_cli.train"]  # inside a function
  # ``from package import submodule`` names the submodule, not the package
  assert "pallas_kernels.gemm.hopper" in real["pallas_kernels.gemm.api"]
  assert "pallas_kernels.gemm" not in real["pallas_kernels.gemm.api"]
  assert "planners.profiler" in real["qsync_cli.profile"]
  assert "qsync_jax.train.task" in real["planners.planning"]  # inside a function
  assert "benchmarks.common.result_rows" in real["benchmarks.predictor"]


def test_no_import_cycle():
  found = cycles(import_graph())
  assert not found, "import cycles (each component's modules import each other in a circle): " + "; ".join(
    " ↔ ".join(component) for component in found
  )
