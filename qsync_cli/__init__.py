"""The ``qsync`` command line, on top of the runtime (``qsync_jax``) and the planner
(``planners``): one module per command, in the pipeline's order — ``indicator``, ``profile``,
``predict``, ``plan``, ``train``, ``export`` — and the dispatcher (``main``)."""
