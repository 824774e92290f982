"""The rest of the step's memory (``other_bytes``) of the hybrid study's models, fitted to XLA:GPU's compiled peak without a GPU.

``benchmarks.hybrid`` plans real-size models traced abstractly (``benchmarks.common.zoo.HYBRID_MODELS``);
their memory by their shapes (``benchmarks.common.op_profile.traced_memory``) counts parameters,
Adam state and the batch, not the rest of the step (logits, the loss's buffers, XLA's temporaries).
``qsync profile`` fits that rest, ``other_bytes`` (fp32 step) and ``other_bytes_16bit`` (all-bf16
step), to XLA's compiled peak of the step on the device (``planners.profiler.fit.fit_memory``).
This script does the same for the traced models with XLA:GPU's device-less ahead-of-time
compiler: each model's training step (``planners.profiler.timing.single_device_step``, Adam) at its
hybrid per-device batch, uniform fp32 and uniform bf16, is traced as on a GPU (``jax.default_backend``
reads ``"gpu"`` while it is traced, so attention takes the fused cuDNN kernel and 16-bit products
run as a GPU runs them), compiled without rematerialization (``NO_REMATERIALIZATION``) for one GPU
of ``TARGET_ARCH`` (``benchmarks.diagnosis.cross_compile``'s description of an A100-40GB, sm80:
buffer assignment hardly depends on the SM count, and most pools' training group is an A100), and
its peak read (``planners.profiler.timing.xla_peak_bytes``). ``fit_memory`` of the model's profile
modeled for the target's device (``corrections``: as ``benchmarks.hybrid`` plans it, no forward
headroom, its 16-bit activations counted at 2 bytes as a GPU keeps them, where the CPU's profile
counts them at 4) turns the two peaks into the corrections, written per
model to ``benchmarks/results/hybrid/traced_memory_gpu.json`` (``op_profile.GPU_MEMORY_FILE``) with
the target, the jax version and the date; ``benchmarks.hybrid`` reads them (``op_profile.fitted_memory``).

What it cannot see: the compile has no autotuning (XLA's default GEMM and fusion choices; a GPU may
pick kernels with other workspaces), and the peak is XLA's buffer assignment, not the allocator's
(no fragmentation, no cuDNN / cuBLAS workspaces outside the program).

Needs XLA's GPU compiler and cuDNN (the transformers' bf16 steps compile to cuDNN's fused
attention, whose graph the compiler builds): the environment of ``benchmarks.diagnosis.cross_compile``
(see its docstring) with ``pip install "nvidia-cudnn-cu12>=9.8,<10" nvidia-cublas-cu12`` added,
run from the repository root::

  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=. python -m benchmarks.diagnosis.traced_memory_gpu [--models gpt_350m]

A model whose compile fails is recorded with the error (and keeps no fitted corrections).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
import unittest.mock

from benchmarks.common.op_profile import GPU_MEMORY_FILE, base_profile, build, traced_record
from benchmarks.common.zoo import HYBRID_MODELS
from benchmarks.diagnosis.cross_compile import TARGETS, first_error, program_kernels, target_config
from planners.predictor.modeled import modeled_profile
from planners.profiler.fit import SIXTEEN_BIT_PRESET, fit_memory
from qsync_jax.jsonio import write_text_atomic

TARGET_ARCH = "sm80"
"""The GPU the steps are compiled for (``cross_compile.TARGETS``: an A100-40GB description)."""
PRESETS = ("fp32", SIXTEEN_BIT_PRESET)
NO_REMATERIALIZATION = {"xla_disable_hlo_passes": "rematerialization"}
"""XLA's options for the compiles: without its rematerialization, which recomputes activations until
the program fits the target's memory (GPT-350M's fp32 step at batch 8: 73 GiB, cut to 34 GiB for an
A100-40GB). The memory model counts the program as written, on any device: its corrections are fitted
to that program's peak, independent of the target's memory (on a device the step does not fit, the
planner takes micro-steps or the sharded update instead of XLA's recomputation, which it does not price)."""


def gpu_sharding(arch: str):
  """A sharding on the one device of a compile-only topology of ``arch``'s target."""
  from jax.experimental import topologies
  from jax.sharding import NamedSharding, PartitionSpec

  topology = topologies.get_topology_desc(
    platform="cuda", topology_name="", topology="1x1x1", target_config=target_config(arch)
  )
  return NamedSharding(topologies.make_mesh(topology, (1,), ("x",)), PartitionSpec())


def compiled_peak(task, data, preset: str, sharding, as_gpu: bool = True) -> tuple[int | None, list[str]]:
  """``(XLA's peak bytes, the program's custom calls and custom fusion kinds)`` of the training step
  of ``task`` on a batch shaped as ``data`` under the uniform ``preset``, traced as on a GPU (``as_gpu``;
  else as on this backend) and compiled for the device of ``sharding``."""
  import jax

  from planners.profiler import timing
  from qsync_jax.policy import PrecisionPolicy
  from qsync_jax.train.train_step import init_variables

  def on_device(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)

  batch = on_device(jax.eval_shape(lambda: data))
  variables = jax.eval_shape(lambda: init_variables(task, 0, data)[0])
  optimizer = timing.default_optimizer()
  opt_state = jax.eval_shape(optimizer.init, variables["params"])
  key = jax.eval_shape(lambda: jax.random.key(0))
  step = timing.single_device_step(task, PrecisionPolicy.uniform(preset), optimizer)
  backend = "gpu" if as_gpu else jax.default_backend()
  with unittest.mock.patch.object(jax, "default_backend", lambda: backend):
    lowered = step.trace(on_device(variables), on_device(opt_state), batch, on_device(key)).lower()
  compiled = lowered.compile(compiler_options=NO_REMATERIALIZATION)
  return timing.xla_peak_bytes(compiled), program_kernels(compiled.as_text())


def corrections(record: dict, fp32_peak: int, sixteen_bit_peak: int) -> dict[str, int]:
  """``other_bytes`` and ``other_bytes_16bit`` at which the memory model of ``record`` (a
  ``traced_record``), modeled for the device of ``TARGET_ARCH``, predicts the two peaks of the
  uniform fp32 and ``SIXTEEN_BIT_PRESET`` steps (``planners.profiler.fit.fit_memory``)."""
  profile = modeled_profile(base_profile(record), TARGETS[TARGET_ARCH].device)
  memory = fit_memory(profile, fp32_peak, sixteen_bit_peak).memory
  return {"other_bytes": memory["other_bytes"], "other_bytes_16bit": memory["other_bytes_16bit"]}


def fit_model(name: str, sharding, say) -> dict:
  """The model's entry of ``RESULTS``: its batch, the two compiled peaks, the fitted
  ``other_bytes`` / ``other_bytes_16bit``, the date, the compile seconds and the compiled programs' custom calls
  (cuDNN's fused attention in the bf16 step of a transformer); or the error that stopped it."""
  record = traced_record(name)
  task, data, _ = build(name, tiny=False)
  date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  entry = {"batch_per_device": record["batch_per_device"], "date": date, "memory_by_shapes": record["memory"]}
  peaks = {}
  for preset in PRESETS:
    t0 = time.perf_counter()
    try:
      peaks[preset], entry[f"{preset}_kernels"] = compiled_peak(task, data, preset, sharding)
    except Exception as e:  # noqa: BLE001 - a model that does not compile is this entry's finding
      say(f"{name} {preset}: failed: {first_error(str(e))}")
      return {**entry, "error": f"{preset} step: {first_error(str(e))}"}
    finally:
      gc.collect()
    entry[f"{preset}_compile_s"] = round(time.perf_counter() - t0, 1)
    say(f"{name} {preset}: peak {peaks[preset] / 2**30:.2f} GiB ({entry[f'{preset}_compile_s']} s)")
  if None in peaks.values():
    return {**entry, "error": "memory_analysis() gave no peak"}
  return {
    **entry,
    "fp32_xla_peak_bytes": peaks["fp32"],
    f"{SIXTEEN_BIT_PRESET}_xla_peak_bytes": peaks[SIXTEEN_BIT_PRESET],
    **corrections(record, peaks["fp32"], peaks[SIXTEEN_BIT_PRESET]),
  }


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.diagnosis.traced_memory_gpu", description=__doc__.splitlines()[0]
  )
  ap.add_argument("--models", nargs="+", default=list(HYBRID_MODELS), choices=HYBRID_MODELS)
  ap.add_argument("--results", default=GPU_MEMORY_FILE)
  args = ap.parse_args(sys.argv[1:] if argv is None else argv)
  import jax

  say = lambda msg: print(msg, flush=True)  # noqa: E731
  try:
    sharding = gpu_sharding(TARGET_ARCH)
  except Exception as e:  # noqa: BLE001 - a CPU jaxlib has no GPU compiler
    raise SystemExit(
      f"XLA's GPU compiler is not installed here: {first_error(str(e))}. Fix: run it in the environment "
      "of benchmarks.diagnosis.cross_compile (its docstring)."
    ) from None
  existing = json.load(open(args.results)) if os.path.exists(args.results) else {"models": {}}
  device = TARGETS[TARGET_ARCH].device
  out = {
    "compiled_for": f"{TARGET_ARCH} (XLA:GPU device-less compile for a {device} description, no GPU)",
    "jax_version": jax.__version__,
    "models": dict(existing.get("models", {})),
  }
  for name in args.models:
    out["models"][name] = fit_model(name, sharding, say)
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    write_text_atomic(args.results, json.dumps(out, indent=1) + "\n", "results file", SystemExit)
  for name, entry in out["models"].items():
    if "error" in entry:
      print(f"{name:10s} not fitted: {entry['error']}")
    else:
      print(
        f"{name:10s} other_bytes {entry['other_bytes'] / 2**30:7.2f} GiB, "
        f"other_bytes_16bit {entry['other_bytes_16bit'] / 2**30:7.2f} GiB"
      )
  print(f"wrote {args.results}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
