"""Helpers shared by the commands: the ``--model`` option, progress lines, output paths."""

from __future__ import annotations

import sys
from collections.abc import Mapping

from qsync_jax.train.outputs import check_write_target


def add_model_argument(parser) -> None:
  """``--model``, as every command takes it."""
  parser.add_argument(
    "--model",
    required=True,
    help="a registered task name (the examples': vgg, resnet, lm, …) or package.module:attr, a Task or a "
    "function returning one",
  )


def progress(msg: str) -> None:
  """One progress line on stderr (stdout stays for results)."""
  print(f"  … {msg}", file=sys.stderr, flush=True)


def check_write_targets(args, outputs: Mapping[str, str]) -> None:
  """``check_write_target`` for every output option of parsed ``args`` (``{dest: kind}``, as
  ``qsync_jax.train.outputs.check_outputs`` takes them); options left unset are skipped."""
  for dest, kind in outputs.items():
    path = getattr(args, dest, None)
    if path is not None:
      check_write_target("--" + dest.replace("_", "-"), path, kind)
