"""Training: the ``Task`` interface and its registry, the hybrid data-parallel step, the
``Trainer``, batching, loss scaling, checkpoints, export and multi-process setup."""
