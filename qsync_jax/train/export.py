"""A run's trained parameters written for use outside qsync: ``export_params``.

The parameters are those of the run's checkpoint (``RUN/checkpoints/STEP/params``, checked
against their checksums): fp32, as the model's own pytree. ``out`` ending in ``.msgpack``: one
file, ``flax.serialization.msgpack_restore(open(out, "rb").read())`` reads it; any other path:
an orbax checkpoint of the parameters alone (``orbax.checkpoint.StandardCheckpointer().restore``).
Nothing is overwritten.
"""

from __future__ import annotations

import os

from qsync_jax.errors import CheckpointError, QsyncError
from qsync_jax.jsonio import write_atomic


def check_out(out: str) -> str:
  """The format ``out`` asks for (``"msgpack"`` or ``"orbax"``); raises ``QsyncError`` if it
  cannot be written without overwriting anything."""
  fmt = "msgpack" if out.endswith(".msgpack") else "orbax"
  path = os.path.abspath(out)
  parent = os.path.dirname(path)
  if os.path.exists(path) and not (fmt == "orbax" and os.path.isdir(path) and not os.listdir(path)):
    kind = "a non-empty directory" if os.path.isdir(path) else "a file"
    raise QsyncError(
      f"--out {out!r} already exists ({kind}); export writes a new {fmt} "
      f"{'file' if fmt == 'msgpack' else 'directory'} and overwrites nothing. Fix: choose a new path."
    )
  if not os.path.isdir(parent):
    raise QsyncError(
      f"--out {out!r}: directory {parent!r} does not exist. Fix: create it, or choose another path."
    )
  if not os.access(parent, os.W_OK):
    raise QsyncError(f"--out {out!r}: directory {parent!r} is not writable. Fix: choose a writable path.")
  return fmt


def export_params(run: str, out: str, step: int | None = None) -> dict:
  """Writes the parameters of checkpoint ``step`` (default: latest) of run directory ``run`` to
  ``out`` (see the module docstring); returns ``{"step", "out", "format", "arrays", "bytes"}``."""
  import jax
  import numpy as np

  from qsync_jax.train.checkpoint import CheckpointStore

  fmt = check_out(out)
  directory = os.path.join(run, "checkpoints")
  if not os.path.isdir(directory):
    raise CheckpointError(
      f"--run {run!r} has no checkpoints/ directory. Fix: pass the --out directory of a qsync train run."
    )
  store = CheckpointStore(directory)
  try:
    params, meta = store.read_params(step)
  finally:
    store.close()
  params = jax.tree.map(np.asarray, params)
  if fmt == "msgpack":
    from flax import serialization

    data = serialization.msgpack_serialize(params)

    def write(tmp: str) -> None:
      with open(tmp, "wb") as f:
        f.write(data)

    write_atomic(out, write, "--out", QsyncError)  # a complete file or none, fsynced
  else:
    import orbax.checkpoint as ocp

    if os.path.isdir(out):
      os.rmdir(out)  # empty (checked above); orbax creates it anew, atomically
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.abspath(out), params)
    checkpointer.wait_until_finished()
    checkpointer.close()
  leaves = jax.tree.leaves(params)
  return {
    "step": int(meta["step"]),
    "out": out,
    "format": fmt,
    "arrays": len(leaves),
    "bytes": int(sum(x.nbytes for x in leaves)),
  }
