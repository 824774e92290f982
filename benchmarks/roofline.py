"""How far the device catalog's roofline is from a measured device: per op leg and per step.

Devices that are not at hand are costed from the catalog (``planners.catalog``: datasheet peak
per precision, memory bandwidth, a derate). This benchmark measures, on the local device, the
models the hybrid-pool study plans (``MODELS``: ResNet-50 at 224², a BERT-base-sized
transformer at sequence 128 and 512, a GPT-2-medium-sized LM at sequence 1024) and compares:

* **per op leg**: every distinct canonical GEMM of the model's quantizable ops (``planners.ops``)
  — forward, dlhs and drhs — timed alone at each precision the device runs (``fp32`` as XLA
  runs a float32 product by default, operands stored at ``bf16``, ``int8`` with int32
  accumulation, ``fp8`` e4m3 with fp32 accumulation; both operands contraction-major), and the
  convolutions also as the real convolution at ``fp32``/``bf16`` (forward and the two
  gradients, as ``jax.linear_transpose`` of the forward); against
  ``catalog.gemm_roofline_ms``;
* **per step**: the training step under the uniform ``fp32`` and ``bf16`` policies (dispatched
  back to back, median) against the replay of the model's catalog-modeled profile.

``--save-measured FILE`` keeps the raw timings and op shapes, so that the catalog can be
re-scored offline (``--measured FILE``, on any machine) as it changes. Rows go to
``benchmarks/results/roofline.jsonl``; a table is printed last.

  python -m benchmarks.roofline --save-measured $OUT/roofline_h100.json       # on the GPU
  python -m benchmarks.roofline --measured benchmarks/results/roofline_h100.json  # offline
  python -m benchmarks.roofline --tiny                                        # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.result_rows import result_row, save_rows
from examples.tasks.language import synthetic_lm
from examples.tasks.vision import resnet_synthetic
from planners import catalog, step
from planners.derived_profiles import modeled_profile
from planners.ops import OpShape, collect_ops
from planners.profiler import Profile
from planners.replay import predict
from qsync_jax.cluster import ClusterSpec
from qsync_jax.plan import Plan

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "roofline.jsonl")

MODELS = {
  "resnet50": (
    resnet_synthetic,
    dict(
      image_size=224,
      stage_sizes=(3, 4, 6, 3),
      widths=(64, 128, 256, 512),
      num_classes=1000,
      imagenet_stem=True,
      block="bottleneck",
    ),
    32,
  ),
  "bert_s128": (
    synthetic_lm,
    dict(vocab_size=30522, d_model=768, num_heads=12, num_layers=12, seq_len=128),
    32,
  ),
  "bert_s512": (
    synthetic_lm,
    dict(vocab_size=30522, d_model=768, num_heads=12, num_layers=12, seq_len=512),
    8,
  ),
  "gpt_350m": (
    synthetic_lm,
    dict(vocab_size=50257, d_model=1024, num_heads=16, num_layers=24, seq_len=1024),
    8,
  ),
}
"""name → (task factory, config, per-device batch)."""

TINY = {
  "resnet50": dict(image_size=16, stage_sizes=(1, 1), widths=(8, 16), num_classes=10, block="bottleneck"),
  "bert_s128": dict(vocab_size=64, d_model=32, num_heads=2, num_layers=1, seq_len=16),
}
"""``--tiny``: the same families at CPU size, batch 2."""

LEG_GEMM = {
  "fwd": lambda m, k, n: (m, k, n),
  "dlhs": lambda m, k, n: (m, n, k),
  "drhs": lambda m, k, n: (k, m, n),
}
"""A leg's product ``(m, k, n)`` from the op's forward ``(m, k, n)`` (as ``modeled_profile``)."""

LEGS = ("fwd", "dlhs", "drhs")


def device_type() -> str:
  """The catalog name of the local device (``H100`` for an H100 SXM, ``cpu`` on a CPU)."""
  kind = jax.devices()[0].device_kind
  if "H100" in kind:
    return "H100-PCIe" if "PCIe" in kind else "H100"
  if "H200" in kind:
    return "H200"
  if "A100" in kind:
    return "A100"
  return "cpu"


def build(name: str, tiny: bool):
  factory, config, batch = MODELS[name]
  if tiny:
    config, batch = TINY[name], 2
  task = factory(**config)
  data = step.device_batch(task, batch)
  return task, data, batch


def model_ops(task, data) -> tuple[list[OpShape], int]:
  """The model's quantizable ops at this batch and its parameter bytes (fp32)."""
  variables = jax.eval_shape(lambda: step.init_variables(task, data))
  ops = collect_ops(
    task.model, variables, *task.inputs(data), **task.train_kwargs, mutable=task.mutable or False
  )
  return ops, step.tree_bytes(variables["params"])


# -- timing -----------------------------------------------------------------------------------


def _kernel_ms(fn, args, repeats: int) -> float:
  """ms per call of ``fn(*args)``: on a GPU its kernels' time from a profiler trace (a standalone
  call's wall time is mostly dispatch for kernels of tens of µs, which a step does not pay), else
  the median wall time of ``repeats`` calls."""
  clock = step.DEVICE_CLOCK if jax.devices()[0].platform == "gpu" else "wall"
  return step.timed_ms(lambda: fn(*args), 10 * max(1, repeats), clock=clock)[0]


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


