"""The types of a sync strategy's options, checked before it is built: an option given on the
command line (``--sync-option delta=abc``: JSON, else a string) or in Python must be of the type
its strategy's function or dataclass annotates (an int passes for a float, a bool for neither),
or the error names the option, the type and an example (the option's default)."""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import json
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from qsync_jax.errors import QsyncError


def check_option_types(name: str, declared: Callable[..., Any], options: Mapping[str, Any]) -> None:
  """``QsyncError`` for the first of ``options`` (of strategy ``name``) whose value is not of the
  type ``declared`` (a function, by its keyword parameters, or a dataclass, by its fields)
  annotates; options it does not annotate pass."""
  hints, defaults = _declared(declared)
  for key, value in options.items():
    hint = hints.get(key)
    if hint is None or _accepts(hint, value):
      continue
    example = _example(hint, defaults.get(key))
    if example is None:
      fix = (
        f"pass a function from Python (sync_options={{{key!r}: my_function}}); --sync-option cannot give one"
      )
    else:
      cli = example if isinstance(example, str) else json.dumps(example)
      fix = f"pass e.g. --sync-option {key}={cli} (in Python: sync_options={{{key!r}: {example!r}}})"
    raise QsyncError(
      f"sync strategy {name!r}: option {key}={value!r} is of type {type(value).__name__}, but {key} takes "
      f"{_describe(hint)}. Fix: {fix}."
    )


def _declared(declared) -> tuple[dict[str, Any], dict[str, Any]]:
  """(annotation, default) of each keyword parameter of the function ``declared``, or field of
  the dataclass ``declared``."""
  hints = typing.get_type_hints(declared)
  if dataclasses.is_dataclass(declared):
    defaults = {f.name: f.default for f in dataclasses.fields(declared)}
  else:
    defaults = {k: p.default for k, p in inspect.signature(declared).parameters.items()}
  return hints, {k: v for k, v in defaults.items() if v is not inspect.Parameter.empty}


def _accepts(hint, value) -> bool:
  """Whether ``value`` is of the annotated type ``hint`` (an int is a float; a bool is neither)."""
  if typing.get_origin(hint) in (typing.Union, types.UnionType):
    return any(_accepts(h, value) for h in typing.get_args(hint))
  if hint is type(None):
    return value is None
  if hint in (int, float):
    return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
  if hint in (str, bool):
    return isinstance(value, hint)
  if hint is collections.abc.Callable or typing.get_origin(hint) is collections.abc.Callable:
    return callable(value)
  return True  # a type no option of the registry uses: not checked


_TYPE_NAMES = {
  int: "an integer",
  float: "a number",
  str: "a string",
  bool: "true or false",
  type(None): "null (its default)",
}


def _describe(hint) -> str:
  if typing.get_origin(hint) in (typing.Union, types.UnionType):
    return " or ".join(_describe(h) for h in typing.get_args(hint))
  if hint is collections.abc.Callable or typing.get_origin(hint) is collections.abc.Callable:
    return "a Python function (the Python API only)"
  return _TYPE_NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def _example(hint, default) -> Any:
  """An example value of an option of type ``hint``: its default where that is one, else one of
  the type; None for a function."""
  if default is not None and not callable(default):
    return default
  args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
  return next(
    ({int: 1024, float: 0.5, bool: True, str: "..."}[h] for h in args if h in (int, float, bool, str)), None
  )
