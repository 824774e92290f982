"""Re-planning from measured speeds on real GPUs, one of them slowed by another process.

Runs on a host with 2 (or more) GPUs. The last GPU also runs a background load: a separate
process looping large bf16 matrix products (``load`` below; CUDA time-slices the two), which
makes it a slower device — by a factor this benchmark measures, not assumes. The model is the
zoo's GPT (``--width``, ``--depth``, ``--seq``, synthetic tokens), trained in bf16 by the
trainer's real step, one ``jax.distributed`` process per GPU, each GPU its own group (all of
one device type, so the catalog's dynamic batching is the equal split). Cases, all in one run
with the load on (in this order):

* ``equal``: the equal split (= dynamic batching from the catalog), ``replan="off"``;
* ``replan``: the trainer measures each group after 3 steps and re-balances once;
* ``sweep/<b0>``: every split of the global batch in steps of ``--granularity`` (``replan="off"``):
  the measured best is ``sweep/best``;
* ``auto``: ``replan="auto"``; the load is stopped at ``--unload-at-step``, and the rows give the
  step time and split before and after (the trainer re-plans back).

Rows go to ``benchmarks/results/replan.jsonl`` with ``case`` = ``setting/alternative`` and
``metric`` = ``step_ms`` (median over the timed steps; ``iqr_ms`` its spread), the ratio against
the equal split of the same run.

  python -m benchmarks.replan [--gpus 2] [--width 768 --depth 4 --seq 256 --batch 32] [--steps 40]
  python -m benchmarks.replan --cpu          # a smoke test: 2 processes of one CPU device each
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

from benchmarks.common.result_rows import append_rows, result_row, results_path

BENCH = "replan"


# -- the background load ------------------------------------------------------------------------


def load(size: int) -> None:
  """Loops ``size``² bf16 products on this process's GPU until killed (JAX, 10 % of its memory)."""
  import jax
  import jax.numpy as jnp

  a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16)
  f = jax.jit(lambda x, y: x @ y)
  while True:
    for _ in range(20):
      c = f(a, b)
    c.block_until_ready()


# -- one training process -----------------------------------------------------------------------


def worker(args) -> None:
  """One process of a case: trains ``args.steps`` steps and, on process 0, prints a JSON line
  with every step's wall time, the split and the re-plan decisions."""
  import jax

  from qsync_jax.train.distributed import initialize

  initialize(
    f"127.0.0.1:{args.port}", args.world, args.process_id, local_device_count=1 if args.cpu else None
  )
  import optax

  from benchmarks.common.zoo import gpt
  from qsync_jax.cluster import ClusterSpec, DeviceGroup
  from qsync_jax.plan import Plan
  from qsync_jax.train.replan import Replanner
  from qsync_jax.train.trainer import Trainer

  device = "cpu" if args.cpu else "H100"
  batches = [int(b) for b in args.batches.split(",")]
  cluster = ClusterSpec(tuple(DeviceGroup(f"gpu{i}", device, 1, 80, b) for i, b in enumerate(batches)))
  plan = Plan.from_json({"policies": {g.name: "bf16" for g in cluster.groups}})
  task = gpt(args.width, args.depth, max(1, args.width // 64), args.seq, vocab=args.vocab)
  replan = Replanner(mode=args.mode, warmup_steps=3, window=10, recheck_windows=5)
  trainer = Trainer(task, cluster, plan, optax.adamw(1e-4), seed=0, replan=replan)
  times, splits = [], []

  def on_step(step, values):
    times.append(time.perf_counter())
    splits.append([g.batch_per_device for g in trainer.program.cluster.groups])
    if step % 25 == 0 and jax.process_index() == 0:
      print(f"STEP {step}", flush=True)

  trainer.run(args.steps, callback=on_step)
  if jax.process_index() == 0:
    steps_ms = [1e3 * (b - a) for a, b in zip(times, times[1:])]
    print("RESULT " + json.dumps({"step_ms": steps_ms, "splits": splits[1:], "replans": replan.history}))


# -- the driver ---------------------------------------------------------------------------------


def _launch(args, batches, mode, steps, port, logs=None) -> list[subprocess.Popen]:
  """The workers of one case; their output is piped back, or written to the files ``logs``
  (one per worker: a pipe nobody reads while the case runs would fill and stall a worker)."""
  procs = []
  for i in range(args.gpus):
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_MEM_FRACTION="0.6")
    if not args.cpu:
      env["CUDA_VISIBLE_DEVICES"] = str(args.first_gpu + i)
    else:
      env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "benchmarks.replan", "worker", "--process-id", str(i), "--world", str(args.gpus)]
    cmd += ["--port", str(port), "--batches", ",".join(map(str, batches)), "--mode", mode, "--steps", str(steps)]
    cmd += ["--width", str(args.width), "--depth", str(args.depth), "--seq", str(args.seq)]
    cmd += ["--vocab", str(args.vocab)] + (["--cpu"] if args.cpu else [])
    out = open(logs[i], "w") if logs else subprocess.PIPE  # noqa: SIM115 - closed when the worker ends
    procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True))
  return procs


