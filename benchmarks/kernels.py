#!/usr/bin/env python3
"""int8 / fp8 GEMMs and Dense training steps against XLA bf16, on the GPU.

  python3 -m benchmarks.kernels [--out DIR] [--shapes NAME,...] [--sweep]
                                            [--variants] [--reps 15]

Cases, per GEMM shape M×K×N, all against XLA bf16 measured in the same run:
  * raw GEMM rates: XLA bf16; XLA int8 / fp8 ``dot_general`` (contraction-major "NT" and,
    for int8, the row-major right operand "NN"); our Pallas int8 / fp8 kernels, Triton
    backend and Mosaic GPU backend (dequantize epilogue included, bf16 out; ``ran`` says
    which GEMM actually ran — a shape off a kernel's tile grid falls back to XLA); the api's
    XLA path (NT dot + XLA-fused epilogue).
  * quantize passes (bandwidth): the Pallas kernels against the jnp reference under XLA.
  * ``--sections pair``: a gradient dY quantized for both gradient legs, ``quantize_pair``'s
    two passes (tile configs) against two ``quantize`` calls, at a GPT's dY shapes.
  * ``--sections both``: an activation quantized in its two GEMM layouts, ``quantize_both``
    (tile configs) against the row kernel plus an XLA transpose of its codes.
  * one Dense training step (forward + dlhs + drhs, every quantization included) through
    ``qsync_jax.quantized_dot_general`` with ``OpPolicy``s — all-int8 with stochastic
    rounding on gradients, int8 forward + bf16 backward (QSync style), fp8 — against the
    same step with ``lax.dot_general`` in bf16. ``--variants`` adds the step under each
    (GEMM impl × quantize impl) pair, not only the product default.

Timing: jitted calls issued back to back (``inner`` per sample, so launch gaps hide behind
device work), synchronized once per sample, warm-up first, inputs rotated among enough
sets to overflow L2; median of ``--reps`` samples, with min and max as the spread.
Prints a table; appends one JSON object per case to DIR/kernels.jsonl.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import itertools
import json
import math
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _platform
from pallas_kernels.gemm import api as gemm_api
from pallas_kernels.gemm import hopper
from pallas_kernels.gemm import kernel as gemm_kernel
from pallas_kernels.gemm.config import GemmConfig, HopperConfig
from pallas_kernels.quantize import api as quant_api
from pallas_kernels.quantize.config import QuantizeConfig
from pallas_kernels.quantize.reference import absmax_scale, quantize_reference
from planners.profiler.timing import profiler_events
from qsync_jax import OpPolicy, quantized_dot_general

SHAPES = {  # name: (M, K, N) of Y[M, N] = X[M, K] · W[K, N]
  "big": (16384, 8192, 8192),
  "mid": (16384, 4096, 4096),
  "small": (4096, 1024, 4096),
  "resnet_conv": (100352, 1152, 128),  # ResNet-50 3x3 conv, 128 ch at 28x28, batch 128 (im2col)
  "bert_ffn": (4096, 768, 3072),  # BERT-base FFN up-projection, 8 x 512 tokens
}
POLICIES = {
  "int8_sr": OpPolicy.preset("int8"),  # all legs int8, stochastic rounding on gradients
  "qsync_int8_bf16": OpPolicy(fwd="int8", dlhs="bf16", drhs="bf16"),
  "fp8": OpPolicy.preset("fp8"),
}
# --variants (big shape): what stochastic rounding costs, and the fused-epilogue GEMM.
VARIANT_POLICIES = {"int8_nearest": OpPolicy.uniform("int8")}
SWEEP = [  # (block_m, block_n, block_k, num_warps, num_stages)
  (128, 256, 128, 8, 3),
  (128, 256, 128, 8, 4),
  (256, 128, 128, 8, 3),
  (128, 128, 128, 4, 4),
  (128, 128, 128, 8, 5),
  (128, 256, 64, 8, 5),
  (64, 256, 128, 4, 4),
  (256, 256, 64, 8, 3),
]
HOPPER_SWEEP = [  # (tile_n, max_concurrent_steps, grid_tile_width) of the Mosaic GPU kernel
  (128, 4, 8),
  (128, 3, 8),
  (128, 4, 4),
  (128, 4, 16),
  (64, 6, 8),
]
DIMS_NN = (((1,), (0,)), ((), ()))
DIMS_NT = (((1,), (1,)), ((), ()))

RESULTS: list[dict] = []


T0 = time.perf_counter()
DEADLINE = [float("inf")]


def log(*a):
  print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


class OutOfTime(Exception):
  pass


def check_deadline():
  if time.perf_counter() - T0 > DEADLINE[0]:
    raise OutOfTime(f"past --deadline {DEADLINE[0]:.0f}s: skipping the remaining cases")


def device_name() -> str:
  d = jax.devices()[0]
  return getattr(d, "device_kind", str(d))


def n_sets(bytes_per_set: int) -> int:
  """Input sets to rotate so that they overflow a 50-60 MB L2."""
  return int(min(8, max(1, math.ceil(160e6 / max(bytes_per_set, 1)))))


def timeit(fn, arg_sets, reps: int, min_sample_s: float = 0.02):
  """(median, min, max) seconds per call of jitted ``fn`` over rotating ``arg_sets``."""
  check_deadline()
  t0 = time.perf_counter()
  out = fn(*arg_sets[0])
  jax.block_until_ready(out)
  first = time.perf_counter() - t0
  if first > 5:
    log(f"  (first call, compile included: {first:.1f}s)")
  t0 = time.perf_counter()
  for i in range(3):
    out = fn(*arg_sets[i % len(arg_sets)])
  jax.block_until_ready(out)
  est = (time.perf_counter() - t0) / 3
  inner = int(min(200, max(3, math.ceil(min_sample_s / max(est, 1e-6)))))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for i in range(inner):
      out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / inner)
  del out
  return statistics.median(samples), min(samples), max(samples)


def record(section, case, shape, metric, per_s, t, work, baseline=None, **extra):
  """One JSON line; ``work`` (ops or bytes) / time gives the rate in ``metric`` units."""
  med, lo, hi = t
  scale = {"TFLOP/s": 1e12, "TOP/s": 1e12, "GB/s": 1e9}[metric]
  value = work / med / scale
  row = {
    "benchmark": "kernels",
    "section": section,
    "case": case,
    "shape": "x".join(map(str, shape)),
    "device": DEVICE,
    "jax": jax.__version__,
    "date": datetime.date.today().isoformat(),
    "metric": metric,
    "value": round(value, 2),
    "time_ms": round(med * 1e3, 4),
    "time_ms_min": round(lo * 1e3, 4),
    "time_ms_max": round(hi * 1e3, 4),
  }
  if baseline is not None:
    row["baseline"] = baseline[0]
    row["baseline_value"] = round(baseline[1], 2)
    row["ratio"] = round(value / baseline[1], 3)
  row.update(extra)
  RESULTS.append(row)
  with open(OUT_JSONL, "a") as f:
    f.write(json.dumps(row) + "\n")
  ratio = f"{row['ratio']:.2f}x" if "ratio" in row else ""
  log(
    f"  {section:8s} {case:34s} {row['shape']:>18s} {value:9.1f} {metric:7s} "
    f"{med * 1e3:9.3f} ms [{lo * 1e3:.3f}-{hi * 1e3:.3f}] {ratio}"
  )
  return value


def guarded(fn):
  @functools.wraps(fn)
  def wrapper(*a, **k):
    try:
      return fn(*a, **k)
    except OutOfTime as e:
      log(f"  !! {e}")
      return None
    except Exception as e:  # a failing case is reported and the run goes on
      log(f"  !! {fn.__name__}{a[:1]}: {type(e).__name__}: {str(e)[:800]}")
      traceback.print_exc(limit=3)
      return None

  return wrapper


def rand(key, shape, dtype):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def qrand(key, shape, fmt, contract):
  return quantize_reference(jax.random.normal(key, shape, jnp.float32), fmt, contract)


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# -- raw GEMMs --------------------------------------------------------------------------------


def lowered_to(f, args) -> str:
  """Which GEMM a jitted call runs: our Mosaic GPU or Triton kernel, or XLA's."""
  hlo = f.lower(*args).as_text()
  return "mosaic_gpu" if "mosaic_gpu" in hlo else "triton" if "triton" in hlo else "xla"


