"""Compiles each architecture's 8-bit kernels for sm75 … sm90 on a machine without those GPUs.

For each CUDA architecture of ``pallas_kernels.arch.KERNELS`` from sm75 on and each 8-bit kernel
implementation (``CASES``: the Pallas-Triton GEMM and quantize kernels, the Mosaic GPU GEMM,
XLA's int8 / fp8 dot, the jnp quantize), a tiny instance is lowered for CUDA and compiled by
XLA:GPU's device-less ahead-of-time compiler for a description of one GPU of that architecture
(``TARGETS``, written as XLA's ``GpuTargetConfigProto`` by ``target_config``). That is the
compiler a GPU of that architecture would run: XLA's own Triton for the Pallas-Triton kernels,
Mosaic GPU's pipeline, XLA's GEMM rewriter (cuBLAS, cuBLASLt or its Triton GEMM), then PTX to a
cubin for that ``sm_XX``. One row per (architecture, case) is appended to
``benchmarks/results/arch_paths.jsonl``:

* ``ok``: it compiled; ``error``: why not (the compiler's message; "not built" where the api
  itself takes another implementation for the case, e.g. Mosaic's mixed fp8 before jax 0.11);
* ``in_table``: the architecture's ``KERNELS`` entry uses this implementation for this operand
  kind (``in_table``); ``ok`` false there means that architecture runs the next implementation;
* ``kernels``: the compiled program's custom calls and custom fusion kinds;
* ``gemm_operands``: the element types XLA's compiled GEMM reads (``xla`` cases): ``f16`` where
  XLA widened the 8-bit operands, i.e. that architecture has no 8-bit tensor-core path for it.

What it proves: that each kernel compiles (or why it does not) for that target, with the
compiler a GPU of it uses. What it cannot: compiling is not running. No numerics, no timing
(``ratio_vs_bf16`` is null), no load- or launch-time checks, no autotuning (XLA takes its
default GEMM configuration; on a GPU it may pick another GEMM kernel), and the target
descriptions are written here from datasheets, not read from a device. The Pallas-Triton
lowering, run without a GPU, takes compute capability 9.0 for its own checks (only its
e4m3 conversions depend on it); XLA's Triton then compiles the kernel for the target.

Each architecture's cases run in a child process, restarted after a crash: an LLVM fatal error
(Triton's "f8e4m3 needs compute capability 8.9") aborts the process instead of raising.

Needs XLA's GPU compiler, which a CPU jaxlib lacks. In a separate environment (not the
project's ``.venv``), with V the project's jax version::

  pip install jax==V jaxlib==V jax-cuda12-plugin==V jax-cuda12-pjrt==V flax optax orbax-checkpoint
  PYTHONPATH=. python -m benchmarks.diagnosis.cross_compile [--arch sm80 sm89] [--no-save]

The CUDA plugin's version check, which needs a driver, is skipped
(``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` in the children's environment).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from benchmarks.common.result_rows import ROOT, append_rows, results_path
from pallas_kernels.arch import arch_kernels, eight_bit_kinds, gemm_impls
from qsync_jax.devices import DEVICES

RESULTS = results_path("arch_paths")
ARCHS = ("sm75", "sm80", "sm86", "sm89", "sm90")


@dataclasses.dataclass(frozen=True)
class Target:
  """One GPU of an architecture as XLA's compiler sees it: ``device`` names its entry of
  ``qsync_jax.devices.DEVICES`` (SM count, memory, bandwidth); the rest are the architecture's
  per-SM limits (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability")."""

  device: str
  smem_per_sm: int  # bytes of shared memory per SM
  smem_per_block_optin: int  # the most one block may opt in to
  threads_per_sm: int


# fmt: off
TARGETS: dict[str, Target] = {
  "sm75": Target("T4",        65536,  65536,  1024),
  "sm80": Target("A100-40GB", 167936, 166912, 2048),
  "sm86": Target("A10",       102400, 101376, 1536),
  "sm89": Target("L4",        102400, 101376, 1536),
  "sm90": Target("H200",      233472, 232448, 2048),
}
# fmt: on

CUDA_TOOLKIT = "12.8.0"
"""The CUDA runtime the descriptions claim: XLA rewrites fp8 dots to cuBLASLt's fp8 GEMM only
from CUDA 12 on (without a version it widens them to f16)."""


def target_config(arch: str) -> str:
  """XLA's ``stream_executor.GpuTargetConfigProto`` (text format) for ``TARGETS[arch]``."""
  if arch not in TARGETS:
    raise ValueError(f"arch={arch!r} has no target description. Fix: use one of {sorted(TARGETS)}.")
  t, number = TARGETS[arch], int(arch.removeprefix("sm"))
  d = DEVICES[t.device]
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {t.smem_per_sm}
  shared_memory_per_block_optin: {t.smem_per_block_optin}
  threads_per_core_limit: {t.threads_per_sm}
  core_count: {d.sm_count}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(d.mem_bw_gbps * 1e9)}
  device_memory_size: {int(d.memory_gb * 2**30)}
  cuda_compute_capability {{ major: {number // 10} minor: {number % 10} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  runtime_version: "{CUDA_TOOLKIT}"
  compile_time_toolkit_version: "{CUDA_TOOLKIT}"
}}
platform_name: "CUDA"
device_description_str: "{d.kinds[0]}"
"""


@dataclasses.dataclass(frozen=True)
class Case:
  """One kernel instance: ``op`` ``"gemm"`` (``lhs`` × ``rhs`` formats, contraction ``k``) or
  ``"quantize"`` (format ``lhs``; ``scales`` ``"row"``, ``"col"``, ``"pair"`` or ``"both_row"`` /
  ``"both_col"``: ``quantize_both`` of an activation / a weight), computed by
  ``impl`` (``"pallas"``, ``"mosaic"``, ``"xla"``, ``"reference"``)."""

  op: str
  lhs: str
  impl: str
  rhs: str = ""
  k: int = 0
  scales: str = ""

  @property
  def kind(self) -> str:
    return "int8" if self.lhs == "int8" else "fp8"

  @property
  def name(self) -> str:
    if self.op == "gemm":
      return f"{self.lhs}x{self.rhs} GEMM K={self.k}, {self.impl}"
    if self.scales == "pair":
      return f"quantize_pair {self.lhs} (row and column copies), {self.impl}"
    if self.scales.startswith("both_"):
      return f"quantize_both {self.lhs} per {self.scales[5:]} (both GEMM layouts), {self.impl}"
    return f"quantize {self.lhs} per {self.scales}, {self.impl}"


GEMM_K = {"pallas": 256, "mosaic": 512, "xla": 512}
"""The contraction of each GEMM case: the Triton kernel runs contractions up to ``SHORT_K``."""

CASES: tuple[Case, ...] = (
  *(
    Case("gemm", lhs, impl, rhs, GEMM_K[impl])
    for lhs, rhs in (("int8", "int8"), ("e4m3", "e4m3"), ("e5m2", "e4m3"))
    for impl in ("pallas", "mosaic", "xla")
  ),
  *(Case("quantize", fmt, "pallas", scales=s) for fmt in ("int8", "e4m3", "e5m2") for s in ("row", "col")),
  *(Case("quantize", fmt, "pallas", scales="pair") for fmt in ("int8", "e5m2")),
  *(Case("quantize", fmt, "pallas", scales=s) for fmt in ("int8", "e4m3") for s in ("both_row", "both_col")),
  Case("quantize", "int8", "reference", scales="row"),
)


def in_table(arch: str, case: Case) -> bool:
  """Whether ``arch``'s entry of ``KERNELS`` runs ``case.impl`` for this case."""
  if case.kind not in eight_bit_kinds(arch):
    return False
  if case.op == "gemm":
    return case.impl in gemm_impls(arch, case.kind, case.k)
  return case.impl == arch_kernels(arch).quantize


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = \(?(\w+)\[")
_GEMM_CALL = re.compile(r"(?:custom-call|fusion)\(([^)]*)\)")
_GEMM_KIND = re.compile(r'custom_call_target="__cublas|"kind":"__triton\w*gemm')


def gemm_operands(hlo: str) -> list[str]:
  """Element types of the first two operands of each GEMM of a compiled module's text (a cuBLAS
  custom call or a fusion XLA made into a GEMM), e.g. ``["s8", "s8"]``."""
  types = {m.group(1): m.group(2) for m in map(_DEF.match, hlo.splitlines()) if m}
  out = []
  for line in hlo.splitlines():
    if _GEMM_KIND.search(line):
      call = _GEMM_CALL.search(line)
      if call:
        names = [a.strip().lstrip("%") for a in call.group(1).split(",")][:2]
        out.extend(types.get(n, "?") for n in names)
  return out


def program_kernels(hlo: str) -> list[str]:
  """The custom-call targets and custom fusion kinds of a compiled module's text."""
  calls = re.findall(r'custom_call_target="([^"]+)"', hlo)
  return sorted(set(calls) | set(re.findall(r'"kind":"(__[\w$]+)"', hlo)))


ERROR_MARKS = ("Fatal Error", "error:", "FAILED_PRECONDITION:", "INTERNAL:", "Error:")
"""What starts the message of a failed compile, most telling first."""
NOISE = ("cuInit", "cudart_stub", "absl::InitializeLog")
"""Lines every child prints on a machine without a GPU driver."""


def first_error(text: str) -> str:
  """The compiler's message from ``text`` (an exception or a process's error output): from the
  first ``ERROR_MARKS`` mark on, the most telling mark first; else the last line."""
  lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not any(n in ln for n in NOISE)]
  for mark in ERROR_MARKS:
    for ln in lines:
      if mark in ln:
        return ln[ln.index(mark) :][:300]
  return lines[-1][:300] if lines else "no output"


# -- the child: lower and compile cases for one architecture ------------------------------------


def _build(case: Case):
  """``(function, argument shapes)`` of ``case``."""
  import jax.numpy as jnp

  from pallas_kernels.gemm import api as gemm_api
  from pallas_kernels.quantize import api as quantize_api
  from pallas_kernels.quantize.reference import QFORMATS

  if case.op == "gemm":
    dims = (((1,), (1,)), ((), ()))
    lhs, rhs = QFORMATS[case.lhs][0], QFORMATS[case.rhs][0]
    shapes = ((256, case.k, lhs), (256, case.k, rhs), (256, 1, jnp.float32), (256, 1, jnp.float32))

    def fn(a, b, sa, sb):
      return gemm_api.scaled_dot_general(a, b, sa, sb, dims, jnp.bfloat16, impl=case.impl)

    return fn, shapes
  shapes = ((256, 512, jnp.bfloat16),)
  if case.scales == "pair":
    return (lambda x: quantize_api.quantize_pair(x, case.lhs, 1, impl=case.impl)), shapes
  if case.scales.startswith("both_"):
    # an activation X (per row, contracting its last axis) or a weight W (per column, its first)
    axes = (1,) if case.scales == "both_row" else (0,)
    return (
      lambda x: quantize_api.quantize_both(x, case.lhs, axes, contract_axes=axes, impl=case.impl)
    ), shapes
  axes = (1,) if case.scales == "row" else (0,)
  return (lambda x: quantize_api.quantize(x, case.lhs, axes, impl=case.impl)), shapes


KERNEL_MARKS = {"pallas": "xla.gpu.triton", "mosaic": "mosaic_gpu"}
"""What names a Pallas kernel among a compiled program's custom calls, per implementation."""


@contextlib.contextmanager
def _stderr_to(file):
  """Sends this process's file descriptor 2 (where the compilers' C++ code writes) to ``file``."""
  sys.stderr.flush()
  saved = os.dup(2)
  os.dup2(file.fileno(), 2)
  try:
    yield
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)


def compile_case(arch: str, case: Case, sharding, log) -> dict:
  """Lowers ``case`` for CUDA and compiles it for ``arch``'s target (``sharding``: a device of
  its compile-only topology), the compilers' error output going to the file ``log``; the result
  fields of its row."""
  import unittest.mock

  import jax

  from pallas_kernels.gemm import api as gemm_api

  fn, shapes = _build(case)
  args = [jax.ShapeDtypeStruct((r, c), dt, sharding=sharding) for r, c, dt in shapes]
  t0 = time.perf_counter()
  try:
    with _stderr_to(log):
      # the api runs Mosaic GPU only on a GPU; the compile-only devices are one, for XLA
      with unittest.mock.patch.object(gemm_api, "on_gpu", lambda: True):
        lowered = jax.jit(fn).trace(*args).lower()
      hlo = lowered.compile().as_text()
  except Exception as e:  # noqa: BLE001 - a failure to compile is this row's finding
    log.seek(0)  # MLIR passes print their diagnostics there; the exception only says "failed"
    error = first_error(log.read() + "\n" + str(e))
    return {"ok": False, "error": error, "compile_s": round(time.perf_counter() - t0, 2)}
  kernels, seconds = program_kernels(hlo), round(time.perf_counter() - t0, 2)
  mark = KERNEL_MARKS.get(case.impl)
  if mark and not any(mark in k for k in kernels):
    error = f"not built: the api runs another implementation for this case (the program holds {kernels})"
    return {"ok": False, "error": error, "kernels": kernels, "compile_s": seconds}
  out = {"ok": True, "kernels": kernels, "compile_s": seconds}
  if case.impl == "xla":
    out["gemm_operands"] = gemm_operands(hlo)
  return out


def child(arch: str, log_path: str, names: list[str]) -> None:
  """Compiles the cases named ``names`` for ``arch``, printing one JSON line per case; each
  case's compiler error output goes to ``log_path`` (rewritten per case), where the parent
  reads it if the compile kills the process."""
  from jax.experimental import topologies
  from jax.sharding import NamedSharding, PartitionSpec

  topology = topologies.get_topology_desc(
    platform="cuda", topology_name="", topology="1x1x1", target_config=target_config(arch)
  )
  sharding = NamedSharding(topologies.make_mesh(topology, (1,), ("x",)), PartitionSpec())
  by_name = {c.name: c for c in CASES}
  for name in names:
    with open(log_path, "w+") as log:
      result = compile_case(arch, by_name[name], sharding, log)
    print(json.dumps({"case": name, **result}), flush=True)


# -- the parent: one child per architecture, restarted past a crash -----------------------------


def run_arch(arch: str, cases: tuple[Case, ...], say) -> dict[str, dict]:
  """``{case name: result}`` for ``arch``; a case whose compile killed its process gets
  ``ok`` false and the child's error output."""
  env = {**os.environ, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "PYTHONPATH": ROOT}
  results, todo = {}, [c.name for c in cases]
  with tempfile.TemporaryDirectory() as tmp:
    log_path = os.path.join(tmp, "compiler.log")
    while todo:
      cmd = [sys.executable, "-m", "benchmarks.diagnosis.cross_compile", "--child", arch, log_path, *todo]
      proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
      crash = open(log_path).read() if os.path.exists(log_path) else ""
      _take(proc, crash, arch, todo, results, say)
  return results


def _take(proc, crash: str, arch: str, todo: list[str], results: dict[str, dict], say) -> None:
  """Moves the cases a child reported from ``todo`` to ``results``; if the child died, the next
  case (the one it was compiling) fails with ``crash``, its compiler output."""
  for line in proc.stdout.splitlines():
    if line.startswith("{"):
      r = json.loads(line)
      name = r.pop("case")
      results[name] = r
      todo.remove(name)
      say(f"{arch} {name}: {'ok' if r['ok'] else r['error']}")
  if todo and proc.returncode != 0:
    if "No visible GPU devices" in proc.stderr or "topology not implemented" in proc.stderr:
      raise RuntimeError(f"XLA's GPU compiler is not installed here: {first_error(proc.stderr)}. {_FIX}")
    results[todo[0]] = {"ok": False, "error": "the compiler aborted: " + first_error(crash)}
    say(f"{arch} {todo[0]}: {results[todo[0]]['error']}")
    todo.pop(0)
  elif todo:
    raise RuntimeError(f"the {arch} child stopped early without an error: {proc.stderr[-400:]}")


_FIX = (
  "Fix: run it in an environment with jax-cuda12-plugin and jax-cuda12-pjrt of the jaxlib version "
  "(see the module docstring)."
)


def rows(arch: str, results: dict[str, dict], jax_version: str) -> list[dict]:
  """One ``arch_paths`` row per case of ``arch``."""
  date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  device = DEVICES[TARGETS[arch].device].kinds[0]
  out = []
  for case in CASES:
    if case.name not in results:
      continue
    out.append(
      {
        "benchmark": "arch_paths",
        "arch": arch,
        "op": case.name,
        "impl": case.impl,
        "ok": results[case.name]["ok"],
        "in_table": in_table(arch, case),
        "compiled_for": f"{arch} (XLA:GPU device-less compile for a {device} description, jax {jax_version}, no GPU)",
        "ratio_vs_bf16": None,
        **{k: v for k, v in results[case.name].items() if k != "ok"},
        "device": "none (CPU)",
        "date": date,
        "jax_version": jax_version,
      }
    )
  return out


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["--child"]:
    child(argv[1], argv[2], argv[3:])
    return 0
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.diagnosis.cross_compile", description=__doc__.splitlines()[0]
  )
  ap.add_argument("--arch", nargs="+", default=list(ARCHS), choices=sorted(TARGETS))
  ap.add_argument("--results", default=RESULTS)
  ap.add_argument("--no-save", action="store_true")
  args = ap.parse_args(argv)
  import jax

  say = lambda msg: print(msg, flush=True)  # noqa: E731
  out = [r for arch in args.arch for r in rows(arch, run_arch(arch, CASES, say), jax.__version__)]
  print(f"\n{'arch':5s} {'in table':8s} {'ok':5s} op")
  for r in out:
    print(f"{r['arch']:5s} {str(r['in_table']):8s} {str(r['ok']):5s} {r['op']}")
  if not args.no_save:
    append_rows(args.results, out)
    print(f"appended {len(out)} rows to {args.results}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
