"""The catalog's modeled steps of ``benchmarks.e2e``'s GPTs against their measured steps.

For each width of the committed measurements on ``--device`` (``benchmarks/results/e2e.jsonl``:
the median of the rows of a cell), the GPT ``benchmarks.common.zoo.e2e_gpt`` builds (bf16
modules) is traced abstractly, its ops costed from the catalog on that device type
(``planners.predictor.modeled``) and the step of one device replayed (``planners.predictor.replay``)
at the plain bf16 policy and with every ``dense`` / ``dense_general`` op at the ``int8`` preset.
The catalog prices one attention (its two products, the scores never written: cuDNN's fused
kernel); each pair of measured cells ``MEASURED`` names is compared where both were measured:
unfused attention (``plain``, ``int8_dense``) and cuDNN's fused attention
(``plain_cudnn_attn`` or ``bf16_fused_attn``, ``int8_dense_fused_attn``). Printed: both steps,
modeled and measured, and the difference ``int8 − bf16`` the planner decides on. Every op's
operands are at the dtype the trace records (``OpShape.activation_dtype``: bf16 for these
modules); ``--activation-dtype float32`` costs them as a float32 model's instead, to compare.
Runs on a CPU (nothing is measured here); rows go to ``benchmarks/results/catalog_check.jsonl``.

``--quantize-efficiency`` derives ``planners.catalog.QUANTIZE_EFFICIENCY`` instead: for each
8-bit cell of ``QUANTIZE_CELLS`` whose kernel time by category was measured on ``--device``
(``benchmarks.e2e --categories``: the latest row of each GPT or Llama-style model, width and
policy), the share of the device's bandwidth at which the catalog's quantize passes of that step
(``planners.predictor.modeled.quantize_leg_ms``: the bytes they read and write and one launch
each) take the measured quantize kernel time; the constant is the median share, to two places.

  python -m benchmarks.diagnosis.catalog_check [--device H200] [--widths 2048,4096] [--activation-dtype float32]
  python -m benchmarks.diagnosis.catalog_check --quantize-efficiency --device H200
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import jax

from benchmarks import e2e
from benchmarks.common import zoo
from benchmarks.common.op_profile import base_profile, model_ops
from benchmarks.common.result_rows import append_rows, result_row, results_path
from planners import catalog
from planners.ops import ACTIVATION_PRECISIONS
from planners.predictor.modeled import modeled_profile, quantize_leg_ms
from planners.predictor.replay import predict
from planners.profiler import timing
from planners.report import table
from qsync_jax.cluster import ClusterSpec
from qsync_jax.devices import DEVICES, device
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import OpPolicy

RESULTS = results_path("catalog_check")
POLICIES = {
  "plain": PrecisionPolicy.uniform("bf16"),
  # e2e's int8_dense, with the ops it leaves to the bf16 modules priced at bf16
  "int8_dense": dataclasses.replace(e2e.POLICIES["int8_dense"], default=OpPolicy.preset("bf16")),
}


MEASURED = {
  "unfused": {"plain": ("plain",), "int8_dense": ("int8_dense",)},
  "fused": {"plain": ("plain_cudnn_attn", "bf16_fused_attn"), "int8_dense": ("int8_dense_fused_attn",)},
}
"""attention → {modeled policy: the e2e GPT cells measuring it, the first measured one used}."""


def measured_steps(device_type: str, path: str = e2e.RESULTS) -> dict[tuple[int, str], float]:
  """``{(width, cell): median step ms}`` of ``device_type``'s rows of the GPT cells ``MEASURED``
  names in ``path``."""
  steps: dict[tuple[int, str], list[float]] = {}
  for row, (model, width, cell) in step_rows(device_type, path):
    if model == "gpt" and any(cell in cells for pairs in MEASURED.values() for cells in pairs.values()):
      steps.setdefault((width, cell), []).append(row["value"])
  return {key: statistics.median(values) for key, values in steps.items()}


def step_rows(device_type: str, path: str):
  """``(row, (model, width, cell))`` of every ``step_ms`` row of ``device_type`` in ``path`` whose
  case is ``model/dWIDTH/cell``."""
  kinds = device(device_type).kinds
  with open(path) as f:
    for line in f:
      row = json.loads(line)
      parts = row["case"].split("/")
      if row.get("device") in kinds and row["metric"] == "step_ms" and len(parts) == 3:
        yield row, (parts[0], int(parts[1].removeprefix("d")), parts[2])


def measured_pairs(measured: dict[tuple[int, str], float]) -> dict[tuple[int, str], dict[str, str]]:
  """``{(width, attention): {modeled policy: measured cell}}`` for every width and attention of
  ``MEASURED`` with a cell measured for both policies (the first measured of each tuple)."""
  out = {}
  for w in sorted({w for w, _ in measured}):
    for attention, policies in MEASURED.items():
      cells = {
        name: next((c for c in options if (w, c) in measured), None) for name, options in policies.items()
      }
      if all(cells.values()):
        out[w, attention] = cells
  return out


QUANTIZE_CELLS = ("int8_dense_fused_attn", "fp8_dense_fused_attn")
"""The e2e policies (every ``dense`` / ``dense_general`` op 8-bit on all legs, cuDNN attention)
whose measured quantize kernel time derives ``catalog.QUANTIZE_EFFICIENCY``."""
MODELS = {"gpt": zoo.e2e_gpt, "llama": zoo.e2e_llama}


def measured_quantize_ms(device_type: str, path: str = e2e.RESULTS) -> dict[tuple[str, int, str], float]:
  """``{(model, width, policy): quantize kernel ms per step}`` of ``device_type``: the ``quantize``
  category (the quantize kernels and their absmax reductions) of the latest ``step_ms`` row of each
  cell of ``QUANTIZE_CELLS`` that has one."""
  latest: dict[tuple[str, int, str], tuple[str, float]] = {}
  for row, key in step_rows(device_type, path):
    if "quantize" in (row.get("categories") or {}) and key[0] in MODELS and key[2] in QUANTIZE_CELLS:
      if key not in latest or row["date"] >= latest[key][0]:
        latest[key] = (row["date"], row["categories"]["quantize"]["ms"])
  return {key: ms for key, (_, ms) in latest.items()}


def modeled_quantize_ms(device_type: str, model: str, width: int) -> tuple[float, float]:
  """``(bytes ms, launches ms)``: what the catalog charges for the quantize passes of one step of
  the e2e ``model`` at ``width`` on ``device_type`` with every ``dense`` / ``dense_general`` op
  8-bit on all legs (``quantize_leg_ms``; the int8 and fp8 presets run the same passes), the bytes
  at ``catalog.QUANTIZE_EFFICIENCY``."""
  spec = device(device_type)
  task, batch = MODELS[model](width)
  ops, _ = model_ops(task, timing.device_batch(task, batch))
  dense = [o for o in ops if o.kind in e2e.DENSE_KINDS]

  def total(s):
    return sum(quantize_leg_ms(s, o, leg) * o.calls for o in dense for leg in ("fwd", "dlhs", "drhs"))

  bytes_ms = total(dataclasses.replace(spec, launch_us=0.0))
  return bytes_ms, total(spec) - bytes_ms


def quantize_shares(device_type: str, path: str = e2e.RESULTS) -> dict[tuple[str, int, str], float]:
  """``{cell: share}``: per measured cell (``measured_quantize_ms``), the share of the device's
  bandwidth at which the catalog's quantize passes (their bytes, then their launches) take the
  measured quantize kernel time."""
  out, charged = {}, {}
  for (model, width, policy), ms in sorted(measured_quantize_ms(device_type, path).items()):
    if (model, width) not in charged:
      charged[model, width] = modeled_quantize_ms(device_type, model, width)
    bytes_ms, launch_ms = charged[model, width]
    out[model, width, policy] = catalog.QUANTIZE_EFFICIENCY * bytes_ms / (ms - launch_ms)
  return out


def derived_quantize_efficiency(shares: dict) -> float:
  """``catalog.QUANTIZE_EFFICIENCY`` from ``quantize_shares``: their median, to two places."""
  return round(statistics.median(shares.values()), 2)


def print_quantize_efficiency(device_type: str) -> int:
  """Prints each measured cell's share and the derived constant; appends one row per cell."""
  shares = quantize_shares(device_type)
  if not shares:
    raise SystemExit(
      f"--device {device_type}: {e2e.RESULTS} has no quantize category of {QUANTIZE_CELLS} measured on it. "
      "Fix: run `python -m benchmarks.e2e --categories` with those policies there first."
    )
  measured = measured_quantize_ms(device_type)
  lines, rows, host = [], [], jax.devices()[0].device_kind
  for (model, width, policy), share in shares.items():
    bytes_ms, launch_ms = modeled_quantize_ms(device_type, model, width)
    lines.append(
      [model, width, policy.split("_")[0], measured[model, width, policy], bytes_ms + launch_ms, share]
    )
    extra = {"modeled_on": device_type, "modeled_quantize_ms": bytes_ms + launch_ms}
    rows.append(
      result_row(
        "catalog_check",
        f"{model}/d{width}/{policy}",
        "quantize_share",
        share,
        measured[model, width, policy],
        host,
        **extra,
      )
    )
  derived = derived_quantize_efficiency(shares)
  headers = ["model", "width", "format", "quantize ms meas.", "quantize ms model", "bandwidth share"]
  print(
    f"quantize kernels per step on one {device_type} (measured: e2e.jsonl categories; modeled: the catalog"
  )
  print(f"at QUANTIZE_EFFICIENCY {catalog.QUANTIZE_EFFICIENCY}):")
  print(table(headers, lines))
  print(
    f"median share: QUANTIZE_EFFICIENCY = {derived} (planners/catalog.py has {catalog.QUANTIZE_EFFICIENCY})"
  )
  append_rows(RESULTS, rows)
  print(f"appended {len(rows)} rows to {RESULTS}")
  return 0