def scaled_cases(api_fn, args, want, kind, shape, metric, reps, ops, baseline):
  """The api's scaled GEMM (bf16 out, epilogue included) under each implementation."""
  for impl in ("xla", "pallas", "mosaic"):
    f = api_fn(impl)
    err = rel_err(f(*args[0]).astype(jnp.float32), want)
    t = timeit(f, args, reps)
    record(
      "gemm",
      f"{impl}_{kind}_nt_scaled_bf16",
      shape,
      metric,
      1,
      t,
      ops,
      baseline,
      rel_err=err,
      ran=lowered_to(f, args[0]),
    )


@guarded
def bench_gemms(name, shape, reps, sweep):
  m, k, n = shape
  ops = 2 * m * k * n
  keys = jax.random.split(jax.random.key(0), 8)
  ns = n_sets(2 * (m * k + k * n))
  log(f"[gemm] {name} {shape} ({ns} input sets)")

  sets = [(rand(keys[0], (m, k), jnp.bfloat16), rand(keys[1], (k, n), jnp.bfloat16))]
  sets += [(rand(jax.random.fold_in(keys[0], i), (m, k), jnp.bfloat16), sets[0][1]) for i in range(1, ns)]
  bf16 = jax.jit(lambda x, w: x @ w)
  base = record("gemm", "xla_bf16_nn", shape, "TFLOP/s", 1, timeit(bf16, sets, reps), ops)
  baseline = ("xla_bf16_nn", base)
  # what a float leg of qdot runs: float32 output (preferred_element_type), then a cast
  f32out = jax.jit(
    lambda x, w: lax.dot_general(x, w, DIMS_NN, preferred_element_type=jnp.float32).astype(x.dtype)
  )
  record("gemm", "xla_bf16_nn_f32out_cast", shape, "TFLOP/s", 1, timeit(f32out, sets, reps), ops, baseline)
  del sets

  int8_sets = []
  for i in range(ns):
    kk = jax.random.fold_in(keys[2], i)
    xq, xs = qrand(kk, (m, k), "int8", (1,))
    int8_sets.append((xq, xs))
  wq, ws = qrand(keys[3], (k, n), "int8", (0,))
  wq_t, ws_t = wq.T, ws.T  # [N, K], [N, 1]: contraction-major right operand
  raw_nt = jax.jit(lambda a, b: lax.dot_general(a, b, DIMS_NT, preferred_element_type=jnp.int32))
  raw_nn = jax.jit(lambda a, b: lax.dot_general(a, b, DIMS_NN, preferred_element_type=jnp.int32))
  record(
    "gemm",
    "xla_int8_nt_dot_int32",
    shape,
    "TOP/s",
    1,
    timeit(raw_nt, [(s[0], wq_t) for s in int8_sets], reps),
    ops,
    baseline,
  )
  record(
    "gemm",
    "xla_int8_nn_dot_int32",
    shape,
    "TOP/s",
    1,
    timeit(raw_nn, [(s[0], wq) for s in int8_sets], reps),
    ops,
    baseline,
  )

  def api_fn(impl, config=None):
    return jax.jit(
      lambda a, sa, b, sb: gemm_api.scaled_dot_general(
        a, b, sa, sb, DIMS_NT, jnp.bfloat16, impl=impl, config=config
      )
    )

  ref = jax.jit(
    lambda a, sa, b, sb: gemm_api.scaled_dot_general(a, b, sa, sb, DIMS_NT, jnp.float32, impl="reference")
  )
  xq, xs = int8_sets[0]
  want = ref(xq, xs, wq_t, ws_t)
  args = [(s[0], s[1], wq_t, ws_t) for s in int8_sets]
  scaled_cases(api_fn, args, want, "int8", shape, "TOP/s", reps, ops, baseline)
  # our kernel on the row-major right operand (no transpose anywhere): the layout penalty
  nn = (
    None
    if name != "big"
    else jax.jit(
      lambda a, sa, b, sb: gemm_kernel.scaled_matmul(
        a, b, sa.reshape(-1), sb.reshape(-1), b_kmajor=False, out_dtype=jnp.bfloat16
      )
    )
  )
  nn and record(
    "gemm",
    "pallas_int8_nn_scaled_bf16",
    shape,
    "TOP/s",
    1,
    timeit(nn, [(s[0], s[1], wq, ws) for s in int8_sets], reps),
    ops,
    baseline,
  )
  if sweep:

    def sweep_case(case, f, args=args, want=want):
      try:
        err = rel_err(f(*args[0]).astype(jnp.float32), want)
        return record("sweep", case, shape, "TOP/s", 1, timeit(f, args, reps), ops, baseline, rel_err=err)
      except Exception as e:
        log(f"  sweep {case}: {type(e).__name__}: {str(e)[:300]}")
        return None

    best = None
    for bm, bn, bk, warps, stages in SWEEP:
      cfg = GemmConfig(bm, bn, bk, 8, warps, stages)
      v = sweep_case(f"pallas_int8_nt_{bm}x{bn}x{bk}_w{warps}_s{stages}", api_fn("pallas", cfg))
      if v is not None:
        best = max(best or (0, None), (v, cfg), key=lambda t: t[0])
    log(f"  best int8 config: {best}")
    for tile_n, steps, width in HOPPER_SWEEP:
      cfg = HopperConfig(tile_n=tile_n, max_concurrent_steps=steps, grid_tile_width=width)
      f = jax.jit(
        lambda a, sa, b, sb, cfg=cfg: hopper.scaled_matmul_nt(
          a, b, sa.reshape(-1), sb.reshape(-1), jnp.bfloat16, cfg
        )
      )
      sweep_case(f"mosaic_int8_nt_128x{tile_n}x128_s{steps}_w{width}", f)
  del int8_sets, args

  # fp8: e4m3 x e4m3 (forward) and e5m2 x e4m3 (gradients)
  for lfmt, case in (("e4m3", "e4m3"), ("e5m2", "e5m2_e4m3")):
    fsets = [qrand(jax.random.fold_in(keys[4], i), (m, k), lfmt, (1,)) for i in range(ns)]
    bq, bs = qrand(keys[5], (n, k), "e4m3", (1,))
    raw = jax.jit(lambda a, b: lax.dot_general(a, b, DIMS_NT, preferred_element_type=jnp.float32))
    record(
      "gemm",
      f"xla_fp8_{case}_nt_dot_f32",
      shape,
      "TFLOP/s",
      1,
      timeit(raw, [(s[0], bq) for s in fsets], reps),
      ops,
      baseline,
    )
    want = ref(fsets[0][0], fsets[0][1], bq, bs)
    args = [(s[0], s[1], bq, bs) for s in fsets]
    scaled_cases(api_fn, args, want, f"fp8_{case}", shape, "TFLOP/s", reps, ops, baseline)
    del fsets, args


