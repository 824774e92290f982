"""How far the device catalog's roofline is from a measured device: per op and per step.

Devices that are not at hand are costed from the catalog (``planners.catalog``,
``planners.predictor.modeled``; ``docs/catalog.md``). This benchmark measures, on the local device,
the models the hybrid-pool study plans (``benchmarks.common.zoo.HYBRID_MODELS``: ResNet-50 at
224², a BERT-base-sized transformer at sequence 128 and 512, a GPT-2-medium-sized LM at sequence
1024) under the uniform ``fp32`` and ``bf16`` policies, and compares with the catalog-modeled
profile of the same ops:

* **per step**: the training step as the trainer compiles it, dispatched back to back
  (``timing.PIPELINED_CLOCK``, median of windows), against the replay of the modeled profile;
* **per op, inside the step**: the step traced (``timing.instruction_times``: on a GPU every kernel on
  the device clock, on a CPU XLA's per-instruction events) and charged to the ops by their JAX
  name stacks (``planners.profiler.step_hlo.per_op_ms``): per op kind, the forward and the gradient legs
  against the modeled legs (``planners.predictor.modeled.leg_ms``), and the rest of the step (elementwise
  work, norms, the loss, the optimizer) against the modeled remainder and optimizer;
* **per op leg alone** (``--standalone``): every distinct canonical GEMM of the model's ops —
  forward, dlhs and drhs — timed alone at each precision the device runs (``fp32`` at full
  precision as the runtime's fp32 legs, ``tf32`` as XLA runs a float32 product by default,
  ``bf16``, ``int8`` with int32 accumulation, ``fp8`` e4m3; operands stored at the precision,
  contraction-major), and the convolutions as the real convolution at ``fp32``/``tf32``/``bf16``,
  against the roofline of the product (``catalog.gemm_roofline_ms``).

``--save-measured FILE`` keeps the raw timings and op shapes (after every model), so that the
catalog can be re-scored offline (``--measured FILE…``, on any machine) as it changes. Rows go
to ``benchmarks/results/roofline.jsonl``; a table is printed last.

  python -m benchmarks.diagnosis.roofline --save-measured $OUT/roofline_h100.json    # on the GPU
  python -m benchmarks.diagnosis.roofline --measured benchmarks/results/roofline/h100_steps.json
  python -m benchmarks.diagnosis.roofline --tiny                                     # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common.op_profile import base_profile, build, model_ops
from benchmarks.common.result_rows import result_row, results_path, save_rows
from benchmarks.common.zoo import HYBRID_MODELS
from planners import catalog
from planners.ops import OpShape
from planners.predictor.modeled import LEG_TENSORS, modeled_profile
from planners.predictor.replay import predict
from planners.profiler import timing
from planners.profiler.step_hlo import per_op_ms
from qsync_jax import devices
from qsync_jax.cluster import ClusterSpec
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy

RESULTS = results_path("roofline")

TINY = ("resnet50", "bert_s128", "gpt_350m")
"""``--tiny``: these models' families at their CPU size (``benchmarks.common.zoo``), batch 2."""
POLICIES = ("fp32", "bf16")
"""The uniform policies whose steps are measured and modeled."""

LEG_GEMM = {
  "fwd": lambda m, k, n: (m, k, n),
  "dlhs": lambda m, k, n: (m, n, k),
  "drhs": lambda m, k, n: (k, m, n),
}
"""A leg's product ``(m, k, n)`` from the op's forward ``(m, k, n)`` (as ``modeled_profile``)."""

LEGS = ("fwd", "dlhs", "drhs")


# -- timing -----------------------------------------------------------------------------------


def _kernel_ms(fn, args, repeats: int) -> float:
  """ms per call of ``fn(*args)``: on a GPU its kernels' time from a profiler trace (a standalone
  call's wall time is mostly dispatch for kernels of tens of µs, which a step does not pay), else
  the median wall time of ``repeats`` calls."""
  clock = timing.DEVICE_CLOCK if jax.devices()[0].platform == "gpu" else "wall"
  return timing.timed_ms(lambda: fn(*args), 10 * max(1, repeats), clock=clock)[0]


