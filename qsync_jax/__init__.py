"""qsync-jax: quantization-minimized synchronous training across hybrid devices.

Public surface of the runtime; see README.md for a tour.
"""

from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.devices import DEVICE_PRECISIONS, DEVICES, supported_precisions
from qsync_jax.errors import (
  CheckpointError,
  ClusterSpecError,
  PlanError,
  PolicyError,
  QsyncError,
  QsyncWarning,
  UnsupportedPrecisionError,
)
from qsync_jax.models.flax_quant import QuantizedModel, quantize
from qsync_jax.ops.qconv import quantized_conv_general_dilated
from qsync_jax.ops.qdot import quantized_dot_general, quantized_einsum, residual_bytes
from qsync_jax.ops.quant_ops import OpInfo
from qsync_jax.plan import Plan
from qsync_jax.policy import OP_KINDS, PrecisionPolicy, Rule, op_name, split_op_name
from qsync_jax.precision import LEGS, PRECISIONS, PRESETS, OpPolicy
from qsync_jax.train.task import Task

__version__ = "0.1.0"

_LAZY = {
  "Trainer": "qsync_jax.train.trainer",
  "make_train_step": "qsync_jax.train.train_step",
  "NnxModel": "qsync_jax.models.nnx_model",
  "QuantizedNnxModel": "qsync_jax.models.nnx_quant",
  "export_params": "qsync_jax.train.export",
}


def __getattr__(name):
  """The trainer (and orbax behind it) and the nnx support (flax.nnx) load on first use,
  keeping ``import qsync_jax`` light."""
  if name in _LAZY:
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'qsync_jax' has no attribute {name!r}")


__all__ = [
  "CheckpointError",
  "ClusterSpec",
  "ClusterSpecError",
  "DeviceGroup",
  "DEVICE_PRECISIONS",
  "DEVICES",
  "LEGS",
  "NnxModel",
  "OP_KINDS",
  "OpInfo",
  "OpPolicy",
  "PRECISIONS",
  "PRESETS",
  "Plan",
  "PlanError",
  "PolicyError",
  "PrecisionPolicy",
  "QsyncError",
  "QsyncWarning",
  "QuantizedModel",
  "QuantizedNnxModel",
  "Rule",
  "Task",
  "Trainer",
  "UnsupportedPrecisionError",
  "export_params",
  "op_name",
  "make_train_step",
  "quantize",
  "quantized_conv_general_dilated",
  "quantized_dot_general",
  "quantized_einsum",
  "residual_bytes",
  "split_op_name",
  "supported_precisions",
]