# -- quantize passes --------------------------------------------------------------------------


@guarded
def bench_quantize(name, shape, reps):
  m, k, n = shape
  keys = jax.random.split(jax.random.key(1), 4)
  ns = n_sets(2 * m * k)
  xs = [(rand(jax.random.fold_in(keys[0], i), (m, k), jnp.bfloat16),) for i in range(ns)]
  key = keys[1]
  log(f"[quantize] {name} {shape}")
  cases = {
    # case: (fn(x, impl), bytes moved at the minimum)
    "x_int8_per_row": (lambda x, impl: quant_api.quantize(x, "int8", (1,), impl=impl), 3 * m * k),
    "x_int8_per_row_sr": (
      lambda x, impl: quant_api.quantize(x, "int8", (1,), "stochastic", key, impl=impl),
      3 * m * k,
    ),
    "x_int8_per_col_sr_transposed": (
      lambda x, impl: quant_api.quantize(x, "int8", (0,), "stochastic", key, contract_axes=(0,), impl=impl),
      3 * m * k,
    ),
    "x_e4m3_per_col_transposed": (
      lambda x, impl: quant_api.quantize(x, "e4m3", (0,), contract_axes=(0,), impl=impl),
      3 * m * k,
    ),
  }
  for case, (fn, nbytes) in cases.items():
    ref = jax.jit(functools.partial(fn, impl="reference"))
    base = record("quantize", f"{case}_xla", shape, "GB/s", 1, timeit(ref, xs, reps), nbytes)
    ker = jax.jit(functools.partial(fn, impl="pallas"))
    q, q_ref = ker(*xs[0])[0], ref(*xs[0])[0]
    diff = float(np.mean(np.asarray(q.astype(jnp.float32)) != np.asarray(q_ref.astype(jnp.float32))))
    record(
      "quantize",
      f"{case}_pallas",
      shape,
      "GB/s",
      1,
      timeit(ker, xs, reps),
      nbytes,
      (f"{case}_xla", base),
      frac_codes_differ=diff,
    )


