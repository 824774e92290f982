"""Dependencies point one way — kernels (``pallas_kernels``) ← runtime (``qsync_jax``) ← planner
(``planners``) ← CLI (``qsync_cli``) ← ``examples`` ← ``benchmarks`` — and inside the runtime and
the planner, layers and stages only import downward (``RULES``). ``benchmarks`` is a package run
with ``python -m``.

Every source file is parsed (not imported), so an import inside a function, or a module named
by a string for ``importlib``, counts like one at the top of a file.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = ("qsync_jax", "planners", "pallas_kernels", "qsync_cli")
IMPORT_FUNCTIONS = {"import_module", "__import__", "find_spec", "run_module"}


def _top(module: str) -> str:
  return module.split(".")[0]


def _within(module: str, packages) -> bool:
  """``module`` is one of ``packages`` or inside one of them."""
  return any(module == p or module.startswith(p + ".") for p in packages)


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


def _source_paths(*packages: str) -> list[pathlib.Path]:
  """The source files of dotted ``packages`` (``qsync_jax.ops``: the folder, or a module file)."""
  files = []
  for pkg in packages:
    folder = ROOT / pkg.replace(".", "/")
    files += sorted(folder.rglob("*.py")) if folder.is_dir() else [folder.with_suffix(".py")]
  assert files and all(f.is_file() for f in files), f"no Python files for {packages}"
  return files


def banned_imports(source: str, banned) -> list[tuple[int, str]]:
  """``(line, module)`` of the imports in ``source`` of a module within one of ``banned``."""
  return sorted((line, m) for line, m in imports_of(source) if _within(m, banned))


def _violations(packages: tuple[str, ...], banned) -> list[str]:
  return [
    f"{path.relative_to(ROOT)}:{line}: {module}"
    for path in _source_paths(*packages)
    for line, module in banned_imports(path.read_text(), banned)
  ]


# Inside the planner (``planners/__init__.py``): shared modules of plain data and formulas, the
# stages, and the pipeline that chains the stages for the commands.
SHARED_PLANNER = ("planners.catalog", "planners.ops", "planners.profile", "planners.report")
PLANNER_STAGES = (
  "planners.indicator",
  "planners.predictor",
  "planners.profiler",
  "planners.allocator",
  "planners.calibrate",
)
PLANNER_TOP = ("planners.inputs", "planners.planning", "planners.plan_report")

# (importer packages, packages they must not import, why): the layers, lowest first.
RULES = [
  (("pallas_kernels",), ("qsync_jax", "planners", "qsync_cli"), "kernels sit below everything"),
  (("qsync_jax",), ("planners", "qsync_cli"), "the runtime knows neither the planner nor the CLI"),
  (("qsync_jax.ops",), ("qsync_jax.train", "qsync_jax.models", "qsync_jax.sync"), "ops sit below training"),
  (("qsync_jax.models",), ("qsync_jax.train", "qsync_jax.sync"), "model adapters sit below training"),
  (("qsync_jax.sync",), ("qsync_jax.models", "qsync_jax.train"), "collectives know no model"),
  (("planners",), ("qsync_cli",), "the planner does not know the CLI"),
  (("planners.predictor",), ("planners.profiler", "planners.allocator"), "the predictor replays profiles"),
  (("planners.profiler",), ("planners.allocator",), "the profiler does not plan"),
  (("planners.indicator",), ("planners.profiler", "planners.predictor", "planners.allocator"), "stage 1"),
  (SHARED_PLANNER, PLANNER_STAGES + PLANNER_TOP, "the planner's shared modules know no stage"),
  (PLANNER_STAGES, PLANNER_TOP, "the stages know nothing of the pipeline that chains them"),
  (("planners.allocator",), ("planners.calibrate",), "the allocator plans from any profile"),
  (("planners.planning",), ("planners.plan_report",), "planning does not print"),
]


@pytest.mark.parametrize("importers, banned, why", RULES, ids=[f"{r[0][0]}-{r[2]}" for r in RULES])
def test_layers_import_only_downward(importers, banned, why):
  assert _violations(importers, banned) == [], why


def test_the_libraries_and_the_cli_import_neither_examples_nor_benchmarks():
  assert _violations(LIBRARY, {"examples", "qsync_examples", "benchmarks"}) == []


def test_the_examples_entry_points_import_only_the_examples_and_errors():
  """``qsync_examples`` (installed: the examples' entry points) loads the checkout's examples."""
  allowed = {"examples", "qsync_jax.errors"}
  imported = {m for _, m in imports_of((ROOT / "qsync_examples" / "__init__.py").read_text())}
  project = {m for m in imported if _top(m) in {*LIBRARY, "examples", "benchmarks", "qsync_examples"}}
  assert project and all(_within(m, allowed) for m in project), project


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


PLANTED = {  # a source that breaks each rule, as a file of the importing package could
  "kernels sit below everything": "from qsync_jax.precision import PRECISIONS",
  "the runtime knows neither the planner nor the CLI": "def f():\n  from planners.profiler import measure",
  "ops sit below training": "import qsync_jax.train.trainer",
  "model adapters sit below training": "from qsync_jax.train.task import Task",
  "collectives know no model": "from qsync_jax.models.flax_quant import quantize",
  "the planner does not know the CLI": 'COMMANDS = {"plan": "qsync_cli.plan"}',
  "the predictor replays profiles": "from planners.profiler.timing import single_device_step",
  "the profiler does not plan": "from planners.allocator import joint",
  "stage 1": "import planners.predictor.replay",
  "the planner's shared modules know no stage": "from planners.predictor.collectives import allreduce_ms",
  "the stages know nothing of the pipeline that chains them": "from planners.planning import train_precision",
  "the allocator plans from any profile": "from planners.calibrate import calibrated_profiles",
  "planning does not print": "from planners.plan_report import plan_report",
}


@pytest.mark.parametrize("importers, banned, why", RULES, ids=[r[2] for r in RULES])
def test_each_rule_catches_a_planted_violation(importers, banned, why):
  assert banned_imports(PLANTED[why], banned), why
  # ...and a neighbour of a banned package with a longer name is no violation
  assert banned_imports("import planners_extra, qsync_jaxx, qsync_cli_tools", banned) == []


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
