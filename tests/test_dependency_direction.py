"""Dependencies point one way: library (``qsync_jax``, ``planners``, ``pallas_kernels``) ←
``examples`` ← ``benchmarks``, and ``benchmarks`` is a package run with ``python -m``.

Every source file is parsed (not imported), so an import inside a function, or a module named
by a string for ``importlib``, counts like one at the top of a file.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = ("qsync_jax", "planners", "pallas_kernels")
IMPORT_FUNCTIONS = {"import_module", "__import__", "find_spec", "run_module"}


def _top(module: str) -> str:
  return module.split(".")[0]


def imports_of(source: str) -> set[tuple[int, str]]:
  """``(line, module)`` of every module ``source`` imports or names for importing: ``import``
  and ``from`` statements anywhere (relative ones excluded: they stay in their package), the
  first argument of ``importlib.import_module`` / ``__import__`` / ``find_spec`` /
  ``runpy.run_module``, and any string that is nothing but a dotted module path
  (``"examples.demo"``, ``"examples.tasks:vgg"``), as a table of modules to import holds."""
  found = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      found |= {(node.lineno, alias.name) for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      found.add((node.lineno, node.module))
    elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
      name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
      if name in IMPORT_FUNCTIONS and isinstance(node.args[0].value, str):
        found.add((node.lineno, node.args[0].value))
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
      if re.fullmatch(r"[A-Za-z_]\w*(\.\w+)+(:\w+)?", node.value):
        found.add((node.lineno, node.value.partition(":")[0]))
  return found


def sys_path_uses(source: str) -> list[int]:
  """Lines that touch ``sys.path`` (``sys.path.insert``, ``from sys import path``…) or call
  ``site.addsitedir``."""
  lines = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
      lines.append(node.lineno)
    elif (
      isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names)
    ):
      lines.append(node.lineno)
    elif isinstance(node, ast.Attribute) and node.attr == "addsitedir":
      lines.append(node.lineno)
  return lines


def _sources(*packages: str) -> list[pathlib.Path]:
  files = [p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))]
  assert files, f"no Python files under {packages}"
  return files


def _violations(packages: tuple[str, ...], banned: set[str]) -> list[str]:
  return [
    f"{path.relative_to(ROOT)}:{line}: {module}"
    for path in _sources(*packages)
    for line, module in sorted(imports_of(path.read_text()))
    if _top(module) in banned
  ]


def test_the_library_imports_neither_examples_nor_benchmarks():
  assert _violations(LIBRARY, {"examples", "benchmarks"}) == []


def test_examples_do_not_import_benchmarks():
  assert _violations(("examples",), {"benchmarks"}) == []


def test_benchmarks_do_not_touch_sys_path():
  found = [
    f"{path.relative_to(ROOT)}:{line}"
    for path in _sources("benchmarks")
    for line in sys_path_uses(path.read_text())
  ]
  assert found == []


def test_benchmarks_is_a_package():
  assert (ROOT / "benchmarks" / "__init__.py").is_file()


# -- the checks themselves catch what they are for ------------------------------------------

FORBIDDEN = """
import examples
import examples.demo as demo
from examples.tasks import vision
def later():
  from benchmarks.predictor import get_model
  importlib.import_module("examples.registry")
  __import__("benchmarks.models")
  importlib.util.find_spec("examples.demo")
COMMANDS = {"demo": "examples.demo", "vgg": "examples.tasks.vision:vgg_digits"}
"""

ALLOWED = '''
"""Docs may say examples.demo in prose, or run `python -m benchmarks.predictor`."""
import examplesque
from . import examples
from .benchmarks import x
raise ValueError("for the examples: pip install -e '.[examples]'")
'''


def test_every_kind_of_import_is_seen():
  modules = [m for _, m in imports_of(FORBIDDEN) if _top(m) in {"examples", "benchmarks"}]
  assert sorted(modules) == [
    "benchmarks.models",
    "benchmarks.predictor",
    "examples",
    "examples.demo",
    "examples.demo",
    "examples.demo",
    "examples.registry",
    "examples.tasks",
    "examples.tasks.vision",
  ]


def test_prose_relative_imports_and_lookalikes_are_not_imports():
  assert [m for _, m in imports_of(ALLOWED) if _top(m) in {"examples", "benchmarks"}] == []


@pytest.mark.parametrize(
  "source",
  [
    "import sys\nsys.path.insert(0, '.')",
    "import sys\nsys.path.append('..')",
    "import sys\nsys.path = ['x']",
    "from sys import path\npath.append('x')",
    "import site\nsite.addsitedir('x')",
  ],
)
def test_every_kind_of_sys_path_change_is_seen(source):
  assert sys_path_uses(source)