def measure_model(name: str, tiny: bool, repeats: int, say, steps: bool = True) -> dict:
  """Raw timings of one model on the local device: per distinct GEMM and conv leg, and per step."""
  task, data, batch = build(name, tiny)
  ops, param_bytes = model_ops(task, data)
  device = device_type()
  precisions = [p for p in GEMM_PRECISIONS if p in catalog.device_spec(device).peak_tflops or device == "cpu"]
  gemms: dict[str, float] = {}
  convs: dict[str, float] = {}
  t0 = time.perf_counter()
  for op in ops:
    if op.kind == "embed":  # a lookup (gather), not a product: no roofline to compare with
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
  say(f"{name}: {len(gemms)} GEMMs, {len(convs)} convolution legs timed in {time.perf_counter() - t0:.0f} s")
  steps = {}
  from qsync_jax.policy import PrecisionPolicy

  for policy in ("fp32", "bf16") if steps else ():
    t0 = time.perf_counter()
    run, _ = step.compiled_train_step(task, PrecisionPolicy.uniform(policy), data)
    steps[policy] = step.timed_ms(run, 10 * max(1, repeats), clock=step.PIPELINED_CLOCK)[0]
    say(
      f"{name}: {policy} step {steps[policy]:.2f} ms (compiled and timed in {time.perf_counter() - t0:.0f} s)"
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
    "step_ms": steps,
  }


# -- scoring ----------------------------------------------------------------------------------


def base_profile(measured: dict) -> Profile:
  """The model's ops and parameter bytes as a profile with no costs (what ``modeled_profile``
  needs); memory other than parameters and optimizer state is not modeled here."""
  ops = tuple(OpShape.from_json(o) for o in measured["ops"])
  pb = measured["param_bytes"]
  memory = {"param_bytes": pb, "opt_state_bytes": 2 * pb, "batch_bytes": 0, "other_bytes": 0}
  return Profile(
    measured["model"],
    measured["device_type"],
    "traced",
    measured["batch_per_device"],
    ops,
    {},
    {},
    0.0,
    {},
    memory,
  )


def modeled_step_ms(measured: dict, policy: str) -> float:
  device = measured["device_type"]
  modeled = modeled_profile(base_profile(measured), device)
  cluster = ClusterSpec.uniform(device, 1, measured["batch_per_device"], memory_gb=1e6)
  return predict(cluster, {device: modeled}, Plan.uniform(cluster, policy)).step_ms


def op_leg_times(measured: dict, spec: catalog.DeviceSpec) -> dict[str, list[tuple[float, float]]]:
  """``{precision: [(measured ms, roofline ms)]}`` over every op leg of the model (an op applied
  several times counts as often)."""
  out: dict[str, list[tuple[float, float]]] = {}
  for o in measured["ops"]:
    op = OpShape.from_json(o)
    for leg in LEGS:
      m, k, n = LEG_GEMM[leg](op.m, op.k, op.n)
      for p in spec.peak_tflops:
        key = conv_key(op, leg, p) if op.kind == "conv" else gemm_key(op, leg, p)
        ms = (measured["conv_ms"] if op.kind == "conv" else measured["gemm_ms"]).get(key)
        if ms is not None:
          out.setdefault(p, []).extend(
            [(ms, catalog.gemm_roofline_ms(spec, p, m, k, n, op.batch))] * op.calls
          )
  return out


def score(measured: dict) -> tuple[list[dict], list[str]]:
  """Rows and table lines: per precision, the op legs' measured / roofline ratio (median, range)
  and the error of their summed time; per step policy, measured and modeled step and the error."""
  spec = catalog.device_spec(measured["device_type"])
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
  for policy, ms in measured["step_ms"].items():
    modeled = modeled_step_ms(measured, policy)
    err = (modeled - ms) / ms
    rows.append(
      result_row(
        "roofline", f"{name} step {policy}", "step_ms", ms, modeled, device, modeled_ms=modeled, error=err
      )
    )
    lines.append(
      f"{name:10s} step {policy:5s}: measured {ms:9.2f} ms  modeled {modeled:9.2f} ms  error {100 * err:+7.1f} %"
    )
  return rows, lines


def merged(runs: list[dict]) -> list[dict]:
  """One entry per model: the timings of later runs of a model added to (and replacing) the earlier."""
  out: dict[str, dict] = {}
  for r in runs:
    if r["model"] not in out:
      out[r["model"]] = {
        **r,
        "gemm_ms": dict(r["gemm_ms"]),
        "conv_ms": dict(r["conv_ms"]),
        "step_ms": dict(r["step_ms"]),
      }
      continue
    for key in ("gemm_ms", "conv_ms", "step_ms"):
      out[r["model"]][key].update(r[key])
  return list(out.values())


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.roofline", description=__doc__.split("\n\n")[0])
  ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
  ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny models, batch 2")
  ap.add_argument("--repeats", type=int, default=5, help="timing windows of 10 calls per GEMM (median)")
  ap.add_argument(
    "--step-models",
    nargs="*",
    default=list(MODELS),
    help="models whose fp32/bf16 steps are timed (default all)",
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
    models = [m for m in args.models if not args.tiny or m in TINY]
    runs = []
    for m in models:
      runs.append(measure_model(m, args.tiny, args.repeats, say, steps=m in args.step_models))
      if args.save_measured:  # after every model, so that a run cut short keeps what it measured
        with open(args.save_measured, "w") as f:
          json.dump(runs, f)
        say(f"raw timings so far in {args.save_measured}")
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
