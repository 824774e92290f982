"""What a compiled step of ``benchmarks.e2e`` holds (equations, GEMMs, Pallas kernels, custom
calls, peak memory) and what kind each GPU kernel of its trace is.

Run as a program, it lowers GPT training steps for CUDA on any machine (no GPU needed: the
kernels are forced as on a GPU, ``lowering_platforms=("cuda",)``) and prints the stages a
GPU host also runs before XLA (trace, lower) with what the module holds::

  python -m benchmarks.e2e_inspect [--plan gpt:768:int8_dense+fp8_dense,...] [--repeats 3] [--kernels]

``--plan`` takes ``benchmarks.e2e``'s ``gpt`` units; every step is built ``--repeats`` times
with JAX's caches cleared in between (medians and ranges printed); ``--kernels`` lists the
distinct Pallas kernels of each step with their call sites.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
import statistics
import time
import unittest.mock

import jax

from qsync_jax import hlo as hlo_text

THREEFRY_PRIMITIVES = ("random_bits", "random_split", "random_fold_in", "threefry2x32")
"""Primitives that each lower to a Threefry computation (with the default PRNG)."""


def _walk(jaxpr):
  """Every equation of ``jaxpr`` and of its nested jaxprs, a nested jaxpr once per call site."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _walk(inner)


def pallas_kernels(jaxpr) -> collections.Counter:
  """``{(kernel name, ((dtype, shape) of each operand, ...)): call sites}`` of a jaxpr."""
  kernels = collections.Counter()
  for eqn in _walk(getattr(jaxpr, "jaxpr", jaxpr)):
    if eqn.primitive.name == "pallas_call":
      shapes = tuple((str(v.aval.dtype), tuple(v.aval.shape)) for v in eqn.invars)
      kernels[(str(eqn.params.get("name_and_src_info", eqn.params.get("name", ""))), shapes)] += 1
  return kernels


def jaxpr_stats(jaxpr) -> dict:
  """Equations, dot_generals (and those on 8-bit operands), Threefry computations (random
  bits, key splits and fold-ins) and Pallas kernels (and their distinct shapes) of a jaxpr,
  nested jaxprs counted at each call site."""
  counts = collections.Counter()
  for eqn in _walk(getattr(jaxpr, "jaxpr", jaxpr)):
    counts["eqns"] += 1
    name = eqn.primitive.name
    if name == "dot_general":
      counts["dot_generals"] += 1
      counts["dot_generals_8bit"] += any(v.aval.dtype.itemsize == 1 for v in eqn.invars)
    counts["pallas_calls"] += name == "pallas_call"
    counts["threefry_calls"] += name in THREEFRY_PRIMITIVES
  return {**counts, "distinct_pallas_kernels": len(pallas_kernels(jaxpr))}


def custom_call_stats(lowered_text: str, compiled_text: str) -> dict:
  """Custom calls (our Pallas kernels among them) by target: in the lowered StableHLO module,
  how many distinct kernels (bodies and launch parameters) among them, and in XLA's compiled
  module (fewer there: XLA merged identical calls on the same operands, e.g. the same
  activation quantized for the query, key and value projections)."""
  calls, bodies = collections.Counter(), collections.defaultdict(set)
  for line in lowered_text.splitlines():
    if "stablehlo.custom_call @" not in line:
      continue
    target = line.split("stablehlo.custom_call @", 1)[1].split("(", 1)[0]
    calls[target] += 1
    bodies[target].add(hash(re.sub(r"%[\w#:]+", "", line.split("=", 1)[-1])))
  compiled = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', compiled_text))
  return {
    "custom_calls": dict(calls),
    "distinct_custom_call_bodies": {k: len(v) for k, v in bodies.items()},
    "compiled_custom_calls": dict(compiled),
  }


def device_peak_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


KERNEL_KINDS = (
  ("our_gemm", ("mosaic", "scaled_matmul")),
  ("our_quantize", ("quantize",)),
  ("float_gemm", ("nvjet", "gemm", "cublas", "cutlass", "xmma", "matmul", "dot")),
  ("attention", ("flash", "fmha", "cudnn")),
  ("reduce", ("reduce",)),
  ("transpose_copy", ("transpose", "copy")),
  ("convert", ("convert",)),
)
"""Kernel name marks per kind, first match wins; any other kernel is ``other_fusion``."""


def kernel_kind(name: str) -> str:
  lower = name.lower()
  return next((kind for kind, marks in KERNEL_KINDS if any(m in lower for m in marks)), "other_fusion")


