"""Op memory model: what each quantizable op keeps between its forward and backward.

Plain functions of an op's shape (``planners.ops.OpShape``) and its policy:

* ``residual_bytes`` — what the op itself saves (inputs at their stored precision, scales);
* ``kept_bytes`` — what the compiled step really keeps for it (backend effects: XLA:CPU
  keeps fp32 copies where its products upcast 16-bit operands, fp8 residuals as fp32, and the
  threefry words of stochastic rounding);
* ``transient_bytes`` — what its backward materializes on top (dequantized residuals);
* ``forward_extra_bytes`` — what its forward holds beyond the fp32 op's at its busiest.

Each rule names the buffer-assignment evidence it rests on. ``planners.replay`` sums them
into a group's peak.
"""

from __future__ import annotations

from planners.ops import OpShape
from qsync_jax.precision import QUANTIZED_PRECISIONS, OpPolicy
from qsync_jax.qdot import FLOAT_DTYPES


def saved_activation_elems(op: OpShape, op_policy: OpPolicy | None) -> int:
  """Elements of one call's activation residual: the input, or the im2col patches
  (``batch·m·k``) of a conv that does not run natively (any quantized or mixed leg)."""
  im2col = op.kind == "conv" and op_policy is not None and not _native_conv(op_policy)
  return op.batch * op.m * op.k if im2col else op.lhs_elems


def residual_bytes(op: OpShape, op_policy: OpPolicy | None) -> int:
  """Bytes one op saves for its backward pass under ``op_policy`` (None = fp32).

  fp32/tf32 forward: the fp32 activation operand(s) (a weight is the parameter itself);
  bf16/fp16: 2-byte copies of the activation operand(s) (XLA re-derives a weight's copy from
  the live parameter rather than keeping it); int8/fp8: 1-byte quantized operands plus fp32
  scales (per channel: one per row / column). A conv that does not run natively saves its
  im2col patches instead of its input (``saved_activation_elems``).
  """
  p = "fp32" if op_policy is None else op_policy.fwd
  lhs = saved_activation_elems(op, op_policy)
  rhs = op.rhs_elems
  if p in QUANTIZED_PRECISIONS:
    if op_policy.granularity == "per_channel":
      scales = 4 * op.batch * (op.m + op.n)
    else:
      scales = 8
    total = lhs + rhs + scales
  elif p in FLOAT_DTYPES:
    total = 2 * lhs + (0 if op.has_weight else 2 * rhs)
  else:
    total = 4 * lhs + (0 if op.has_weight else 4 * rhs)
  return int(total * op.calls)


def upcasts_16bit_products(device_type: str) -> bool:
  """Whether the runtime runs bf16/fp16 legs on ``device_type`` as fp32 products of 16-bit-rounded
  values (``qsync_jax.qdot.leg_dot`` does so on XLA:CPU, which lacks some 16-bit products)."""
  return device_type == "cpu"


def dequantizes_fp8_residuals(device_type: str) -> bool:
  """Whether the compiled step on ``device_type`` keeps an fp8 forward's residuals as fp32.

  XLA:CPU has no fp8 arithmetic: it runs an fp8 GEMM on fp32 copies of the fp8-rounded
  operands, and converts a saved fp8 residual back to fp32 (times its scale) as soon as the
  forward made it, keeping that fp32 copy, laid out for the backward leg that reads it,
  instead of the 1-byte one (buffer assignment of the VGG and MLP steps; fp8 with nearest or
  stochastic gradient rounding alike). An int8 residual stays 1-byte there."""
  return device_type == "cpu"


