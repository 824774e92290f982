"""What a compiled step of ``benchmarks.e2e`` holds (equations, GEMMs, Pallas kernels, custom
calls, peak memory) and what kind each GPU kernel of its trace is.

``lower_for_cuda`` lowers a training step for CUDA on any machine (no GPU needed: the kernels
forced as on a GPU, ``lowering_platforms=("cuda",)``): the stages a GPU host also runs before
XLA (trace, lower) and what the module holds (``python -m benchmarks.e2e --lower-for-cuda``).
"""

from __future__ import annotations

import collections
import contextlib
import re
import statistics
import time
import unittest.mock

import jax

from planners.profiler import hlo as hlo_text

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


STEP_CATEGORIES = ("gemm", "quantize", "cast_transpose", "attention", "norm_elementwise", "optimizer")
"""The categories of a training step's kernel time (``step_category``)."""
_GEMM_MARKS = ("mosaic", "scaled_matmul", "nvjet", "gemm", "cublas", "cutlass", "xmma", "triton_dot")
_QUANTIZE_MARKS = ("quantize", "pair_scales")
_ATTENTION_MARKS = ("flash", "fmha", "cudnn", "sdpa", "dot_product_attention")


def step_category(name: str, stack: str) -> str:
  """The category of one GPU kernel of a training step, from its name and the JAX name stack of
  the HLO instruction it runs (``instruction_stacks``); first match wins:

  * ``cast_transpose``: a transpose or copy kernel, or a convert (cast) fusion;
  * ``quantize``: a quantize kernel or an instruction under a quantize function (absmax and
    scale reductions, ``quantize_absmax`` scopes);
  * ``gemm``: matrix-product kernels (the 8-bit Mosaic / Triton GEMMs, cuBLAS, XLA's Triton GEMMs);
  * ``attention``: cuDNN's fused attention (and anything under ``dot_product_attention``);
  * ``optimizer``: instructions outside the model's forward and backward (no ``jvp(`` in the
    stack): the optimizer update and the step's bookkeeping;
  * ``norm_elementwise``: the rest (norms, activations, residual adds, the loss, bias gradients).
  """
  lower, stack_lower = name.lower(), stack.lower()
  if "transpose" in lower or "copy" in lower:
    return "cast_transpose"
  if any(m in lower or m in stack_lower for m in _QUANTIZE_MARKS):
    return "quantize"
  if any(m in lower for m in _GEMM_MARKS):
    return "gemm"
  if any(m in lower or m in stack_lower for m in _ATTENTION_MARKS):
    return "attention"
  if "convert" in lower:
    return "cast_transpose"
  if stack and "jvp(" not in stack:
    return "optimizer"
  return "norm_elementwise"


def step_categories(per_kernel: dict[str, tuple[float, float]], hlo: str, top: int = 0):
  """``{category: {"ms", "launches"}}`` (``step_category``) of ``{kernel: (ms, launches)}``
  per step (``planners.profiler.timing.kernels_by``) of the compiled module ``hlo``; with
  ``top``, also ``(categories, [[kernel, ms, launches, category, name stack], ...])`` of the
  ``top`` largest kernels."""
  stacks = instruction_stacks(hlo)
  out = {c: {"ms": 0.0, "launches": 0.0} for c in STEP_CATEGORIES}
  kernels = []
  for name, (ms, n) in per_kernel.items():
    stack = stacks.get(name.replace(".", "_"), "")
    cat = step_category(name, stack)
    out[cat]["ms"] += ms
    out[cat]["launches"] += n
    kernels.append([name, ms, n, cat, stack[-120:]])
  if not top:
    return out
  return out, sorted(kernels, key=lambda k: -k[1])[:top]


