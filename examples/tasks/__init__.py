"""``qsync_jax.train.task.Task`` builders for the examples, registered by name in ``pyproject.toml``
(entry-point group ``qsync_jax.tasks``), so ``qsync train --model vgg`` and
``qsync_jax.train.task.get_task("vgg")`` find them once the checkout is installed.

==================== =========================================================== =========================
name                 model / data                                                overrides
==================== =========================================================== =========================
``resnet``           ResNet (BasicBlocks, BatchNorm) on scikit-learn digits      ``ResNetDigitsConfig``
``vgg``              VGG-BN on scikit-learn digits                               ``VGGDigitsConfig``
``lm``               causal transformer LM on the Python stdlib source (bytes)   ``LMConfig``
``resnet_cifar10``   ResNet on CIFAR-10 from ``data_dir`` (python-pickle batches) ``ResNetCifar10Config``
``resnet_synthetic`` ResNet on random images (step timing; ResNet-18 at 224×224) ``ResNetSyntheticConfig``
==================== =========================================================== =========================

Defaults are tiny (a 4-device CPU training step well under a second); overrides (fields of the
config dataclasses) give the full-size models, e.g.
``get_task("resnet", stage_sizes=(2, 2, 2, 2), widths=(64, 128, 256, 512))``. Digits and stdlib
tasks have a held-out split; batches are numpy dicts (``{"image", "label"}`` or ``{"tokens"}``).

Examples:
  >>> from qsync_jax.train.task import get_task
  >>> task = get_task("vgg", hidden=32)
  >>> batch = next(task.train_batches(16, 0))
  >>> batch["image"].shape
  (16, 8, 8, 1)
"""
