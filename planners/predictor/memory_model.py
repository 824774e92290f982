"""Memory model: the peak bytes of a plan's training step on one device of a group.

Per op, functions of its shape and policy: ``residual_bytes`` (what the op saves for its
backward), ``kept_bytes`` (what the compiled step really keeps for it), ``transient_bytes``
(what its backward materializes on top), ``forward_extra_bytes`` (what its forward holds at its
busiest beyond the fp32 op's). Activations are those of one micro-batch (``GroupCost.micro_batch``:
the per-device batch over the group's micro-steps, the whole batch without accumulation); the
input batch is the whole per-device batch. ``memory_bytes(group)`` is the largest of three moments:

* where the backward starts: parameters + optimizer state + gradients + batch + what every op
  keeps + the largest backward transient + the fitted ``other_bytes`` (mixed with
  ``other_bytes_16bit`` by the plan's share of 16-bit activations, ``sixteen_bit_share``);
* during each op's forward: the fp32 step's peak less its headroom there
  (``Profile.forward_headroom``; where unmeasured, the fp32 residuals of the later ops), plus
  what the plan keeps beyond fp32 for the earlier ops, plus the op's own forward extra.

and a third, after the backward (its activations freed), where the step combines the gradients
over several devices or accumulates micro-steps: parameters + optimizer state + batch +
``other_bytes`` + two gradients (the local one and the combined one; under the sharded update the
gathered parameters; with micro-steps the sum beside the last micro-step's gradient) + the
sharded update's shards.

The optimizer state is whole under the replicated update, ``1/N`` of it on each of the ``N``
devices of the sharded one (plus ``P/N`` of shards: the device's gradient, parameter and update
shards, ``P`` the parameters' bytes); with micro-steps the backward holds the sum of the
gradients beside the micro-step's. This is what the trainer's compiled step allocates, checked
against XLA's buffer assignment on 2-, 3- and 4-group simulated pools
(``tests/planners/test_memory_modes.py``; the state donated, as on GPUs).

A plan's step is one SPMD program for every device (``qsync_jax.train.branch``): a plan whose
groups run different branches (policy, per-device batch or micro-steps) compiles them all into one
``lax.switch``, and XLA gives the branches' buffers one temporary allocation, as large as the
costliest branch needs. So every device holds the costliest branch's buffers whatever branch it
runs, and receives the input padded to the plan's largest per-device batch:
``program_memory_bytes(groups)`` is, for each group, the largest ``memory_bytes`` of any branch
evaluated with that group's profile (its device type), the input at the largest batch (checked against XLA's
buffer assignment of mixed 2- and 3-group simulated pools in ``tests/planners/test_memory_modes.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from planners.ops import OpShape
from planners.profile import GroupCost, Profile
from qsync_jax.ops.qdot import FLOAT_DTYPES
from qsync_jax.precision import QUANTIZED_PRECISIONS, OpPolicy


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
  values (``qsync_jax.ops.qdot.leg_dot`` on XLA:CPU)."""
  return device_type == "cpu"


def dequantizes_fp8_residuals(device_type: str) -> bool:
  """Whether the compiled step on ``device_type`` keeps an fp8 forward's residuals as fp32: XLA:CPU
  has no fp8 arithmetic, runs fp8 GEMMs on fp32 copies and keeps a saved fp8 residual
  dequantized (an int8 residual stays 1-byte there)."""
  return device_type == "cpu"


