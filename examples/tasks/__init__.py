"""``qsync_jax.task.Task`` builders for the examples (see ``examples.registry``)."""
