"""Whole-model training steps on one device: plain Flax bf16 against qsync policies.

  python -m benchmarks.e2e [--plan UNIT,...] [--widths 768 1024 2048 4096] [--policies ...]
                           [--steps 30] [--compile-only] [--budget-s S] [--isolate]
                           [--compilation-cache DIR] [--tiny]
                           [--out-jsonl PATH]
  python -m benchmarks.e2e --lower-for-cuda [--plan gpt:768:int8_dense+...] [--tiny]

Units of work (``--plan``, comma-separated, run in that order; default: every GPT cell, then
the ResNet cells):

* ``gpt[:WIDTH[:POLICY+POLICY...]]`` — one training step cell per width and policy (default:
  ``--widths`` × ``--policies``). The model (``benchmarks.common.zoo.e2e_gpt``) is the examples'
  ``TransformerLM`` on random tokens (``examples.tasks.language.synthetic_lm``) with every
  module in bf16 (``dtype=jnp.bfloat16``, float32 parameters): token and position ``nn.Embed``,
  pre-LN blocks of ``nn.MultiHeadDotProductAttention`` and a 4d GELU MLP of ``nn.Dense``, an
  untied ``nn.Dense`` head; vocabulary 32768, sequence 1024 × batch 8 = 8192 tokens per step, 4
  blocks, heads of 64 (d ≤ 1024) or 128 dims; AdamW.
* ``llama[:WIDTH[:POLICY+POLICY...]]`` — the same cells for a Llama-style model
  (``benchmarks.common.zoo.e2e_llama``: RMSNorm, attention and a SwiGLU MLP without biases,
  learned positions; the GPT's widths, blocks, heads, vocabulary and tokens per step).
* ``cnn[:POLICY+...]`` — ResNet-50 (bottleneck blocks, ``benchmarks.common.zoo.e2e_resnet50``) on
  random 224×224 images, batch 32, bf16 modules; policies ``CNN_POLICIES``.
* ``profile[:WIDTH[:POLICY+...]]`` — the GPU kernels of one GPT step (default: the first
  width, ``plain`` and ``int8_dense``): time per kernel and per kind of kernel
  (``kernel_kind``), each kernel with the module path of the HLO instruction it runs.
* ``attention[:SEQ]`` — one attention's forward + backward (12 heads of 64, 8192 tokens,
  causal): Flax's bf16 einsums against quantized QKᵀ / PV (``QuantizedEinsum``, int8, int8
  forward, fp8) and ``jax.nn.dot_product_attention`` (cuDNN on a GPU) with the mask as an
  array and as ``is_causal``; default sequences 512, 1024, 2048.
* ``conv[:SHAPE]`` — one convolution's forward + both gradients at ResNet-50 layer shapes
  (batch 32): the native bf16 convolution against quantized ones through im2col and through
  XLA's convolution on int8 / fp8 operands (``qsync_jax.ops.qconv_native``).

Policies (``qsync_jax.quantize`` on the same bf16 model; ``plain`` is the model alone):
``POLICIES``. A GPT or ResNet cell records: the training step's median time over windows of
steps dispatched back to back (``planners.profiler.timing.PIPELINED_CLOCK``; its ratio to ``plain`` of
the same width in the same run, ``speed`` = plain / this), compile time split into JAX's
stages (``planners.profiler.timing.staged_compile``: trace, lower, XLA compile) plus the first call,
what the program holds (jaxpr equations, dot_generals, Pallas kernels and their distinct
shapes, Threefry computations, custom calls in the lowered module, and the lowered module's
SHA-256: two cells with the same hash hand XLA the same program), and memory (XLA's
``memory_analysis`` peak and the device's ``peak_bytes_in_use``). With ``--categories`` a step cell also traces 5 steps and sums its kernel time by category
(``benchmarks.common.e2e_inspect.step_category``: GEMM, quantize, cast/transpose/copy,
attention, norm/elementwise, optimizer); its row carries them, its 40 largest kernels and the
ceiling: the step minus its quantize and cast/transpose/copy kernels. A restarted run's compile
is the same command run again with the same ``--compilation-cache``: its cells compile out of
JAX's persistent compilation cache (a second build in one process is no measure of it: a
Mosaic GPU kernel lowered again in one process gets another module, and misses the cache).

``--isolate`` runs every unit in a fresh Python process (compile caches, memory and the
device's peak start empty for each; each unit gets its own subfolder of
``--compilation-cache``); ``--budget-s`` skips units that would not end before the budget
(estimated from what was measured, or ``UNIT_ESTIMATE_S`` on a GPU) and, with ``--isolate``,
stops a unit that runs past it; either way a row says what was skipped. Rows append to
``--out-jsonl`` (default ``benchmarks/results/e2e.jsonl``) and, when ``$OUT`` is set, to
``$OUT/e2e.jsonl``; a table of this run's rows prints last. ``--tiny`` shrinks every model
and shape for a CPU smoke test.

``--lower-for-cuda`` runs no unit: it traces and lowers the plan's GPT steps for CUDA on this
machine, no GPU needed (``benchmarks.common.e2e_inspect.lower_for_cuda``: the kernels forced as
on a GPU), three builds each with JAX's caches cleared in between, and prints the stages'
medians and what each module holds, its distinct Pallas kernels with their call sites.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import unittest.mock
import uuid

import jax
import optax

from benchmarks.common.e2e_inspect import (
  custom_call_stats,
  device_peak_bytes,
  instruction_stacks,
  jaxpr_stats,
  kernel_kind,
  lower_for_cuda,
  lowered_table,
  step_categories,
)
from benchmarks.common.e2e_micro import (
  CONV_CASES,
  CONV_SHAPES,
  TINY_CONV_SHAPES,
  attention_cases,
  conv_case,
  conv_operands,
  time_micro,
)
from benchmarks.common.e2e_table import table
from benchmarks.common.result_rows import append_rows, result_row, results_path
from benchmarks.common.zoo import e2e_gpt, e2e_llama, e2e_resnet50
from pallas_kernels import arch
from pallas_kernels.gemm import api as gemm_api
from pallas_kernels.quantize import api as quantize_api
from planners.allocator import auto_policy
from planners.profiler import timing
from planners.profiler.timing import kernels_by, profiler_events
from qsync_jax import OpPolicy, PrecisionPolicy, Rule
from qsync_jax.ops.qattention import fused_attention

RESULTS = results_path("e2e")

DENSE_KINDS = ("dense", "dense_general")
ATTENTION_KINDS = ("attention_qk", "attention_pv")


def kinds_policy(preset: str, kinds) -> PrecisionPolicy:
  """``preset`` on every op of ``kinds``; other ops untouched (the plain model's code)."""
  return PrecisionPolicy(rules=tuple(Rule(".*", OpPolicy.preset(preset), kind=k) for k in kinds))


POLICIES = {
  "plain": PrecisionPolicy(),  # matches nothing: the plain model's program, bit-identical
  # the plain model with the attention a Flax user writes for a GPU (attention_fn calling
  # jax.nn.dot_product_attention, cuDNN): the attention products at bf16, traced fused
  "plain_cudnn_attn": kinds_policy("bf16", ATTENTION_KINDS),
  "bf16": PrecisionPolicy.uniform("bf16"),
  "bf16_fused_attn": PrecisionPolicy.uniform("bf16"),  # traced under qattention.fused_attention()
  "int8_dense": kinds_policy("int8", DENSE_KINDS),
  "fp8_dense": kinds_policy("fp8", DENSE_KINDS),
  "int8_fwd_dense": kinds_policy("int8_fwd", DENSE_KINDS),
  "int8_dense_attn": kinds_policy("int8", DENSE_KINDS + ATTENTION_KINDS),
  "int8_dense_fused_attn": PrecisionPolicy(  # traced under qattention.fused_attention()
    rules=kinds_policy("int8", DENSE_KINDS).rules + kinds_policy("bf16", ATTENTION_KINDS).rules
  ),
  "fp8_dense_fused_attn": PrecisionPolicy(  # traced under qattention.fused_attention()
    rules=kinds_policy("fp8", DENSE_KINDS).rules + kinds_policy("bf16", ATTENTION_KINDS).rules
  ),
  "int8_conv": kinds_policy("int8", ("conv", "dense")),
  "int8_fwd_conv": kinds_policy("int8_fwd", ("conv", "dense")),
}
"""Every Dense is the examples' ``nn.Dense`` (MLP, head) and the attention's ``DenseGeneral``
projections (query, key, value, out)."""
FUSED_ATTENTION = (
  "plain_cudnn_attn",
  "bf16_fused_attn",
  "int8_dense_fused_attn",
  "fp8_dense_fused_attn",
  "auto",
)
"""Policies traced with fused attention on (``qattention.fused_attention``, the library's default);
the others are traced with it off, Flax's own attention einsums."""
AUTO = "auto"
"""Not a fixed policy: ``planners.allocator.auto_policy`` measured on the cell's model first."""
GPT_POLICIES = (
  "plain",
  "plain_cudnn_attn",
  "bf16",
  "int8_dense",
  "fp8_dense",
  "int8_fwd_dense",
  "int8_dense_attn",
  "auto",
)
CNN_POLICIES = ("plain", "bf16", "int8_conv", "int8_fwd_conv")
PROFILE_POLICIES = ("plain", "int8_dense")

UNIT_ESTIMATE_S = {
  "plain": 40,
  "plain_cudnn_attn": 45,
  "auto": 200,
  "bf16": 40,
  "bf16_fused_attn": 50,
  "int8_dense_fused_attn": 100,
  "fp8_dense_fused_attn": 120,
  "int8_fwd_dense": 90,
  "int8_dense": 100,
  "int8_dense_attn": 130,
  "fp8_dense": 180,
  "int8_conv": 150,
  "int8_fwd_conv": 150,
  "attention": 60,
  "conv": 60,
}
"""Seconds a unit is assumed to take on a GPU before one like it was measured (compile times
of an H100: plain bf16 11-14 s, int8 on every Dense 33-123 s, fp8 97-160 s), for the budget."""


def optimizer() -> optax.GradientTransformation:
  return optax.adamw(1e-4)


# -- one training step cell -----------------------------------------------------------------


GEMM_IMPLS = ("auto", "pallas", "mosaic", "xla")
ARCHS = tuple(arch.KERNELS)


@dataclasses.dataclass(frozen=True)
class Variant:
  """A policy and how its step is built: ``name[@key=value;...]`` (``parse_variant``).

  Attributes:
    policy: a key of ``POLICIES``.
    gemm: the 8-bit GEMM implementation forced while tracing (``auto``: the api's choice).
    short_k: ``pallas_kernels.arch.SHORT_K`` while tracing (None: as it is).
    arch: the GPU architecture the kernel APIs see while tracing (``sm75``, ``sm80``, ``sm89``…;
      None: the device's): each architecture's implementations, run on this GPU.
    xla: XLA compile options (``xla_...``) of the step.
  """

  policy: str
  gemm: str = "auto"
  short_k: int | None = None
  arch: str | None = None
  xla: tuple[tuple[str, object], ...] = ()


def parse_variant(text: str) -> Variant:
  """``int8_dense@gemm=pallas;xla_gpu_autotune_level=0`` → ``Variant``; ``SystemExit`` naming
  what is wrong."""
  name, _, options = text.partition("@")
  if name not in POLICIES and name != AUTO:
    raise SystemExit(f"--plan / --policies: unknown policy {name!r}. Fix: use one of {sorted(POLICIES)}.")
  fields = {"policy": name}
  xla = []
  for item in filter(None, options.split(";")):
    key, _, value = item.partition("=")
    if key == "gemm" and value in GEMM_IMPLS:
      fields["gemm"] = value
    elif key == "short_k" and value.isdigit():
      fields["short_k"] = int(value)
    elif key == "arch" and value in ARCHS:
      fields["arch"] = value
    elif key.startswith("xla_") and value:
      xla.append(
        (key, int(value) if value.lstrip("-").isdigit() else {"true": True, "false": False}.get(value, value))
      )
    else:
      raise SystemExit(
        f"policy {text!r}: option {item!r} is not gemm=({'|'.join(GEMM_IMPLS)}), short_k=N, "
        f"arch=({'|'.join(ARCHS)}) or xla_<option>=value."
      )
  return Variant(**fields, xla=tuple(xla))


def build(task, policy_spec: str, batch, policy: PrecisionPolicy | None = None):
  """The training step of ``task`` under ``policy_spec`` (a ``Variant``'s text; ``policy``, if
  given, in place of its named policy), built and compiled."""
  v = parse_variant(policy_spec)
  with contextlib.ExitStack() as stack:
    stack.enter_context(fused_attention(v.policy in FUSED_ATTENTION))
    if v.gemm != "auto":
      stack.enter_context(gemm_api.use_impl(v.gemm))
    if v.short_k is not None:
      stack.enter_context(unittest.mock.patch.object(arch, "SHORT_K", v.short_k))
    if v.arch is not None:
      for api in (gemm_api, quantize_api):
        stack.enter_context(unittest.mock.patch.object(api, "gpu_arch", lambda: v.arch))
    return timing.build_train_step(
      task,
      policy or POLICIES[v.policy],
      batch,
      optimizer(),
      compiler_options=dict(v.xla) or None,
      variables=init(task, batch),
    )


def init(task, batch):
  """The model's variables, initialised by one jitted program on the batch's first example
  (no variable depends on the batch size), compiled without GEMM autotuning: op by op, a
  4096-wide GPT's initialisation dispatches and compiles hundreds of small programs."""
  inputs = jax.tree.map(lambda x: x[:1], task.inputs(batch))
  init_fn = jax.jit(lambda key, inputs: task.model.init(key, *inputs, **task.train_kwargs))
  options = {"xla_gpu_autotune_level": 0} if jax.default_backend() == "gpu" else None
  return init_fn.lower(jax.random.key(0), inputs).compile(options)(jax.random.key(0), inputs)


def step_cell(
  task, batch_size: int, policy_name: str, steps: int, compile_only: bool, categories: bool = False
):
  """``{metric: value, ...}`` of one training step cell (see the module docstring); with
  ``categories``, also its kernel time per ``e2e_inspect.step_category`` (a trace of 5 steps)."""
  batch = timing.device_batch(task, batch_size)
  out, policy = {}, None
  if parse_variant(policy_name).policy == AUTO:
    t0 = time.perf_counter()
    found = auto_policy(task, batch_size, progress=lambda msg: print(f"  auto: {msg}", flush=True))
    out["auto"] = {
      "measure_s": time.perf_counter() - t0,
      "winner": found.winner,
      "chosen": found.chosen,
      "step_ms": found.step_ms,
      "payoffs": [[p.op, p.base_ms, dict(p.preset_ms)] for p in found.payoffs],
    }
    policy = found.policy
  built = build(task, policy_name, batch, policy)
  out.update({f"{k[:-2]}_s": v for k, v in built.seconds.items()})  # trace_s, lower_s, compile_s
  out.update(jaxpr_stats(built.traced.jaxpr))
  lowered_text = built.lowered.as_text()
  out.update(custom_call_stats(lowered_text, built.compiled.as_text()))
  out["lowered_sha256"] = hashlib.sha256(lowered_text.encode()).hexdigest()
  t0 = time.perf_counter()
  jax.block_until_ready(built.run())
  out["first_call_s"] = time.perf_counter() - t0
  out["compile_total_s"] = sum(built.seconds.values()) + out["first_call_s"]
  out["xla_peak_bytes"] = timing.xla_peak_bytes(built.compiled)
  stats = built.compiled.memory_analysis()
  out["xla_temp_bytes"] = getattr(stats, "temp_size_in_bytes", None)
  if not compile_only:
    clock = timing.default_step_clock()
    ms, samples = timing.timed_ms(built.run, steps, clock=clock)
    out.update(
      step_ms=ms, step_ms_min=min(samples), step_ms_max=max(samples), clock=clock, samples=len(samples)
    )
    if categories:
      run = built.run
      per_kernel = kernels_by(profiler_events(lambda: jax.block_until_ready(run()), 5), 5)
      out["categories"], out["top_kernels"] = step_categories(per_kernel, built.compiled.as_text(), top=40)
      out["kernel_ms"] = sum(ms for ms, _ in per_kernel.values())
  out["device_peak_bytes"] = device_peak_bytes()
  del built
  gc.collect()
  return out


# -- profile ----------------------------------------------------------------------------------


def profile_cell(task, batch_size: int, policy_name: str, repeats: int = 5) -> dict:
  """GPU kernel time of one step: total, per ``kernel_kind``, and the 40 largest kernels with
  the JAX name stack of the HLO instruction of the same name (where there is one)."""
  batch = timing.device_batch(task, batch_size)
  built = build(task, policy_name, batch)
  jax.block_until_ready(built.run())
  events = profiler_events(lambda: jax.block_until_ready(built.run()), repeats)
  per_kernel = kernels_by(events, repeats)
  stacks = instruction_stacks(built.compiled.as_text())
  kinds = collections.defaultdict(lambda: [0.0, 0.0])
  for name, (ms, n) in per_kernel.items():
    kinds[kernel_kind(name)][0] += ms
    kinds[kernel_kind(name)][1] += n
  top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:40]
  return {
    "kernel_ms": sum(ms for ms, _ in per_kernel.values()),
    "kernels": sum(n for _, n in per_kernel.values()),
    "by_kind": {
      k: {"ms": v[0], "launches": v[1]} for k, v in sorted(kinds.items(), key=lambda kv: -kv[1][0])
    },
    "top": [[name, ms, n, stacks.get(name.replace(".", "_"), "")[-160:]] for name, (ms, n) in top],
  }