PAIR_SHAPES = {  # name: dY [M, N] of a GPT at 8192 tokens: the head (32k vocabulary), MLP, attention
  "head_dy": (8192, 32768),
  "mlp_dy": (8192, 3072),
  "attn_dy": (8192, 768),
}
PAIR_CONFIGS = {"": None, "_128x64": QuantizeConfig(128, 64, 8), "_64x128": QuantizeConfig(64, 128, 8)}
PAIR_ROUNDINGS = {"": "stochastic", "_nearest": "nearest"}  # what the in-kernel noise costs


@guarded
def bench_quantize_pair(name, shape, reps):
  """dY quantized for both gradient legs (per row with W's column scale folded in, per column
  transposed with X's row scale): ``quantize_pair`` against two ``quantize`` calls."""
  m, n = shape
  keys = jax.random.split(jax.random.key(2), 4)
  ns = n_sets(2 * m * n)
  col_in = jnp.exp(jax.random.normal(keys[1], (1, n)))
  row_in = jnp.exp(jax.random.normal(keys[2], (m, 1)))
  xs = [(rand(jax.random.fold_in(keys[0], i), (m, n), jnp.bfloat16),) for i in range(ns)]
  legs = (keys[3], jax.random.fold_in(keys[3], 1))
  log(f"[quantize_pair] {name} {shape}")
  for fmt, (tag, rounding) in itertools.product(("int8", "e5m2"), PAIR_ROUNDINGS.items()):
    fmt_tag = fmt + tag

    def two_calls(x, fmt=fmt, rounding=rounding):
      one = functools.partial(quant_api.quantize, x, fmt, rounding=rounding, impl="pallas")
      return (
        one((1,), key=legs[0], in_scale=col_in, contract_axes=(1,)),
        one((0,), key=legs[1], in_scale=row_in, contract_axes=(0,)),
      )

    nbytes = 4 * m * n  # dY read once, two 8-bit copies written
    base_fn = jax.jit(two_calls)
    base = record(
      "pair", f"{fmt_tag}_two_quantize_calls", shape, "GB/s", 1, timeit(base_fn, xs, reps), nbytes
    )
    want = base_fn(*xs[0])
    for suffix, cfg in PAIR_CONFIGS.items() if rounding == "stochastic" else [("", None)]:
      fn = jax.jit(
        lambda x, fmt=fmt, cfg=cfg, rounding=rounding: quant_api.quantize_pair(
          x, fmt, 1, rounding, legs[0], in_scales=(col_in, row_in), impl="pallas", config=cfg
        )
      )
      got = fn(*xs[0])
      diff = max(
        float(np.mean(np.asarray(a[0].astype(jnp.float32)) != np.asarray(b[0].astype(jnp.float32))))
        for a, b in zip(got, want)
      )
      t = timeit(fn, xs, reps)
      record(
        "pair",
        f"{fmt_tag}_pair{suffix}",
        shape,
        "GB/s",
        1,
        t,
        nbytes,
        (f"{fmt_tag}_two_quantize_calls", base),
        frac_codes_differ=diff,
      )


