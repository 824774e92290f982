"""``qsync export``: a run's trained parameters, for use outside qsync.

  qsync export --run runs/a --out params.msgpack        # one file (flax.serialization msgpack)
  qsync export --run runs/a --out params_ckpt           # a directory (orbax params-only checkpoint)
  qsync export --run runs/a --step 100 --out p.msgpack  # another checkpoint than the latest

The parameters are those of the run's checkpoint (``RUN/checkpoints/STEP/params``, checked
against their checksums): fp32, as the model's own pytree (linen module names, or the nnx
graph's). Two formats, chosen by ``--out``:

* a path ending in ``.msgpack``: one self-contained file that needs only flax to read —
  ``flax.serialization.msgpack_restore(open(path, "rb").read())`` gives the nested dict of numpy
  arrays. For sharing and small to medium models (the whole tree is built in host memory);
* any other path: an orbax checkpoint of the parameters alone, for large models and sharded
  loading: ``orbax.checkpoint.StandardCheckpointer().restore(path)`` (or with a target tree
  to place the arrays on devices).

``--out`` must not exist yet (a directory may exist if empty) and its parent must be a writable
directory; nothing is overwritten.
"""

from __future__ import annotations

import argparse
import json

HELP = "write a run's trained parameters as a msgpack file or an orbax params-only checkpoint"


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--run", required=True, help="run directory of qsync train (its --out)")
  parser.add_argument(
    "--out", required=True, help="FILE.msgpack (flax.serialization msgpack) or DIR (orbax checkpoint)"
  )
  parser.add_argument("--step", type=int, help="checkpoint step to export (default: the latest)")


def run(args: argparse.Namespace) -> int:
  from qsync_jax.train.export import export_params

  print(json.dumps(export_params(args.run, args.out, args.step)))
  return 0