# -- units, budget, rows ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Unit:
  section: str  # gpt, cnn, profile, attention, conv
  arg: str = ""  # width, sequence or shape name
  policies: tuple[str, ...] = ()

  @property
  def name(self) -> str:
    return ":".join(x for x in (self.section, self.arg, "+".join(self.policies)) if x)


def parse_plan(text: str, args) -> list[Unit]:
  """``--plan``'s units (see the module docstring), defaults filled in."""
  units = []
  for item in filter(None, (s.strip() for s in text.split(","))):
    section, *rest = item.split(":")
    arg = rest[0] if rest else ""
    policies = tuple(rest[1].split("+")) if len(rest) > 1 else ()
    if section in ("gpt", "llama"):
      for width in [arg] if arg else [str(w) for w in args.widths]:
        for p in policies or args.policies:
          units.append(Unit(section, width, (p,)))
    elif section == "cnn":
      units += [Unit("cnn", "", (p,)) for p in (tuple(arg.split("+")) if arg else CNN_POLICIES)]
    elif section == "profile":
      width = arg or str(args.widths[0])
      units += [Unit("profile", width, (p,)) for p in policies or PROFILE_POLICIES]
    elif section == "attention":
      seqs = [arg] if arg else (["32", "64"] if args.tiny else ["512", "1024", "2048"])
      units += [Unit("attention", s) for s in seqs]
    elif section == "conv":
      shapes = TINY_CONV_SHAPES if args.tiny else CONV_SHAPES
      units += [Unit("conv", s) for s in ([arg] if arg else list(shapes))]
    else:
      raise SystemExit(
        f"--plan: unknown unit {item!r}. Fix: use gpt, llama, cnn, profile, attention or conv."
      )
    for u in units:
      for p in u.policies:
        parse_variant(p)
  return units


