"""QSync's cost profiler: op × leg × precision costs of a model's training step, measured on the
local device (``measure_profile``) or its ops' shapes alone (``traced_profile``), and the fits
that turn measured steps into a profile's remainder and cast costs."""

from planners.profiler.fit import fit_profile, fit_remainder
from planners.profiler.measure import measure_profile, memory_sizes, task_ops, task_shapes, traced_profile

__all__ = ["fit_profile", "fit_remainder", "measure_profile", "memory_sizes", "task_ops", "task_shapes", "traced_profile"]
