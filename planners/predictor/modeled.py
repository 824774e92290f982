"""Profiles of devices not at hand, modeled from the device catalog (``docs/catalog.md``).

``modeled_profile(base, device_type)`` costs the ops of a measured or traced profile on a catalog
device: every leg at every precision the device runs by the roofline and the conversions or
quantizations the trainer runs for it (``leg_ms``); the remainder as ``REST_BYTES`` per element of
every op output (``remainder_ms``); the optimizer as Adam's reads and writes of the parameters.
Memory is the base profile's. The profile is labelled ``"modeled"``.

What the trainer runs between ops (``qsync_jax.ops.qdot``): an op returns its model's dtype,
whatever its policy (``OpShape.activation_dtype``), so the activations and gradients of a
float32 model (the catalog's checked models) are float32 between ops, those of a model computing
in bf16 are bf16. The parameters are float32, and a Flax module converts its weight to its own
dtype before the product (``promote_dtype``, whatever the op's policy), so both operands reach an
op at the model's dtype. A leg at another precision converts them; XLA fuses each conversion
into the producer of its source, which writes the copy. An 8-bit leg's operands are quantized by
the Pallas kernels (``pallas_kernels.quantize``): kernels of their own, which read the source at
the model's dtype. The remainder is the catalog's per-element traffic (``REST_BYTES``), whatever
the activations' width.
"""

from __future__ import annotations

import dataclasses

from planners import catalog
from planners.ops import OpShape
from planners.profile import CAST_TYPES, CastModel, Profile, cast_precisions
from qsync_jax.devices import DeviceType, device
from qsync_jax.precision import FP32_LIKE, LEGS, QUANTIZED_PRECISIONS

# Each leg's two operands and its result, as the forward's tensors (dX = dY·Wᵀ, dW = Xᵀ·dY).
LEG_TENSORS = {"fwd": ("lhs", "rhs", "out"), "dlhs": ("out", "rhs", "lhs"), "drhs": ("lhs", "out", "rhs")}

REST_BYTES = {"conv": 43.0, "other": 21.0}
"""The remainder (norms, activations, softmax, the loss and their gradients): bytes moved per
step per element of an op's output, by the op's kind (a convolution's output goes through a
batch norm and a ReLU). Fitted to the rest of the H100 bf16 steps traced per op
(``docs/catalog.md``); attention scores (``attention_qk`` outputs) are not counted: the 16-bit
steps run cuDNN's fused attention, which never writes them."""


def modeled_cast(spec: DeviceType, cast_type: str) -> CastModel:
  """Roofline cast model of ``cast_type`` (``"src->dst"``) per element. A conversion to a float
  type fuses into the kernel that produces its source and costs the write of the copy; from an
  8-bit type (a saved residual dequantized) it is a kernel of its own that reads the copy and
  writes the float one. A quantization is the per-row quantize kernel (one launch): it reads its
  source once and writes the 8-bit copy at the quantize kernels' rate."""
  src, dst = cast_precisions(cast_type)
  launch = spec.launch_us * 1e-3
  if dst in QUANTIZED_PRECISIONS:
    return CastModel(catalog.quantize_ms(spec, catalog.BYTES[src] + 1), launch, 0.0, "modeled")
  if src in QUANTIZED_PRECISIONS:
    return CastModel(catalog.memory_ms(spec, 1 + catalog.BYTES[dst]), launch, 0.0, "modeled")
  return CastModel(catalog.memory_ms(spec, catalog.BYTES[dst]), 0.0, 0.0, "modeled")


def quantize_leg_ms(spec: DeviceType, op: OpShape, leg: str) -> float:
  """ms of the quantization one call of ``op``'s 8-bit ``leg`` runs, as ``qsync_jax.ops.qdot``
  runs it under a per-channel policy (an 8-bit forward and gradient legs of its format: the
  ``int8`` and ``fp8`` presets; an 8-bit forward alone: ``int8_fwd``):

  * ``fwd``: the left operand (an activation; a convolution's im2col patches, written first)
    per row: one kernel reads it once and writes its 8-bit copy; the right operand per column,
    laid out contraction-major: an XLA absmax reduction, then a kernel that reads it again and
    writes the copy;
  * ``dlhs``, ``drhs``: the forward's saved 8-bit operands are reused as they are; ``dY`` is
    quantized for both legs by one ``quantize_pair`` (two kernels, each reading ``dY``; two 8-bit
    copies written), half of it charged to each leg. Where a gradient leg runs at the forward's
    format the forward writes the operand it reads in that leg's layout too (``quantize_both``:
    no transpose in the backward), which that leg is charged: ``drhs`` X's second copy and, as
    its kernel then takes a known scale, X's absmax reduction (``a`` + 1 bytes per element, one
    launch more); ``dlhs`` W's second copy (1 byte per element).
  """
  launch = spec.launch_us * 1e-3
  a = catalog.BYTES[op.activation_precision]  # both operands reach the op at the model's dtype
  lhs, im2col_ms = op.lhs_elems, 0.0
  if op.kind == "conv":
    lhs = op.batch * op.m * op.k
    im2col_ms = catalog.memory_ms(spec, a * (op.lhs_elems + lhs))  # reads the input, writes the patches
  if leg != "fwd":
    pair_ms = (catalog.quantize_ms(spec, (2 * a + 2) * op.out_elems) + 2 * launch) / 2
    if leg == "drhs":
      return pair_ms + catalog.quantize_ms(spec, (a + 1) * lhs) + launch
    return pair_ms + catalog.quantize_ms(spec, op.rhs_elems)
  nbytes = (a + 1) * lhs + (2 * a + 1) * op.rhs_elems
  return im2col_ms + catalog.quantize_ms(spec, nbytes) + 3 * launch


