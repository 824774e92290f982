"""Overhead of the hybrid data-parallel trainer against a plain ``jax.jit`` training step, and
the rate the ``Trainer`` prints against that step's time.

Same model (an MLP, ``benchmarks.common.zoo.mlp_task``), same optimizer, same batch, one device,
uniform (unquantized) policy. The host batches are 8 generated once and cycled (``cycled``):
feeding one costs its copy to the device, not the generator's sampling (tens of ms for 4096 × 1024
normals, which would hide the step). Cases, each row printed as soon as it is measured:

* ``step``: the trainer's compiled step (``make_train_step``: shard_map over a 1-device
  mesh, step RNG, loss/metric packing) on a batch already on the device, against a plain
  ``jax.jit`` step (value_and_grad + optax update) on the same batch;
* ``printed``: the rate a fresh ``Trainer`` PRINTS (parsed from its progress line: the first
  that shows a rate, at step ``--steps``, over the steps after the one that compiled) as ms per
  step, against the plain step's median ms of the ``step`` case; the line's TFLOP/s per device
  and MFU (from the step's traced jaxpr and the device table's peak) are shown next to the
  MLP's FLOPs counted by hand at that rate;
* ``loop``: ``Trainer.run`` (host batches cut and placed each step, metrics read one step
  late) against a plain loop that places each host batch and reads the loss one step late;
* ``paired``: one blocked step of each, alternating, ``--repeats × --steps`` times; the median
  of the per-pair ratios (the most robust estimate on a loaded machine; blocking adds the
  dispatch cost).

``step`` and ``loop`` are timed ``--repeats`` times (``--steps`` steps each, after a warm-up),
trainer and plain interleaved; the table shows median and min–max in ms/step and the overhead
``trainer / plain - 1`` of the medians (target ≤ 3 %). Progress lines carry the seconds since the
start and the compilations so far. Rows are appended to ``benchmarks/results/trainer.jsonl``.

  python -m benchmarks.trainer                 # CPU, or the first GPU (bigger default model)
  python -m benchmarks.trainer --quick         # 3 repeats of 30 steps
  python -m benchmarks.trainer --width 2048 --batch 512 --repeats 21
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

from benchmarks.common.progress import Progress
from benchmarks.common.result_rows import append_rows, result_row, results_path
from benchmarks.common.zoo import mlp_task
from qsync_jax.cluster import ClusterSpec
from qsync_jax.devices import DEVICES, device_type_of
from qsync_jax.train.task import Task
from qsync_jax.train.train_step import make_train_step
from qsync_jax.train.trainer import Trainer

RESULTS = results_path("trainer")
PROGRESS_LINE = re.compile(
  r"^step (?P<step>\d+)/\d+ .*?(?P<steps_per_s>[\d.]+) steps/s"
  r"(?:.*?(?P<tflops>[\d.e+-]+) TFLOP/s/device)?(?:.*?MFU (?P<mfu>[\d.]+)%)?"
)
"""A ``Trainer`` progress line (``qsync_jax.train.progress.progress_line``) and its rates."""


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


def cycled(task: Task, host_batches: list) -> Task:
  """``task`` whose training batches are ``host_batches`` in turn, forever."""
  return dataclasses.replace(task, train_batches=lambda n, seed: itertools.cycle(host_batches))


def mlp_step_flops(features: int, width: int, depth: int, batch: int, classes: int = 10) -> float:
  """FLOPs of one training step of ``zoo.MLP``, by hand: each Dense layer's forward product and
  its two gradient products, ``2·batch·in·out`` each, less the first layer's input gradient
  (the data is not differentiated)."""
  shapes = [(features, width)] + [(width, width)] * (depth - 1) + [(width, classes)]
  return sum(3 * 2.0 * batch * i * o for i, o in shapes) - 2.0 * batch * features * width


class LineStream:
  """A text stream that keeps each line written to it and hands it to ``echo``."""

  def __init__(self, echo):
    self.lines, self.echo, self._part = [], echo, ""

  def write(self, text: str) -> int:
    *done, self._part = (self._part + text).split("\n")
    for line in done:
      self.lines.append(line)
      self.echo(line)
    return len(text)

  def flush(self) -> None:
    pass


def first_rated_line(lines: list[str]) -> tuple[str, dict[str, float]] | None:
  """The first progress line of ``lines`` that shows a rate, and its fields (``steps_per_s``,
  and ``tflops``, ``mfu`` (a fraction) where printed)."""
  for line in lines:
    m = PROGRESS_LINE.match(line)
    if m and float(m["steps_per_s"]) > 0:
      fields = {"step": int(m["step"]), "steps_per_s": float(m["steps_per_s"])}
      if m["tflops"]:
        fields["tflops"] = float(m["tflops"])
      if m["mfu"]:
        fields["mfu"] = float(m["mfu"]) / 100
      return line, fields
  return None


def _time(fn, steps: int) -> float:
  t0 = time.perf_counter()
  fn(steps)
  return (time.perf_counter() - t0) / steps * 1e3


def timed_case(trainer_fn, plain_fn, steps: int, repeats: int) -> tuple[list[float], list[float]]:
  """``(trainer ms/step, plain ms/step)``, one per repeat, after a warm-up (which compiles)."""
  trainer_fn(3)
  plain_fn(3)
  t_times, p_times = [], []
  for r in range(repeats):  # ABBA order: a drift in machine load hits both alike
    if r % 2 == 0:
      t_times.append(_time(trainer_fn, steps))
      p_times.append(_time(plain_fn, steps))
    else:
      p_times.append(_time(plain_fn, steps))
      t_times.append(_time(trainer_fn, steps))
  return t_times, p_times


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.trainer", description=__doc__.splitlines()[0])
  # Defaults give a step of a few ms: MLP 3x512, batch 128 on the CPU; 4x4096, batch 4096 on a GPU.
  parser.add_argument("--width", type=int, help="hidden width (default 512 CPU, 4096 GPU)")
  parser.add_argument("--depth", type=int, help="hidden layers (default 3 CPU, 4 GPU)")
  parser.add_argument("--features", type=int, help="input features (default 256 CPU, 1024 GPU)")
  parser.add_argument("--batch", type=int, help="batch (default 128 CPU, 4096 GPU)")
  parser.add_argument(
    "--steps", type=int, default=20, help="steps per repeat; the Trainer logs every this many"
  )
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument("--quick", action="store_true", help="--repeats 3 --steps 30")
  parser.add_argument("--no-save", action="store_true")
  args = parser.parse_args(argv)
  if args.quick:
    args.repeats, args.steps = 3, 30
  progress = Progress()

  device = jax.devices()[0]
  device_type = device_type_of(device)
  defaults = (512, 3, 256, 128) if device.platform == "cpu" else (4096, 4, 1024, 4096)
  for name, value in zip(("width", "depth", "features", "batch"), defaults):
    if getattr(args, name) is None:
      setattr(args, name, value)
  host = mlp_task(args.features, args.width, args.depth, accuracy=True).train_batches(args.batch, 0)
  host_batches = [next(host) for _ in range(8)]
  task = cycled(mlp_task(args.features, args.width, args.depth, accuracy=True), host_batches)
  optimizer = optax.adam(1e-3)
  cluster = ClusterSpec.uniform(device_type, 1, args.batch, memory_gb=DEVICES[device_type].memory_gb)
  kind = f"{device.platform}:{device.device_kind}" + (
    f" ({os.cpu_count()} cores)" if device.platform == "cpu" else ""
  )
  model = f"mlp{args.depth}x{args.width}/b{args.batch}"
  progress.say(
    f"trainer overhead: MLP {args.depth}x{args.width}, batch {args.batch}, {args.steps} steps x "
    f"{args.repeats} repeats, {kind} (device type {device_type}), jax {jax.__version__}"
  )

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
  trainer = Trainer(task, cluster, None, optimizer, devices=[device], progress=None)
  plain_batches = itertools.cycle(host_batches)

  def run_trainer_loop(n):
    trainer.run(trainer.step + n)
    jax.block_until_ready(trainer.state)

  def run_plain_loop(n):
    p, o = holder["p"]
    pending = None
    for _ in range(n):
      p, o, m = step(p, o, jax.device_put(next(plain_batches), device))
      if pending is not None:
        float(pending["loss"])
      pending = m
    float(pending["loss"])
    jax.block_until_ready((p, o))
    holder["p"] = (p, o)

  rows = []
  header = f"{'case':<8} {'plain ms/step':>22} {'trainer ms/step':>22} {'overhead':>9} {'(of min)':>9}"

  def timed_row(case, trainer_fn, plain_fn):
    progress.say(f"{case}: compiling and timing")
    t_times, p_times = timed_case(trainer_fn, plain_fn, args.steps, args.repeats)
    t_med, p_med = statistics.median(t_times), statistics.median(p_times)
    ratio, min_ratio = t_med / p_med, min(t_times) / min(p_times)
    print(header, flush=True)
    print(
      f"{case:<8} {p_med:>9.3f} ({min(p_times):.3f}–{max(p_times):.3f}) "
      f"{t_med:>9.3f} ({min(t_times):.3f}–{max(t_times):.3f}) {100 * (ratio - 1):>+8.1f}% "
      f"{100 * (min_ratio - 1):>+8.1f}%",
      flush=True,
    )
    extra = {"data": "8 host batches generated once, cycled"} if case == "loop" else {}
    rows.append(
      result_row(
        "trainer",
        f"{case}/{model}",
        "ms_per_step_median",
        t_med,
        p_med,
        kind,
        ratio_of_min=min_ratio,
        trainer_min_max=[min(t_times), max(t_times)],
        baseline_min_max=[min(p_times), max(p_times)],
        repeats=args.repeats,
        steps=args.steps,
        **extra,
      )
    )
    return p_med

  plain_ms = timed_row("step", run_trainer_step, run_plain_step)

  # -- printed: the rate a fresh Trainer prints, from its first line with a rate -------------
  progress.say(f"printed: a fresh Trainer, logging every {args.steps} steps")
  stream = LineStream(lambda line: progress.say(f"  Trainer: {line}"))
  fresh = Trainer(task, cluster, None, optimizer, devices=[device], log_every=args.steps, progress=stream)
  fresh.run(2 * args.steps)
  found = first_rated_line(stream.lines)
  if found is None:
    raise SystemExit(f"the Trainer printed no line with a rate: {stream.lines}")
  line, fields = found
  printed_ms = 1e3 / fields["steps_per_s"]
  by_hand = mlp_step_flops(args.features, args.width, args.depth, args.batch) * fields["steps_per_s"] / 1e12
  peak = DEVICES[device_type].peak_tflops
  peak16 = peak.get("bf16") or peak.get("fp16")
  mfu = f"{100 * fields['mfu']:.1f}%" if "mfu" in fields else "none"
  shown = f"printed TFLOP/s/device {fields.get('tflops', 'none')}, MFU {mfu}"
  print(
    f"printed  step {fields['step']}: {fields['steps_per_s']:.2f} steps/s = {printed_ms:.3f} ms/step; plain jit "
    f"step {plain_ms:.3f} ms/step; printed / plain {printed_ms / plain_ms:.3f}\n"
    f"         {shown}; by hand {by_hand:.3g} TFLOP/s ({device_type} 16-bit peak {peak16:g})",
    flush=True,
  )
  rows.append(
    result_row(
      "trainer",
      f"printed/{model}",
      "printed_ms_per_step",
      printed_ms,
      plain_ms,
      kind,
      line=line,
      printed_tflops_per_device=fields.get("tflops"),
      printed_mfu=fields.get("mfu"),
      tflops_by_hand=by_hand,
      log_every=args.steps,
    )
  )

  timed_row("loop", run_trainer_loop, run_plain_loop)

  # -- paired: one blocked step of each, alternating; the median of the per-pair ratios ------
  progress.say("paired: one blocked step of each, alternating")
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
    f"{'paired':<8} {p_med:>9.3f} {'':>12} {t_med:>9.3f} {'':>12} {100 * (ratio - 1):>+8.1f}%"
    f"   (median of {len(ratios)} per-step ratios; quartiles {100 * (q1 - 1):+.1f}% / {100 * (q3 - 1):+.1f}%)",
    flush=True,
  )
  rows.append(  # ratio: the median of the per-pair ratios, not the ratio of the medians
    result_row(
      "trainer",
      f"paired/{model}",
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
  count, seconds = progress.compiles()
  progress.say(f"done: {count} compilations took {seconds:.1f} s")
  if not args.no_save:
    append_rows(RESULTS, rows)
    print(f"appended {len(rows)} rows to {os.path.relpath(RESULTS)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
