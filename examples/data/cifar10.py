"""CIFAR-10 from a local directory in its python-pickle batch format (no download).

The directory holds ``data_batch_1`` … ``data_batch_5`` and ``test_batch`` as distributed in
``cifar-10-python.tar.gz`` (folder ``cifar-10-batches-py``). Each file is a pickled dict with
``b"data"``: uint8[N, 3072] (1024 red, 1024 green, 1024 blue values, row-major 32×32) and
``b"labels"``: N ints in [0, 10). Images are returned NHWC float32 in [0, 1].
"""

from __future__ import annotations

import pathlib
import pickle

import numpy as np

from examples.data.batches import Split
from qsync_jax.errors import QsyncError

NUM_CLASSES = 10
IMAGE_SHAPE = (32, 32, 3)
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"


def read_batch(path: pathlib.Path) -> dict[str, np.ndarray]:
  """One batch file → ``{"image": float32[N, 32, 32, 3], "label": int32[N]}``."""
  try:
    with open(path, "rb") as f:
      raw = pickle.load(f, encoding="bytes")
  except (OSError, pickle.UnpicklingError, EOFError) as e:
    raise QsyncError(
      f"cannot read CIFAR-10 batch {path}: {e}. "
      "Fix: point --data-dir at the extracted 'cifar-10-batches-py' folder of cifar-10-python.tar.gz."
    ) from e
  if not isinstance(raw, dict) or b"data" not in raw or b"labels" not in raw:
    raise QsyncError(
      f"{path} is not a CIFAR-10 python batch (a pickled dict with b'data' and b'labels'). "
      "Fix: use the python version of CIFAR-10 (cifar-10-python.tar.gz)."
    )
  data = np.asarray(raw[b"data"], dtype=np.uint8)
  labels = np.asarray(raw[b"labels"], dtype=np.int32)
  if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
    raise QsyncError(
      f"{path}: data has shape {data.shape} and {len(labels)} labels; expected (N, 3072) and N labels. "
      "Fix: re-extract the CIFAR-10 python batches."
    )
  images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1).astype(np.float32) / 255.0
  return {"image": images, "label": labels}


def load(
  data_dir: str | pathlib.Path | None, train_files: tuple[str, ...] = TRAIN_FILES
) -> tuple[Split, Split]:
  """(train, test) splits from ``data_dir``; raises ``QsyncError`` naming a missing file."""
  if data_dir is None:
    raise QsyncError(
      "CIFAR-10 needs a local data directory (data_dir=None). "
      "Fix: download and extract cifar-10-python.tar.gz, then pass --data-dir path/to/cifar-10-batches-py."
    )
  root = pathlib.Path(data_dir)
  for name in (*train_files, TEST_FILE):
    if not (root / name).is_file():
      raise QsyncError(
        f"CIFAR-10 file {root / name} is missing. Fix: pass --data-dir pointing at the extracted "
        "'cifar-10-batches-py' folder (it holds data_batch_1..5 and test_batch)."
      )
  parts = [read_batch(root / name) for name in train_files]
  train = {k: np.concatenate([p[k] for p in parts]) for k in ("image", "label")}
  return train, read_batch(root / TEST_FILE)


def write_batch(path: str | pathlib.Path, images_uint8: np.ndarray, labels: np.ndarray) -> None:
  """Writes NHWC uint8 images and labels in CIFAR-10's batch format (for fixtures and subsets)."""
  data = np.asarray(images_uint8, dtype=np.uint8).transpose(0, 3, 1, 2).reshape(len(images_uint8), -1)
  with open(path, "wb") as f:
    pickle.dump({b"data": data, b"labels": [int(v) for v in labels]}, f)
