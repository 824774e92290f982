"""A joint plan run for real: one ``jax.distributed`` process per device, two groups with
different per-device batches and precisions; gradients against one device's fp32 step on
the same global batch, and the measured step against the replay's prediction.

The LM: a GPT on random tokens (``benchmarks.common.zoo.gpt``) of ``--d-model``, ``--layers``,
``--heads``, ``--seq`` and ``--vocab``.

1. **profile** (a subprocess on device 0): the LM's cost profile (``measure_profile``) at the
   training group's batch, saved to ``--out``.
2. **plan**: ``planners.allocator.joint`` plans a pool whose training group is this device type and
   whose inference group is modeled as ``--infer-device`` (e.g. an L4: a slower device that
   the planner gives a smaller batch and lower precisions); the plan is then run on the
   devices at hand (every group on this device type), as a user runs a plan's numerics on
   any devices. A second plan keeps the joint plan's batches with every op in fp32.
3. **run** (``--processes`` processes, one device each): each plan's step with
   ``return_grads``; process 0 compares the combined gradient with ``jax.grad`` of the
   full-batch loss on its device at fp32 (``highest`` matmul precision) and times the step
   (median and IQR of steps dispatched one at a time); the replay predicts the same plan on
   the measured profile (every group this device type).

Rows go to ``benchmarks/results/joint_run.jsonl``.

  python -m benchmarks.joint_run --out $OUT/joint [--processes 2] [--d-model 1024 --layers 8]
      [--profile-file benchmarks/results/joint_run/profile_h100.json]
  python -m benchmarks.joint_run --out /tmp/jr --tiny      # CPU smoke run (2 processes, gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from benchmarks.common.result_rows import ROOT, append_rows, result_row, results_path
from benchmarks.common.zoo import gpt

RESULTS = results_path("joint_run")


def local_type() -> str:
  import jax

  kind = jax.devices()[0].device_kind
  for name in ("H200", "H100", "A100"):
    if name in kind:
      return name
  return "cpu"


def role_profile(args) -> int:
  from planners.profiler.measure import measure_profile

  task = gpt(args.d_model, args.layers, args.heads, args.seq, vocab=args.vocab)
  prof = measure_profile(task, args.batch, ("fp32", "bf16", "fp16", "int8"), repeats=3, step_repeats=5)
  prof.save(os.path.join(args.out, "profile.json"))
  return 0


def plans(args, prof):
  """``{name: Plan}`` and the cluster they run on (every group the local device type)."""
  from planners.allocator.greedy import make_problem
  from planners.allocator.joint import joint_plan, plan_of
  from planners.predictor.modeled import modeled_profile
  from qsync_jax.cluster import ClusterSpec
  from qsync_jax.plan import Plan
  from qsync_jax.policy import PrecisionPolicy

  run_cluster = plan_cluster(args, prof)
  pool = ClusterSpec(
    (run_cluster.groups[0], run_cluster.groups[1].replace(device_type=args.infer_device, memory_gb=24.0))
  )
  profiles = {prof.device_type: prof, args.infer_device: modeled_profile(prof, args.infer_device)}
  rng = np.random.default_rng(0)  # synthetic Ω, as benchmarks.hybrid
  omega = {}
  for name in prof.op_names:
    s = float(rng.exponential())
    omega[name] = {"int8": s, "fp8": s / 2, "fp16": s / 50, "bf16": s / 50, "fp32": 0.0}
  problem = make_problem(pool, profiles, {"omega": omega}, ["train"], args.train_precision)
  chosen, _, _ = joint_plan(problem, args.granularity, 0.02)
  joint = plan_of(problem, chosen)
  fp32 = Plan(
    batch_per_device=joint.batch_per_device,
    policies={g: PrecisionPolicy.uniform("fp32") for g in ("train", "infer")},
  )
  return {"joint": joint, "fp32 at the joint batches": fp32}, run_cluster, chosen.name


def role_worker(args) -> int:
  import jax
  import optax

  from planners.predictor.replay import predict
  from planners.profile import Profile
  from qsync_jax.plan import Plan
  from qsync_jax.train import distributed
  from qsync_jax.train.train_step import make_train_step

  distributed.initialize(
    f"127.0.0.1:{args.port}", args.processes, args.process_id, local_device_count=1 if args.tiny else None
  )
  task = gpt(args.d_model, args.layers, args.heads, args.seq, vocab=args.vocab)
  prof = Profile.load(os.path.join(args.out, "profile.json"))
  for name, plan in json.load(open(os.path.join(args.out, "plans.json"))).items():
    plan = Plan.from_json(plan)
    cluster = plan_cluster(args, prof)
    pred = predict(cluster, {prof.device_type: prof}, plan)  # every process, before any collective
    ts = make_train_step(task, cluster, plan, optax.sgd(0.0), return_grads=True)
    batch = next(task.train_batches(ts.global_batch, 7))
    state = ts.init(3, batch)
    sharded = ts.shard(batch)
    params = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), state.params)  # the step donates
    state, _, grads = ts(state, sharded)
    times = []
    for _ in range(args.steps):  # sgd(0): the parameters stay those of the gradient above
      start = time.perf_counter()
      state, _, _ = jax.block_until_ready(ts(state, sharded))
      times.append(time.perf_counter() - start)
    if jax.process_index() != 0:
      continue
    host = jax.device_put(batch, jax.local_devices()[0])

    def full_loss(p, host=host):
      loss, _ = task.loss(task.model.apply({"params": p}, *task.inputs(host)), host)
      return loss

    with jax.default_matmul_precision("highest"):
      ref = jax.grad(full_loss)(params)
    ours = [np.asarray(g.addressable_data(0), np.float64) for g in jax.tree.leaves(grads)]
    theirs = [np.asarray(r, np.float64) for r in jax.tree.leaves(ref)]
    # over the whole gradient: a leaf whose true gradient is 0 (attention's key bias: softmax
    # ignores a per-row constant) has no meaningful relative error of its own
    diff = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(ours, theirs)))
    rel = diff / np.sqrt(sum(np.sum(b**2) for b in theirs))
    out = {
      "plan": name,
      "batch_per_device": plan.batch_per_device,
      "grad_rel_error": float(rel),
      "median_ms": 1e3 * float(np.median(times)),
      "iqr_ms": 1e3 * float(np.subtract(*np.percentile(times, [75, 25]))),
      "predicted_ms": pred.step_ms,
    }
    print(json.dumps(out), flush=True)
  jax.distributed.shutdown()
  return 0


def plan_cluster(args, prof):
  """Half the processes in ``train``, the rest in ``infer``, all this device type, linked at
  the catalog's device-to-device bandwidth (NVLink on an H100)."""
  from qsync_jax.cluster import ClusterSpec, DeviceGroup
  from qsync_jax.devices import device

  half, link = args.processes // 2, 8 * device(prof.device_type).link_gbytes_s
  return ClusterSpec(
    (
      DeviceGroup("train", prof.device_type, half, 80.0, args.batch, link),
      DeviceGroup("infer", prof.device_type, args.processes - half, 80.0, args.batch, link),
    )
  )


