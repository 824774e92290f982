"""The library stays in small parts: no function over ``MAX_FUNCTION_LINES`` lines and no file over
``MAX_FILE_LINES`` lines in ``qsync_jax``, ``planners``, ``pallas_kernels`` or ``qsync_cli``, unless
``ALLOWED`` lists it with the reason it may be longer for now.

A function's length runs from its ``def`` line to its last line (nested functions count in their
enclosing one and on their own); a file's is its number of lines. Every ``ALLOWED`` entry must
name a file or function that exists, so that an entry outlives neither a rename nor a split.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = ("qsync_jax", "planners", "pallas_kernels", "qsync_cli")
MAX_FUNCTION_LINES = 120
MAX_FILE_LINES = 600

ALLOWED = {  # "path" (a file) or "path::qualified.name" (a function) -> why it may be longer
}


def function_lengths(source: str) -> dict[str, int]:
  """``{qualified name: lines}`` of every function and method of ``source`` (``Class.method``,
  ``outer.inner``)."""
  lengths = {}

  def visit(node, prefix: str) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        name = prefix + child.name
        if not isinstance(child, ast.ClassDef):
          lengths[name] = child.end_lineno - child.lineno + 1
        visit(child, name + ".")
      else:
        visit(child, prefix)

  visit(ast.parse(source), "")
  return lengths


def oversized(sources: dict[str, str], allowed: dict[str, str]) -> list[str]:
  """Each file of ``sources`` (``{path: text}``) over ``MAX_FILE_LINES`` and each function over
  ``MAX_FUNCTION_LINES`` that ``allowed`` does not list, with its length."""
  found = []
  for path, source in sorted(sources.items()):
    lines = len(source.splitlines())
    if lines > MAX_FILE_LINES and path not in allowed:
      found.append(f"{path}: {lines} lines (at most {MAX_FILE_LINES}: split it into modules of one job each)")
    for name, length in function_lengths(source).items():
      if length > MAX_FUNCTION_LINES and f"{path}::{name}" not in allowed:
        found.append(
          f"{path}::{name}: {length} lines (at most {MAX_FUNCTION_LINES}: split it into named steps)"
        )
  return found


def library_sources() -> dict[str, str]:
  return {
    p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
    for package in LIBRARY
    for p in (ROOT / package).rglob("*.py")
  }


def test_no_library_function_or_file_outgrows_the_limits_unless_listed():
  sources = library_sources()
  assert len(sources) > 50, "the library's files were found"
  assert oversized(sources, ALLOWED) == []


def test_every_listed_exception_names_an_existing_file_or_function_and_says_why():
  sources = library_sources()
  for entry, why in ALLOWED.items():
    path, _, function = entry.partition("::")
    assert path in sources, f"ALLOWED names {path}, which is not a library file: remove the entry"
    if function:
      assert function in function_lengths(sources[path]), f"ALLOWED names {entry}, which does not exist"
    assert why.strip(), f"ALLOWED[{entry!r}] gives no reason"


PLANTED_FUNCTION = "class Loop:\n  def run(self):\n" + "    x = 1\n" * 120 + "\n\ndef short():\n  return 1\n"


def test_a_planted_long_function_and_a_long_file_fail_unless_listed():
  planted = {
    "qsync_jax/planted.py": PLANTED_FUNCTION,
    "planners/long.py": "x = 1\n" * (MAX_FILE_LINES + 1),
    "pallas_kernels/ok.py": "x = 1\n" * MAX_FILE_LINES,  # at the limit: fine
  }
  assert function_lengths(PLANTED_FUNCTION) == {"Loop.run": 121, "short": 2}
  assert oversized(planted, {}) == [
    "planners/long.py: 601 lines (at most 600: split it into modules of one job each)",
    "qsync_jax/planted.py::Loop.run: 121 lines (at most 120: split it into named steps)",
  ]
  listed = {"planners/long.py": "planted", "qsync_jax/planted.py::Loop.run": "planted"}
  assert oversized(planted, listed) == []
