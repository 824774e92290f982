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

  python -m benchmarks.diagnosis.catalog_check [--device H200] [--widths 2048,4096] [--activation-dtype float32]
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
from planners.ops import ACTIVATION_PRECISIONS
from planners.predictor.modeled import modeled_profile
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
  kinds = device(device_type).kinds
  steps: dict[tuple[int, str], list[float]] = {}
  with open(path) as f:
    for line in f:
      row = json.loads(line)
      parts = row["case"].split("/")
      if (
        row.get("device") in kinds
        and row["metric"] == "step_ms"
        and len(parts) == 3
        and parts[0] == "gpt"
        and any(parts[2] in cells for pairs in MEASURED.values() for cells in pairs.values())
      ):
        steps.setdefault((int(parts[1].removeprefix("d")), parts[2]), []).append(row["value"])
  return {key: statistics.median(values) for key, values in steps.items()}


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
  args = ap.parse_args(argv)
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
