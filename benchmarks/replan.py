"""Re-planning from measured speeds on real GPUs, one of them slowed by another process.

Runs on a host with 2 (or more) GPUs. The last GPU also runs a background load: a separate
process looping large bf16 matrix products (``load`` below; CUDA time-slices the two), which
makes it a slower device — by a factor this benchmark measures, not assumes. The model is the
zoo's GPT (``--width``, ``--depth``, ``--seq``, synthetic tokens), trained in bf16 by the
trainer's real step, one ``jax.distributed`` process per GPU (``CUDA_VISIBLE_DEVICES`` set per
process here), each GPU its own group (all of one device type, so the catalog's dynamic batching
is the equal split). One pair of processes runs every case in turn (each a fresh ``Trainer`` on
the same model, in this order; the compiled steps and probes of one case serve the next through
a compilation cache):

* ``loaded/equal``: the equal split (= dynamic batching from the catalog), ``replan="off"``;
* ``loaded/replan``: the trainer measures each group after 3 steps and re-balances once
  (the row's step time: after the re-plan);
* ``loaded/sweep/<b0>``: every split of the global batch in steps of ``--granularity``
  (``replan="off"``): the measured best is ``loaded/sweep_best``;
* ``unload/auto``: ``replan="auto"``; the first process stops the load (kills it) after step
  ``--unload-at-step``, and the trainer re-plans back. The row's value is the step after the
  re-plan back; it carries the decisions (``replans``: step, old and new split, predicted and
  measured step) and the median step time in each phase (``ms_loaded``: on the first
  re-planned split with the load on; ``ms_unloaded``: the same split once the load is gone;
  ``ms_back``: after the re-plan back; without one, ``replanned_back`` is false and the value is
  the unloaded phase's), with the step where each phase starts;
* ``unloaded/equal``: the equal split without the load (after ``auto``), for reference.

Each row is written as soon as its case ends (to ``--out``, default
``benchmarks/results/replan.jsonl``, and as a ``ROW {...}`` line on stdout), with ``case`` =
``setting/alternative`` and ``metric`` = ``step_ms`` (median over the timed steps; ``iqr_ms`` its
spread), the ratio against the equal split of the same run. The first process prints each
re-plan decision as it is taken (``REPLAN {...}``, flushed), and ``UNLOADED {...}``.

  python -m benchmarks.replan [--gpus 2] [--width 1024 --depth 8 --seq 512 --batch 32] [--out FILE]
  python -m benchmarks.replan --cpu --width 64 --depth 1 --seq 32 --cases replan
      # a smoke test: 2 processes of one CPU device each, each on its own core, the load on the last one
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from benchmarks.common.result_rows import append_rows, result_row, results_path

BENCH = "replan"


# -- the background load ------------------------------------------------------------------------


def load(size: int, cpu: bool = False) -> None:
  """Loops ``size``² products until killed: bf16 on this process's GPU (JAX, 10 % of its
  memory), or float32 on one CPU core (``cpu``)."""
  if cpu:
    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    while True:
      a = np.tanh(a @ a)
  import jax
  import jax.numpy as jnp

  a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16)
  f = jax.jit(lambda x, y: x @ y)
  while True:
    for _ in range(20):
      c = f(a, b)
    c.block_until_ready()


# -- the training processes ---------------------------------------------------------------------


def worker(args) -> None:
  """One process of the job: runs every case of ``args.cases`` in turn (a fresh ``Trainer`` each,
  the same task and optimizer). The first process prints a ``RESULT`` line per case (every
  step's wall time, the splits, the decisions), each decision as it is taken and when it stopped
  the load."""
  if args.cpu:
    os.sched_setaffinity(0, {args.process_id % os.cpu_count()})  # one core each (threads inherit it)
  import jax

  from qsync_jax.train.distributed import initialize

  initialize(
    f"127.0.0.1:{args.port}", args.world, args.process_id, local_device_count=1 if args.cpu else None
  )
  if args.compile_cache:  # the steps and probes of a case serve the next (process 0 writes it)
    jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  import optax

  from benchmarks.common.zoo import gpt
  from qsync_jax.cluster import ClusterSpec, DeviceGroup
  from qsync_jax.plan import Plan
  from qsync_jax.train.replan import Replanner
  from qsync_jax.train.trainer import Trainer

  primary = jax.process_index() == 0
  device = "cpu" if args.cpu else "H100"
  task = gpt(args.width, args.depth, max(1, args.width // 64), args.seq, vocab=args.vocab)
  optimizer = optax.adamw(1e-4)  # one object: the compiled probes are kept across the cases

  def say(kind, obj):
    if primary:
      print(f"{kind} {json.dumps(obj)}", flush=True)

  def case(name, batches, mode, steps, unload_at=None):
    cluster = ClusterSpec(tuple(DeviceGroup(f"gpu{i}", device, 1, 80, b) for i, b in enumerate(batches)))
    plan = Plan.from_json({"policies": {g.name: "bf16" for g in cluster.groups}})
    replan = Replanner(
      mode=mode, warmup_steps=3, window=args.window, recheck_windows=args.recheck_windows,
      max_overhead=args.max_overhead, report=lambda r: say("REPLAN", {"case": name, **r}),
    )
    # (a first decision compiles a few probes between two steps: more than the default watchdog's 120 s
    # on a slow host)
    trainer = Trainer(task, cluster, plan, optimizer, seed=0, replan=replan, progress=None, step_timeout_s=600)
    done: dict[int, float] = {}
    t0 = time.perf_counter()

    def on_step(step, values):
      done[step] = time.perf_counter()  # step's metrics read: it has finished
      if unload_at is not None and step == unload_at:
        if primary and args.load_pgid:
          os.killpg(args.load_pgid, signal.SIGKILL)
        say("UNLOADED", {"case": name, "step": step})

    trainer.run(steps, callback=on_step)
    step_ms = {s: 1e3 * (done[s] - done[s - 1]) for s in sorted(done) if s - 1 in done}
    say("RESULT", {
      "case": name, "batches": batches, "step_ms": step_ms, "wall_s": time.perf_counter() - t0,
      "split": [g.batch_per_device for g in trainer.program.cluster.groups], "replans": replan.history,
    })
    trainer.close()

  equal = [args.batch // args.world] * args.world
  cases = args.cases.split(",")
  case("loaded/equal", equal, "off", args.steps)
  if "replan" in cases:
    case("loaded/replan", equal, "once", args.steps + 20)
  if "sweep" in cases and args.world == 2:
    for b0 in range(args.granularity, args.batch, args.granularity):
      case(f"loaded/sweep/{b0}", [b0, args.batch - b0], "off", args.sweep_steps)
  if "auto" in cases:
    case("unload/auto", equal, "auto", args.auto_steps, unload_at=args.unload_at_step)
    case("unloaded/equal", equal, "off", args.steps)


# -- the driver ---------------------------------------------------------------------------------


def _median(values):
  """(median, IQR) of ``values``; (nan, nan) when empty."""
  if not values:
    return float("nan"), float("nan")
  q = np.percentile(values, [25, 75])
  return float(statistics.median(values)), float(q[1] - q[0])


def _finite(x):
  """``x``, or None for NaN (JSON has no NaN)."""
  return None if x != x else x


def _steps_between(step_ms: dict[int, float], lo: int, hi: int) -> list[float]:
  """The step times of steps ``lo`` < step ≤ ``hi``."""
  return [ms for s, ms in step_ms.items() if lo < s <= hi]


def _auto_summary(ms: dict[int, float], replans: list[dict], unload: int, skip: int):
  """``(median, IQR, extra fields, a line)`` of the ``auto`` case from its step times
  ``{step: ms}`` and decisions: the phases loaded (after the last re-plan before the load
  stopped), unloaded (until the first re-plan after it) and back (after the last re-plan)."""
  last = max(ms)
  first = [r for r in replans if r["step"] <= unload]
  back = [r for r in replans if r["step"] > unload]
  start_loaded = (first[-1]["step"] if first else 0) + skip
  start_unloaded = unload + skip  # (the load is killed after step `unload` has been read)
  end_unloaded = back[0]["step"] if back else last
  start_back = back[-1]["step"] + skip if back else None
  loaded, _ = _median(_steps_between(ms, start_loaded, unload))
  unloaded, unloaded_iqr = _median(_steps_between(ms, start_unloaded, end_unloaded))
  med, iqr = _median(_steps_between(ms, start_back, last)) if back else (unloaded, unloaded_iqr)
  keys = ("step", "old", "new", "predicted_ms_old", "predicted_ms_new", "measured_ms_new")
  extra = {
    "replans": [{k: r.get(k) for k in keys} for r in replans],
    "unload_at_step": unload,
    "replanned_back": bool(back),
    "ms_loaded": _finite(loaded),
    "ms_unloaded": _finite(unloaded),
    "ms_back": _finite(med) if back else None,
    "phases_start": {"loaded": start_loaded, "unloaded": start_unloaded, "back": start_back},
  }
  line = (
    f"re-plans at steps {[r['step'] for r in replans]}, the load stopped after step {unload}; "
    f"{loaded:.2f} ms loaded, {unloaded:.2f} ms unloaded"
    + (f", {med:.2f} ms after re-planning back" if back else ", no re-plan after the load stopped")
  )
  return med, iqr, extra, line


def _start_load(args) -> subprocess.Popen | None:
  """The background load on the last GPU (or, with ``--cpu``, the last core), in a process
  group of its own (the first worker kills the group to stop it)."""
  if args.no_load:
    return None
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  size = args.load_size or (256 if args.cpu else 8192)
  cmd = [sys.executable, "-m", "benchmarks.replan", "load", "--size", str(size)]
  if args.cpu:
    env.update(JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd += ["--cpu"]
  else:
    env.update(CUDA_VISIBLE_DEVICES=str(args.first_gpu + args.gpus - 1), XLA_PYTHON_CLIENT_MEM_FRACTION="0.1")

  def pin():
    if args.cpu:
      os.sched_setaffinity(0, {(args.gpus - 1) % os.cpu_count()})

  p = subprocess.Popen(
    cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=pin
  )
  time.sleep(2 if args.cpu else 8)  # its compile, before the timed cases start
  return p


def _stop(load_proc):
  if load_proc is not None and load_proc.poll() is None:
    os.killpg(load_proc.pid, signal.SIGKILL)
  if load_proc is not None:
    load_proc.wait()


def _launch(args, port, load_pgid, log_dir) -> list[subprocess.Popen]:
  """The workers: the first one's output piped (read as it comes), the others' to files."""
  procs = []
  for i in range(args.gpus):
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_MEM_FRACTION="0.6")
    if args.cpu:
      env["JAX_PLATFORMS"] = "cpu"
    else:
      env["CUDA_VISIBLE_DEVICES"] = str(args.first_gpu + i)
    cmd = [sys.executable, "-m", "benchmarks.replan", "worker", "--process-id", str(i), "--world", str(args.gpus)]
    cmd += ["--port", str(port), "--cases", args.cases, "--batch", str(args.batch)]
    cmd += ["--granularity", str(args.granularity), "--steps", str(args.steps), "--sweep-steps", str(args.sweep_steps)]
    cmd += ["--auto-steps", str(args.auto_steps), "--unload-at-step", str(args.unload_at_step)]
    cmd += ["--window", str(args.window), "--recheck-windows", str(args.recheck_windows)]
    cmd += ["--max-overhead", str(args.max_overhead), "--load-pgid", str(load_pgid or 0)]
    cmd += ["--width", str(args.width), "--depth", str(args.depth), "--seq", str(args.seq), "--vocab", str(args.vocab)]
    cmd += ["--compile-cache", args.compile_cache] + (["--cpu"] if args.cpu else [])
    out = subprocess.PIPE if i == 0 else open(os.path.join(log_dir, f"replan_worker{i}.log"), "w")  # noqa: SIM115
    procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True))
  return procs


def run(args) -> int:
  model = f"gpt d{args.width} x{args.depth} seq{args.seq} batch{args.batch} bf16"
  device = "cpu (smoke test, one core each, the load on the last)" if args.cpu else f"{args.gpus} GPUs"
  out_path = args.out or results_path(BENCH)
  log_dir = os.environ.get("OUT") or "/tmp"
  rows: dict[str, tuple] = {}
  base = [None]

  def save(name, med, iqr, split, extra):
    """Writes one case's row as soon as it is measured (a run cut short keeps it); the ratio
    is against the equal split with the load, the first case."""
    if base[0] is None:
      base[0] = med
    rows[name] = (med, iqr, split)
    ratio = base[0] / med if med == med and base[0] == base[0] else None
    row = result_row(BENCH, name, "step_ms", _finite(med), _finite(base[0]), device, ratio=ratio,
                     iqr_ms=_finite(iqr), split=split, model=model, **extra)
    print("ROW " + json.dumps(row), flush=True)
    if args.save:
      append_rows(out_path, [row])

  def on_result(res):
    name, ms = res["case"], {int(k): v for k, v in res["step_ms"].items()}
    replans = res["replans"]
    if name == "unload/auto":
      med, iqr, extra, line = _auto_summary(ms, replans, args.unload_at_step, args.skip)
      print(f"{name}: {line}", flush=True)
      save(name, med, iqr, res["split"], extra)
      return
    start = (replans[-1]["step"] if replans else 0) + args.skip
    med, iqr = _median(_steps_between(ms, start, max(ms)))
    print(f"{name:<20} split {res['split']}  {med:8.2f} ms (IQR {iqr:.2f})  [{res['wall_s']:.0f} s]", flush=True)
    save(name, med, iqr, res["split"], {"replans": replans} if replans else {})
    sweep = {k: v for k, v in rows.items() if k.startswith("loaded/sweep/")}
    if name.startswith("loaded/sweep/") and name.endswith(f"/{args.batch - args.granularity}"):
      best = min(sweep, key=lambda k: sweep[k][0])
      save("loaded/sweep_best", *sweep[best], {"best_of": len(sweep)})

  import jax

  port = 23456 + 100 * args.first_gpu + os.getpid() % 50
  load_proc = _start_load(args)
  t0 = time.perf_counter()
  procs = []
  try:
    procs = _launch(args, port, load_proc.pid if load_proc is not None else 0, log_dir)
    timer = threading.Timer(args.timeout, lambda: [p.kill() for p in procs])
    timer.start()
    for line in procs[0].stdout:  # as it comes: every decision when it is taken
      line = line.rstrip("\n")
      if line.startswith("RESULT "):
        on_result(json.loads(line[7:]))
      elif line.startswith(("REPLAN ", "UNLOADED ")):
        print(f"[{time.perf_counter() - t0:6.1f} s] {line}", flush=True)
      elif line.strip():
        print(f"  worker0: {line[-400:]}", flush=True)
    timer.cancel()
    codes = [p.wait() for p in procs]
    if any(codes):
      tail = open(os.path.join(log_dir, "replan_worker1.log")).read()[-3000:] if args.gpus > 1 else ""
      print(f"a worker failed (exit codes {codes}); worker 1's log ends:\n{tail}", flush=True)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    _stop(load_proc)
  b = rows.get("loaded/equal", (float("nan"),))[0]
  print(f"\n{device}, jax {jax.__version__}, {time.perf_counter() - t0:.0f} s; ratio = equal split (loaded) / this")
  for name, (med, iqr, split) in rows.items():
    print(f"{name:<22} {str(split):<12} {med:9.2f} ms  IQR {iqr:6.2f}  {b / med:5.2f}x")
  return 1 if any(p.returncode for p in procs) else 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("command", nargs="?", default="run", choices=("run", "worker", "load"))
  parser.add_argument("--gpus", type=int, default=2)
  parser.add_argument("--first-gpu", type=int, default=0, help="the GPUs are first-gpu … first-gpu + gpus - 1")
  parser.add_argument("--cases", default="replan,sweep,auto", help="of replan, sweep, auto (equal always runs)")
  parser.add_argument("--cpu", action="store_true", help="a smoke test on CPU processes, one core each")
  parser.add_argument("--no-load", action="store_true", help="no background load")
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--depth", type=int, default=8)
  parser.add_argument("--seq", type=int, default=512)
  parser.add_argument("--vocab", type=int, default=8192)
  parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
  parser.add_argument("--granularity", type=int, default=4, help="the sweep's step")
  parser.add_argument("--steps", type=int, default=40, help="steps of equal (replan: 20 more)")
  parser.add_argument("--sweep-steps", type=int, default=20)
  parser.add_argument("--auto-steps", type=int, default=700)
  parser.add_argument("--unload-at-step", type=int, default=300)
  parser.add_argument("--skip", type=int, default=5, help="steps not timed after the start and after a re-plan")
  parser.add_argument("--window", type=int, default=10, help="auto: steps per window")
  parser.add_argument("--recheck-windows", type=int, default=5, help="auto: windows between periodic checks")
  parser.add_argument("--max-overhead", type=float, default=0.05, help="auto: the periodic checks' cost bound")
  parser.add_argument("--load-size", type=int, help="the load's matrix size (default 8192 on GPUs, 256 on a CPU core)")
  parser.add_argument("--timeout", type=float, default=480.0, help="seconds before the workers are killed")
  parser.add_argument("--compile-cache", default="/tmp/qsync_replan_jax_cache")
  parser.add_argument("--out", help="rows to this JSON lines file (default benchmarks/results/replan.jsonl)")
  parser.add_argument("--no-save", dest="save", action="store_false")
  # worker
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--world", type=int, default=2)
  parser.add_argument("--port", type=int, default=23456)
  parser.add_argument("--load-pgid", type=int, default=0)
  parser.add_argument("--size", type=int, default=8192)
  args = parser.parse_args(argv)
  if args.command == "worker":
    worker(args)
    return 0
  if args.command == "load":
    load(args.size, cpu=args.cpu)
    return 0
  return run(args)


if __name__ == "__main__":
  sys.exit(main())