def modeled_steps(device_type: str, width: int, activation_dtype: str | None = None) -> dict[str, float]:
  """``{policy: modeled step ms}`` of the e2e GPT at ``width`` on one ``device_type``; every op's
  activations at ``activation_dtype`` where given, else at its traced dtype."""
  task, batch = zoo.e2e_gpt(width)
  ops, param_bytes = model_ops(task, timing.device_batch(task, batch))
  if activation_dtype is not None:
    ops = [dataclasses.replace(op, activation_dtype=activation_dtype) for op in ops]
  traced = {
    "model": f"e2e_gpt_d{width}",
    "device_type": "cpu",
    "batch_per_device": batch,
    "ops": [op.to_json() for op in ops],
    "param_bytes": param_bytes,
  }
  profile = modeled_profile(base_profile(traced), device_type)
  cluster = ClusterSpec.uniform(device_type, 1, batch, memory_gb=1e3)
  return {
    name: predict(cluster, {device_type: profile}, Plan(policies={"all": policy})).step_ms
    for name, policy in POLICIES.items()
  }


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.diagnosis.catalog_check", description=__doc__.splitlines()[0]
  )
  ap.add_argument("--device", choices=sorted(d for d, t in DEVICES.items() if t.arch), default="H100")
  ap.add_argument(
    "--widths", default=None, help="comma-separated (default: every width measured at both policies)"
  )
  ap.add_argument("--activation-dtype", choices=sorted(ACTIVATION_PRECISIONS), default=None)
  ap.add_argument(
    "--quantize-efficiency",
    action="store_true",
    help="derive the catalog's QUANTIZE_EFFICIENCY from the device's measured quantize kernel times",
  )
  args = ap.parse_args(argv)
  if args.quantize_efficiency:
    return print_quantize_efficiency(args.device)
  measured = measured_steps(args.device)
  pairs = measured_pairs(measured)
  both = sorted({w for w, _ in pairs})
  if not both:
    raise SystemExit(
      f"--device {args.device}: {e2e.RESULTS} has no pair of cells {MEASURED} measured on it. Fix: run "
      f"`python -m benchmarks.e2e` there first, or pick a device it has rows of."
    )
  widths = [int(w) for w in args.widths.split(",")] if args.widths else both
  missing = [w for w in widths if w not in both]
  if missing:
    raise SystemExit(
      f"--widths: no measured {args.device} pair of cells at {missing} in {e2e.RESULTS}. Fix: pick some of {both}."
    )
  host = jax.devices()[0].device_kind
  lines, rows = [], []
  for w in widths:
    modeled = modeled_steps(args.device, w, args.activation_dtype)
    for (width, attention), cells in pairs.items():
      if width != w:
        continue
      meas = {name: measured[w, cell] for name, cell in cells.items()}
      lines.append(
        [
          w,
          attention,
          meas["plain"],
          modeled["plain"],
          meas["int8_dense"],
          modeled["int8_dense"],
          meas["int8_dense"] - meas["plain"],
          modeled["int8_dense"] - modeled["plain"],
        ]
      )
      extra = {"activation_dtype": args.activation_dtype or "traced", "modeled_on": args.device}
      for name, cell in cells.items():
        rows.append(
          result_row(
            "catalog_check", f"gpt/d{w}/{cell}", "modeled_step_ms", modeled[name], meas[name], host, **extra
          )
        )
  headers = [
    "width",
    "attention",
    "bf16 meas.",
    "bf16 model",
    "int8 meas.",
    "int8 model",
    "int8−bf16 meas.",
    "int8−bf16 model",
  ]
  print(f"ms per step on one {args.device} (measured: e2e.jsonl medians; modeled: the catalog, on this CPU):")
  print(table(headers, lines))
  append_rows(RESULTS, rows)
  print(f"appended {len(rows)} rows to {RESULTS}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