BOTH_SHAPES = {  # name: X [M, K] of a GPT d2048 step at 8192 tokens: the GELU output, a LayerNorm output
  "gelu_out": (8192, 8192),
  "ln_out": (8192, 2048),
}
BOTH_CONFIGS = {
  "": None,
  "_128x64": QuantizeConfig(128, 64, 8),
  "_64x128": QuantizeConfig(64, 128, 4),
  "_128x128": QuantizeConfig(128, 128, 8),
  "_32x128": QuantizeConfig(32, 128, 4),
}


@guarded
def bench_quantize_both(name, shape, reps):
  """An activation X quantized per row for the forward and transposed for the weight gradient:
  ``quantize_both`` (an XLA absmax, one kernel pass writing both copies; tile configs) against
  the fused-absmax row kernel with an XLA transpose of its codes, and the absmax alone."""
  m, k = shape
  keys = jax.random.split(jax.random.key(3), 2)
  xs = [(rand(jax.random.fold_in(keys[0], i), (m, k), jnp.bfloat16),) for i in range(n_sets(2 * m * k))]
  log(f"[quantize_both] {name} {shape}")
  for fmt in ("int8", "e4m3"):
    rows_t = jax.jit(lambda x, fmt=fmt: quant_api.quantize(x, fmt, (1,), impl="pallas")[0].T)
    base = record(
      "both", f"{fmt}_rows_then_xla_transpose", shape, "GB/s", 1, timeit(rows_t, xs, reps), 5 * m * k
    )
    absmax = jax.jit(lambda x, fmt=fmt: absmax_scale(x, fmt, (1,)))
    record("both", f"{fmt}_xla_absmax", shape, "GB/s", 1, timeit(absmax, xs, reps), 2 * m * k)
    for suffix, cfg in BOTH_CONFIGS.items() if fmt == "int8" else [("", None)]:
      fn = jax.jit(
        lambda x, fmt=fmt, cfg=cfg: quant_api.quantize_both(
          x, fmt, (1,), contract_axes=(1,), impl="pallas", config=cfg
        )
      )
      (q, _), (qt, _) = fn(*xs[0])
      ok = bool(jnp.all(q.T == qt))
      t = timeit(fn, xs, reps)
      record(
        "both",
        f"{fmt}_both{suffix}",
        shape,
        "GB/s",
        1,
        t,
        6 * m * k,
        (f"{fmt}_rows_then_xla_transpose", base),
        both_layouts_agree=ok,
      )


