"""What each gradient sync of ``qsync_jax.sync`` sends and computes, per gradient element.

The step's gradient is ``E`` fp32 elements per device (the parameters'). A sync moves a payload
over the links and runs passes over device memory before and after it, as the trainer runs it:

* ``fp32`` — the trainer's default reduction: one ``psum`` per leaf, packed by XLA's combiner
  into buckets that start as the backward produces them (``planners.predictor.graph``); 4 bytes
  an element on the wire, no pass of its own.
* ``bf16`` / ``fp16`` (``qsync_jax.sync.allreduce``, ``accumulate="fp32"``) — after the whole
  backward: the leaves cast and concatenated into one buffer (reads 4, writes 2 bytes an
  element), an ``all_to_all`` of it (a reduce-scatter's bytes), the ``n`` received chunks summed
  in fp32 (reads 2), an ``all_gather`` of the summed chunk, and the result split and cast back
  (reads 2, writes 4): 2 bytes an element on the wire, 14 bytes of passes.
* ``global_qsgd`` (``qsync_jax.sync.global_qsgd``) — after the whole backward: every leaf's
  absolute maximum (reads 4), one ``pmax`` of the maxima (a collective of a few bytes: its
  latency), the dithering to integers (reads 4, writes the payload's width ``w``: 1 byte while
  ``n ≤ 127``), an integer all-reduce packed by the combiner like the fp32 one, and the sum
  scaled back (reads ``w``, writes 4): ``w`` bytes an element on the wire, ``12 + 2w`` bytes of
  passes.

Those are the bytes the passes must move. The trainer's step takes longer than they do: on one H200
each sync's step measured longer than the fp32 step by 2.2–3.2 times what those bytes take
(``MEASURED_PASS_BYTES``). The replay charges the measured figure: the passes of an element cost
``MEASURED_PASS_BYTES[sync]`` bytes at the device's catalog bandwidth (``planners.catalog.memory_ms``),
split before / after the collective as the counted bytes are, plus one launch a pass. The
collectives' times stay **modeled** (``planners.predictor.collectives``).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from planners import catalog
from planners.predictor.collectives import allreduce_ms, reduce_scatter_ms
from qsync_jax.devices import device
from qsync_jax.errors import PlanError
from qsync_jax.sync.global_qsgd import INT_PAYLOADS, payload_for

PRICED_SYNCS = ("fp32", "bf16", "fp16", "global_qsgd")
"""The gradient syncs the planner prices (``qsync plan --sync``); the others build their own step
(``selsync``, ``qsdp``: ``qsync_jax.sync``), which the replay does not model."""

PASSES = {"bf16": (6, 8), "fp16": (6, 8)}
"""``sync: (bytes an element before the collective, after it)`` of the cast syncs' passes (the
module docstring); ``global_qsgd``'s depend on its payload's width (``pass_bytes``)."""


MEASURED_PASS_BYTES = {"bf16": 31.1, "fp16": 35.4, "global_qsgd": 44.1}
"""``sync: bytes an element`` the passes cost as measured: the trainer's step under the sync less its
step under fp32 on one device, less the passes' launches, over the parameters' elements and at the
catalog bandwidth of the device (``planners.catalog.memory_ms``). Measured on one H200 (jax 0.11.2;
``python -m benchmarks.multigpu --cases sync --d-model 1024 --heads 16 --layers 8``: a GPT of
101.6 M parameters, bf16 policy, 8 sequences of 256; rows ``sync/*`` ``ms_over_fp32_measured`` of
``benchmarks/results/multigpu.jsonl``): +0.75, +0.85 and +1.06 ms over the fp32 step's 8.47 (IQR
0.17–0.27 ms). On one device the collectives reduce to nothing, so the difference is the passes and
whatever XLA does around them (the concatenation, the split, gradients written out before the
update); which of these make the excess over the counted bytes is not measured. bf16 and fp16 run
the same code: their difference is within the steps' spread. Global-QSGD was measured at its int8
payload (``w = 1``)."""


def check_sync(sync: str) -> None:
  """``PlanError`` for a sync the replay does not price, with the fix."""
  if sync not in PRICED_SYNCS:
    raise PlanError(
      f"sync {sync!r} is not one the planner prices (it prices {list(PRICED_SYNCS)}; selsync and qsdp build "
      "their own step, whose syncs and memory the replay does not model). Fix: plan with one of those "
      f"(`qsync plan --sync ...`), or train with --sync {sync} under a plan without a `sync` of its own."
    )


def wire_bytes(sync: str, n_devices: int) -> int:
  """Bytes one gradient element takes on the wire under ``sync`` among ``n_devices``."""
  check_sync(sync)
  if sync == "global_qsgd":
    name, _ = payload_for(max(n_devices, 1))
    return jnp.dtype(INT_PAYLOADS[name][0]).itemsize
  return {"fp32": 4, "bf16": 2, "fp16": 2}[sync]


def pass_bytes(sync: str, n_devices: int) -> tuple[int, int]:
  """``(before, after)``: bytes of device memory one gradient element's passes read and write
  before the collective and after it (module docstring)."""
  if sync == "fp32":
    return 0, 0
  if sync == "global_qsgd":
    w = wire_bytes(sync, n_devices)
    return 4 + 4 + w, w + 4
  return PASSES[sync]


def priced_pass_bytes(sync: str, n_devices: int) -> tuple[float, float]:
  """``(before, after)``: the bytes an element the replay charges ``sync``'s passes —
  ``pass_bytes`` scaled so that at the width it was measured at they sum to
  ``MEASURED_PASS_BYTES[sync]`` (a wider Global-QSGD payload scales alike)."""
  before, after = pass_bytes(sync, n_devices)
  if not before:
    return 0.0, 0.0
  counted = sum(pass_bytes(sync, 1))  # the width it was measured at: int8 (one device)
  scale = MEASURED_PASS_BYTES[sync] / counted
  return before * scale, after * scale


def pass_ms(sync: str, device_type: str, elements: float, n_devices: int) -> tuple[float, float]:
  """``(before, after)`` ms of ``sync``'s passes over ``elements`` gradient elements on one
  device of ``device_type`` (``priced_pass_bytes`` at the catalog bandwidth, one launch a pass):
  0 for ``fp32``."""
  before, after = priced_pass_bytes(sync, n_devices)
  if not before:
    return 0.0, 0.0
  spec = device(device_type)
  launches = 3 if sync == "global_qsgd" else 2  # absmax, dither | cast-concat, fp32 sum
  return (
    catalog.memory_ms(spec, before * elements) + launches * spec.launch_us * 1e-3,
    catalog.memory_ms(spec, after * elements) + spec.launch_us * 1e-3,
  )


def whole_buffer_ms(
  sync: str, elements: float, n_devices: int, link_gbps: float, latency_us: float, bucket_bytes: int
) -> float:
  """ms of ``sync``'s collectives over the whole gradient (``elements`` per device) among
  ``n_devices`` on a ring of ``link_gbps``: the cast syncs an ``all_to_all`` and an
  ``all_gather`` of the payload (each a reduce-scatter's bytes); ``global_qsgd`` a ``pmax``
  (latency) and the integer all-reduce in buckets of at most ``bucket_bytes`` (XLA's combiner)."""
  nbytes = elements * wire_bytes(sync, n_devices)
  if n_devices <= 1:
    return 0.0
  if sync == "global_qsgd":
    k = max(1, math.ceil(nbytes / bucket_bytes))
    return latency_us * 1e-3 + k * allreduce_ms(nbytes / k, n_devices, link_gbps, latency_us)
  return 2 * reduce_scatter_ms(nbytes, n_devices, link_gbps, latency_us)
