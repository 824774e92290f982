"""What the benchmark scripts share, imported and never run: the model zoo (``zoo``: every
benchmark model defined once, as ``qsync_jax.Task`` builders and named sizes), result rows and
their file (``result_rows``), a model's ops as a cost-free profile (``op_profile``), GPU kernel
summaries of a trace (``kernel_summary``), the all-reduce link fit (``link``), the parts of
``benchmarks.e2e`` (its program inspection, micro-benchmarks and table), and of
``benchmarks.multigpu`` (trainer steps run outside the ``Trainer``, ``train_steps``; its modes
case, ``multigpu_modes``). Import as
``from benchmarks.common.<module> import <name>``."""
