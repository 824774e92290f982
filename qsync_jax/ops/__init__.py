"""Quantized ops: ``dot_general`` / einsum / conv / embedding / attention with one precision per
GEMM leg (custom_vjp), the callables Flax's hooks take, and the ``shard_map`` shim they share."""