# -- Dense training steps ---------------------------------------------------------------------


def bf16_step(x, w, dy, key):
  del key
  y, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, DIMS_NN), x, w)
  return (y, *vjp(dy))


def q_step(policy, x, w, dy, key):
  y, vjp = jax.vjp(lambda a, b: quantized_dot_general(a, b, DIMS_NN, policy, key), x, w)
  return (y, *vjp(dy))


def kernel_table(fn, args, repeats: int = 5) -> list[tuple[float, int, str]]:
  """``[(ms per step, launches per step, kernel name)]`` of jitted ``fn`` on the GPU, from a
  ``jax.profiler`` trace of ``repeats`` calls, largest first."""
  jax.block_until_ready(fn(*args))
  ms, launches = collections.defaultdict(float), collections.defaultdict(int)
  for e in profiler_events(lambda: jax.block_until_ready(fn(*args)), repeats):
    if "/device:GPU" in e["process"]:
      ms[e["name"]] += e["dur"] / 1e3 / repeats
      launches[e["name"]] += 1
  return sorted(((v, launches[k] // repeats, k) for k, v in ms.items()), reverse=True)


def log_kernel_table(case, fn, args, out_dir):
  rows = kernel_table(fn, args)
  log(f"  [profile] {case}: {sum(r[0] for r in rows):.3f} ms of GPU kernels per step")
  for ms, n, name in rows[:12]:
    log(f"     {ms:7.3f} ms  x{n:<3d} {name[:120]}")
  with open(os.path.join(out_dir, f"profile_{case}.json"), "w") as f:
    json.dump({"device": DEVICE, "jax": jax.__version__, "kernels": rows}, f)


def jit_under(fn, gemm_impl, quant_impl, args):
  """A fresh jitted ``fn``, traced (and compiled) while the impl overrides are active."""
  f = jax.jit(lambda *a: fn(*a))
  with gemm_api.use_impl(gemm_impl), quant_api.use_impl(quant_impl):
    jax.block_until_ready(f(*args))
  return f


@guarded
def bench_steps(name, shape, reps, variants, profile_dir=None):
  m, k, n = shape
  ops = 6 * m * k * n
  keys = jax.random.split(jax.random.key(2), 4)
  ns = n_sets(2 * (2 * m * k + k * n + m * n))
  sets = []
  for i in range(ns):
    kk = jax.random.fold_in(keys[0], i)
    sets.append(
      (
        rand(jax.random.fold_in(kk, 0), (m, k), jnp.bfloat16),
        rand(keys[1], (k, n), jnp.bfloat16) * (1 / math.sqrt(k)),
        rand(jax.random.fold_in(kk, 1), (m, n), jnp.bfloat16),
        jax.random.fold_in(keys[2], i),
      )
    )
  log(f"[step] {name} {shape} ({ns} input sets)")
  f = jax.jit(bf16_step)
  want = [np.asarray(o, np.float32) for o in f(*sets[0])]
  base = record("step", "xla_bf16", shape, "TFLOP/s", 1, timeit(f, sets, reps), ops)
  if profile_dir:
    log_kernel_table(f"{name}_xla_bf16", f, sets[0], profile_dir)
  baseline = ("xla_bf16", base)
  cases = [(p, "auto", "auto") for p in POLICIES if f"{name}:{p}" not in SKIP]
  if variants:
    cases += [("int8_sr", "xla", "auto"), ("qsync_int8_bf16", "xla", "auto")]
    cases += [("int8_nearest", "auto", "auto")]
  for pname, gi, qi in cases:
    policy = {**POLICIES, **VARIANT_POLICIES}[pname]
    case = f"{pname}" + ("" if gi == "auto" else f"[gemm={gi},quantize={qi}]")
    try:
      fn = jit_under(functools.partial(q_step, policy), gi, qi, sets[0])
      got = fn(*sets[0])
      errs = {f"rel_err_{o}": round(rel_err(g, w), 4) for o, g, w in zip(("y", "dx", "dw"), got, want)}
      del got
      record("step", case, shape, "TFLOP/s", 1, timeit(fn, sets, reps), ops, baseline, **errs)
      if profile_dir:
        log_kernel_table(f"{name}_{case}", fn, sets[0], profile_dir)
    except OutOfTime:
      raise
    except Exception as e:
      log(f"  !! step {case}: {type(e).__name__}: {str(e)[:600]}")


def main(argv=None):
  global DEVICE, OUT_JSONL
  p = argparse.ArgumentParser(
    prog="python -m benchmarks.kernels",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
  p.add_argument("--shapes", default=",".join(SHAPES))
  p.add_argument("--sections", default="gemm,quantize,step", help="of gemm, quantize, step, pair, both")
  p.add_argument("--reps", type=int, default=15)
  p.add_argument("--sweep", action="store_true", help="time int8 kernel tile configs on the first shape")
  p.add_argument("--variants", action="store_true", help="steps of the big shape under other impls too")
  p.add_argument("--deadline", type=float, default=float("inf"), help="seconds; later cases are skipped")
  p.add_argument("--skip", default="", help="shape:policy step cases to skip, comma-separated")
  p.add_argument("--profile", action="store_true", help="per-kernel GPU time of each step at the first shape")
  args = p.parse_args(argv)
  if jax.default_backend() != "gpu":
    sys.exit("benchmarks/kernels.py times GPU kernels: run it on the lent GPU (see docs/kernels.md).")
  DEVICE = device_name()
  os.makedirs(args.out, exist_ok=True)
  OUT_JSONL = os.path.join(args.out, "kernels.jsonl")
  log(
    f"device {DEVICE}, jax {jax.__version__}, gemm auto: pallas_kernels.arch.KERNELS[{_platform.gpu_arch()!r}]"
  )
  DEADLINE[0] = args.deadline
  SKIP.update(args.skip.split(","))
  sections = args.sections.split(",")
  if "pair" in sections:
    for name, shape in PAIR_SHAPES.items():
      bench_quantize_pair(name, shape, args.reps)
  if "both" in sections:
    for name, shape in BOTH_SHAPES.items():
      bench_quantize_both(name, shape, args.reps)
  for i, name in enumerate(args.shapes.split(",")):
    shape = SHAPES[name]
    if "step" in sections:
      profile_dir = args.out if args.profile and i == 0 else None
      bench_steps(name, shape, args.reps, args.variants and name == "big", profile_dir)
    if "gemm" in sections:
      bench_gemms(name, shape, args.reps, args.sweep and i == 0)
    if "quantize" in sections and name in ("big", "resnet_conv"):
      bench_quantize(name, shape, args.reps)
  log("\nsummary (value, ratio to the XLA bf16 baseline of the same run)")
  for r in RESULTS:
    if r["section"] in ("gemm", "step"):
      log(
        f"{r['section']:6s} {r['case']:44s} {r['shape']:>18s} {r['value']:8.1f} {r['metric']:7s} {r.get('ratio', 1.0):5.2f}x"
      )


DEVICE = ""
OUT_JSONL = ""
SKIP: set[str] = set()

if __name__ == "__main__":
  main()