def run_unit(unit: Unit, args) -> list[dict]:
  """The rows of one unit, measured in this process."""
  device = jax.devices()[0].device_kind
  tags = {"run": args.run_id, "unit": unit.name}
  rows = []

  def row(case, metric, value, baseline=None, **extra):
    rows.append(result_row("e2e", case, metric, value, baseline, device, **tags, **extra))

  if unit.section in ("gpt", "llama", "cnn"):
    if unit.section == "cnn":
      (task, batch), case = e2e_resnet50(args.tiny), f"resnet50/{unit.policies[0]}"
    else:
      builder = e2e_gpt if unit.section == "gpt" else e2e_llama
      (task, batch), case = (
        builder(int(unit.arg), args.tiny),
        f"{unit.section}/d{unit.arg}/{unit.policies[0]}",
      )
    policy = unit.policies[0]
    res = step_cell(task, batch, policy, args.steps, args.compile_only, args.categories)
    earlier = run_rows(args.out_jsonl, args.run_id)
    base_case = baseline_case(case, {r["case"] for r in earlier})
    plain = {r["metric"]: r["value"] for r in earlier if r["case"] == base_case}
    extra = {"batch": batch, "policy": policy, "model": unit.section, "baseline_case": base_case}
    if "auto" in res:
      extra["auto"] = res["auto"]
    if "categories" in res:
      extra["categories"], extra["kernel_ms"] = res["categories"], res["kernel_ms"]
      extra["top_kernels"] = res["top_kernels"]
      overhead = sum(res["categories"][c]["ms"] for c in ("quantize", "cast_transpose"))
      extra["ceiling_ms"] = res["step_ms"] - overhead
    if "step_ms" in res:
      base = plain.get("step_ms")
      timing = {k: res[k] for k in ("step_ms_min", "step_ms_max", "clock")}
      row(
        case,
        "step_ms",
        res["step_ms"],
        base,
        **extra,
        **timing,
        speed=base / res["step_ms"] if base else None,
      )
    compile_keys = [k for k in res if k.endswith("_s") and k != "compile_total_s"]
    row(
      case,
      "compile_s",
      res["compile_total_s"],
      plain.get("compile_s"),
      **extra,
      **{k: res[k] for k in compile_keys},
    )
    structure = (
      "eqns",
      "dot_generals",
      "dot_generals_8bit",
      "pallas_calls",
      "distinct_pallas_kernels",
      "threefry_calls",
      "custom_calls",
    )
    row(
      case,
      "program",
      res.get("eqns", 0),
      **extra,
      **{k: res.get(k, 0) for k in structure[1:]},
      distinct_custom_call_bodies=res.get("distinct_custom_call_bodies", {}),
      compiled_custom_calls=res.get("compiled_custom_calls", {}),
      lowered_sha256=res["lowered_sha256"],
    )
    row(
      case,
      "peak_bytes",
      res["xla_peak_bytes"],
      **extra,
      xla_temp_bytes=res["xla_temp_bytes"],
      device_peak_bytes=res["device_peak_bytes"],
      isolated=args.isolate,
    )
  elif unit.section == "profile":
    task, batch = e2e_gpt(int(unit.arg), args.tiny)
    policy = unit.policies[0]
    res = profile_cell(task, batch, policy)
    row(
      f"profile/d{unit.arg}/{policy}",
      "kernel_ms",
      res["kernel_ms"],
      policy=policy,
      kernels=res["kernels"],
      by_kind=res["by_kind"],
      top=res["top"],
    )
  elif unit.section in ("attention", "conv"):
    if unit.section == "attention":
      cases, operands = attention_cases(int(unit.arg), args.tiny)
      res, base_case = time_micro(cases, operands, 3, args.steps), "bf16_einsum"
    else:
      shape = {**CONV_SHAPES, **TINY_CONV_SHAPES}[unit.arg]
      cases = {c: conv_case(p, impl, shape[-1]) for c, (p, impl) in CONV_CASES.items()}
      res, base_case = time_micro(cases, conv_operands(shape), 2, args.steps), "bf16"
    base = res.get(base_case, {}).get("ms")
    prefix = f"attention/seq{unit.arg}" if unit.section == "attention" else f"conv/{unit.arg}"
    for case, r in res.items():
      ms = r.get("ms")
      row(
        f"{prefix}/{case}",
        "fwd_bwd_ms",
        ms,
        base if ms else None,
        **{k: v for k, v in r.items() if k != "ms"},
      )
  return rows


