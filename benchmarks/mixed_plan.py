"""A plan mixing precisions across groups against uniform plans, on simulated CPU devices.

Three groups of one simulated CPU device each (``cpu`` device type, ``--batch`` per device), the
same model and data; plans:

* ``uniform bf16``: every group bf16 (the baseline of the ratio column);
* ``uniform fp32`` and ``uniform int8_fwd``: every group at one of the mixed plan's precisions;
* ``mixed``: fp32, bf16 and int8_fwd, one group each — a 3-branch ``lax.switch`` in the step;
* ``mixed, convs as autodiff emits them`` (convnets only, with ``--show-unfixed``): the mixed plan
  with the step's ``canonical_convs`` replaced by the identity, i.e. the gradient convolutions
  in the dimension order JAX's autodiff emits, which XLA:CPU's canonicalization pass does not
  rewrite inside a branch (``qsync_jax.train.canonical_convs``).

Timing: every round runs one blocked step of each plan in turn (round robin, so the shared
machine's noise hits all alike) after a compiling warm-up; the table shows each plan's median ms
per step (min–max) and the median over rounds of its per-round ratio to the baseline (with
quartiles). Rows go to ``benchmarks/results/mixed_plan.jsonl``. On a CPU host the simulated
devices share its cores: the figures compare programs, not devices.

  python -m benchmarks.mixed_plan                       # resnet, vgg and mlp (digits)
  python -m benchmarks.mixed_plan --models resnet --rounds 40 --show-unfixed
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=3"
).strip()

import jax  # noqa: E402
import optax  # noqa: E402

import qsync_jax.train.train_step as train_step_module  # noqa: E402
from benchmarks.common.result_rows import result_row, results_path, save_rows  # noqa: E402
from qsync_jax.cluster import ClusterSpec, DeviceGroup  # noqa: E402
from qsync_jax.plan import Plan  # noqa: E402
from qsync_jax.train.task import load_task  # noqa: E402
from qsync_jax.train.train_step import make_train_step  # noqa: E402

RESULTS = results_path("mixed_plan")
GROUPS = ("g0", "g1", "g2")
MIXED = ("fp32", "bf16", "int8_fwd")
CONVNETS = ("resnet", "vgg")


def plans() -> dict[str, Plan]:
  uniform = {p: Plan.from_json({"policies": dict.fromkeys(GROUPS, p)}) for p in ("bf16", "fp32", "int8_fwd")}
  return {
    "uniform bf16": uniform["bf16"],
    "uniform fp32": uniform["fp32"],
    "uniform int8_fwd": uniform["int8_fwd"],
    "mixed": Plan.from_json({"policies": dict(zip(GROUPS, MIXED))}),
  }


def build(task, cluster, plan, canonical=True):
  """``(one blocked step, seconds of the first step: compile included)`` of ``plan``'s step on a
  fixed batch."""
  saved = train_step_module.canonical_convs
  if not canonical:
    train_step_module.canonical_convs = lambda fn: fn
  try:
    program = make_train_step(task, cluster, plan, optax.adam(1e-3))
    batch = next(task.train_batches(program.global_batch, 0))
    holder = {"state": program.init(0, batch)}
    sharded = program.shard(batch)

    def one_step() -> float:
      t = time.perf_counter()
      holder["state"], metrics = program(holder["state"], sharded)
      jax.block_until_ready(metrics)
      return 1e3 * (time.perf_counter() - t)

    compile_s = one_step() / 1e3  # traces (under the patch above) and compiles
  finally:
    train_step_module.canonical_convs = saved
  return one_step, compile_s


def run_model(model: str, batch: int, rounds: int, show_unfixed: bool) -> list[dict]:
  task = load_task(model)
  cluster = ClusterSpec(tuple(DeviceGroup(g, "cpu", 1, 16, batch) for g in GROUPS))
  steps = {}
  for name, plan in plans().items():
    steps[name] = build(task, cluster, plan)
  if show_unfixed and model in CONVNETS:
    steps["mixed, convs as autodiff emits them"] = build(task, cluster, plans()["mixed"], canonical=False)
  times: dict[str, list[float]] = {name: [] for name in steps}
  for _ in range(rounds):
    for name, (one_step, _) in steps.items():
      times[name].append(one_step())
  base = times["uniform bf16"]
  kind = f"cpu ({os.cpu_count()} cores, 3 simulated devices)"
  print(f"\n{model}, batch {batch} per device, {rounds} rounds, {kind}, jax {jax.__version__}")
  print(f"{'plan':<38} {'ms/step median (min-max)':>26} {'ratio to uniform bf16 (quartiles)':>36}")
  rows = []
  for name, ts in times.items():
    ratios = [t / b for t, b in zip(ts, base)]
    q1, ratio, q3 = statistics.quantiles(ratios, n=4)
    median = statistics.median(ts)
    print(f"{name:<38} {median:>9.2f} ({min(ts):.2f}-{max(ts):.2f})      {ratio:>6.2f} ({q1:.2f}-{q3:.2f})")
    rows.append(
      result_row(
        "mixed_plan",
        f"{model}/b{batch}/{name}",
        "ms_per_step_median",
        median,
        statistics.median(base),
        kind,
        ratio=ratio,  # the median of the per-round ratios, not the ratio of the medians
        ratio_quartiles=[q1, q3],
        min_max=[min(ts), max(ts)],
        compile_s=steps[name][1],
        rounds=rounds,
      )
    )
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.mixed_plan", description=__doc__.splitlines()[0]
  )
  parser.add_argument("--models", nargs="+", default=["resnet", "vgg", "mlp"])
  parser.add_argument("--batch", type=int, default=16, help="per-device batch (default 16)")
  parser.add_argument("--rounds", type=int, default=30)
  parser.add_argument(
    "--show-unfixed", action="store_true", help="also time the mixed plan without canonical_convs"
  )
  parser.add_argument("--no-save", action="store_true")
  args = parser.parse_args(argv)
  rows = []
  for model in args.models:
    rows += run_model(model, args.batch, args.rounds, args.show_unfixed)
  save_rows(RESULTS, rows, not args.no_save)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
