"""argparse options generated from a config dataclass (one ``--flag`` per field)."""

from __future__ import annotations

import argparse
import dataclasses
import typing


def add_config_arguments(parser: argparse.ArgumentParser, config_cls) -> None:
  hints = typing.get_type_hints(config_cls)
  for field in dataclasses.fields(config_cls):
    kind = hints[field.name]
    base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
    parser.add_argument(
      "--" + field.name.replace("_", "-"),
      dest=field.name,
      type=base if base in (int, float, str) else str,
      default=field.default,
      help=f"default: {field.default}",
    )


def config_from_args(config_cls, args: argparse.Namespace):
  return config_cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)})
