"""The catalog's modeled steps of ``benchmarks.e2e``'s GPTs against their measured H100 steps.

For each width of the committed measurements on ``--device`` (``benchmarks/results/e2e.jsonl``,
cases ``gpt/d<width>/plain`` and ``gpt/d<width>/int8_dense``: the median of their rows), the GPT
``benchmarks.common.zoo.e2e_gpt`` builds (bf16 modules) is traced abstractly, its ops costed
from the catalog on that device type (``planners.predictor.modeled``) and the step of one
device replayed (``planners.predictor.replay``) at the plain bf16 policy and with every
``dense`` / ``dense_general`` op at the ``int8`` preset. Printed: both steps, modeled and
measured, and the difference ``int8 − bf16`` the planner decides on. Every op's activations
are at the dtype the trace records (``OpShape.activation_dtype``: bf16 for these modules);
``--activation-dtype float32`` costs them as a float32 model's instead, to compare. Runs on a
CPU (nothing is measured here); rows go to ``benchmarks/results/catalog_check.jsonl``.

  python -m benchmarks.diagnosis.catalog_check [--device H200] [--widths 2048,4096] [--activation-dtype float32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import jax

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
from qsync_jax.policy import PrecisionPolicy, Rule
from qsync_jax.precision import OpPolicy

RESULTS = results_path("catalog_check")
E2E = results_path("e2e")
POLICIES = {
  "plain": PrecisionPolicy.uniform("bf16"),
  "int8_dense": PrecisionPolicy(
    rules=tuple(Rule(".*", OpPolicy.preset("int8"), kind) for kind in ("dense", "dense_general")),
    default=OpPolicy.preset("bf16"),
  ),
}


def measured_steps(device_type: str, path: str = E2E) -> dict[tuple[int, str], float]:
  """``{(width, policy): median step ms}`` of ``device_type``'s rows of ``POLICIES``' GPT cases in
  ``path``."""
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
        and parts[2] in POLICIES
      ):
        steps.setdefault((int(parts[1].removeprefix("d")), parts[2]), []).append(row["value"])
  return {key: statistics.median(values) for key, values in steps.items()}


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
  both = sorted({w for w, _ in measured if all((w, p) in measured for p in POLICIES)})
  widths = [int(w) for w in args.widths.split(",")] if args.widths else both
  missing = [w for w in widths if any((w, p) not in measured for p in POLICIES)]
  if not both:
    raise SystemExit(
      f"--device {args.device}: {E2E} has no step of {list(POLICIES)} measured on it. Fix: run "
      f"`python -m benchmarks.e2e` there first, or pick a device it has rows of."
    )
  if missing:
    raise SystemExit(
      f"--widths: no measured {args.device} rows of {list(POLICIES)} at {missing} in {E2E}. Fix: pick some of "
      f"{both}."
    )
  host = jax.devices()[0].device_kind
  lines, rows = [], []
  for w in widths:
    modeled = modeled_steps(args.device, w, args.activation_dtype)
    m_diff = measured[w, "int8_dense"] - measured[w, "plain"]
    p_diff = modeled["int8_dense"] - modeled["plain"]
    lines.append(
      [
        w,
        measured[w, "plain"],
        modeled["plain"],
        measured[w, "int8_dense"],
        modeled["int8_dense"],
        m_diff,
        p_diff,
      ]
    )
    extra = {"activation_dtype": args.activation_dtype or "traced", "modeled_on": args.device}
    for name in POLICIES:
      rows.append(
        result_row(
          "catalog_check",
          f"gpt/d{w}/{name}",
          "modeled_step_ms",
          modeled[name],
          measured[w, name],
          host,
          **extra,
        )
      )
  headers = [
    "width",
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