def baseline_case(case: str, cases_run: set[str]) -> str:
  """The baseline of ``case``: the same model and width's ``plain_cudnn_attn`` cell where this run
  has one, else its ``plain`` cell."""
  prefix = case.rsplit("/", 1)[0]
  cudnn = f"{prefix}/plain_cudnn_attn"
  return cudnn if cudnn in cases_run and case != cudnn else f"{prefix}/plain"


def estimate_s(unit: Unit, done: dict[str, list[float]], backend: str) -> float:
  """Seconds ``unit`` is expected to take: the longest like unit measured so far (same section
  and policy) × 1.2, else ``UNIT_ESTIMATE_S`` on a GPU (0 elsewhere)."""
  key = unit.policies[0] if unit.policies else unit.section
  if done.get(key):
    return 1.2 * max(done[key])
  return UNIT_ESTIMATE_S.get(key, 60) if backend == "gpu" else 0.0


def unit_groups(units: list[Unit], isolate: bool) -> list[list[Unit]]:
  """Units run together: each alone, except that with ``isolate`` consecutive units of one
  section other than the step cells (profile, attention, conv) share a process."""
  groups: list[list[Unit]] = []
  for unit in units:
    shared = isolate and unit.section not in ("gpt", "llama", "cnn")
    if shared and groups and groups[-1][0].section == unit.section:
      groups[-1].append(unit)
    else:
      groups.append([unit])
  return groups


