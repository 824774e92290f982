"""Image classification on digits (or CIFAR-10), optionally under a precision policy.

python -m examples.vision.main --model resnet --steps 300
python -m examples.vision.main --model vgg --policy int8
python -m examples.vision.main --model resnet_cifar10 --data-dir ~/data/cifar-10-batches-py
"""

from __future__ import annotations

import argparse
import sys

from examples.cli_args import add_config_arguments, config_from_args
from examples.vision.train import Config, train_and_evaluate


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_config_arguments(parser, Config)
  train_and_evaluate(config_from_args(Config, parser.parse_args(argv)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
