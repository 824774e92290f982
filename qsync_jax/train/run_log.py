"""What a training run logs: ``metrics.jsonl`` (one JSON record per line) and the same numbers as
TensorBoard scalars (``TensorBoardWriter``, in ``tensorboard/``), in the run directory; process 0
writes. TensorBoard tags carry the record's kind: ``train/`` (a logged step's metrics and rates),
``eval/`` (held-out metrics), ``replan/`` (re-planning's decisions and measured steps).

A resumed run first drops the lines logged after its checkpoint (``drop_metrics_after``), so that
no step appears twice.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from qsync_jax.errors import OutputPathError, QsyncWarning
from qsync_jax.jsonio import JsonLine, read_json_lines, undecodable_warning, write_atomic


class RunLog:
  """``metrics.jsonl`` and TensorBoard events (``tensorboard/``) in ``out_dir``; nothing when
  ``out_dir`` is None or this is not the process that writes (``primary``). ``say``: where a
  missing ``tensorboardX`` is reported (once)."""

  def __init__(self, out_dir: str | None, primary: bool, say: Callable[[str], None] | None = None):
    self.path = os.path.join(out_dir, "metrics.jsonl") if out_dir and primary else None
    self.tensorboard = TensorBoardWriter(os.path.join(out_dir, "tensorboard"), say) if self.path else None

  def write(
    self, line: Mapping[str, Any], scalars: Mapping[str, Any] | None = None, prefix: str = ""
  ) -> None:
    """Appends ``line`` (with its ``"step"``) to ``metrics.jsonl`` and every number of ``scalars``
    (default: of ``line``) as a TensorBoard scalar at that step, tagged ``prefix + key``."""
    if self.path is None:
      return
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    with open(self.path, "a") as f:
      f.write(json.dumps(line) + "\n")
    scalars = line if scalars is None else scalars
    if scalars:
      self.tensorboard.write(line["step"], scalars, prefix=prefix)

  def drop_after(self, step: int) -> None:
    """Drops what was logged after ``step`` (a resumed run logs it again)."""
    if self.path is not None:
      drop_metrics_after(self.path, step)
      self.tensorboard.purge_step = step + 1

  def close(self) -> None:
    if self.tensorboard is not None:
      self.tensorboard.close()


def drop_metrics_after(path: str, step: int) -> None:
  """Removes the lines of metrics file ``path`` logged after ``step`` (the steps a resumed run
  will log again) and a line a kill cut short, atomically; keeps the other lines it cannot parse
  byte for byte (one that is not UTF-8 is named in a ``QsyncWarning``)."""
  if not os.path.exists(path):
    return
  lines, undecodable = read_json_lines(path)
  if undecodable:
    warnings.warn(undecodable_warning(path, undecodable, "kept as they are"), QsyncWarning, stacklevel=2)

  def keep(line: JsonLine) -> bool:
    try:
      return line.complete and int(line.value["step"]) <= step
    except (ValueError, KeyError, TypeError):
      return True

  kept = [line.raw for line in lines if keep(line)]
  if len(kept) != len(lines):

    def write(tmp: str) -> None:
      with open(tmp, "wb") as f:
        f.writelines(kept)

    write_atomic(path, write, "metrics file", OutputPathError)


def _scalars(record: Mapping, prefix: str = ""):
  """``(tag, value)`` for every number of ``record`` (bools as 0/1; nested mappings as
  ``outer/inner`` tags; strings, lists and ``None`` skipped)."""
  for key, value in record.items():
    tag = f"{prefix}{key}"
    if isinstance(value, Mapping):
      yield from _scalars(value, tag + "/")
    elif isinstance(value, (bool, int, float)):
      yield tag, float(value)


class TensorBoardWriter:
  """TensorBoard events in ``directory``: ``write(step, record)`` adds every number of ``record``
  (``_scalars``; its ``step`` key is the x-axis, not a scalar) at ``step`` and flushes, so a
  killed run keeps what it logged.

  ``tensorboardX`` (a dependency) is imported at the first write; where it is missing (a broken
  install) nothing is written (no directory) and ``say`` reports it once. The event file opens at
  the first write with ``purge_step`` (default: that write's step; a resumed run's: the step after
  its checkpoint), so a resumed run hides the events an earlier run logged from that step on (as
  ``metrics.jsonl`` drops them). ``close`` is idempotent.
  """

  def __init__(self, directory: str, say: Callable[[str], None] | None = None):
    self.directory, self.say = directory, say
    self.purge_step: int | None = None
    self._writer = None
    self._unavailable = False

  @property
  def enabled(self) -> bool:
    """False once the first write found no ``tensorboardX``."""
    return not self._unavailable

  def write(self, step: int, record: Mapping, prefix: str = "") -> None:
    if self._unavailable:
      return
    if self._writer is None:
      try:
        from tensorboardX import SummaryWriter
      except ImportError:
        self._unavailable = True
        if self.say is not None:
          self.say(
            "TensorBoard: no events are written, tensorboardX cannot be imported (metrics.jsonl has the "
            "same numbers). Fix: pip install tensorboardX (a qsync-jax dependency)."
          )
        return
      purge = self.purge_step if self.purge_step is not None else int(step)
      self._writer = SummaryWriter(self.directory, purge_step=purge)
    for tag, value in _scalars({k: v for k, v in record.items() if k != "step"}, prefix):
      self._writer.add_scalar(tag, value, int(step))
    self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None
