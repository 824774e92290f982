"""What each gradient-sync strategy sends, and what it costs, on 8 simulated CPU devices.

For each strategy (fp32 / bf16 / fp16 all-reduce, Global-QSGD, SelSync, QSDP), train the same
CNN on scikit-learn digits (``benchmarks.common.zoo.digits_cnn``; global batch 64, Adam 3e-3,
the same initial parameters and batch order) for ``--steps`` steps and report:

* ring bytes per step: what each device sends per step with ring collectives, from the
  collectives of the compiled step's HLO (``planners.profiler.hlo``: 2(n-1)/n of an all-reduce's
  buffer, (n-1)/n of an all-gather's, reduce-scatter's or all-to-all's); the ratio column
  compares it with fp32. SelSync's is the expected value ``always + sync fraction x sync
  branch``, the sync fraction measured in the run;
* buffer bytes: the sum of the collectives' buffer sizes (an all-to-all + all-gather pair
  covers the same buffers as one all-reduce but sends half as much);
* collectives per step (SelSync: on a sync step / on a local step);
* step time: median and interquartile range over the steps after the first (compile); the
  strategies' steps run round robin so that the shared machine's noise hits all alike;
* final training loss (mean of the last 10 steps) and held-out accuracy.

Ratios are against the fp32 all-reduce measured in the same run. The CPU "devices" share
memory, so step times measure the strategies' compute overhead, not network savings.

  python -m benchmarks.comm [--steps 150] [--strategies fp32 bf16 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks.common.result_rows import result_row, results_path, save_rows  # noqa: E402
from benchmarks.common.zoo import digits_cnn  # noqa: E402
from planners.profiler import hlo  # noqa: E402
from qsync_jax.cluster import ClusterSpec, DeviceGroup  # noqa: E402
from qsync_jax.sync import make_grad_sync, make_qsdp_step, make_selsync_step  # noqa: E402
from qsync_jax.train.task_step import task_loss  # noqa: E402
from qsync_jax.train.train_step import make_train_step  # noqa: E402

RESULTS = results_path("comm")
STRATEGIES = ("fp32", "bf16", "fp16", "global_qsgd", "selsync", "qsdp")
SEED, BATCH, LR = 0, 64, 3e-3


def accuracy(task, params) -> float:
  right = total = 0
  for batch in task.eval_batches(359):
    logits = task.model.apply({"params": params}, *task.inputs(batch), **task.eval_kwargs)
    right += int(jnp.sum(jnp.argmax(logits, -1) == jnp.asarray(batch["label"])))
    total += len(batch["label"])
  return right / total


@dataclasses.dataclass
class Run:
  bytes: float
  wire_bytes: float
  collectives: str
  times: list
  losses: list
  accuracy: float
  note: str = ""


class Case:
  """One strategy being benchmarked: its compiled step, state, batches and measurements."""

  def __init__(self, step, state, batches, key, finish):
    self.step_fn, self.state, self.batches, self.key, self.finish = step, state, batches, key, finish
    self.times, self.losses = [], []

  def args(self, i):
    batch = self.batches[i]
    return (self.state, batch) if self.key is None else (self.state, batch, jax.random.fold_in(self.key, i))

  def step(self, i):
    t0 = time.perf_counter()
    self.state, metrics = self.step_fn(*self.args(i))
    jax.block_until_ready(self.state)
    if i:  # the first step compiles
      self.times.append(time.perf_counter() - t0)
    self.losses.append(float(metrics["loss"]))


def hook_case(task, name, steps):
  cluster = ClusterSpec((DeviceGroup("cpu", "cpu", 8, 16, BATCH // 8),))
  ts = make_train_step(task, cluster, None, optax.adam(LR), make_grad_sync(name))
  host = task.train_batches(BATCH, SEED)
  batches = [ts.shard(next(host)) for _ in range(steps)]
  state = ts.init(SEED, next(task.train_batches(BATCH, SEED)))
  s = hlo.summarize(hlo.collectives(hlo.compiled_text(ts.step, state, batches[0])))

  def finish(case):
    return Run(
      s["bytes"], s["wire_bytes"], str(s["count"]), case.times, case.losses, accuracy(task, case.state.params)
    )

  return Case(ts.step, state, batches, None, finish), ts


def builder_case(task, name, steps, initial, mesh):
  loss_fn = task_loss(task, params_only=True)
  if name == "selsync":
    trainer = make_selsync_step(loss_fn, optax.adam(LR), mesh)
    params_of = trainer.consolidate
  else:
    trainer = make_qsdp_step(loss_fn, optax.adam(LR), initial, mesh, bucket_size=256)
    params_of = trainer.gather
  sharding = NamedSharding(mesh, P("data"))
  host = task.train_batches(BATCH, SEED)
  batches = [jax.device_put(next(host), sharding) for _ in range(steps)]
  state = trainer.init(initial)
  key = jax.random.key(SEED)
  text = hlo.compiled_text(trainer.step, state, batches[0], key)

  def finish(case):
    acc = accuracy(task, params_of(case.state))
    if name == "qsdp":
      s = hlo.summarize(hlo.collectives(text))
      return Run(s["bytes"], s["wire_bytes"], str(s["count"]), case.times, case.losses, acc)
    always = hlo.summarize(hlo.outside_conditionals(text))
    (branches,) = hlo.conditional_branches(text)
    synced = hlo.summarize(max(branches, key=len))
    syncs = int(case.state["syncs"])
    return Run(
      always["bytes"] + syncs / steps * synced["bytes"],
      always["wire_bytes"] + syncs / steps * synced["wire_bytes"],
      f"{always['count'] + synced['count']}/{always['count']}",
      case.times,
      case.losses,
      acc,
      note=f"synced {syncs}/{steps} steps",
    )

  return Case(trainer.step, state, batches, key, finish)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.comm", description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
  parser.add_argument("--no-save", action="store_true", help="do not append to benchmarks/results/comm.jsonl")
  args = parser.parse_args(argv)
  task = digits_cnn()
  names = ["fp32"] + [s for s in args.strategies if s != "fp32"]
  cases = {}
  initial = mesh = None
  for name in names:
    if name in ("selsync", "qsdp"):
      cases[name] = builder_case(task, name, args.steps, initial, mesh)
    else:
      cases[name], ts = hook_case(task, name, args.steps)
      if initial is None:
        initial, mesh = cases[name].state.params, ts.mesh
  # Round robin: step i of every strategy, then step i + 1, so machine noise hits all alike.
  for i in range(args.steps):
    for case in cases.values():
      case.step(i)
  runs = {name: case.finish(case) for name, case in cases.items()}

  base = runs["fp32"]
  device = f"{jax.devices()[0].platform} x{jax.device_count()} (simulated, {os.cpu_count()} cores)"
  header = (
    f"{'strategy':<12} {'ring B/step':>11} {'ratio':>6} {'buffer B':>9} {'colls':>6} "
    f"{'step ms (IQR)':>15} {'ratio':>6} {'loss':>7} {'acc':>6}  note"
  )
  print(f"\ncomm benchmark: DigitsCNN, {args.steps} steps, batch {BATCH}, {device}, jax {jax.__version__}")
  print(header)
  rows = []
  for name, r in runs.items():
    med, q1, q3 = (float(np.percentile(r.times, q)) * 1e3 for q in (50, 25, 75))
    base_med = float(np.median(base.times)) * 1e3
    loss = float(np.mean(r.losses[-10:]))
    base_loss = float(np.mean(base.losses[-10:]))
    print(
      f"{name:<12} {r.wire_bytes:>11.0f} {r.wire_bytes / base.wire_bytes:>6.3f} {r.bytes:>9.0f} {r.collectives:>6} "
      f"{med:>7.1f} ({q3 - q1:>4.1f}) {med / base_med:>6.2f} {loss:>7.4f} {r.accuracy:>6.3f}  {r.note}"
    )
    metrics = {
      "bytes_per_step": (r.bytes, base.bytes),
      "ring_bytes_per_step": (r.wire_bytes, base.wire_bytes),
      "step_time_ms_median": (med, base_med),
      "step_time_ms_iqr": (q3 - q1, None),
      "final_loss": (loss, base_loss),
      "eval_accuracy": (r.accuracy, base.accuracy),
    }
    for metric, (value, baseline) in metrics.items():
      rows.append(
        result_row(
          "comm",
          name,
          metric,
          value,
          baseline,
          device,
          steps=args.steps,
          collectives=r.collectives,
          note=r.note,
        )
      )
  save_rows(RESULTS, rows, not args.no_save)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
