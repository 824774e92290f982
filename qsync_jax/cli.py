"""The ``qsync`` command line: one subcommand per pipeline stage.

Each stage registers itself in ``SUBCOMMANDS`` as ``name -> (help, add_arguments, run)``;
``run(args)`` returns an exit code. Bad input raises ``QsyncError`` subclasses, which the
CLI prints as one clear line (no traceback) and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import qsync_jax
from qsync_jax.errors import QsyncError

# name -> module that defines ``HELP``, ``add_arguments(parser)`` and ``run(args)``.
SUBCOMMANDS: dict[str, str] = {}


def _register_optional():
  """Subcommands whose modules exist in this checkout (stages land one by one)."""
  candidates = {
    "indicator": "planners.cli_indicator",
    "profile": "planners.cli_profile",
    "predict": "planners.cli_predict",
    "plan": "planners.cli_plan",
    "train": "qsync_jax.cli_train",
    "export": "qsync_jax.cli_export",
    "demo": "examples.demo",
  }
  for name, module in candidates.items():
    if importlib.util.find_spec(module) is not None:
      SUBCOMMANDS[name] = module


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="qsync",
    description="Quantization-minimized synchronous training of Flax models across hybrid devices.",
  )
  parser.add_argument("--version", action="version", version=f"qsync-jax {qsync_jax.__version__}")
  sub = parser.add_subparsers(dest="command", metavar="COMMAND")
  _register_optional()
  for name, module_name in SUBCOMMANDS.items():
    module = importlib.import_module(module_name)
    p = sub.add_parser(name, help=module.HELP, description=module.HELP)
    module.add_arguments(p)
    p.set_defaults(_run=module.run)
  return parser


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  if not getattr(args, "_run", None):
    parser.print_help()
    return 0
  try:
    return int(args._run(args) or 0)
  except QsyncError as e:
    print(f"qsync {args.command}: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
