"""qsync-jax: quantization-minimized synchronous training across hybrid devices.

Public surface of the runtime; see README.md for a tour.
"""

from qsync_jax.errors import (
  CheckpointError,
  ClusterSpecError,
  PlanError,
  PolicyError,
  QsyncError,
  UnsupportedPrecisionError,
)
from qsync_jax.flax_quant import OpInfo, QuantizedModel, quantize
from qsync_jax.policy import OP_KINDS, PrecisionPolicy, Rule, op_name, split_op_name
from qsync_jax.precision import (
  DEVICE_PRECISIONS,
  LEGS,
  PRECISIONS,
  PRESETS,
  OpPolicy,
  supported_precisions,
)
from qsync_jax.qconv import quantized_conv_general_dilated
from qsync_jax.qdot import quantized_dot_general, quantized_einsum, residual_bytes

__version__ = "0.1.0"

__all__ = [
  "CheckpointError",
  "ClusterSpecError",
  "DEVICE_PRECISIONS",
  "LEGS",
  "OP_KINDS",
  "OpInfo",
  "OpPolicy",
  "PRECISIONS",
  "PRESETS",
  "PlanError",
  "PolicyError",
  "PrecisionPolicy",
  "QsyncError",
  "QuantizedModel",
  "Rule",
  "UnsupportedPrecisionError",
  "op_name",
  "quantize",
  "quantized_conv_general_dilated",
  "quantized_dot_general",
  "quantized_einsum",
  "residual_bytes",
  "split_op_name",
  "supported_precisions",
]