def kept_bytes(
  op: OpShape,
  op_policy: OpPolicy | None,
  upcast_16bit: bool = False,
  lhs_differentiated: bool = True,
  dequantized_fp8: bool = False,
) -> int:
  """Bytes the compiled training step keeps live for one op's backward pass.

  ``residual_bytes`` (what the op's ``custom_vjp`` saves) with what XLA does with it in a step:

  * ``upcast_16bit`` (``upcasts_16bit_products``): a 16-bit residual read by fp32 products is
    kept as fp32 (XLA fuses the conversion into its producer); likewise an int8/fp8 activation
    residual read by a float drhs leg is kept dequantized.
  * ``dequantized_fp8`` (``dequantizes_fp8_residuals``): an fp8 forward's residuals are kept
    as fp32 — the activation (read by drhs) and, when the dlhs leg runs, the right operand.
  * The first op's dlhs (``lhs_differentiated=False``: the model input) is never computed.
  * Stochastic rounding keeps nothing extra: its noise is a hash of each element's index
    (``pallas_kernels.quantize.noise``), computed where the rounding reads it.
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
    # a float drhs leg reads the 8-bit activation residual as fp32, dequantized in the forward
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
  8-bit precision, 2 bytes per element for a bf16/fp16 leg, 4 for an fp32 one."""
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

  A float op: what it keeps beyond the fp32 op (``kept_bytes`` minus the fp32 residual). An
  int8/fp8 forward: the larger of its two busiest moments (``_busiest_forward``).
  """
  kept = kept_bytes(op, op_policy, upcast_16bit, lhs_differentiated, dequantized_fp8)
  delta = kept - residual_bytes(op, None)
  if op_policy is None or op_policy.fwd not in QUANTIZED_PRECISIONS:
    return int(delta)
  return _busiest_forward(op, op_policy, upcast_16bit, dequantized_fp8, delta)


def _busiest_forward(
  op: OpShape, op_policy: OpPolicy, upcast_16bit: bool, dequantized_fp8: bool, kept: int
) -> int:
  """An int8/fp8 forward's busiest bytes, the larger of two moments: its GEMM (an im2col conv's
  fp32 patches and the GEMM operands, beside ``kept`` or, if larger, the activation residual
  where XLA computes it dequantized in the forward, ``_dequantized_in_forward``); and on
  XLA:CPU (``upcast_16bit``) an im2col conv's stacking of its patches beside as many fp32
  elements of strided input slices."""
  act = saved_activation_elems(op, op_policy) * op.calls
  dequantized = 4 * act * _dequantized_in_forward(op_policy, upcast_16bit, dequantized_fp8)
  gemm = _patches_and_operands(op, op_policy, dequantized_fp8) + max(kept, dequantized)
  stacking = 2 * 4 * act if upcast_16bit and op.kind == "conv" else 0
  return int(max(gemm, stacking))


def _dequantized_in_forward(op_policy: OpPolicy, upcast_16bit: bool, dequantized_fp8: bool) -> bool:
  """Whether XLA computes an int8/fp8 forward's activation residual as fp32 in the forward: an
  fp8 one where fp8 GEMMs run on fp32 copies (``dequantized_fp8``), and on XLA:CPU
  (``upcast_16bit``) one the drhs leg reads in another precision."""
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


class OpMemory(NamedTuple):
  """Bytes of one op of a group at its batch: ``kept_bytes``, ``transient_bytes``, what it would
  keep as an fp32 op, the excess of kept over that, and ``forward_extra_bytes``."""

  kept: int
  transient: int
  fp32_kept: int
  forward_delta: int
  forward_extra: int


def op_memory(group: GroupCost, op_index: int) -> OpMemory:
  """The ``OpMemory`` of one op of ``group`` at its micro-batch (its batch without accumulation)."""
  prof = group.profile
  op = prof.ops[op_index].scaled(group.micro_batch / prof.batch_per_device)
  pol = group.op_policies.get(op.name)
  upcast, fp8 = upcasts_16bit_products(prof.device_type), dequantizes_fp8_residuals(prof.device_type)
  kept = kept_bytes(op, pol, upcast, op_index > 0, fp8)
  fp32_kept = residual_bytes(op, None)
  return OpMemory(
    kept,
    transient_bytes(op, pol, upcast, fp8),
    fp32_kept,
    kept - fp32_kept,
    forward_extra_bytes(op, pol, upcast, op_index > 0, fp8),
  )


SIXTEEN_BIT = ("bf16", "fp16")


def sixteen_bit_share(profile: Profile, op_policies: Mapping[str, OpPolicy | None]) -> float:
  """The share of the step's activations that bf16/fp16 ops produce: the output elements of the
  ops whose forward runs at a 16-bit float, over those of all ops (0 without outputs)."""
  total = sum(op.out_elems * op.calls for op in profile.ops)
  sixteen = sum(
    op.out_elems * op.calls
    for op in profile.ops
    if (pol := op_policies.get(op.name)) is not None and pol.fwd in SIXTEEN_BIT
  )
  return sixteen / total if total > 0 else 0.0


def other_bytes(profile: Profile, op_policies: Mapping[str, OpPolicy | None]) -> float:
  """The fitted ``other_bytes`` of the profile for a plan: mixed with ``other_bytes_16bit``
  (where fitted) by the plan's ``sixteen_bit_share``."""
  mem = profile.memory
  if mem.get("other_bytes_16bit") is None:
    return mem["other_bytes"]
  share = sixteen_bit_share(profile, op_policies)
  return (1 - share) * mem["other_bytes"] + share * mem["other_bytes_16bit"]


