"""The tests mirror the source tree: the tests of ``qsync_jax/sync/`` are in ``tests/qsync_jax/sync/``,
those of the command line (``qsync_cli/``) in ``tests/qsync_cli/``, those of a top-level module such as
``qsync_jax/plan.py`` directly in ``tests/qsync_jax/``, and so on.

Every folder of ``tests/`` that holds a test file has a counterpart folder in the checkout
(``tests/X/Y/`` ↔ ``X/Y/``: a package of the library, or ``docs/``, ``examples/``, ``benchmarks/``
for the tests of those); the test files at the top of ``tests/`` check the whole checkout (import
direction, growth, packaging). Every folder of ``tests/`` with Python files is a package
(``__init__.py``): pytest then imports a test by its dotted name
(``tests.qsync_jax.train.test_checkpoint``), so two folders may hold test files of one name, and the
CLI tests name their tasks that way (``--model tests.qsync_jax.train.tiny:make_task``).
"""

from __future__ import annotations

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def suite_files() -> list[str]:
  """The test files of ``tests/``, as paths relative to it (``qsync_jax/ops/test_qdot.py``)."""
  return sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py"))


def checkout_folders() -> set[str]:
  """Every folder of the checkout outside ``tests/`` (``qsync_jax/ops``, ``docs``…); hidden folders
  (``.git``, ``.venv``) and caches are not walked."""
  folders = set()
  for directory, subdirs, _ in os.walk(ROOT):
    subdirs[:] = [d for d in subdirs if not d.startswith(".") and d != "__pycache__"]
    if pathlib.Path(directory) == ROOT:
      subdirs.remove("tests")
    else:
      folders.add(pathlib.Path(directory).relative_to(ROOT).as_posix())
  return folders


def unmirrored(files: list[str], folders: set[str]) -> list[str]:
  """Each of ``files`` (relative to ``tests/``) in a folder of ``tests/`` whose counterpart is not one of
  ``folders``; a file at the top of ``tests/`` is no violation."""
  return sorted(f for f in files if "/" in f and f.rpartition("/")[0] not in folders)


def not_packages(python_files: list[str]) -> list[str]:
  """The folders (relative to ``tests/``) of ``python_files`` without an ``__init__.py`` among them."""
  folders = {f.rpartition("/")[0] for f in python_files if "/" in f}
  return sorted(d for d in folders if f"{d}/__init__.py" not in python_files)


def test_every_test_folder_mirrors_a_folder_of_the_checkout():
  files = suite_files()
  library = {
    "qsync_cli",
    "qsync_jax",
    "qsync_jax/ops",
    "qsync_jax/models",
    "qsync_jax/sync",
    "qsync_jax/train",
  }
  assert library <= {f.rpartition("/")[0] for f in files}, "the library's test folders were found"
  assert unmirrored(files, checkout_folders()) == [], (
    "move each test to the folder of tests/ that mirrors the code it tests (tests/X/Y/ for X/Y/)"
  )


def test_every_test_folder_is_a_package():
  python_files = sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("*.py"))
  assert not_packages(python_files) == [], "add an empty __init__.py to each of these folders of tests/"


def test_planted_violations_are_reported():
  folders = {"qsync_jax", "qsync_jax/ops", "qsync_jax/train", "docs"}
  files = [
    "qsync_jax/ops/test_qdot.py",
    "qsync_jax/test_plan.py",  # a top-level module's test: its folder is qsync_jax/
    "docs/test_readme.py",
    "test_import_graph.py",  # the whole checkout's
    "trainer/test_cli.py",  # the violations: no trainer/ or qsync_jax/training/ in the checkout
    "qsync_jax/training/test_step.py",
  ]
  assert unmirrored(files, folders) == ["qsync_jax/training/test_step.py", "trainer/test_cli.py"]
  assert not_packages(["conftest.py", "a/__init__.py", "a/test_x.py", "a/b/tiny.py", "c/test_y.py"]) == [
    "a/b",
    "c",
  ]
  assert "qsync_jax/ops" in checkout_folders() and not any(f.startswith("tests") for f in checkout_folders())