def leg_ms(spec: DeviceType, op: OpShape, leg: str, precision: str) -> float:
  """Modeled ms of one call of ``op``'s ``leg`` at ``precision``: the roofline of its product over
  the tensors it moves, plus its operands' conversions — at a float precision other than the
  model's dtype half of each operand's fused conversion (each tensor feeds two of the op's legs,
  which share its converted copy), at 8 bits the quantization the leg runs
  (``quantize_leg_ms``). An embedding lookup is a gather and its table gradient a
  scatter-add: the bytes they move."""
  if op.kind == "embed":  # fwd: rows read, output written; drhs: table zeroed, dY read, rows updated
    nbytes = {"fwd": 8 * op.out_elems, "dlhs": 0, "drhs": 4 * (op.rhs_elems + 3 * op.out_elems)}[leg]
    return catalog.memory_ms(spec, nbytes) + spec.launch_us * 1e-3 * (nbytes > 0)
  m, k, n = {"fwd": (op.m, op.k, op.n), "dlhs": (op.m, op.n, op.k), "drhs": (op.k, op.m, op.n)}[leg]
  sizes = {"lhs": op.lhs_elems, "rhs": op.rhs_elems, "out": op.out_elems}
  a, b, out = (sizes[t] for t in LEG_TENSORS[leg])
  ms = catalog.gemm_roofline_ms(spec, precision, m, k, n, op.batch, (a, b, out), op.kind == "conv")
  if precision in QUANTIZED_PRECISIONS:
    return ms + quantize_leg_ms(spec, op, leg)
  stored = "fp32" if precision in FP32_LIKE else precision
  if op.activation_precision != stored:
    ms += modeled_cast(spec, f"{op.activation_precision}->{stored}").ms(a + b) / 2
  return ms


def remainder_ms(spec: DeviceType, ops) -> float:
  """Modeled ms of the rest of a step over ``ops``: ``REST_BYTES`` per element of every op's
  output (each call), by kind, but the attention scores."""
  nbytes = sum(
    REST_BYTES["conv" if o.kind == "conv" else "other"] * o.out_elems * o.calls
    for o in ops
    if o.kind != "attention_qk"
  )
  return catalog.memory_ms(spec, nbytes)


def optimizer_ms(spec: DeviceType, param_bytes: float) -> float:
  """Modeled ms of one Adam update of ``param_bytes`` of fp32 parameters: it reads p, g, m, v
  and writes p, m, v (7 passes over the parameters' bytes), plus one launch."""
  return catalog.memory_ms(spec, 7 * param_bytes) + spec.launch_us * 1e-3


def modeled_profile(base: Profile, device_type: str) -> Profile:
  """The profile of ``base``'s model on ``device_type``; see the module docstring."""
  spec = device(device_type)
  op_ms = {
    op.name: {
      leg: {
        p: leg_ms(spec, op, leg, p) for p in spec.peak_tflops if op.runs_8bit or p not in QUANTIZED_PRECISIONS
      }
      for leg in LEGS
    }
    for op in base.ops
  }
  return dataclasses.replace(
    base,
    device_type=device_type,
    source="modeled",
    op_ms=op_ms,
    optimizer_ms=optimizer_ms(spec, base.memory["param_bytes"]),
    cast={c: modeled_cast(spec, c) for c in CAST_TYPES},
    memory=dict(base.memory),
    meta={"derived_from": base.device_type, "catalog": dataclasses.asdict(spec)},
    forward_headroom={},
    quantized_in_step_ms={},
    group=None,  # a device type's profile, even when modeled from one group's
    fixed_share=0.0,  # the catalog's costs are linear in the batch
  ).with_remainder(remainder_ms(spec, base.ops))
