"""Image-classification tasks: ResNet / VGG / an MLP on scikit-learn's digits, ResNet on CIFAR-10."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import optax

from examples.data import batches, cifar10, digits
from examples.models.mlp import MLP
from examples.models.resnet import ResNet
from examples.models.vgg import VGG
from examples.tasks.config import make_config
from qsync_jax.train.task import Task


def classification_loss(logits, batch):
  """Mean softmax cross-entropy and accuracy of integer labels ``batch["label"]``."""
  logits = logits.astype(jnp.float32)
  labels = jnp.asarray(batch["label"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  accuracy = jnp.mean((jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32))
  return loss, {"accuracy": accuracy}


def image_inputs(batch):
  return (jnp.asarray(batch["image"]),)


def classification_task(name: str, model, train, test) -> Task:
  """A Task over in-memory (train, held-out) splits of ``{"image", "label"}``."""
  return Task(
    name=name,
    model=model,
    inputs=image_inputs,
    loss=classification_loss,
    train_batches=functools.partial(batches.train_batches, train),
    eval_batches=functools.partial(batches.eval_batches, test),
    train_kwargs={"train": True},
    eval_kwargs={"train": False},
    mutable=("batch_stats",),
  )


@dataclasses.dataclass(frozen=True)
class ResNetDigitsConfig:
  """ResNet on digits. ResNet-18: stage_sizes=(2, 2, 2, 2), widths=(64, 128, 256, 512)."""

  stage_sizes: tuple[int, ...] = (1, 1, 1)
  widths: tuple[int, ...] = (16, 32, 64)
  holdout_fraction: float = 0.2
  split_seed: int = 0


@dataclasses.dataclass(frozen=True)
class VGGDigitsConfig:
  """VGG on digits. VGG-16-BN: stages=((64, 64), (128, 128), (256,)*3, (512,)*3, (512,)*3), hidden=4096."""

  stages: tuple[tuple[int, ...], ...] = ((16, 16), (32, 32), (64, 64))
  hidden: int = 64
  holdout_fraction: float = 0.2
  split_seed: int = 0


@dataclasses.dataclass(frozen=True)
class MLPDigitsConfig:
  """An MLP on digits' flattened images: the smallest example (no BatchNorm), for quick runs."""

  hidden: tuple[int, ...] = (64,)
  holdout_fraction: float = 0.2
  split_seed: int = 0


@dataclasses.dataclass(frozen=True)
class ResNetCifar10Config:
  """ResNet on CIFAR-10 read from ``data_dir`` (python-pickle batches)."""

  data_dir: str | None = None
  stage_sizes: tuple[int, ...] = (1, 1, 1, 1)
  widths: tuple[int, ...] = (16, 32, 64, 128)
  train_files: tuple[str, ...] = cifar10.TRAIN_FILES


def resnet_digits(**overrides) -> Task:
  cfg = make_config(ResNetDigitsConfig, overrides, "resnet")
  train, test = digits.load(cfg.holdout_fraction, cfg.split_seed)
  model = ResNet(stage_sizes=cfg.stage_sizes, widths=cfg.widths, num_classes=digits.NUM_CLASSES)
  return classification_task("resnet", model, train, test)


def vgg_digits(**overrides) -> Task:
  cfg = make_config(VGGDigitsConfig, overrides, "vgg")
  train, test = digits.load(cfg.holdout_fraction, cfg.split_seed)
  model = VGG(stages=cfg.stages, hidden=cfg.hidden, num_classes=digits.NUM_CLASSES)
  return classification_task("vgg", model, train, test)


def mlp_digits(**overrides) -> Task:
  cfg = make_config(MLPDigitsConfig, overrides, "mlp")
  train, test = digits.load(cfg.holdout_fraction, cfg.split_seed)
  task = classification_task("mlp", MLP(hidden=cfg.hidden, num_classes=digits.NUM_CLASSES), train, test)
  return dataclasses.replace(task, train_kwargs={}, eval_kwargs={}, mutable=())


def resnet_cifar10(**overrides) -> Task:
  cfg = make_config(ResNetCifar10Config, overrides, "resnet_cifar10")
  train, test = cifar10.load(cfg.data_dir, cfg.train_files)
  model = ResNet(stage_sizes=cfg.stage_sizes, widths=cfg.widths, num_classes=cifar10.NUM_CLASSES)
  return classification_task("resnet_cifar10", model, train, test)


@dataclasses.dataclass(frozen=True)
class ResNetSyntheticConfig:
  """ResNet on random images, for step timing (no held-out split: the labels are noise).

  ResNet-18 at ImageNet size: ``image_size=224, stage_sizes=(2, 2, 2, 2),
  widths=(64, 128, 256, 512), num_classes=1000, imagenet_stem=True``; ResNet-50 adds
  ``stage_sizes=(3, 4, 6, 3), block="bottleneck"``.
  """

  image_size: int = 16
  channels: int = 3
  num_classes: int = 10
  stage_sizes: tuple[int, ...] = (1, 1)
  widths: tuple[int, ...] = (8, 16)
  imagenet_stem: bool = False
  block: str = "basic"


def synthetic_image_batches(cfg: ResNetSyntheticConfig, batch_size: int, seed: int):
  """Standard-normal images and uniform labels, deterministic given ``seed``, forever."""
  rng = np.random.default_rng(seed)
  shape = (batch_size, cfg.image_size, cfg.image_size, cfg.channels)
  while True:
    yield {
      "image": rng.standard_normal(shape, dtype=np.float32),
      "label": rng.integers(0, cfg.num_classes, batch_size).astype(np.int32),
    }


def resnet_synthetic(**overrides) -> Task:
  cfg = make_config(ResNetSyntheticConfig, overrides, "resnet_synthetic")
  model = ResNet(
    stage_sizes=cfg.stage_sizes,
    widths=cfg.widths,
    num_classes=cfg.num_classes,
    imagenet_stem=cfg.imagenet_stem,
    block=cfg.block,
  )
  return Task(
    name="resnet_synthetic",
    model=model,
    inputs=image_inputs,
    loss=classification_loss,
    train_batches=functools.partial(synthetic_image_batches, cfg),
    train_kwargs={"train": True},
    eval_kwargs={"train": False},
    mutable=("batch_stats",),
  )