def kept_bytes(
  op: OpShape,
  op_policy: OpPolicy | None,
  upcast_16bit: bool = False,
  lhs_differentiated: bool = True,
  dequantized_fp8: bool = False,
) -> int:
  """Bytes the compiled training step keeps live for one op's backward pass.

  ``residual_bytes`` (what the op's ``custom_vjp`` saves) with corrections for what XLA
  does with it inside a whole step:

  * ``upcast_16bit`` (``upcasts_16bit_products``): a bf16/fp16 forward's backward legs read
    its 16-bit residual as fp32; XLA fuses that conversion into the residual's producer and
    keeps the fp32 values, so the residual costs 4 bytes per element, as an fp32 forward's.
    Likewise an int8/fp8 activation residual (a conv's patches) read by a float drhs leg is
    kept dequantized.
  * ``dequantized_fp8`` (``dequantizes_fp8_residuals``): an fp8 forward's residuals are kept
    as fp32 — the activation (read by drhs) and, when the dlhs leg runs, the right operand.
  * The first op's dlhs (``lhs_differentiated=False``: the model input) is never computed.
  * Stochastic rounding keeps nothing extra: its noise is a hash of each element's index
    (``pallas_kernels.quantize.noise``), computed where the rounding reads it. (With
    ``jax.random.uniform`` XLA:CPU kept threefry's two 32-bit words per element of dY.)
  """
  kept = residual_bytes(op, op_policy)
  if op_policy is None:
    return kept
  act = saved_activation_elems(op, op_policy) * op.calls
  if upcast_16bit and op_policy.fwd in FLOAT_DTYPES:
    kept = residual_bytes(op, OpPolicy.uniform("fp32"))
  elif dequantized_fp8 and op_policy.fwd == "fp8":
    rhs = op.rhs_elems * op.calls
    kept += 3 * act - rhs + 4 * rhs * lhs_differentiated
  elif upcast_16bit and op_policy.fwd in QUANTIZED_PRECISIONS:
    # a float drhs leg reads the 8-bit activation residual dequantized, as fp32 (XLA hoists
    # that elementwise dequantization into the forward as well): 4 bytes instead of 1 per
    # element. (A weight residual is dequantized where the dlhs leg reads it.)
    kept += 3 * act * (op_policy.drhs not in QUANTIZED_PRECISIONS)
  return int(kept)


def transient_bytes(
  op: OpShape, op_policy: OpPolicy | None, upcast_16bit: bool = False, dequantized_fp8: bool = False
) -> int:
  """Bytes live only while the op's backward runs: its int8/fp8 residuals dequantized for the
  gradient legs that read them — those ``kept_bytes`` does not already keep as fp32 (with
  ``upcast_16bit``, an activation a float drhs leg reads; with ``dequantized_fp8``, all of an
  fp8 forward's), at fp32.

  On a backend with native 16-bit and 8-bit products (neither flag: GPUs) each residual is
  dequantized to the precision of the leg that reads it: none for a leg at the forward's own
  8-bit precision (it reads the 1-byte values and their scales), 2 bytes per element for a
  bf16/fp16 leg, 4 for an fp32 one (buffer assignment of a VGG step on an H100: the int8_fwd
  plan's fp16 drhs legs hold ``f16`` im2col patches, the all-int8 plan none)."""
  if op_policy is None or op_policy.fwd not in QUANTIZED_PRECISIONS:
    return 0
  if dequantized_fp8 and op_policy.fwd == "fp8":
    return 0
  act = saved_activation_elems(op, op_policy)
  if not upcast_16bit and not dequantized_fp8:

    def width(leg_precision: str) -> int:
      return 0 if leg_precision == op_policy.fwd else 2 if leg_precision in FLOAT_DTYPES else 4

    return width(op_policy.drhs) * act + width(op_policy.dlhs) * op.rhs_elems
  if upcast_16bit and op_policy.drhs not in QUANTIZED_PRECISIONS:
    act = 0
  return 4 * (act + op.rhs_elems)


def forward_extra_bytes(
  op: OpShape,
  op_policy: OpPolicy | None,
  upcast_16bit: bool = False,
  lhs_differentiated: bool = True,
  dequantized_fp8: bool = False,
) -> int:
  """Bytes one op's forward holds at its busiest beyond what the fp32 op's forward holds.

  A float op: what it keeps beyond the fp32 op (``kept_bytes`` minus the fp32 residual,
  random bits aside). An int8/fp8 forward: the larger of its two busiest moments
  (``_busiest_forward``), at the GEMM with the activation residual in its kept form beside
  (at least fp32 where XLA computes it dequantized in the forward).

  The residuals earlier ops keep are live too: the replay adds their excess over fp32.
  """
  kept = kept_bytes(op, op_policy, upcast_16bit, lhs_differentiated, dequantized_fp8)
  delta = kept - residual_bytes(op, None)
  if op_policy is None or op_policy.fwd not in QUANTIZED_PRECISIONS:
    return int(delta)
  return _busiest_forward(op, op_policy, upcast_16bit, dequantized_fp8, delta)


