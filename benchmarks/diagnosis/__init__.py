"""Diagnosis of the predictor and of the training step: scripts that explain where a predicted
step differs from a measured one — the replay of logged runs offline (``predictor_replay``,
``multigpu_replay``), the catalog's roofline against a device (``roofline``), a step's time and
memory taken apart (``step_ops``, ``step_kernels``, ``kernel_categories``, ``step_liveness``),
its drift across executables (``step_drift``), the predictor on GPU-sized models
(``models``), delayed (amax-history) against dynamic 8-bit scaling (``delayed_scaling``), and every 8-bit
kernel compiled for each architecture without its GPU (``cross_compile``). Run one as ``python -m benchmarks.diagnosis.<name>``; its rows go, like every
benchmark's, to ``benchmarks/results/<name>.jsonl``."""
