"""Measured sensitivities Ω and gradient payload costs of the hybrid study's models, on one device.

``benchmarks.hybrid`` plans real-size models (``benchmarks.common.zoo.HYBRID_MODELS``) that it
traces without running them; their op sensitivities are a synthetic draw unless this script has
measured them. For each model it runs what ``qsync indicator`` runs (``qsync_cli.indicator``): the
``gradient`` indicator (``planners.indicator.compute``, its ``moments`` estimator, the one ``qsync
plan`` and ``auto_policy`` read) on ``--batches`` training batches at the model's initial
parameters (``planners.indicator.initial_variables``, after ``--train-steps`` fp32 steps), and the
accuracy cost of every gradient sync's payload against fp32 on the same batches
(``planners.indicator.payload_cost.measure_payload``) at every device count a pool of
``benchmarks.hybrid.POOLS`` can run (``pool_device_counts``: the payload's cost depends on the
devices that sum it). Each model's table is written atomically to
``benchmarks/results/hybrid/omega_<model>.json`` (``omega_path``): a ``qsync-indicator/1`` table
(``planners.indicator.load`` reads it; so does ``qsync plan --indicator``) whose ``metadata`` adds
the probed batch, the batch its Ω judges (``loss_batch_size``: the model's per-device batch in the
hybrid study), the batches, steps, seed, device kind, jax version and the seconds of each phase.

Probed batch: the model's per-device batch of the study (``zoo.MODELS[model].batch``) except where
``PROBE_BATCH`` says otherwise (the probe keeps every op's output error at each probed precision
until its backward: four activation copies); its Ω is then rescaled by the estimator to the study's
batch (``loss_batch_size``). The payload's cost is measured at the probed batch (each simulated
device holds one batch's gradient).

  python -m benchmarks.diagnosis.hybrid_omega                          # every model, on a GPU
  python -m benchmarks.diagnosis.hybrid_omega --models bert_s128 --budget-s 500 --out-dir $OUT
  python -m benchmarks.diagnosis.hybrid_omega --tiny --models bert_s128 # the CPU size, seconds

``--budget-s S`` starts a model only when the seconds spent so far plus its expected seconds fit in
``S`` (``EXPECTED_S``, an estimate, scaled by the measured over the expected seconds of the models
already measured in the run); the others are skipped, and said so. The table is written once Ω is
measured and again after each device count's payload (``payload_order``: whole pools' counts first), so a
run cut short keeps what it measured. A model that fails (out of memory, a compile error) is reported,
the others still run; the exit status is then 1. ``--tiny`` measures the models' CPU sizes (``zoo.get(model, tiny=True)``)
into ``omega_<model>.tiny.json``, which ``python -m benchmarks.hybrid --tiny`` plans with.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import time

from benchmarks.common import zoo
from benchmarks.common.zoo import HYBRID_MODELS
from benchmarks.hybrid import OMEGA_DIR, POOLS, omega_path

PROBE_BATCH = {"gpt_774m": 4}
"""Per-device batches the probe runs at where the study's does not fit one H200 (GPT-774M at 8:
about 55 GB of probed output errors beside the fp32 step's own ~45 GB of activations)."""
EXPECTED_S = {"resnet50": 240, "bert_s128": 270, "bert_s512": 400, "gpt_350m": 550, "gpt_774m": 900}
"""Expected seconds per model on one H200, for ``--budget-s`` only: an estimate, not a measurement. The
probe's compile dominates; its program has 16.8 k (ResNet-50), 19.5 k (BERT), 38.2 k (GPT-350M) and
57.0 k (GPT-774M) StableHLO ops against 4.2 k for a 2-block d2048 GPT whose indicator took ~50 s on
an H200, taken as linear in the ops (an upper estimate where the compile's GEMM autotuning, shared
by repeated shapes, dominates), plus the gradient's and the payload windows' compiles. Measured on one
H200 (jax 0.11.2): BERT s512 403 s (Ω 89 s, payloads 245 s), GPT-350M 549 s (Ω 325 s, payloads 136 s);
GPT-774M's figure is extrapolated from those, not measured."""
TINY_EXPECTED_S = 30


def pool_device_counts(pools=POOLS) -> list[int]:
  """Every number of devices a plan of ``pools`` can run on (the counts of any non-empty subset of a
  pool's groups), ascending: the device counts whose payload cost a plan may be charged."""
  counts = set()
  for groups in pools.values():
    sizes = [n for _, n in groups]
    for r in range(1, len(sizes) + 1):
      counts.update(sum(c) for c in itertools.combinations(sizes, r))
  return sorted(counts)


def payload_order(devices, pools=POOLS) -> list[int]:
  """``devices`` in the order their payloads are measured: first the counts of whole pools, then of
  one group of a pool (a training group alone), then the rest ascending — so that a run cut short
  has the counts most plans run at."""
  whole = {sum(n for _, n in groups) for groups in pools.values()}
  one = {n for groups in pools.values() for _, n in groups}
  return sorted(dict.fromkeys(devices), key=lambda n: (n not in whole, n not in one, n))