GEMM_PRECISIONS = ("fp32", "tf32", "bf16", "int8", "fp8")
LAX_PRECISION = {"fp32": jax.lax.Precision.HIGHEST, "tf32": jax.lax.Precision.DEFAULT}
"""``fp32`` as the runtime's fp32 legs run it (full precision); ``tf32`` as XLA runs a float32
product by default (TF32 tensor cores on GPUs that have them)."""


def _operands(key, batch, m, k, n, precision):
  """``lhs [batch, m, k]`` and ``rhs [batch, n, k]`` (contraction-major) stored at ``precision``."""
  k1, k2 = jax.random.split(key)
  lhs = jax.random.normal(k1, (batch, m, k), jnp.float32)
  rhs = jax.random.normal(k2, (batch, n, k), jnp.float32)
  if precision == "int8":
    return (jnp.clip(lhs * 32, -127, 127).astype(jnp.int8), jnp.clip(rhs * 32, -127, 127).astype(jnp.int8))
  dtype = {"fp32": jnp.float32, "tf32": jnp.float32, "bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}[
    precision
  ]
  return lhs.astype(dtype), rhs.astype(dtype)


def gemm_key(op: OpShape, leg: str, precision: str) -> str:
  m, k, n = LEG_GEMM[leg](op.m, op.k, op.n)
  return f"{op.batch}x{m}x{k}x{n}:{precision}"


def conv_key(op: OpShape, leg: str, precision: str) -> str:
  return f"{'x'.join(map(str, op.lhs_shape))}*{'x'.join(map(str, op.rhs_shape))}:{leg}:{precision}"


def gemm_ms(batch, m, k, n, precision, repeats) -> float:
  out = {
    "int8": jnp.int32,
    "fp8": jnp.float32,
    "fp32": jnp.float32,
    "tf32": jnp.float32,
    "bf16": jnp.bfloat16,
  }
  dims = (((2,), (2,)), ((0,), (0,)))
  prec = LAX_PRECISION.get(precision)
  f = jax.jit(
    lambda a, b: jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=out[precision])
  )
  return _kernel_ms(f, _operands(jax.random.key(0), batch, m, k, n, precision), repeats)


def conv_leg_ms(op: OpShape, leg: str, precision: str, repeats: int) -> float:
  """The real convolution of ``op`` (SAME padding, stride from its shapes), one leg."""
  n_img, h, w, c_in = op.lhs_shape
  kh, kw, _, c_out = op.rhs_shape
  spatial_out = op.m // n_img
  stride = max(1, round((h * w / spatial_out) ** 0.5))
  dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
  x = jax.random.normal(jax.random.key(1), op.lhs_shape, dtype)
  kernel = jax.random.normal(jax.random.key(2), op.rhs_shape, dtype)

  def conv(x, kernel):
    return jax.lax.conv_general_dilated(
      x,
      kernel,
      (stride, stride),
      "SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
      precision=LAX_PRECISION.get(precision),
    )

  y = jax.eval_shape(conv, x, kernel)
  g = jax.random.normal(jax.random.key(3), y.shape, dtype)
  if leg == "fwd":
    return _kernel_ms(jax.jit(conv), (x, kernel), repeats)
  if leg == "dlhs":
    f = jax.jit(lambda kernel, g: jax.linear_transpose(lambda x: conv(x, kernel), x)(g)[0])
    return _kernel_ms(f, (kernel, g), repeats)
  f = jax.jit(lambda x, g: jax.linear_transpose(lambda kernel: conv(x, kernel), kernel)(g)[0])
  return _kernel_ms(f, (x, g), repeats)