def instruction_stacks(hlo: str) -> dict[str, str]:
  """``{instruction name: JAX name stack}`` of every instruction of a compiled module, in any
  computation (fusions sit inside command-buffer computations on a GPU, not only in ENTRY),
  keyed as XLA:GPU names their kernels (``.`` written ``_``)."""
  comps, _ = hlo_text.parse(hlo)
  return {ins.name.replace(".", "_"): ins.op_name for body in comps.values() for ins in body if ins.op_name}


# -- lowering for CUDA on this machine ---------------------------------------------------------


def lower_for_cuda(task, batch_size: int, policy, optimizer, fused: bool = False) -> dict:
  """Trace and lower ``task``'s training step under ``policy`` for CUDA with the Pallas kernels
  forced as on an H100 (``fused``: inside ``qattention.fused_attention()``); the variables and
  optimizer state abstract: nothing is initialised or compiled. ``{trace_s, lower_s, what the
  program holds, kernels}``."""
  from pallas_kernels.gemm import api as gemm_api
  from pallas_kernels.quantize import api as quantize_api
  from planners.profiler import timing
  from qsync_jax.ops.qattention import fused_attention

  batch = timing.device_batch(task, batch_size)
  inputs = jax.tree.map(lambda x: x[:1], task.inputs(batch))
  variables = jax.eval_shape(lambda k: task.model.init(k, *inputs, **task.train_kwargs), jax.random.key(0))
  opt_state = jax.eval_shape(optimizer.init, variables["params"])
  key = jax.eval_shape(lambda: jax.random.key(0))
  on_gpu = lambda: True  # noqa: E731
  with contextlib.ExitStack() as stack:
    for api in (quantize_api, gemm_api):
      stack.enter_context(unittest.mock.patch.object(api, "on_gpu", on_gpu))
      if hasattr(api, "gpu_arch"):  # kernels chosen by architecture: an H100's
        stack.enter_context(unittest.mock.patch.object(api, "gpu_arch", lambda: "sm90"))
    if fused:
      stack.enter_context(fused_attention())
    step = timing.single_device_step(task, policy, optimizer)
    t0 = time.perf_counter()
    traced = step.trace(variables, opt_state, batch, key)
    t1 = time.perf_counter()
    lowered = traced.lower(lowering_platforms=("cuda",))
    t2 = time.perf_counter()
  out = {"trace_s": t1 - t0, "lower_s": t2 - t1, **jaxpr_stats(traced.jaxpr)}
  out.update(custom_call_stats(lowered.as_text(), ""))
  out["kernels"] = pallas_kernels(traced.jaxpr)
  return out


def lowered_table(results: dict[str, list[dict]], kernels: bool) -> str:
  """``{step name: lower_for_cuda results of its builds}`` as a text table (medians and ranges
  of the stages), with each step's distinct kernels and their call sites if ``kernels``."""
  lines = [
    f"{'step':32s} {'trace s':>15s} {'lower s':>15s} {'kernel calls':>12s} {'distinct':>8s} "
    f"{'triton':>6s} {'mosaic':>6s} {'threefry':>8s}"
  ]
  for name, runs in results.items():
    last, bodies = runs[-1], runs[-1]["distinct_custom_call_bodies"]
    lines.append(
      f"{name:32s} {_median_range([r['trace_s'] for r in runs]):>15s} "
      f"{_median_range([r['lower_s'] for r in runs]):>15s} {last.get('pallas_calls', 0):12d} "
      f"{last['distinct_pallas_kernels']:8d} {bodies.get('__gpu$xla.gpu.triton', 0):6d} "
      f"{bodies.get('mosaic_gpu_v2', 0):6d} {last.get('threefry_calls', 0):8d}"
    )
    if kernels:
      for (kernel, shapes), n in sorted(last["kernels"].items()):
        operands = ", ".join(f"{dtype}{list(shape)}" for dtype, shape in shapes)
        lines.append(f"    {n:4d} x {kernel.split(' ')[0]}({operands})")
  return "\n".join(lines)


def _median_range(xs) -> str:
  return f"{statistics.median(xs):5.2f} ({min(xs):.2f}-{max(xs):.2f})"