def measure(
  model: str, tiny: bool, batches: int, train_steps: int, seed: int, devices, say=print, save=None
) -> dict:
  """The indicator table of ``model`` (module docstring) with its ``payload`` section and the
  measurement's ``metadata``. ``save``, where given, receives the table once Ω is measured (no
  ``payload`` yet) and after each device count's payload (``payload_order``), so that a run cut
  short keeps what it measured."""
  import jax

  from planners.indicator import compute, initial_variables, unreached_note
  from planners.indicator.payload_cost import measure_payload

  task, study_batch = zoo.get(model, tiny)
  batch = study_batch if tiny else PROBE_BATCH.get(model, study_batch)
  seconds = {}
  t0 = time.perf_counter()
  stream = task.train_batches(batch, seed + 1)  # as `qsync indicator --seed`
  data = [next(stream) for _ in range(batches)]
  variables = initial_variables(task, seed, train_steps, batch)
  seconds["variables"] = time.perf_counter() - t0
  say(f"{model}: probing {batches} batches of {batch} (Ω judged at a batch of {study_batch})")
  t0 = time.perf_counter()
  table = compute(task, variables, data, ["gradient"], seed=seed, loss_batch_size=study_batch)["gradient"]
  seconds["omega"] = time.perf_counter() - t0
  say(f"{model}: Ω of {len(table['ops'])} ops in {seconds['omega']:.1f} s; payloads at {devices} devices")
  if note := unreached_note(table, train_steps):
    say(f"{model}: warning: {note}")
  device = jax.devices()[0]

  def with_metadata(payload=None):
    if payload is not None:
      table["payload"] = payload
      seconds["payload"] = time.perf_counter() - t0
    table["metadata"].update(
      model=model,
      tiny=tiny,
      batch=batch,
      loss_batch_size=study_batch,
      train_steps=train_steps,
      seed=seed,
      device=device.device_kind,
      backend=jax.default_backend(),
      seconds={k: round(v, 1) for k, v in seconds.items()},
    )
    return table

  if save is not None:
    save(with_metadata())
  t0 = time.perf_counter()
  on_count = None if save is None else (lambda section: save(with_metadata(section)))
  return with_metadata(measure_payload(task, variables, data, payload_order(devices), seed, on_count))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.diagnosis.hybrid_omega", description=__doc__.splitlines()[0]
  )
  ap.add_argument(
    "--models", default=",".join(HYBRID_MODELS), help=f"comma-separated of {list(HYBRID_MODELS)}"
  )
  ap.add_argument("--tiny", action="store_true", help="the models' CPU sizes (omega_<model>.tiny.json)")
  ap.add_argument(
    "--batches", type=int, default=None, help="probed batches (default: the most devices counted)"
  )
  ap.add_argument("--train-steps", type=int, default=0, help="fp32 steps before probing (default 0)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument(
    "--devices",
    default=None,
    help="comma-separated device counts of the payloads (default: pool_device_counts())",
  )
  ap.add_argument(
    "--budget-s", type=float, default=None, help="start a model only if it is expected to end by then"
  )
  ap.add_argument("--out-dir", default=OMEGA_DIR, help=f"where the tables go (default {OMEGA_DIR})")
  args = ap.parse_args(sys.argv[1:] if argv is None else argv)
  models = args.models.split(",")
  unknown = [m for m in models if m not in HYBRID_MODELS]
  if unknown:
    raise SystemExit(f"--models: unknown {unknown}. Fix: use some of {list(HYBRID_MODELS)}, comma-separated.")
  try:
    devices = sorted({int(n) for n in args.devices.split(",")}) if args.devices else pool_device_counts()
  except ValueError:
    raise SystemExit(f"--devices {args.devices!r}: not integers. Fix: pass e.g. --devices 4,8.") from None
  if devices[0] < 1:
    raise SystemExit(
      f"--devices {args.devices}: a count below 1. Fix: pass counts from 1, e.g. --devices 4,8."
    )
  batches = args.batches if args.batches is not None else max(devices)
  if batches < max(devices):
    raise SystemExit(
      f"--batches {batches}: the payload at {max(devices)} devices needs as many batches (one per simulated "
      f"device). Fix: pass --batches {max(devices)} or more."
    )
  if args.train_steps < 0:
    raise SystemExit(f"--train-steps {args.train_steps} must be 0 or more. Fix: pass e.g. --train-steps 20.")
  from qsync_jax.errors import QsyncError
  from qsync_jax.jsonio import write_text_atomic

  start, done, took = time.perf_counter(), [], {}
  say = lambda msg: print(f"[{time.perf_counter() - start:6.1f} s] {msg}", flush=True)  # noqa: E731
  estimate = lambda m: TINY_EXPECTED_S if args.tiny else EXPECTED_S[m]  # noqa: E731
  failed = {}
  for model in models:
    scale = sum(took.values()) / sum(estimate(m) for m in took) if took else 1.0
    expected = round(estimate(model) * scale)
    spent = time.perf_counter() - start
    if args.budget_s is not None and spent + expected > args.budget_s:
      say(f"{model}: skipped (expected {expected} s after {spent:.0f} s: over --budget-s {args.budget_s:g})")
      continue
    path = omega_path(model, args.tiny, args.out_dir)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def save(table, path=path, model=model):
      write_text_atomic(path, json.dumps(table, indent=1) + "\n", "Ω table", QsyncError)
      measured = (table.get("payload") or {}).get("devices", [])
      say(f"{model}: wrote {path} (Ω; payloads at {measured or 'no'} devices)")

    try:
      table = measure(model, args.tiny, batches, args.train_steps, args.seed, devices, say, save)
    except Exception as e:  # noqa: BLE001 - a model that does not fit or compile: the others still run
      failed[model] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
      say(f"{model}: failed ({failed[model]}); its table keeps what was measured before, if anything")
      gc.collect()
      continue
    took[model] = time.perf_counter() - start - spent
    done.append(model)
    say(
      f"{model}: wrote {path} in {took[model]:.1f} s (expected {expected} s; {table['metadata']['seconds']})"
    )
    del table
    gc.collect()
  skipped = [m for m in models if m not in done and m not in failed]
  print(
    f"measured {len(done)} of {len(models)} models"
    + (f"; skipped {', '.join(skipped)}" if skipped else "")
    + (f"; failed {', '.join(failed)}" if failed else "")
  )
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