def standalone_legs(ops: list[OpShape], device: str, repeats: int) -> tuple[dict, dict]:
  """``(gemm_ms, conv_ms)``: every distinct GEMM leg at each precision the device runs, and every
  convolution leg at fp32/tf32/bf16, each timed alone (module docstring)."""
  precisions = [p for p in GEMM_PRECISIONS if p in devices.device(device).peak_tflops or device == "cpu"]
  gemms: dict[str, float] = {}
  convs: dict[str, float] = {}
  for op in ops:
    if op.kind == "embed":  # a lookup (gather), not a product: no product to time alone
      continue
    for leg in LEGS:
      if op.kind == "conv":  # the step runs the convolution itself at 16/32 bits
        for p in ("fp32", "tf32", "bf16"):
          key = conv_key(op, leg, p)
          if key not in convs:
            convs[key] = conv_leg_ms(op, leg, p, repeats)
        continue
      for p in precisions:
        key = gemm_key(op, leg, p)
        if key not in gemms:
          gemms[key] = gemm_ms(op.batch, *LEG_GEMM[leg](op.m, op.k, op.n), p, repeats)
  return gemms, convs


def measure_model(
  name: str, tiny: bool, say, step_windows: int = 3, trace_steps: int = 3, standalone_repeats: int = 0
) -> dict:
  """Raw timings of one model on the local device, per policy: the step (``step_windows``
  windows of ``timing.PIPELINE_WINDOW`` steps), its kernels charged to ops and the rest
  (``in_step_ms``, a trace of ``trace_steps`` steps) and their total (``step_kernel_ms``); with
  ``standalone_repeats``, every GEMM and convolution leg alone (``standalone_legs``)."""
  task, data, batch = build(name, tiny)
  ops, param_bytes = model_ops(task, data)
  device = devices.device_type_of(jax.devices()[0])
  t0 = time.perf_counter()
  gemms, convs = standalone_legs(ops, device, standalone_repeats) if standalone_repeats else ({}, {})
  if standalone_repeats:
    say(
      f"{name}: {len(gemms)} GEMMs, {len(convs)} convolution legs timed in {time.perf_counter() - t0:.0f} s"
    )
  step_ms, in_step, kernel_ms = {}, {}, {}
  clock = timing.default_step_clock()
  for policy in POLICIES if step_windows else ():
    t0 = time.perf_counter()
    run, _ = timing.compiled_train_step(task, PrecisionPolicy.uniform(policy), data)
    step_ms[policy] = timing.timed_ms(run, step_windows * timing.PIPELINE_WINDOW, clock=clock)[0]
    del run  # its state, before the traced step builds its own
    hlo, instruction_ms = timing.instruction_times(task, PrecisionPolicy.uniform(policy), data, trace_steps)
    in_step[policy] = per_op_ms(hlo, instruction_ms, ops)
    kernel_ms[policy] = sum(instruction_ms.values())
    say(
      f"{name}: {policy} step {step_ms[policy]:.2f} ms, traced kernels {kernel_ms[policy]:.2f} ms "
      f"({time.perf_counter() - t0:.0f} s)"
    )
  return {
    "model": name,
    "device_type": device,
    "device_kind": jax.devices()[0].device_kind,
    "batch_per_device": batch,
    "param_bytes": param_bytes,
    "ops": [o.to_json() for o in ops],
    "gemm_ms": gemms,
    "conv_ms": convs,
    "step_ms": step_ms,
    "in_step_ms": in_step,
    "step_kernel_ms": kernel_ms,
  }


# -- scoring ----------------------------------------------------------------------------------


def modeled_step_ms(measured: dict, policy: str) -> float:
  device = measured["device_type"]
  modeled = modeled_profile(base_profile(measured), device)
  cluster = ClusterSpec.uniform(device, 1, measured["batch_per_device"], memory_gb=1e6)
  return predict(cluster, {device: modeled}, Plan.uniform(cluster, policy)).step_ms