def memory_bytes(
  group: GroupCost,
  memory_fn=None,
  optimizer_shards: int = 1,
  devices: int = 1,
  input_batch: int | None = None,
) -> int:
  """Peak bytes on one device of ``group`` running its own branch alone; see the module
  docstring. ``memory_fn`` defaults to ``op_memory`` (a caller evaluating many plans may pass a
  memoized one); ``optimizer_shards``: the number of devices the optimizer state is sharded over
  (a plan's ``optimizer_update: "sharded"``: each holds ``opt_state_bytes / N``); ``devices``: the
  devices the step combines gradients over (those that run); ``input_batch``: the rows of the
  input batch the device receives (default the group's per-device batch; in a plan, the largest
  per-device batch: ``program_memory_bytes``)."""
  memory_fn = memory_fn or op_memory
  prof = group.profile
  scale = group.micro_batch / prof.batch_per_device  # the activations': one micro-batch's
  mem = prof.memory
  terms = [memory_fn(group, i) for i in range(len(prof.ops))]
  params = mem["param_bytes"]
  accumulating = group.micro_steps > 1
  common = (
    params
    + mem["opt_state_bytes"] / optimizer_shards
    + (input_batch or group.batch_per_device) / prof.batch_per_device * mem["batch_bytes"]
    + scale * other_bytes(prof, group.op_policies)
  )
  base = common + params * (2 if accumulating else 1)  # the gradient, and the micro-steps' sum beside it
  # after the backward (its activations freed): the local gradient beside the combined one (or the
  # sum beside the last micro-step's), and the sharded update's shards
  combined = devices > 1 or optimizer_shards > 1 or accumulating
  update = (
    common + params * (2 if combined else 1) + (params / optimizer_shards if optimizer_shards > 1 else 0)
  )
  backward = base + sum(t.kept for t in terms) + max((t.transient for t in terms), default=0)
  fp32_peak = base + sum(t.fp32_kept for t in terms)
  forward, before, later = 0.0, 0, sum(t.fp32_kept for t in terms)
  for op, t in zip(prof.ops, terms):
    later -= t.fp32_kept
    # unmeasured: the fp32 step holds all but the residuals of the ops still to run
    headroom = scale * prof.forward_headroom[op.name] if op.name in prof.forward_headroom else later
    forward = max(forward, fp32_peak - headroom + before + t.forward_extra)
    before += t.forward_delta
  return int(max(backward, forward, update))


def program_memory_bytes(
  groups: Sequence[GroupCost], memory_fn=None, optimizer_shards: int = 1, devices: int = 1
) -> dict[str, int]:
  """Peak bytes on one device of each group of a plan (those with a batch), the plan's step being
  one program with every group's branch (module docstring): for group ``g``, the largest
  ``memory_bytes`` of any group's branch (its policies, batch and micro-steps) evaluated with
  ``g``'s profile, the input padded to the largest per-device batch. Equal to ``memory_bytes``
  for a plan whose groups run one branch at one batch."""
  running = [g for g in groups if g.batch_per_device > 0]
  rows = max((g.batch_per_device for g in running), default=0)
  layout = {"optimizer_shards": optimizer_shards, "devices": devices, "input_batch": rows}
  return {
    g.name: max(
      memory_bytes(dataclasses.replace(h, name=g.name, profile=g.profile), memory_fn, **layout)
      for h in running
    )
    for g in running
  }
