"""``pyproject.toml``: metadata setuptools accepts without deprecation warnings, the tested
jax range, and what an install puts into site-packages (no generic top-level ``examples`` or
``benchmarks``; the examples' entry points go through ``qsync_examples``)."""

from __future__ import annotations

import fnmatch
import os
import pathlib
import re
import subprocess
import sys

import pytest

try:
  import tomllib
except ModuleNotFoundError:  # Python 3.10: pip vendors the same parser
  from pip._vendor import tomli as tomllib

PYPROJECT = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_license_is_an_spdx_string_and_setuptools_supports_it():
  """A ``license = {text = ...}`` table is deprecated by setuptools; the SPDX string form (PEP 639)
  needs setuptools 77 or newer to build."""
  config = tomllib.loads(PYPROJECT.read_text())
  assert config["project"]["license"] == "Apache-2.0"
  (setuptools,) = [r for r in config["build-system"]["requires"] if r.startswith("setuptools")]
  match = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", setuptools)
  assert match and int(match.group(1)) >= 77, setuptools


def test_jax_is_capped_at_the_tested_versions_and_says_so():
  text = PYPROJECT.read_text()
  assert "jax>=0.10,<0.12" in tomllib.loads(text)["project"]["dependencies"]
  lines = text.splitlines()
  comment = lines[lines.index('  "jax>=0.10,<0.12",') - 1]
  assert comment.strip().startswith("#") and "tested" in comment and "0.10" in comment and "0.11" in comment


# -- what `pip install .` puts into site-packages ---------------------------------------------

INSTALLED_TOP_LEVEL = {"qsync_jax", "qsync_cli", "qsync_examples", "pallas_kernels", "planners"}
NEVER_INSTALLED = {"examples", "benchmarks", "tests"}


def packaged(config: dict) -> list[str]:
  """The packages ``[tool.setuptools.packages.find]`` selects, found as setuptools finds them:
  folders with an ``__init__.py`` below the root (through packages only) whose dotted name
  matches an ``include`` pattern (``fnmatch``) and no ``exclude`` pattern."""
  find = config["tool"]["setuptools"]["packages"]["find"]
  include, exclude = find.get("include", ["*"]), find.get("exclude", [])
  found, todo = [], [(p, p.name) for p in sorted(PYPROJECT.parent.iterdir()) if p.is_dir()]
  while todo:
    folder, name = todo.pop()
    if "." in folder.name or not (folder / "__init__.py").is_file():
      continue
    if any(fnmatch.fnmatchcase(name, p) for p in include) and not any(
      fnmatch.fnmatchcase(name, p) for p in exclude
    ):
      found.append(name)
    todo += [(p, f"{name}.{p.name}") for p in sorted(folder.iterdir()) if p.is_dir()]
  return sorted(found)


def test_no_generic_top_level_package_is_installed():
  """``examples`` and ``benchmarks`` would land in site-packages as top-level modules of those
  names, where they collide with other projects'; the examples run from the checkout."""
  config = tomllib.loads(PYPROJECT.read_text())
  top = {name.split(".")[0] for name in packaged(config)}
  assert top == INSTALLED_TOP_LEVEL
  assert not top & NEVER_INSTALLED
  assert "qsync_examples" in packaged(config) and "qsync_jax.train" in packaged(config)


def test_the_package_finder_sees_what_an_include_pattern_adds():
  """The check above fails on the configuration it guards against."""
  config = tomllib.loads(PYPROJECT.read_text())
  config["tool"]["setuptools"]["packages"]["find"]["include"].append("examples*")
  assert {"examples", "examples.tasks"} <= set(packaged(config))


def test_every_entry_point_names_an_installed_module():
  """An entry point whose module is not installed fails in an install without the checkout
  (or imports another project's module of that name)."""
  config = tomllib.loads(PYPROJECT.read_text())
  modules = set(packaged(config))
  targets = [config["project"]["scripts"]["qsync"]]
  for group in config["project"]["entry-points"].values():
    targets += group.values()
  for target in targets:
    module = target.partition(":")[0]
    package, _, name = module.rpartition(".")
    is_module = package in modules and (PYPROJECT.parent / package.replace(".", "/") / f"{name}.py").is_file()
    assert module in modules or is_module, target


def test_the_examples_entry_points_load_the_checkout_s_factories():
  import examples.demo
  import examples.nnx.train
  import examples.tasks.language
  import examples.tasks.vision
  import qsync_examples

  config = tomllib.loads(PYPROJECT.read_text())
  tasks = config["project"]["entry-points"]["qsync_jax.tasks"]
  assert tasks == {name: f"qsync_examples:{name}" for name in qsync_examples.TASKS}
  assert config["project"]["entry-points"]["qsync_jax.commands"] == {"demo": "qsync_examples:demo"}
  assert qsync_examples.vgg is examples.tasks.vision.vgg_digits
  assert qsync_examples.lm is examples.tasks.language.stdlib_lm
  assert qsync_examples.nnx_digits is examples.nnx.train.make_task
  assert qsync_examples.demo is examples.demo
  assert qsync_examples.mlp is examples.tasks.vision.mlp_digits
  with pytest.raises(AttributeError, match="no attribute 'mnist'"):
    qsync_examples.mnist  # noqa: B018


def test_without_the_checkout_a_task_and_the_demo_say_so(monkeypatch, tmp_path, capsys):
  """As after ``pip install .`` (a wheel): no ``examples`` beside ``qsync_examples``."""
  import qsync_examples
  from qsync_cli import main as cli

  monkeypatch.setattr(qsync_examples, "PACKAGE", tmp_path / "examples")
  with pytest.raises(ImportError, match="run from a qsync-jax checkout"):
    qsync_examples.vgg  # noqa: B018
  demo = qsync_examples.demo
  monkeypatch.setattr(cli, "_installed_commands", lambda: {"demo": demo})
  assert cli.main(["demo", "--out", "x", "--steps", "3"]) == 2
  err = capsys.readouterr().err
  assert "qsync demo: error:" in err and "pip install -e '.[examples]'" in err


def test_another_examples_package_first_is_named(monkeypatch):
  import types

  import qsync_examples

  other = types.ModuleType("examples")
  other.__file__ = "/elsewhere/examples/__init__.py"
  monkeypatch.setitem(sys.modules, "examples", other)
  with pytest.raises(ImportError, match=r"another package named `examples` \(/elsewhere/examples"):
    qsync_examples.vgg  # noqa: B018


def test_the_examples_load_by_path_where_they_are_not_on_sys_path(tmp_path):
  """The ``qsync`` script's case: the checkout is not on ``sys.path``; run in a fresh
  interpreter from elsewhere, with the checkout reachable only through ``qsync_examples``."""
  import qsync_examples

  root, init = str(PYPROJECT.parent), qsync_examples.__file__
  code = (
    f"import sys; sys.path = [p for p in sys.path if p not in ('', {root!r})]\n"
    "import importlib.util as u; assert u.find_spec('examples') is None\n"
    f"spec = u.spec_from_file_location('qsync_examples', {init!r})\n"
    "m = u.module_from_spec(spec); spec.loader.exec_module(m)\n"
    "print(m.__getattr__('demo').__file__, m.__getattr__('vgg').__module__)\n"
  )
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr
  assert done.stdout.split() == [str(PYPROJECT.parent / "examples" / "demo.py"), "examples.tasks.vision"]
