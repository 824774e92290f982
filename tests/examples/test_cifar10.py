"""CIFAR-10 python-pickle loading, on a small fixture written in that exact format."""

import pickle

import numpy as np
import pytest

from examples.data import cifar10
from examples.tasks.vision import resnet_cifar10
from qsync_jax.errors import QsyncError


def _write_fixture(root, rng, per_batch=3, n_test=4):
  """Writes data_batch_1..5 and test_batch as CIFAR-10 does: data uint8[N, 3072] channel-first."""
  images = {}
  for name in (*cifar10.TRAIN_FILES, cifar10.TEST_FILE):
    n = n_test if name == cifar10.TEST_FILE else per_batch
    chw = rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n).tolist()
    with open(root / name, "wb") as f:
      pickle.dump({b"batch_label": name.encode(), b"data": chw.reshape(n, 3072), b"labels": labels}, f)
    images[name] = (chw, np.asarray(labels))
  return images


def test_load_matches_the_pickled_pixels(tmp_path):
  rng = np.random.default_rng()
  written = _write_fixture(tmp_path, rng)
  train, test = cifar10.load(tmp_path)
  assert train["image"].shape == (15, 32, 32, 3) and train["image"].dtype == np.float32
  chw, labels = written["data_batch_2"]
  # Pixel (row 5, col 7) of the 2nd image of batch 2, green channel.
  assert train["image"][3 + 1, 5, 7, 1] == pytest.approx(chw[1, 1, 5, 7] / 255.0)
  np.testing.assert_array_equal(train["label"][3:6], labels)
  chw, labels = written["test_batch"]
  np.testing.assert_allclose(test["image"], chw.transpose(0, 2, 3, 1) / 255.0, rtol=1e-6)
  np.testing.assert_array_equal(test["label"], labels)


def test_write_batch_round_trips(tmp_path):
  rng = np.random.default_rng()
  images = rng.integers(0, 256, size=(5, 32, 32, 3), dtype=np.uint8)
  labels = rng.integers(0, 10, size=5)
  cifar10.write_batch(tmp_path / "b", images, labels)
  back = cifar10.read_batch(tmp_path / "b")
  np.testing.assert_allclose(back["image"] * 255.0, images, atol=1e-3)
  np.testing.assert_array_equal(back["label"], labels)


def test_missing_file_is_named(tmp_path):
  _write_fixture(tmp_path, np.random.default_rng())
  (tmp_path / "data_batch_4").unlink()
  with pytest.raises(QsyncError, match="data_batch_4 is missing.*--data-dir"):
    cifar10.load(tmp_path)


def test_task_needs_a_data_dir():
  with pytest.raises(QsyncError, match="needs a local data directory.*--data-dir"):
    resnet_cifar10()


def test_not_a_cifar_batch(tmp_path):
  _write_fixture(tmp_path, np.random.default_rng())
  with open(tmp_path / "test_batch", "wb") as f:
    pickle.dump([1, 2, 3], f)
  with pytest.raises(QsyncError, match="not a CIFAR-10 python batch"):
    cifar10.load(tmp_path)


def test_task_reads_the_fixture(tmp_path):
  _write_fixture(tmp_path, np.random.default_rng(), per_batch=4)
  task = resnet_cifar10(data_dir=str(tmp_path), widths=(4, 8), stage_sizes=(1, 1))
  batch = next(task.train_batches(8, 0))
  assert batch["image"].shape == (8, 32, 32, 3)
  assert sum(len(b["label"]) for b in task.eval_batches(3)) == 4
