"""Batching over in-memory numpy arrays: shuffled training epochs and an ordered held-out pass.

A split is a dict of numpy arrays sharing their leading axis (e.g. ``{"image", "label"}``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from qsync_jax.errors import QsyncError

Split = Mapping[str, np.ndarray]


def split_size(split: Split) -> int:
  return len(next(iter(split.values())))


def check_batch_size(what: str, batch_size: int, available: int) -> None:
  if not isinstance(batch_size, int) or batch_size < 1:
    raise QsyncError(f"{what}={batch_size!r} must be a positive integer. Fix: pass e.g. 64.")
  if batch_size > available:
    raise QsyncError(
      f"{what}={batch_size} exceeds the {available} examples of the split. "
      f"Fix: use a batch size of at most {available}."
    )


def train_batches(split: Split, global_batch: int, seed: int) -> Iterator[dict[str, np.ndarray]]:
  """Endless batches of ``global_batch`` examples: a fresh permutation each epoch.

  Deterministic given ``seed``; the remainder of each epoch is dropped so every batch is full.
  """
  n = split_size(split)
  check_batch_size("global_batch", global_batch, n)
  rng = np.random.default_rng(seed)
  while True:
    order = rng.permutation(n)
    for start in range(0, n - global_batch + 1, global_batch):
      idx = order[start : start + global_batch]
      yield {k: v[idx] for k, v in split.items()}


def eval_batches(split: Split, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
  """One ordered pass over the split; the last batch holds the remainder (may be smaller)."""
  n = split_size(split)
  check_batch_size("batch_size", batch_size, n)
  for start in range(0, n, batch_size):
    yield {k: v[start : start + batch_size] for k, v in split.items()}


def holdout_split(arrays: Split, holdout_fraction: float, seed: int = 0) -> tuple[Split, Split]:
  """Splits examples into (train, held-out) by a fixed permutation (``seed``)."""
  if not 0.0 < holdout_fraction < 1.0:
    raise QsyncError(f"holdout_fraction={holdout_fraction!r} must lie in (0, 1). Fix: pass e.g. 0.2.")
  n = split_size(arrays)
  order = np.random.default_rng(seed).permutation(n)
  n_test = max(1, int(round(n * holdout_fraction)))
  test, train = order[:n_test], order[n_test:]
  return {k: v[train] for k, v in arrays.items()}, {k: v[test] for k, v in arrays.items()}
