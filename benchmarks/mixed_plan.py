"""A plan mixing precisions across groups against uniform plans, on simulated CPU devices.

Three groups of one simulated CPU device each (``cpu`` device type, ``--batch`` per device), the
same model and data; plans:

* ``uniform bf16``: every group bf16 (the baseline of the ratio column);
* ``uniform fp32`` and ``uniform int8_fwd``: every group at one of the mixed plan's precisions;
* ``mixed``: fp32, bf16 and int8_fwd, one group each — a 3-branch ``lax.switch`` in the step;
* ``mixed, convs as autodiff emits them`` (convnets only, with ``--show-unfixed``): the mixed plan
  with the branches' ``canonical_convs`` replaced by the identity, i.e. the gradient convolutions
  in the dimension order JAX's autodiff emits, which XLA:CPU's canonicalization pass does not
  rewrite inside a branch (``qsync_jax.train.canonical_convs``).

``--sync selsync`` / ``qsdp`` times the same plans in that strategy's step (``make_strategy_step``),
whose int8 group runs its gradient legs in bf16 (``int8_fwd_bf16``: these steps have no loss
scaling for fp16 legs); the rows' cases start with the sync. These steps carry no BatchNorm
statistics, so their convnet is ``vgg_plain``: the ``vgg`` example without its BatchNorm layers.

Timing: every round runs one blocked step of each plan in turn (round robin, so the shared
machine's noise hits all alike) after a compiling warm-up; the table shows each plan's median ms
per step (min–max) and the median over rounds of its per-round ratio to the baseline (with
quartiles). Rows go to ``benchmarks/results/mixed_plan.jsonl``. On a CPU host the simulated
devices share its cores: the figures compare programs, not devices.

  python -m benchmarks.mixed_plan                       # resnet, vgg and mlp (digits)
  python -m benchmarks.mixed_plan --models resnet --rounds 40 --show-unfixed
  python -m benchmarks.mixed_plan --models vgg_plain mlp --sync selsync --show-unfixed
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

import dataclasses  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

import qsync_jax.train.branch as branch_module  # noqa: E402
from benchmarks.common.result_rows import result_row, results_path, save_rows  # noqa: E402
from examples.data import digits  # noqa: E402
from examples.tasks.vision import classification_task  # noqa: E402
from qsync_jax.cluster import ClusterSpec, DeviceGroup  # noqa: E402
from qsync_jax.plan import Plan  # noqa: E402
from qsync_jax.train.strategy_step import make_strategy_step  # noqa: E402
from qsync_jax.train.task import load_task  # noqa: E402
from qsync_jax.train.train_step import make_train_step  # noqa: E402

RESULTS = results_path("mixed_plan")
GROUPS = ("g0", "g1", "g2")
CONVNETS = ("resnet", "vgg", "vgg_plain")
SYNCS = ("fp32", "selsync", "qsdp")
INT8_FWD_BF16 = {"__default__": {"fwd": "int8", "dlhs": "bf16", "drhs": "bf16"}}
"""int8 forward, bf16 gradient legs: the int8 group's policy in SelSync and QSDP (no loss scaling)."""


class PlainVGG(nn.Module):
  """The ``vgg`` example's network (its default stages) without BatchNorm."""

  stages: tuple[tuple[int, ...], ...] = ((16, 16), (32, 32), (64, 64))
  hidden: int = 64

  @nn.compact
  def __call__(self, x):
    for stage in self.stages:
      for features in stage:
        x = nn.relu(nn.Conv(features, (3, 3), padding="SAME")(x))
      x = nn.max_pool(x, (2, 2), (2, 2), padding="SAME")
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(self.hidden)(x))
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(digits.NUM_CLASSES)(x)


def load(model: str):
  """The task ``model`` names: ``vgg_plain`` (``PlainVGG`` on digits) or an example task."""
  if model != "vgg_plain":
    return load_task(model)
  train, test = digits.load(0.2, 0)
  task = classification_task("vgg_plain", PlainVGG(), train, test)
  return dataclasses.replace(task, train_kwargs={}, eval_kwargs={}, mutable=())


def plans(sync: str = "fp32") -> dict[str, Plan]:
  """The plans timed, by name; the int8 group's policy is ``int8_fwd`` in the hybrid step (fp32
  sync), ``INT8_FWD_BF16`` in a step-builder strategy's."""
  int8_name, int8 = ("int8_fwd", "int8_fwd") if sync == "fp32" else ("int8_fwd_bf16", INT8_FWD_BF16)
  policies = {"bf16": "bf16", "fp32": "fp32", int8_name: int8}
  uniform = {name: Plan.from_json({"policies": dict.fromkeys(GROUPS, p)}) for name, p in policies.items()}
  return {
    "uniform bf16": uniform["bf16"],
    "uniform fp32": uniform["fp32"],
    f"uniform {int8_name}": uniform[int8_name],
    "mixed": Plan.from_json({"policies": dict(zip(GROUPS, ("fp32", "bf16", int8)))}),
  }


def build(task, cluster, plan, sync="fp32", canonical=True):
  """``(one blocked step, seconds of the first step: compile included)`` of ``plan``'s step with
  ``sync`` (fp32: the hybrid step) on a fixed batch."""
  saved = branch_module.canonical_convs
  if not canonical:
    branch_module.canonical_convs = lambda fn: fn
  try:
    if sync == "fp32":
      program = make_train_step(task, cluster, plan, optax.adam(1e-3))
    else:
      program = make_strategy_step(task, cluster, plan, optax.adam(1e-3), sync)
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
    branch_module.canonical_convs = saved
  return one_step, compile_s


def run_model(model: str, batch: int, rounds: int, show_unfixed: bool, sync: str = "fp32") -> list[dict]:
  task = load(model)
  cluster = ClusterSpec(tuple(DeviceGroup(g, "cpu", 1, 16, batch) for g in GROUPS))
  steps = {}
  for name, plan in plans(sync).items():
    steps[name] = build(task, cluster, plan, sync)
  if show_unfixed and model in CONVNETS:
    unfixed = build(task, cluster, plans(sync)["mixed"], sync, canonical=False)
    steps["mixed, convs as autodiff emits them"] = unfixed
  times: dict[str, list[float]] = {name: [] for name in steps}
  for _ in range(rounds):
    for name, (one_step, _) in steps.items():
      times[name].append(one_step())
  base = times["uniform bf16"]
  kind = f"cpu ({os.cpu_count()} cores, 3 simulated devices)"
  step = "hybrid step, fp32 sync" if sync == "fp32" else f"{sync} step"
  print(f"\n{model}, {step}, batch {batch} per device, {rounds} rounds, {kind}, jax {jax.__version__}")
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
        f"{model}/b{batch}/{name}" if sync == "fp32" else f"{sync}/{model}/b{batch}/{name}",
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
  parser.add_argument(
    "--sync",
    choices=SYNCS,
    default="fp32",
    help="fp32: the hybrid step (default); selsync, qsdp: their steps",
  )
  parser.add_argument("--no-save", action="store_true")
  args = parser.parse_args(argv)
  rows = []
  for model in args.models:
    rows += run_model(model, args.batch, args.rounds, args.show_unfixed, args.sync)
  save_rows(RESULTS, rows, not args.no_save)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