def op_leg_times(measured: dict, spec: devices.DeviceType) -> dict[str, list[tuple[float, float]]]:
  """``{precision: [(measured ms, roofline ms)]}`` over every op leg timed alone (an op applied
  several times counts as often), against the roofline of the leg's product alone."""
  out: dict[str, list[tuple[float, float]]] = {}
  for o in measured["ops"]:
    op = OpShape.from_json(o)
    sizes = {"lhs": op.lhs_elems, "rhs": op.rhs_elems, "out": op.out_elems}
    for leg in LEGS:
      m, k, n = LEG_GEMM[leg](op.m, op.k, op.n)
      elems = tuple(sizes[t] for t in LEG_TENSORS[leg])
      for p in spec.peak_tflops:
        key = conv_key(op, leg, p) if op.kind == "conv" else gemm_key(op, leg, p)
        ms = (measured["conv_ms"] if op.kind == "conv" else measured["gemm_ms"]).get(key)
        if ms is not None:
          roofline = catalog.gemm_roofline_ms(spec, p, m, k, n, op.batch, elems, op.kind == "conv")
          out.setdefault(p, []).extend([(ms, roofline)] * op.calls)
  return out


def in_step_times(measured: dict, policy: str) -> dict[str, dict[str, tuple[float, float]]]:
  """``{op kind: {"fwd" | "bwd": (measured ms, modeled ms)}, "rest": {"all": (…)}}`` of one step:
  the traced time charged to the ops of each kind against their modeled legs (the first op has
  no dlhs), and the rest of the step against the modeled remainder plus optimizer."""
  modeled = modeled_profile(base_profile(measured), measured["device_type"])
  traced = measured["in_step_ms"][policy]
  out: dict[str, dict[str, tuple[float, float]]] = {}
  for i, op in enumerate(modeled.ops):
    legs = {leg: op.calls * modeled.leg_ms(op.name, leg, policy) for leg in LEGS}
    model = {"fwd": legs["fwd"], "bwd": legs["drhs"] + (legs["dlhs"] if i else 0.0)}
    row = out.setdefault(op.kind, {"fwd": (0.0, 0.0), "bwd": (0.0, 0.0)})
    for part, (a, b) in row.items():
      row[part] = (a + traced.get(op.name, {}).get(part, 0.0), b + model[part])
  rest = sum(traced.get("rest", {}).values())
  out["rest"] = {"all": (rest, sum(modeled.remainder_ms.values()) + modeled.optimizer_ms)}
  return out


def score(measured: dict) -> tuple[list[dict], list[str]]:
  """Rows and table lines: per precision, the standalone op legs' measured / roofline ratio (median,
  range) and the error of their summed time; per policy, the in-step time of each op kind and
  of the rest against the model's; per policy, the measured and modeled step and the error."""
  spec = devices.device(measured["device_type"])
  name, device = measured["model"], measured["device_kind"]
  rows, lines = [], []
  for p, pairs in op_leg_times(measured, spec).items():
    meas, model = np.asarray(pairs).T
    r = meas / model
    total_err = float(model.sum() / meas.sum() - 1)
    rows.append(
      result_row(
        "roofline",
        f"{name} op legs {p}",
        "measured_over_roofline",
        float(np.median(r)),
        None,
        device,
        ratio=float(np.median(r)),
        spread=[float(r.min()), float(r.max())],
        legs=len(r),
        summed_error=total_err,
      )
    )
    lines.append(
      f"{name:10s} op legs {p:5s}: measured/roofline median {np.median(r):5.2f} "
      f"(min {r.min():.2f}, max {r.max():.2f}) over {len(r):3d} legs; summed {100 * total_err:+6.1f} %"
    )
  for policy in measured.get("in_step_ms", {}):
    for kind, parts in in_step_times(measured, policy).items():
      meas = sum(a for a, _ in parts.values())
      model = sum(b for _, b in parts.values())
      err = (model - meas) / meas if meas > 0 else float("nan")
      rows.append(
        result_row(
          "roofline",
          f"{name} in-step {policy} {kind}",
          "step_share_ms",
          meas,
          model,
          device,
          modeled_ms=model,
          error=err,
          **{part: list(v) for part, v in parts.items()},
        )
      )
      detail = [", ".join(f"{part} {v[j]:.2f}" for part, v in parts.items() if part != "all") for j in (0, 1)]
      meas_s, model_s = (f" ({d})" if d else "" for d in detail)
      lines.append(
        f"{name:10s} in step {policy:4s} {kind:14s}: measured {meas:8.2f} ms{meas_s}  "
        f"modeled {model:8.2f} ms{model_s}  error {100 * err:+7.1f} %"
      )
  for policy, ms in measured["step_ms"].items():
    modeled = modeled_step_ms(measured, policy)
    err = (modeled - ms) / ms
    kernels = measured.get("step_kernel_ms", {}).get(policy)
    rows.append(
      result_row(
        "roofline",
        f"{name} step {policy}",
        "step_ms",
        ms,
        modeled,
        device,
        modeled_ms=modeled,
        error=err,
        **({"kernel_ms": kernels} if kernels is not None else {}),
      )
    )
    busy = f"  (traced kernels {kernels:8.2f} ms)" if kernels is not None else ""
    lines.append(
      f"{name:10s} step {policy:5s}: measured {ms:9.2f} ms  modeled {modeled:9.2f} ms  "
      f"error {100 * err:+7.1f} %{busy}"
    )
  return rows, lines


