"""No two modules of the library (``qsync_jax``, ``planners``, ``pallas_kernels``) share a file name:
a name says what a module is, so two of one name are two things called the same.

Exempt: a package's ``__init__.py``, and the per-op folder layout of the kernels, where every op
folder ``pallas_kernels/<op>/`` holds its ``reference.py`` (the jnp definition), ``kernel.py``,
``config.py`` and ``api.py`` by design.
"""

from __future__ import annotations

import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("qsync_jax", "planners", "pallas_kernels")
OP_FOLDER_MODULES = {"reference.py", "kernel.py", "config.py", "api.py"}


def exempt(path: str) -> bool:
  """``path`` (relative, ``/``-separated) is a package ``__init__`` or one of an op folder's modules."""
  parts = path.split("/")
  if parts[-1] == "__init__.py":
    return True
  return len(parts) == 3 and parts[0] == "pallas_kernels" and parts[-1] in OP_FOLDER_MODULES


def shared_names(paths: list[str]) -> dict[str, list[str]]:
  """``{file name: its paths}`` for each name two or more non-exempt modules of ``paths`` carry."""
  by_name = collections.defaultdict(list)
  for path in paths:
    if not exempt(path):
      by_name[path.rsplit("/", 1)[-1]].append(path)
  return {name: sorted(found) for name, found in sorted(by_name.items()) if len(found) > 1}


def library_modules() -> list[str]:
  return sorted(str(p.relative_to(ROOT).as_posix()) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_no_two_library_modules_share_a_name():
  modules = library_modules()
  assert len(modules) > 50, "the library's modules were found"
  assert shared_names(modules) == {}, "rename one of each pair to a name that says what it is"


def test_a_planted_pair_of_one_name_is_reported_and_the_op_folders_are_not():
  planted = [
    "qsync_jax/train/checkpoint.py",
    "planners/profiler/checkpoint.py",  # the violation
    "pallas_kernels/gemm/kernel.py",
    "pallas_kernels/quantize/kernel.py",  # the op-folder layout: exempt
    "pallas_kernels/gemm/__init__.py",
    "qsync_jax/__init__.py",
    "planners/indicator/api.py",  # one api.py outside the op folders: no pair
    "pallas_kernels/kernel.py",  # not in an op folder: counts
    "qsync_jax/ops/kernel.py",
  ]
  assert shared_names(planted) == {
    "checkpoint.py": ["planners/profiler/checkpoint.py", "qsync_jax/train/checkpoint.py"],
    "kernel.py": ["pallas_kernels/kernel.py", "qsync_jax/ops/kernel.py"],
  }