def quantized_forward_bytes(
  op: OpShape, op_policy: OpPolicy | None, upcast_16bit: bool = False, dequantized_fp8: bool = False
) -> int:
  """Bytes an int8/fp8 forward's own buffers hold at its busiest (0 for a float forward):
  ``_busiest_forward`` with nothing kept beyond its own buffers. On an H100 the all-int8
  step of a 128-512-channel VGG peaks at its second conv's row quantization: its fp32
  patches (302.0 MB) and their int8 copy (75.5 MB) live, nothing else of that op
  (``benchmarks/step_liveness.py``)."""
  if op_policy is None or op_policy.fwd not in QUANTIZED_PRECISIONS:
    return 0
  return _busiest_forward(op, op_policy, upcast_16bit, dequantized_fp8, 0)


def _busiest_forward(
  op: OpShape, op_policy: OpPolicy, upcast_16bit: bool, dequantized_fp8: bool, kept: int
) -> int:
  """An int8/fp8 forward's busiest bytes, the larger of two moments (buffer assignment of
  small CNN and VGG steps on XLA:CPU):

  * its GEMM: an im2col conv's fp32 patch matrix and the GEMM operands
    (``_patches_and_operands``), beside ``kept`` (what the op keeps) or, where XLA computes
    the activation residual dequantized in the forward (``_dequantized_in_forward``), that
    fp32 copy if larger;
  * on XLA:CPU (``upcast_16bit``) an im2col conv's stacking of its patches: the strided
    slices of the input, as many fp32 elements as the patch matrix, live beside it.
  """
  act = saved_activation_elems(op, op_policy) * op.calls
  dequantized = 4 * act * _dequantized_in_forward(op_policy, upcast_16bit, dequantized_fp8)
  gemm = _patches_and_operands(op, op_policy, dequantized_fp8) + max(kept, dequantized)
  stacking = 2 * 4 * act if upcast_16bit and op.kind == "conv" else 0
  return int(max(gemm, stacking))


def _dequantized_in_forward(op_policy: OpPolicy, upcast_16bit: bool, dequantized_fp8: bool) -> bool:
  """Whether XLA computes an int8/fp8 forward's activation residual as fp32 in the forward:
  an fp8 one where the backend runs fp8 GEMMs on fp32 copies (``dequantized_fp8``), and on
  XLA:CPU (``upcast_16bit``) one the drhs leg reads in another precision (a float leg, or
  the other 8-bit format, which rounds it again from there). An int8 drhs leg of an int8
  forward reads the saved values as they are (a small CNN's all-int8 step on XLA:CPU holds
  no fp32 copy of the activation)."""
  return (dequantized_fp8 and op_policy.fwd == "fp8") or (upcast_16bit and op_policy.drhs != op_policy.fwd)


def _patches_and_operands(op: OpShape, op_policy: OpPolicy, dequantized_fp8: bool) -> int:
  """An int8/fp8 forward's fp32 im2col patches (a conv's) and its GEMM operands: 1 byte per
  element, 4 where the backend runs fp8 GEMMs on fp32 copies (``dequantized_fp8``)."""
  act = saved_activation_elems(op, op_policy) * op.calls
  patches = 4 * act if op.kind == "conv" else 0
  gemm = (4 if dequantized_fp8 and op_policy.fwd == "fp8" else 1) * (act + op.rhs_elems * op.calls)
  return patches + gemm


def _native_conv(op_policy: OpPolicy) -> bool:
  p = op_policy.fwd
  return p not in QUANTIZED_PRECISIONS and op_policy.dlhs == p and op_policy.drhs == p
