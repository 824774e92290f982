"""The examples' entry points (``qsync demo``, ``--model vgg`` …) under a qsync-prefixed name.

The examples (``examples/`` in the checkout) are not installed: a top-level ``examples`` package
in site-packages would collide with other projects'. ``pyproject.toml``'s entry points name
this package instead, and it imports the checkout's ``examples`` on first use: the checkout
beside this file, where an editable install (``pip install -e .``, what ``python3 dev.py``
runs) keeps it. ``python -m examples.…`` from the checkout's root works too.

An install without the checkout (``pip install .``, a wheel) has no examples: a task name then
ends in a ``QsyncError`` saying so (``qsync_jax.train.task``), and ``qsync demo`` says it too.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import pathlib
import sys
import types

CHECKOUT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = CHECKOUT / "examples"

TASKS = {
  "resnet": "examples.tasks.vision:resnet_digits",
  "vgg": "examples.tasks.vision:vgg_digits",
  "mlp": "examples.tasks.vision:mlp_digits",
  "lm": "examples.tasks.language:stdlib_lm",
  "resnet_cifar10": "examples.tasks.vision:resnet_cifar10",
  "resnet_synthetic": "examples.tasks.vision:resnet_synthetic",
  "nnx_digits": "examples.nnx.train:make_task",
}
"""Entry point name (``qsync_jax.tasks``) -> the task factory in the checkout's examples."""

COMMANDS = {"demo": "examples.demo"}
"""Entry point name (``qsync_jax.commands``) -> the command module in the checkout's examples."""

MISSING = (
  "the qsync-jax examples (the example tasks and `qsync demo`) run from a qsync-jax checkout, and this "
  f"install was made without one ({PACKAGE} does not exist)"
)
FIX = (
  "Fix: clone the repository and run `pip install -e '.[examples]'` in it (or `python3 dev.py qsync ...`)."
)


def _checkout_examples() -> None:
  """Makes ``import examples`` the checkout's package; raises ``ImportError`` (``MISSING``) where
  there is no checkout, or where another project's ``examples`` is imported or importable first."""
  init = PACKAGE / "__init__.py"
  if not init.is_file():
    raise ImportError(MISSING)
  loaded = sys.modules.get("examples")
  if loaded is None:
    spec = importlib.util.find_spec("examples")
    if spec is None:  # not on sys.path (the `qsync` script): the checkout's, by its path
      spec = importlib.util.spec_from_file_location(
        "examples", init, submodule_search_locations=[str(PACKAGE)]
      )
      module = importlib.util.module_from_spec(spec)
      sys.modules["examples"] = module
      try:
        spec.loader.exec_module(module)
      except BaseException:
        del sys.modules["examples"]
        raise
      return
    origin = spec.origin
  else:
    origin = getattr(loaded, "__file__", None)
  if origin is None or pathlib.Path(origin).resolve() != init:
    raise ImportError(
      f"another package named `examples` ({origin}) comes before the qsync-jax checkout's ({PACKAGE}). "
      "Fix: run qsync from outside that project's directory, or take it off PYTHONPATH."
    )


def _load(target: str):
  module, _, attr = target.partition(":")
  _checkout_examples()
  loaded = importlib.import_module(module)
  return getattr(loaded, attr) if attr else loaded


def _missing_command(name: str) -> types.ModuleType:
  """A command module that only says the examples are missing (so that every other ``qsync``
  command works without a warning in an install without the checkout)."""

  def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.prefix_chars = ""  # every argument, options and --help too, reaches run(), which says why
    parser.add_argument("arguments", nargs="*")

  def run(args) -> int:
    from qsync_jax.errors import QsyncError

    raise QsyncError(f"{MISSING}. {FIX}")

  module = types.ModuleType(f"{__name__}.{name}")
  module.HELP = f"(needs a qsync-jax checkout) the examples' `{name}` command"
  module.add_arguments, module.run = add_arguments, run
  return module


def __getattr__(name: str):
  if name in TASKS:
    return _load(TASKS[name])
  if name in COMMANDS:
    if not (PACKAGE / "__init__.py").is_file():
      return _missing_command(name)
    return _load(COMMANDS[name])
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
