"""Every module of the library and the examples imports on the CPU without the GPU extras
(jax-triton), and the examples in its docstrings (``>>>``) run and print what they show."""

import doctest
import importlib
import pkgutil

import pytest

PACKAGES = ("qsync_jax", "pallas_kernels", "planners", "qsync_cli", "examples")


def module_names() -> list[str]:
  names = []
  for package in PACKAGES:
    names.append(package)
    path = importlib.import_module(package).__path__
    names += [info.name for info in pkgutil.walk_packages(path, prefix=f"{package}.")]
  return sorted(name for name in names if not name.endswith(".__main__"))  # those run on import


MODULES = module_names()


def test_every_package_has_modules_and_examples():
  assert len(MODULES) > 60, MODULES
  with_examples = [name for name in MODULES if doctest.DocTestFinder().find(importlib.import_module(name))]
  assert any(name.startswith("planners") for name in with_examples), with_examples
  assert any(name.startswith("qsync_jax") for name in with_examples), with_examples


@pytest.mark.standard_promotion  # docstring examples are user code, under default promotion
@pytest.mark.parametrize("name", MODULES)
def test_module_imports_and_its_docstring_examples_run(name):
  module = importlib.import_module(name)
  failures = []
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  for test in doctest.DocTestFinder().find(module, name):
    if test.examples:
      runner.run(test, out=failures.append, clear_globs=True)
  assert runner.failures == 0, "".join(failures)
