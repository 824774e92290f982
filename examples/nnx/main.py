"""Trains an nnx CNN on digits with qsync's hybrid trainer, optionally under a policy.

python -m examples.nnx.main --steps 200
python -m examples.nnx.main --policy int8 --devices 2 --out runs/nnx
"""

from __future__ import annotations

import argparse
import sys

from examples.cli_args import add_config_arguments, config_from_args
from examples.nnx.train import Config, train_and_evaluate


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_config_arguments(parser, Config)
  train_and_evaluate(config_from_args(Config, parser.parse_args(argv)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
