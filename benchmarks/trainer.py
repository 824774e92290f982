"""Overhead of the hybrid data-parallel trainer against a plain ``jax.jit`` training step.

Same model (an MLP, ``benchmarks.common.zoo.mlp_task``), same optimizer, same batch, one device,
uniform (unquantized) policy:

* ``step``: the trainer's compiled step (``make_train_step``: shard_map over a 1-device
  mesh, step RNG, loss/metric packing) on a batch already on the device, against a plain
  ``jax.jit`` step (value_and_grad + optax update) on the same batch;
* ``loop``: ``Trainer.run`` (host batches cut and placed each step, metrics read one step
  late) against a plain loop that places each host batch and reads the loss one step late.
* ``paired``: one blocked step of each, alternating, many times; the median of the per-pair
  ratios (the most robust estimate on a loaded machine; blocking adds the dispatch cost);

Each case is timed ``--repeats`` times (``--steps`` steps each, after a warm-up), trainer and
plain interleaved; the table shows median and min–max in ms/step and the overhead
``trainer / plain - 1`` of the medians (target ≤ 3 %). Rows are appended to
``benchmarks/results/trainer.jsonl`` (benchmark, case, device, jax_version, date, metric,
value, baseline, ratio).

  python -m benchmarks.trainer                 # CPU, or the first GPU (bigger default model)
  python -m benchmarks.trainer --width 2048 --batch 512 --repeats 21
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

from benchmarks.common.result_rows import append_rows, result_row, results_path
from benchmarks.common.zoo import mlp_task
from qsync_jax.cluster import ClusterSpec
from qsync_jax.train.task import Task
from qsync_jax.train.train_step import make_train_step
from qsync_jax.train.trainer import Trainer

RESULTS = results_path("trainer")


def plain_step(task: Task, optimizer):
  """The reference: what a user writes without qsync-jax."""

  @jax.jit
  def step(params, opt_state, batch):
    def loss_fn(p):
      return task.loss(task.model.apply({"params": p}, *task.inputs(batch)), batch)

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss, **metrics}

  return step


def _time(fn, steps: int) -> float:
  t0 = time.perf_counter()
  fn(steps)
  return (time.perf_counter() - t0) / steps * 1e3


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.trainer", description=__doc__.splitlines()[0])
  # Defaults give a step of a few ms: MLP 3x512, batch 128 on the CPU; 4x4096, batch 4096 on a GPU.
  parser.add_argument("--width", type=int, help="hidden width (default 512 CPU, 4096 GPU)")
  parser.add_argument("--depth", type=int, help="hidden layers (default 3 CPU, 4 GPU)")
  parser.add_argument("--features", type=int, help="input features (default 256 CPU, 1024 GPU)")
  parser.add_argument("--batch", type=int, help="batch (default 128 CPU, 4096 GPU)")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument("--no-save", action="store_true")
  args = parser.parse_args(argv)

  device = jax.devices()[0]
  device_type = "cpu" if device.platform == "cpu" else "H100"
  defaults = (512, 3, 256, 128) if device.platform == "cpu" else (4096, 4, 1024, 4096)
  for name, value in zip(("width", "depth", "features", "batch"), defaults):
    if getattr(args, name) is None:
      setattr(args, name, value)
  task = mlp_task(args.features, args.width, args.depth, accuracy=True)
  optimizer = optax.adam(1e-3)
  cluster = ClusterSpec.uniform(device_type, 1, args.batch)
  host = task.train_batches(args.batch, 0)
  host_batches = [next(host) for _ in range(8)]

  # -- step: compiled step on a resident batch -----------------------------------------------
  ts = make_train_step(task, cluster, None, optimizer, devices=[device])
  state = ts.init(0, host_batches[0])
  t_batch = ts.shard(host_batches[0])
  step = plain_step(task, optimizer)
  # Own copies: on accelerators the trainer's step donates its input state.
  p_params = jax.tree.map(lambda x: jnp.array(x, copy=True), state.params)
  p_opt = jax.tree.map(lambda x: jnp.array(x, copy=True), state.opt_state)
  p_batch = jax.device_put(host_batches[0], device)
  holder = {"t": state, "p": (p_params, p_opt)}

  def run_trainer_step(n):
    s = holder["t"]
    for _ in range(n):
      s, _ = ts(s, t_batch)
    jax.block_until_ready(s)
    holder["t"] = s

  def run_plain_step(n):
    p, o = holder["p"]
    for _ in range(n):
      p, o, _ = step(p, o, p_batch)
    jax.block_until_ready((p, o))
    holder["p"] = (p, o)

  # -- loop: host data feeding and metrics read-back -----------------------------------------
  trainer = Trainer(task, cluster, None, optimizer, devices=[device])

  def run_trainer_loop(n):
    trainer.run(trainer.step + n)
    jax.block_until_ready(trainer.state)

  def run_plain_loop(n):
    p, o = holder["p"]
    pending = None
    for _ in range(n):
      p, o, m = step(p, o, jax.device_put(next(host), device))
      if pending is not None:
        float(pending["loss"])
      pending = m
    float(pending["loss"])
    jax.block_until_ready((p, o))
    holder["p"] = (p, o)

  cases = {"step": (run_trainer_step, run_plain_step), "loop": (run_trainer_loop, run_plain_loop)}
  # The trainer's loop draws its own host batches from the task (same generator, same cost).
  rows = []
  kind = f"{device.platform}:{device.device_kind}" + (
    f" ({os.cpu_count()} cores)" if device.platform == "cpu" else ""
  )
  print(
    f"\ntrainer overhead: MLP {args.depth}x{args.width}, batch {args.batch}, {args.steps} steps x "
    f"{args.repeats} repeats, {kind}, jax {jax.__version__}\n"
  )
  print(f"{'case':<6} {'plain ms/step':>22} {'trainer ms/step':>22} {'overhead':>9} {'(of min)':>9}")
  for case, (trainer_fn, plain_fn) in cases.items():
    trainer_fn(3)  # warm-up (compiles)
    plain_fn(3)
    t_times, p_times = [], []
    for r in range(args.repeats):  # ABBA order: a drift in machine load hits both alike
      if r % 2 == 0:
        t_times.append(_time(trainer_fn, args.steps))
        p_times.append(_time(plain_fn, args.steps))
      else:
        p_times.append(_time(plain_fn, args.steps))
        t_times.append(_time(trainer_fn, args.steps))
    t_med, p_med = statistics.median(t_times), statistics.median(p_times)
    ratio = t_med / p_med
    min_ratio = min(t_times) / min(p_times)
    print(
      f"{case:<6} {p_med:>9.3f} ({min(p_times):.3f}–{max(p_times):.3f}) "
      f"{t_med:>9.3f} ({min(t_times):.3f}–{max(t_times):.3f}) {100 * (ratio - 1):>+8.1f}% "
      f"{100 * (min_ratio - 1):>+8.1f}%"
    )
    rows.append(
      result_row(
        "trainer",
        f"{case}/mlp{args.depth}x{args.width}/b{args.batch}",
        "ms_per_step_median",
        t_med,
        p_med,
        kind,
        ratio_of_min=min_ratio,
        trainer_min_max=[min(t_times), max(t_times)],
        baseline_min_max=[min(p_times), max(p_times)],
        repeats=args.repeats,
        steps=args.steps,
      )
    )
  # -- paired: one blocked step of each, alternating; the median of the per-pair ratios ------
  ratios, t_one, p_one = [], [], []
  for r in range(args.repeats * args.steps):
    first, second = (run_trainer_step, run_plain_step) if r % 2 == 0 else (run_plain_step, run_trainer_step)
    a, b = _time(first, 1), _time(second, 1)
    t, p = (a, b) if r % 2 == 0 else (b, a)
    t_one.append(t)
    p_one.append(p)
    ratios.append(t / p)
  ratio = statistics.median(ratios)
  q1, _, q3 = statistics.quantiles(ratios, n=4)
  t_med, p_med = statistics.median(t_one), statistics.median(p_one)
  print(
    f"{'paired':<6} {p_med:>9.3f} {'':>12} {t_med:>9.3f} {'':>12} {100 * (ratio - 1):>+8.1f}%"
    f"   (median of {len(ratios)} per-step ratios; quartiles {100 * (q1 - 1):+.1f}% / {100 * (q3 - 1):+.1f}%)"
  )
  rows.append(  # ratio: the median of the per-pair ratios, not the ratio of the medians
    result_row(
      "trainer",
      f"paired/mlp{args.depth}x{args.width}/b{args.batch}",
      "ms_per_step_median",
      t_med,
      p_med,
      kind,
      ratio=ratio,
      ratio_quartiles=[q1, q3],
      pairs=len(ratios),
    )
  )
  print(
    "\noverhead = trainer median / plain median - 1 (target <= +3%); (of min) = the same with the"
    "\nfastest repeat of each, the least disturbed estimate on a loaded machine"
  )
  if not args.no_save:
    append_rows(RESULTS, rows)
    print(f"appended {len(rows)} rows to {os.path.relpath(RESULTS)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