def child_command(group: list[Unit], args, remaining_s: float) -> list[str]:
  """The command that runs ``group`` in a fresh process, its rows appended to the same file."""
  plan = ",".join(u.name for u in group)
  cmd = [sys.executable, "-m", "benchmarks.e2e", "--plan", plan, "--run-id", args.run_id, "--child"]
  cmd += ["--steps", str(args.steps), "--out-jsonl", args.out_jsonl, "--budget-s", f"{remaining_s:.0f}"]
  cmd += ["--widths", *map(str, args.widths), "--policies", *args.policies]
  for flag in ("compile_only", "tiny", "categories"):
    if getattr(args, flag):
      cmd.append("--" + flag.replace("_", "-"))
  if args.compilation_cache:
    cmd += ["--compilation-cache", os.path.join(args.compilation_cache, re.sub(r"[^\w.-]", "_", plan))]
  return cmd


def emit(rows: list[dict], args) -> None:
  append_rows(args.out_jsonl, rows)
  out_dir = os.environ.get("OUT")
  if out_dir and os.path.abspath(os.path.join(out_dir, "e2e.jsonl")) != os.path.abspath(args.out_jsonl):
    append_rows(os.path.join(out_dir, "e2e.jsonl"), rows)


def run_rows(path: str, run_id: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [r for r in map(json.loads, f) if r.get("run") == run_id]


# -- main -------------------------------------------------------------------------------------


class OutOfTime(Exception):
  pass


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__.splitlines()[0])
  ap.add_argument("--plan", default="gpt,cnn", help="units, comma-separated (see the module docstring)")
  ap.add_argument(
    "--widths", nargs="+", type=int, default=None, help="GPT widths (default 768 1024 2048 4096)"
  )
  ap.add_argument(
    "--policies", nargs="+", default=list(GPT_POLICIES), help=f"GPT policies, of {sorted(POLICIES)}"
  )
  ap.add_argument("--steps", type=int, default=30, help="timed steps per cell (windows of 10 on a GPU)")
  ap.add_argument("--compile-only", action="store_true", help="compile (and run once); no step timing")
  ap.add_argument(
    "--categories", action="store_true", help="step cells also trace their kernels by category (5 steps)"
  )
  ap.add_argument(
    "--compilation-cache", help="JAX's persistent compilation cache folder (run twice: a restart's compile)"
  )
  ap.add_argument(
    "--budget-s", type=float, default=float("inf"), help="stop cleanly within this many seconds"
  )
  ap.add_argument("--isolate", action="store_true", help="every unit in a fresh process")
  ap.add_argument("--tiny", action="store_true", help="tiny models and shapes (CPU smoke test)")
  ap.add_argument(
    "--lower-for-cuda", action="store_true", help="only trace and lower the GPT steps for CUDA (no GPU)"
  )
  ap.add_argument("--out-jsonl", default=RESULTS)
  ap.add_argument("--run-id", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  t_start = time.perf_counter()
  args.widths = args.widths or ([64] if args.tiny else [768, 1024, 2048, 4096])
  args.run_id = args.run_id or f"e2e-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
  args.out_jsonl = os.path.abspath(args.out_jsonl)
  units = parse_plan(args.plan, args)
  if args.lower_for_cuda:
    return lower_units_for_cuda(units, args.tiny)
  try:
    os.makedirs(os.path.dirname(args.out_jsonl), exist_ok=True)
    with open(args.out_jsonl, "a"):
      pass
  except OSError as e:
    raise SystemExit(
      f"--out-jsonl {args.out_jsonl!r} cannot be written ({e}). Fix: pass a writable path."
    ) from None
  if args.compilation_cache:
    jax.config.update("jax_compilation_cache_dir", args.compilation_cache)

  def say(msg):
    if not args.child:
      print(f"[{time.perf_counter() - t_start:6.0f} s] {msg}", flush=True)

  def stop(signum, frame):
    raise OutOfTime(f"signal {signum}")

  signal.signal(signal.SIGTERM, stop)
  done: dict[str, list[float]] = {}
  args.backend, args.device = backend_and_device(args.isolate)
  say(f"run {args.run_id}: {len(units)} units on {args.backend} ({args.device}), budget {args.budget_s} s")
  try:
    for group in unit_groups(units, args.isolate):
      remaining = args.budget_s - (time.perf_counter() - t_start)
      need = estimate_s(group[0], done, args.backend)
      if need > remaining:
        reason = f"budget: needs ~{need:.0f} s, {remaining:.0f} s left"
        emit([skip_row(unit, args, "skipped", reason) for unit in group], args)
        say(f"{', '.join(u.name for u in group)}: skipped ({reason})")
        continue
      t0 = time.perf_counter()
      try:
        if args.isolate:
          timeout = max(remaining, 1) if math.isfinite(remaining) else None
          proc = subprocess.run(child_command(group, args, remaining), timeout=timeout, check=False)
          if proc.returncode != 0:
            raise RuntimeError(f"exit status {proc.returncode}")
        else:
          emit(run_unit(group[0], args), args)
      except subprocess.TimeoutExpired:
        reason = f"stopped at the budget after {time.perf_counter() - t0:.0f} s"
        emit([skip_row(unit, args, "failed", reason) for unit in group], args)
      except OutOfTime:
        raise
      except Exception as e:  # noqa: BLE001 - one failing unit is reported, the rest still run
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        emit([skip_row(unit, args, "failed", reason) for unit in group], args)
      took = time.perf_counter() - t0
      for unit in group:
        done.setdefault(unit.policies[0] if unit.policies else unit.section, []).append(took / len(group))
      say(f"{', '.join(u.name for u in group)}: {took:.0f} s")
  except (OutOfTime, KeyboardInterrupt) as e:
    say(f"stopped: {e}")
  if not args.child:
    print("\n" + table(run_rows(args.out_jsonl, args.run_id)))
  return 0


def lower_units_for_cuda(units: list[Unit], tiny: bool, builds: int = 3) -> int:
  """``--lower-for-cuda``: the GPT units' steps lowered for CUDA, ``builds`` times each."""
  if any(u.section not in ("gpt", "llama") for u in units):
    raise SystemExit(
      "--lower-for-cuda: only gpt and llama units are lowered. Fix: e.g. --plan gpt:768:int8_dense."
    )
  results = {}
  for unit in units:
    task, batch = (e2e_gpt if unit.section == "gpt" else e2e_llama)(int(unit.arg), tiny)
    policy = parse_variant(unit.policies[0]).policy
    results[f"{unit.section}/d{unit.arg}/{policy}"] = runs = []
    for _ in range(builds):
      jax.clear_caches()
      runs.append(lower_for_cuda(task, batch, POLICIES[policy], optimizer(), policy in FUSED_ATTENTION))
  print(lowered_table(results, kernels=True))
  return 0


def skip_row(unit: Unit, args, metric: str, reason: str) -> dict:
  """A row saying a unit was skipped or failed (``metric``), with why."""
  case = {
    "gpt": f"gpt/d{unit.arg}/{'+'.join(unit.policies)}",
    "llama": f"llama/d{unit.arg}/{'+'.join(unit.policies)}",
    "cnn": f"resnet50/{'+'.join(unit.policies)}",
  }
  name = case.get(unit.section, unit.name)
  return result_row(
    "e2e", name, metric, None, None, args.device, run=args.run_id, unit=unit.name, reason=reason
  )


def backend_and_device(isolate: bool) -> tuple[str, str]:
  """JAX's backend and device kind. With ``isolate`` they are read in a child process, so that
  this one never takes the accelerator (and its memory) from the units' processes."""
  if not isolate:
    return jax.default_backend(), jax.devices()[0].device_kind
  code = "import jax; print(jax.default_backend()); print(jax.devices()[0].device_kind)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
  backend, device = out.strip().splitlines()[-2:]
  return backend, device


if __name__ == "__main__":
  sys.exit(main())
