"""Typed task configs built from keyword overrides, with errors that list the valid fields."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from qsync_jax.errors import QsyncError

C = TypeVar("C")


def make_config(cls: type[C], overrides: Mapping[str, Any], task: str) -> C:
  """``cls(**overrides)`` after checking every key is a field of ``cls``; lists become tuples."""
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise QsyncError(
      f"task {task!r} has no option(s) {unknown}. Fix: use only {sorted(fields)} "
      f"(defaults: {dataclasses.asdict(cls())})."
    )
  return cls(**{k: _tuples(v) for k, v in overrides.items()})


def _tuples(value):
  """JSON/CLI lists → tuples, so configs stay hashable (Flax module fields must be)."""
  if isinstance(value, list):
    return tuple(_tuples(v) for v in value)
  return value