def merged(runs: list[dict]) -> list[dict]:
  """One entry per model: the timings of later runs of a model added to (and replacing) the earlier."""
  keys = ("gemm_ms", "conv_ms", "step_ms", "in_step_ms", "step_kernel_ms")
  out: dict[str, dict] = {}
  for r in runs:
    entry = out.setdefault(r["model"], {**r, **{key: {} for key in keys}})
    for key in keys:
      entry[key].update(r.get(key, {}))
  return list(out.values())


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.diagnosis.roofline", description=__doc__.split("\n\n")[0]
  )
  ap.add_argument("--models", nargs="+", default=list(HYBRID_MODELS), choices=list(HYBRID_MODELS))
  ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny models, batch 2")
  ap.add_argument("--step-windows", type=int, default=3, help="windows of 10 steps per step time (median)")
  ap.add_argument("--trace-steps", type=int, default=3, help="steps traced for the in-step op times")
  ap.add_argument(
    "--standalone",
    type=int,
    default=0,
    metavar="N",
    help="also time every op leg alone, N windows of 10 calls",
  )
  ap.add_argument(
    "--step-models",
    nargs="*",
    default=list(HYBRID_MODELS),
    help="models whose steps are measured (default all)",
  )
  ap.add_argument("--save-measured", help="write the raw timings (JSON) here")
  ap.add_argument("--measured", nargs="+", help="score saved raw timings instead of measuring")
  ap.add_argument("--results", default=RESULTS)
  ap.add_argument("--no-save", action="store_true")
  args = ap.parse_args(argv)

  def say(msg):
    print(f"# {msg}", flush=True)

  if args.measured:
    runs = merged([m for path in args.measured for m in json.load(open(path))])
  else:
    runs, t0 = [], time.perf_counter()
    for m in [m for m in args.models if not args.tiny or m in TINY]:
      windows = args.step_windows if m in args.step_models else 0
      runs.append(measure_model(m, args.tiny, say, windows, args.trace_steps, args.standalone))
      if args.save_measured:  # after every model, so that a run cut short keeps what it measured
        with open(args.save_measured, "w") as f:
          json.dump(runs, f)
        say(f"raw timings so far in {args.save_measured} ({time.perf_counter() - t0:.0f} s in all)")
  rows, lines = [], []
  for measured in runs:
    r, ls = score(measured)
    rows += r
    lines += ls
  save_rows(args.results, rows, not args.no_save)
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