def instruction_stacks(hlo: str) -> dict[str, str]:
  """``{instruction name: JAX name stack}`` of every instruction of a compiled module, in any
  computation (fusions sit inside command-buffer computations on a GPU, not only in ENTRY),
  keyed as XLA:GPU names their kernels (``.`` written ``_``)."""
  comps, _ = hlo_text.parse(hlo)
  return {ins.name.replace(".", "_"): ins.op_name for body in comps.values() for ins in body if ins.op_name}


# -- lowering for CUDA on this machine ---------------------------------------------------------


def lower_for_cuda(width: int, policy: str, tiny: bool = False) -> dict:
  """Trace and lower ``benchmarks.e2e``'s GPT step at ``width`` under ``policy`` for CUDA with
  the Pallas kernels forced as on a GPU (the variables and optimizer state abstract: nothing is
  initialised or compiled). ``{trace_s, lower_s, what the program holds, kernels}``."""
  from benchmarks import e2e  # e2e imports this module
  from pallas_kernels.gemm import api as gemm_api
  from pallas_kernels.quantize import api as quantize_api
  from planners import timing

  task, batch_size = e2e.gpt_task(width, tiny)
  batch = timing.device_batch(task, batch_size)
  inputs = jax.tree.map(lambda x: x[:1], task.inputs(batch))
  variables = jax.eval_shape(lambda k: task.model.init(k, *inputs, **task.train_kwargs), jax.random.key(0))
  opt = e2e.optimizer()
  opt_state = jax.eval_shape(opt.init, variables["params"])
  key = jax.eval_shape(lambda: jax.random.key(0))
  on_gpu = lambda: True  # noqa: E731
  with (
    unittest.mock.patch.object(quantize_api, "on_gpu", on_gpu),
    unittest.mock.patch.object(gemm_api, "on_gpu", on_gpu),
  ):
    step = timing.make_train_step(task, e2e.POLICIES[policy], opt)
    with e2e.fused_attention() if policy in e2e.FUSED_ATTENTION else contextlib.nullcontext():
      t0 = time.perf_counter()
      traced = step.trace(variables, opt_state, batch, key)
      t1 = time.perf_counter()
      lowered = traced.lower(lowering_platforms=("cuda",))
      t2 = time.perf_counter()
  out = {"trace_s": t1 - t0, "lower_s": t2 - t1, **jaxpr_stats(traced.jaxpr)}
  out.update(custom_call_stats(lowered.as_text(), ""))
  out["kernels"] = pallas_kernels(traced.jaxpr)
  return out


def _median_range(xs) -> str:
  return f"{statistics.median(xs):5.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description="GPT steps of benchmarks.e2e lowered for CUDA on this machine")
  ap.add_argument("--plan", default="gpt:768:plain+int8_dense+fp8_dense+int8_fwd_dense+int8_dense_attn")
  ap.add_argument("--repeats", type=int, default=3, help="builds per step (JAX's caches cleared between)")
  ap.add_argument("--kernels", action="store_true", help="list each step's distinct Pallas kernels")
  ap.add_argument("--tiny", action="store_true", help="tiny models (a smoke test)")
  args = ap.parse_args(argv)
  from benchmarks import e2e

  plan_args = argparse.Namespace(
    widths=[64] if args.tiny else [768], policies=["plain", "int8_dense"], tiny=args.tiny
  )
  units = e2e.parse_plan(args.plan, plan_args)
  if any(u.section != "gpt" for u in units):
    raise SystemExit(
      f"--plan {args.plan!r}: only gpt units lower for CUDA here. Fix: e.g. gpt:768:int8_dense."
    )
  print(
    f"{'step':32s} {'trace s':>15s} {'lower s':>15s} {'kernel calls':>12s} {'distinct':>8s} "
    f"{'triton':>6s} {'mosaic':>6s} {'threefry':>8s}"
  )
  for unit in units:
    runs = []
    for _ in range(args.repeats):
      jax.clear_caches()
      runs.append(lower_for_cuda(int(unit.arg), unit.policies[0], args.tiny))
    last = runs[-1]

    bodies = last["distinct_custom_call_bodies"]
    print(
      f"{'gpt/d' + unit.arg + '/' + unit.policies[0]:32s} {_median_range([r['trace_s'] for r in runs]):>15s} {_median_range([r['lower_s'] for r in runs]):>15s} "
      f"{last.get('pallas_calls', 0):12d} {last['distinct_pallas_kernels']:8d} "
      f"{bodies.get('__gpu$xla.gpu.triton', 0):6d} {bodies.get('mosaic_gpu_v2', 0):6d} "
      f"{last.get('threefry_calls', 0):8d}",
      flush=True,
    )
    if args.kernels:
      for (name, shapes), n in sorted(last["kernels"].items()):
        operands = ", ".join(f"{dtype}{list(shape)}" for dtype, shape in shapes)
        print(f"    {n:4d} x {name.split(' ')[0]}({operands})")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