def spawn(args, role: str, n: int, timeout: int) -> list[str]:
  flags = [
    f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("tiny", "role", "process_id")
  ]
  flags += ["--tiny"] if args.tiny else []
  procs = []
  for pid in range(n):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(pid))
    if args.tiny:
      env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "benchmarks.joint_run", f"--role={role}", f"--process-id={pid}", *flags]
    procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
  outs = [p.communicate(timeout=timeout)[0] for p in procs]
  if any(p.returncode for p in procs):
    raise SystemExit(f"{role} processes failed: return codes {[p.returncode for p in procs]}")
  return outs


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.joint_run", description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--processes", type=int, default=2)
  ap.add_argument("--d-model", type=int, default=1024)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--seq", type=int, default=512)
  ap.add_argument("--vocab", type=int, default=32000)
  ap.add_argument(
    "--batch", type=int, default=8, help="per-device batch of the spec (global = batch × processes)"
  )
  ap.add_argument("--granularity", type=int, default=1)
  ap.add_argument("--infer-device", default="L4")
  ap.add_argument("--train-precision", default="bf16")
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--port", type=int, default=29411)
  ap.add_argument("--profile-file", default="", help="a saved profile.json of the same model (skips step 1)")
  ap.add_argument("--tiny", action="store_true", help="CPU smoke run: a tiny LM, 2 gloo processes")
  ap.add_argument("--role", default="main", choices=("main", "profile", "worker"))
  ap.add_argument("--process-id", type=int, default=0)
  args = ap.parse_args(argv)
  if args.tiny and args.role == "main":
    args.d_model, args.heads, args.layers, args.seq, args.vocab, args.batch, args.steps = (
      32,
      2,
      1,
      16,
      64,
      4,
      3,
    )
  if args.role == "profile":
    return role_profile(args)
  if args.role == "worker":
    return role_worker(args)
  os.makedirs(args.out, exist_ok=True)
  if args.profile_file:
    shutil.copy(args.profile_file, os.path.join(args.out, "profile.json"))
  else:
    spawn(args, "profile", 1, 900)
  from planners.profile import Profile

  prof = Profile.load(os.path.join(args.out, "profile.json"))
  chosen_plans, _, chosen = plans(args, prof)
  with open(os.path.join(args.out, "plans.json"), "w") as f:
    json.dump({k: p.to_json() for k, p in chosen_plans.items()}, f, indent=1)
  print(
    f"joint planner chose {chosen!r} for {prof.device_type} + {args.infer_device}: "
    f"batches {chosen_plans['joint'].batch_per_device}"
  )
  outs = spawn(args, "worker", args.processes, 900)
  results = [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]
  rows = []
  device = f"{args.processes} x {prof.device_type}" if not args.tiny else "cpu"
  for r in results:
    print(
      f"{r['plan']:28s} batches {r['batch_per_device']}: gradient rel. L2 error {r['grad_rel_error']:.2e}; "
      f"step {r['median_ms']:.2f} ms (IQR {r['iqr_ms']:.2f}) vs predicted {r['predicted_ms']:.2f} ms "
      f"({100 * (r['predicted_ms'] / r['median_ms'] - 1):+.1f} %)"
    )
    case = f"lm d{args.d_model} l{args.layers} s{args.seq}/{r['plan']}"
    rows.append(result_row("joint_run", case, "grad_rel_error_vs_fp32", r["grad_rel_error"], None, device))
    rows.append(
      result_row(
        "joint_run",
        case,
        "predicted_step_ms",
        r["predicted_ms"],
        r["median_ms"],
        device,
        measured_iqr_ms=r["iqr_ms"],
        batch_per_device=r["batch_per_device"],
      )
    )
  if not args.tiny:
    append_rows(RESULTS, rows)
  with open(os.path.join(args.out, "joint_run.json"), "w") as f:
    json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
