"""scikit-learn's bundled handwritten digits: 1797 real 8×8 grayscale images, 10 classes.

Ships inside scikit-learn (no download). Images are NHWC float32 in [0, 1].
"""

from __future__ import annotations

import functools

import numpy as np

from examples.data.batches import Split, holdout_split

NUM_CLASSES = 10
IMAGE_SHAPE = (8, 8, 1)


@functools.lru_cache(maxsize=1)
def _load() -> dict[str, np.ndarray]:
  try:
    from sklearn.datasets import load_digits
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("the digits examples need scikit-learn. Fix: pip install 'qsync-jax[examples]'.") from e
  digits = load_digits()
  images = (digits.images.astype(np.float32) / 16.0)[..., None]
  return {"image": images, "label": digits.target.astype(np.int32)}


def load(holdout_fraction: float = 0.2, split_seed: int = 0) -> tuple[Split, Split]:
  """(train, held-out) splits of the digits; the split is fixed by ``split_seed``."""
  return holdout_split(_load(), holdout_fraction, split_seed)
