"""Sensitivity indicators: Ω[op][precision], the expected loss change of quantizing one op.

``compute(task, variables, batches, methods)`` probes the training step once (``probes``)
and returns one JSON table per method: ``gradient`` (ours), ``gvar`` (QSync), ``wvar``,
``hessian`` (HAWQ-v2 style) and ``random``. ``payload_cost.measure_payload`` measures, on Ω's
scale, what each gradient sync's payload costs against fp32 (the table's ``payload``).
"""

from planners.indicator.api import (
  FORMAT,
  METHODS,
  check_values,
  compute,
  initial_variables,
  load,
  make_table,
  save,
  unreached_note,
  unreached_ops,
)
from planners.indicator.gradient import ESTIMATORS
from planners.indicator.gvar import GvarConfig
from planners.indicator.probes import PROBED_PRECISIONS, OpCall, collect, forward_op_policy, trace_calls

__all__ = [
  "ESTIMATORS",
  "FORMAT",
  "METHODS",
  "PROBED_PRECISIONS",
  "GvarConfig",
  "OpCall",
  "check_values",
  "collect",
  "compute",
  "forward_op_policy",
  "initial_variables",
  "load",
  "make_table",
  "save",
  "trace_calls",
  "unreached_note",
  "unreached_ops",
]
