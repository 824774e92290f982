"""The example tasks by name: ``get_task("resnet")`` → a ``qsync_jax.task.Task``.

=================  ===========================================================  ==========
name               model / data                                                 overrides
=================  ===========================================================  ==========
``resnet``         ResNet (BasicBlocks, BatchNorm) on scikit-learn digits       ``ResNetDigitsConfig``
``vgg``            VGG-BN on scikit-learn digits                                ``VGGDigitsConfig``
``lm``             causal transformer LM on the Python stdlib source (bytes)    ``LMConfig``
``resnet_cifar10`` ResNet on CIFAR-10 from ``data_dir`` (python-pickle batches)  ``ResNetCifar10Config``
``resnet_synthetic`` ResNet on random images (step timing; ResNet-18 at 224×224)  ``ResNetSyntheticConfig``
``lm_synthetic``   causal transformer LM on random tokens (step timing)          ``SyntheticLMConfig``
=================  ===========================================================  ==========

Defaults are tiny (a 4-device CPU training step well under a second); overrides give the
full-size models, e.g. ``get_task("resnet", stage_sizes=(2, 2, 2, 2), widths=(64, 128, 256, 512))``.
Digits and stdlib tasks have a held-out split; batches are numpy dicts
(``{"image", "label"}`` or ``{"tokens"}``).

Examples:
  >>> task = get_task("vgg", hidden=32)
  >>> batch = next(task.train_batches(16, 0))
  >>> batch["image"].shape
  (16, 8, 8, 1)
"""

from __future__ import annotations

from collections.abc import Callable

from examples.tasks.language import stdlib_lm, synthetic_lm
from examples.tasks.vision import resnet_cifar10, resnet_digits, resnet_synthetic, vgg_digits
from qsync_jax.errors import QsyncError
from qsync_jax.task import Task

TASKS: dict[str, Callable[..., Task]] = {
  "resnet": resnet_digits,
  "vgg": vgg_digits,
  "lm": stdlib_lm,
  "resnet_cifar10": resnet_cifar10,
  "resnet_synthetic": resnet_synthetic,
  "lm_synthetic": synthetic_lm,
}


def get_task(name: str, **overrides) -> Task:
  """The task registered as ``name``, its config changed by ``overrides`` (config fields)."""
  if name not in TASKS:
    raise QsyncError(
      f"unknown task {name!r}. Fix: use one of {sorted(TASKS)}, "
      "or pass your own 'package.module:make_task' to the trainer."
    )
  return TASKS[name](**overrides)
