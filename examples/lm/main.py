"""Byte-level causal LM on the Python standard library's source, optionally under a policy.

python -m examples.lm.main --steps 300
python -m examples.lm.main --policy my_policy.json
"""

from __future__ import annotations

import argparse
import sys

from examples.cli_args import add_config_arguments, config_from_args
from examples.lm.train import Config, train_and_evaluate


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_config_arguments(parser, Config)
  train_and_evaluate(config_from_args(Config, parser.parse_args(argv)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
