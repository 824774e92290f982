"""The memory model's 8-bit steps against XLA's compiled peak on this machine's device.

``benchmarks.hybrid`` and ``qsync plan`` predict an 8-bit group's memory from corrections fitted to
the fp32 and the all-bf16 steps (``planners.profiler.fit.fit_memory``: ``other_bytes``,
``other_bytes_16bit``) and the per-op residuals of the 8-bit policy
(``planners.predictor.memory_model``). This script checks that on the device itself: for each model
of ``--models`` (``benchmarks.common.zoo.HYBRID_MODELS``, at its hybrid per-device batch) it
compiles the training step (``planners.profiler.timing.single_device_step``, Adam) under the
uniform fp32, bf16 and then each of ``--presets`` (8-bit) policies for the first local device, without
rematerialization (``traced_memory_gpu.NO_REMATERIALIZATION``), reads each program's peak
(``timing.xla_peak_bytes``: XLA's buffer assignment), fits the two corrections to the fp32 and bf16
peaks on the profile modeled for the device's type, and prints the 8-bit steps' modeled memory
beside their compiled peaks. Each row is appended to ``benchmarks/results/memory_8bit_gpu.jsonl`` as soon
as its step is compiled (measured: the compiled peak; modeled: the memory model's figure).

  python -m benchmarks.diagnosis.memory_8bit_gpu [--models gpt_350m bert_s128] [--presets int8 fp8]
  python -m benchmarks.diagnosis.memory_8bit_gpu --tiny --models gpt_350m --presets int8   # CPU
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

from benchmarks.common.op_profile import base_profile, build, traced_record
from benchmarks.common.result_rows import append_rows, result_row, results_path
from benchmarks.common.zoo import HYBRID_MODELS
from benchmarks.diagnosis.cross_compile import first_error
from benchmarks.diagnosis.traced_memory_gpu import compiled_peak
from planners.predictor.memory_model import memory_bytes
from planners.predictor.modeled import modeled_profile
from planners.profile import GroupCost
from planners.profiler.fit import SIXTEEN_BIT_PRESET, fit_memory
from qsync_jax.precision import PRESETS

RESULTS = results_path("memory_8bit_gpu")


def modeled_bytes(profile, preset: str) -> int:
  """The memory model's peak of the uniform ``preset`` step on one device of ``profile``'s type."""
  policies = {o.name: PRESETS[preset] for o in profile.ops}
  return int(memory_bytes(GroupCost("local", profile, policies, profile.batch_per_device)))


def check(name: str, presets, tiny: bool, say, emit) -> int:
  """Compiles ``name``'s fp32 and bf16 steps, fits the memory model to them, then each 8-bit preset's
  step: ``emit`` receives its row (compiled peak: measured; the memory model's: modeled) as soon as
  it is compiled, so a run cut short keeps the rows it reached. Returns the rows emitted."""
  import jax
  from jax.sharding import SingleDeviceSharding

  from qsync_jax.devices import device_type_of

  dev = jax.devices()[0]
  device_type = device_type_of(dev)
  record = traced_record(name, tiny)
  task, data, _ = build(name, tiny)
  sharding = SingleDeviceSharding(dev)

  def peak(preset: str) -> int | None:
    t0 = time.perf_counter()
    try:
      found, _ = compiled_peak(task, data, preset, sharding, as_gpu=False)
    except Exception as e:  # noqa: BLE001 - a preset that does not compile is reported, the others go on
      say(f"{name} {preset}: failed: {first_error(str(e))}")
      return None
    finally:
      gc.collect()
    say(f"{name} {preset}: compiled peak {found / 1e6:.1f} MB ({time.perf_counter() - t0:.1f} s)")
    return found

  fp32, sixteen = peak("fp32"), peak(SIXTEEN_BIT_PRESET)
  if fp32 is None or sixteen is None:
    return 0
  profile = fit_memory(modeled_profile(base_profile(record), device_type), fp32, sixteen)
  emitted = 0
  for preset in presets:
    compiled = peak(preset)
    if compiled is None:
      continue
    modeled = modeled_bytes(profile, preset)
    emit(
      result_row(
        "memory_8bit_gpu",
        f"{name}{'.tiny' if tiny else ''}/{preset}",
        "compiled_peak_bytes",
        compiled,
        modeled,
        dev.device_kind,
        modeled_bytes=modeled,
        fp32_peak_bytes=fp32,
        bf16_peak_bytes=sixteen,
        batch_per_device=record["batch_per_device"],
        device_type=device_type,
      )
    )
    emitted += 1
  return emitted


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.diagnosis.memory_8bit_gpu", description=__doc__.splitlines()[0]
  )
  ap.add_argument("--models", nargs="+", default=["gpt_350m", "bert_s128"], choices=HYBRID_MODELS)
  ap.add_argument("--presets", nargs="+", default=["int8", "fp8"], choices=["int8", "fp8", "int8_fwd"])
  ap.add_argument("--tiny", action="store_true", help="the models' CPU sizes")
  ap.add_argument("--results", default=RESULTS)
  ap.add_argument("--no-save", action="store_true")
  args = ap.parse_args(sys.argv[1:] if argv is None else argv)
  say = lambda msg: print(msg, flush=True)  # noqa: E731
  rows = []

  def emit(row: dict) -> None:
    rows.append(row)
    if not args.no_save:
      append_rows(args.results, [row])

  for name in args.models:
    check(name, args.presets, args.tiny, say, emit)
  print(
    f"\n{'model / preset':<22} {'compiled peak MB (measured)':>28} {'modeled MB':>11} {'modeled/measured':>17}"
  )
  for r in rows:
    print(
      f"{r['case']:<22} {r['value'] / 1e6:>28.1f} {r['modeled_bytes'] / 1e6:>11.1f} "
      f"{r['modeled_bytes'] / r['value']:>17.3f}"
    )
  return 0 if rows else 1


if __name__ == "__main__":
  sys.exit(main())