def _result(procs, timeout) -> dict:
  outs = []
  for p in procs:
    try:
      out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      p.kill()
      out, _ = p.communicate()
    outs.append(out)
  found = [line[7:] for line in outs[0].splitlines() if line.startswith("RESULT ")]
  if not found or any(p.returncode for p in procs):
    raise RuntimeError("a worker failed:\n" + "\n---\n".join(o[-3000:] for o in outs))
  return json.loads(found[-1])


def _median(ms, skip):
  timed = ms[min(skip, max(0, len(ms) - 3)) :]
  q = np.percentile(timed, [25, 75])
  return statistics.median(timed), float(q[1] - q[0])


def _start_load(args) -> subprocess.Popen | None:
  if args.cpu:
    return None
  env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(args.first_gpu + args.gpus - 1), XLA_PYTHON_CLIENT_MEM_FRACTION="0.1")
  cmd = [sys.executable, "-m", "benchmarks.replan", "load", "--size", str(args.load_size)]
  p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
  time.sleep(8)  # its compile, before the timed cases start
  return p


def _stop(load_proc):
  if load_proc is not None and load_proc.poll() is None:
    os.killpg(load_proc.pid, signal.SIGKILL)
    load_proc.wait()


def run(args) -> int:
  model = f"gpt d{args.width} x{args.depth} seq{args.seq} batch{args.batch} bf16"
  device = "cpu (smoke test)" if args.cpu else f"{args.gpus} GPUs"

  def save(name, med, iqr, split, extra):
    """Appends one case's row as soon as it is measured (a run cut short keeps it); the ratio
    is against the equal split, the first case."""
    rows.append((name, med, iqr, split, extra))
    base = rows[0][1]
    if args.save:
      row = result_row(BENCH, name, "step_ms", med, base, device, ratio=base / med, iqr_ms=iqr, split=split,
                       model=model, **extra)
      append_rows(results_path(BENCH), [row])

  import jax

  equal = [args.batch // args.gpus] * args.gpus
  port = 23456 + 100 * args.first_gpu
  load_proc = _start_load(args)
  rows, table = [], []
  try:

    def case(name, batches, mode, steps, skip):
      nonlocal port
      port += 1
      t0 = time.perf_counter()
      res = _result(_launch(args, batches, mode, steps, port), args.timeout)
      med, iqr = _median(res["step_ms"], skip)
      print(f"{name:<14} split {res['splits'][-1]}  {med:8.2f} ms (IQR {iqr:.2f})  [{time.perf_counter() - t0:.0f} s]",
            flush=True)
      for r in res["replans"]:
        print("  replan " + json.dumps(r), flush=True)
      return med, iqr, res

    cases = args.cases.split(",")
    base, base_iqr, _ = case("equal", equal, "off", args.steps, 5)
    save("loaded/equal", base, base_iqr, equal, {})
    if "replan" in cases:
      med, iqr, res = case("replan", equal, "once", args.steps, 10)
      save("loaded/replan", med, iqr, res["splits"][-1], {"replans": res["replans"]})
    sweep = {}
    for b0 in range(args.granularity, args.batch, args.granularity) if "sweep" in cases else ():
      rest = args.batch - b0
      if args.gpus != 2 or rest <= 0:
        break
      med, iqr, _ = case(f"sweep/{b0}", [b0, rest], "off", args.sweep_steps, 5)
      sweep[b0] = (med, iqr)
      save(f"loaded/sweep/{b0}", med, iqr, [b0, rest], {})
    if sweep:
      b0 = min(sweep, key=lambda b: sweep[b][0])
      save("loaded/sweep_best", *sweep[b0], [b0, args.batch - b0], {})
    if load_proc is not None and "auto" in cases:  # auto: the load goes away mid-run
      port += 1
      logs = [os.path.join(os.environ.get("OUT", "/tmp"), f"replan_auto_worker{i}.log") for i in range(args.gpus)]
      procs = _launch(args, equal, "auto", args.auto_steps, port, logs)
      deadline = time.monotonic() + args.timeout
      while procs[0].poll() is None and time.monotonic() < deadline:  # stop the load at --unload-at-step
        steps_done = [int(x.split()[1]) for x in open(logs[0]).read().splitlines() if x.startswith("STEP ")]
        if steps_done and steps_done[-1] >= args.unload_at_step:
          break
        time.sleep(0.5)
      _stop(load_proc)
      for p in procs:
        try:
          p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
          p.kill()
      outs = [open(path).read() for path in logs]
      found = [line[7:] for line in outs[0].splitlines() if line.startswith("RESULT ")]
      if not found:
        raise RuntimeError("an auto worker failed:\n" + "\n---\n".join(o[-3000:] for o in outs))
      res = json.loads(found[-1])
      splits, ms, replans = res["splits"], res["step_ms"], res["replans"]
      unload = args.unload_at_step
      before = [r["step"] for r in replans if r["step"] < unload]
      since = [r["step"] for r in replans if r["step"] >= unload]
      start_loaded = (before[-1] if before else 0) + 5
      start_after = (since[-1] if since else unload) + 5
      for name, lo, hi in (("auto/loaded", start_loaded, unload), ("auto/unloaded", start_after, len(ms))):
        part = ms[lo:hi]
        if len(part) >= 3:
          q = np.percentile(part, [25, 75])
          split = splits[min(hi, len(splits)) - 1]
          save(name, statistics.median(part), float(q[1] - q[0]), split, {"replans": replans})
      print(f"auto: replans {[ (r['step'], r['new']) for r in replans]}", flush=True)
  finally:
    _stop(load_proc)
  base = rows[0][1] if rows else float("nan")
  for name, med, iqr, split, _ in rows:
    table.append(f"{name:<22} {str(split):<12} {med:9.2f} ms  IQR {iqr:6.2f}  {base / med:5.2f}x vs equal")
  print(f"\n{device}, jax {jax.__version__}; ratio = equal split / this (> 1: faster)")
  print("\n".join(table))
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("command", nargs="?", default="run", choices=("run", "worker", "load"))
  parser.add_argument("--gpus", type=int, default=2)
  parser.add_argument("--first-gpu", type=int, default=0, help="the GPUs are first-gpu … first-gpu + gpus - 1")
  parser.add_argument("--cases", default="replan,sweep,auto", help="of replan, sweep, auto (equal always runs)")
  parser.add_argument("--cpu", action="store_true", help="a smoke test on CPU processes (no load)")
  parser.add_argument("--width", type=int, default=768)
  parser.add_argument("--depth", type=int, default=4)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--vocab", type=int, default=8192)
  parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
  parser.add_argument("--granularity", type=int, default=4)
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--sweep-steps", type=int, default=20)
  parser.add_argument("--auto-steps", type=int, default=600)
  parser.add_argument("--unload-at-step", type=int, default=300)
  parser.add_argument("--load-size", type=int, default=8192)
  parser.add_argument("--timeout", type=float, default=300.0)
  parser.add_argument("--no-save", dest="save", action="store_false")
  # worker
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--world", type=int, default=2)
  parser.add_argument("--port", type=int, default=23456)
  parser.add_argument("--batches", default="16,16")
  parser.add_argument("--mode", default="off")
  parser.add_argument("--size", type=int, default=8192)
  args = parser.parse_args(argv)
  if args.command == "worker":
    worker(args)
    return 0
  if args.command == "load":
    load(args.size)
    return 0
  return run(args)


if __name__ == "__main__":
  sys.exit(main())
