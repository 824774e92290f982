"""A text corpus that is on every machine: the Python standard library's own source files.

The ``.py`` files directly under ``sysconfig.get_paths()["stdlib"]`` in sorted file-name order,
then those of its packages (subdirectories, ``site-packages`` excluded) in sorted path order,
concatenated as bytes (byte-level vocabulary of 256) and capped at ``max_bytes``. The
last ``holdout_fraction`` of the bytes is the held-out split (whole files are never shuffled,
so held-out text is unseen source code).
"""

from __future__ import annotations

import functools
import os
import pathlib
import sysconfig

import numpy as np

from qsync_jax.errors import QsyncError

VOCAB_SIZE = 256
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_dir() -> pathlib.Path:
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def source_files(root: pathlib.Path):
  """The corpus's files in order: ``root``'s own ``.py`` files, then its packages' (walked in
  sorted order, skipping ``site-packages`` and ``dist-packages``), lazily."""
  yield from sorted(root.glob("*.py"))
  for top in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in SKIPPED_DIRS):
    for dirpath, dirnames, filenames in os.walk(top):
      dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
      yield from (pathlib.Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))


@functools.lru_cache(maxsize=4)
def corpus(max_bytes: int = 2_000_000) -> np.ndarray:
  """The corpus as a uint8 array of at most ``max_bytes`` bytes (deterministic)."""
  root = stdlib_dir()
  chunks, total = [], 0
  for path in source_files(root):
    data = path.read_bytes()
    chunks.append(data[: max_bytes - total])
    total += len(chunks[-1])
    if total >= max_bytes:
      break
  if not chunks:
    raise QsyncError(
      f"no .py files under the standard library directory {root}. "
      "Fix: run with a CPython installation that ships its standard library sources."
    )
  return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def load(max_bytes: int = 2_000_000, holdout_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
  """(train tokens, held-out tokens) as int32 byte ids."""
  if not 0.0 < holdout_fraction < 1.0:
    raise QsyncError(f"holdout_fraction={holdout_fraction!r} must lie in (0, 1). Fix: pass e.g. 0.1.")
  tokens = corpus(max_bytes).astype(np.int32)
  cut = int(len(tokens) * (1.0 - holdout_fraction))
  return tokens[:cut], tokens[cut:]


def train_windows(tokens: np.ndarray, seq_len: int, global_batch: int, seed: int):
  """Endless batches ``{"tokens": int32[global_batch, seq_len + 1]}`` at random offsets."""
  _check_windows(tokens, seq_len, global_batch)
  rng = np.random.default_rng(seed)
  offsets = np.arange(seq_len + 1)
  while True:
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=global_batch)
    yield {"tokens": tokens[starts[:, None] + offsets[None, :]]}


def eval_windows(tokens: np.ndarray, seq_len: int, batch_size: int):
  """One ordered pass of non-overlapping windows; the last batch may be smaller."""
  _check_windows(tokens, seq_len, batch_size)
  n = (len(tokens) - 1) // seq_len
  starts = np.arange(n) * seq_len
  offsets = np.arange(seq_len + 1)
  for i in range(0, n, batch_size):
    yield {"tokens": tokens[starts[i : i + batch_size, None] + offsets[None, :]]}


def _check_windows(tokens: np.ndarray, seq_len: int, batch_size: int) -> None:
  if seq_len < 1 or batch_size < 1:
    raise QsyncError(
      f"seq_len={seq_len} and batch size={batch_size} must be positive. Fix: pass e.g. 64 and 32."
    )
  if len(tokens) < seq_len + 2:
    raise QsyncError(
      f"the text split has {len(tokens)} tokens, fewer than seq_len + 2 = {seq_len + 2}. "
      "Fix: lower seq_len or raise max_bytes."
    )
