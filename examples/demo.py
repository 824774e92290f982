"""``qsync demo``: the whole pipeline on a simulated hybrid cluster, end to end.

  qsync demo --out demo_out          # ≈ 3-5 minutes on a 2-core CPU

Four simulated CPU devices form two groups at their real memory: ``training`` (2 devices
modeled as V100, 32 GB) and ``inference`` (2 devices modeled as T4, 16 GB). The demo runs

1. **indicator** — trains the model briefly in fp32, then scores every op's sensitivity to
   int8 and fp16 (``planners.indicator``, gradient method);
2. **profile** — traces the model's ops and memory and models V100, T4 and A100 costs from the
   device catalog (roofline; labelled *modeled*); no group runs on the local CPU, so nothing
   is measured;
3. **plan** — the joint planner (``planners.allocator.joint``) chooses every group's per-device batch
   and the T4s' per-op precisions, the V100s at fp16 mixed precision (with loss scaling; a V100
   has no bf16; ``qsync plan``'s default), and predicts the alternatives it compared: the
   training groups alone, dynamic batching, uniform low precision, QSync's precision-only plan;
   it also plans a modern pool, 1 × A100 (bf16) + 7 × T4, that nothing trains;
4. **train** — trains each of them on the 4 CPU devices with the hybrid trainer and
   evaluates held-out loss and accuracy (fp32 master weights);

then prints one table (each column the replay predicts for the V100/T4 pool says *modeled*;
the accuracy cost relative to uniform low precision), a line for each alternative the joint
plan does not beat outright saying why, a table of both pools' chosen plans against their best
baseline (the fastest of equal batches, dynamic batching and the training group alone, each also at
every group's 8-bit auto policy and every gradient payload) and their bound
(``planners.allocator.summary``; modeled), and writes to ``--out``: ``plan.json`` (the joint plan, its
alternatives under ``predictions.alternatives``), ``plans/<config>.json``, ``cluster.json``,
``indicator.json``, ``profile_*.json``, ``trace.json`` (Chrome trace of the joint plan's
predicted step; open in ui.perfetto.dev), ``timeline.png``, ``sensitivity.png`` and
``results.json`` (with each plan's held-out loss and accuracy of the CPU run). Times are the
replay's predictions for the modeled devices, not CPU times; the CPU only runs the numerics.
The table compares no held-out accuracy: one seed moves it more between plans of equal
precision than precision does (``ACCURACY_NOTE``; over seeds: ``python -m benchmarks.accuracy``,
docs/results.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any

from qsync_jax.errors import QsyncError

HELP = "End-to-end demo: indicator → profile → plan → train on a simulated V100 + T4 cluster."
OUTPUTS = {"out": "dir"}  # checked by the CLI before any work (qsync_jax.train.outputs)

NUM_DEVICES = 4
CONFIGS = (
  "training groups only",
  "dynamic batching",
  "uniform low precision",
  "QSync (precision only)",
  "joint",
)
"""The planner's candidates the demo trains (``planners.allocator.joint``'s names)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--out", default="qsync_demo", help="output directory (default: qsync_demo)")
  parser.add_argument(
    "--model", default="vgg", help="registered task or package.module:make_task (default: vgg on digits)"
  )
  parser.add_argument(
    "--batch-per-device", type=int, default=16, help="per-device batch the CPU trains (default 16)"
  )
  parser.add_argument(
    "--pool-batch-per-device",
    type=int,
    default=128,
    help="per-device batch the modeled V100/T4 pool is planned at (default 128, a job whose ops are big "
    "enough for precision to matter); the CPU trains each plan's batch shares at --batch-per-device",
  )
  parser.add_argument("--steps", type=int, default=150, help="training steps per configuration (default 150)")
  parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--pretrain-steps", type=int, default=40, help="fp32 steps before the indicator probes (default 40)"
  )
  parser.add_argument(
    "--indicator-batches",
    type=int,
    default=16,
    help="batches the indicator averages (default 16, as `qsync indicator`)",
  )
  parser.add_argument(
    "--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}"
  )


# -- setup ----------------------------------------------------------------------------------


class Progress:
  """Stage lines with elapsed time on stderr."""

  def __init__(self, stream=sys.stderr):
    self.stream, self.t0 = stream, time.perf_counter()

  def __call__(self, msg: str) -> None:
    print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", file=self.stream, flush=True)


def simulated_devices(n: int = NUM_DEVICES):
  """``n`` CPU devices: asks JAX for ``n`` host devices if no JAX computation has run yet."""
  import jax

  try:
    jax.config.update("jax_num_cpu_devices", max(n, 1))
  except RuntimeError:
    pass  # JAX already started (e.g. under pytest with 8 devices): use what it has
  devices = jax.devices()
  if len(devices) < n:
    raise QsyncError(
      f"the demo needs {n} devices but JAX has {len(devices)}. Fix: run it in a fresh process, or set "
      f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts."
    )
  return devices[:n]


def demo_cluster(batch_per_device: int):
  """2 × V100 (training, 32 GB) + 2 × T4 (inference, 16 GB), on 4 simulated devices."""
  from qsync_jax.cluster import ClusterSpec, DeviceGroup

  return ClusterSpec(
    (
      DeviceGroup("training", "V100", 2, 32.0, batch_per_device, link_gbps=100.0),
      DeviceGroup("inference", "T4", 2, 16.0, batch_per_device, link_gbps=32.0),
    ),
    name="demo-v100-t4",
  )


def modern_cluster(batch_per_device: int):
  """1 × A100 (training, 80 GB) + 7 × T4 (inference, 16 GB), links as ``demo_cluster``'s: a pool
  the demo plans (modeled) next to the paper's, and does not train."""
  from qsync_jax.cluster import ClusterSpec, DeviceGroup

  return ClusterSpec(
    (
      DeviceGroup("training", "A100", 1, 80.0, batch_per_device, link_gbps=100.0),
      DeviceGroup("inference", "T4", 7, 16.0, batch_per_device, link_gbps=32.0),
    ),
    name="demo-a100-7t4",
  )


def training_precision(cluster) -> str:
  """The training group's precision, as ``qsync plan`` defaults it (``planners.planning.train_precision``):
  fp16 mixed precision (with loss scaling) on a V100, bf16 on an A100."""
  from planners.planning import train_precision

  return train_precision(cluster, ("training",), None)


# -- stages ---------------------------------------------------------------------------------


def stage_indicator(task, args, say) -> dict:
  """fp32 pre-training, then the gradient indicator's Ω table (as ``qsync indicator``)."""
  from planners.indicator import compute, initial_variables

  say(f"indicator: {args.pretrain_steps} fp32 pre-training steps of {task.name}")
  variables = initial_variables(task, args.seed, args.pretrain_steps, 32)
  stream = task.train_batches(32, args.seed + 1)
  batches = [next(stream) for _ in range(args.indicator_batches)]
  say(f"indicator: probing every op at int8 and fp16 on {len(batches)} batches")
  return compute(task, variables, batches, ("gradient",), ("int8", "fp16"), seed=args.seed)["gradient"]


def stage_profile(task, batch_per_device: int, say, device_types=("V100", "T4")) -> dict:
  """``{device type: Profile}`` (and ``"cpu"``: the traced ops): each of ``device_types`` costed
  from the device catalog on the model's traced ops and memory; no group runs on the local
  device, so nothing is measured."""
  from planners.predictor import modeled_profile
  from planners.profiler import traced_profile

  # The profiler traces the model's ops with ``train_kwargs`` but without ``mutable``, which
  # BatchNorm in training mode needs; the op shapes are the same in eval mode.
  probe_task = dataclasses.replace(task, train_kwargs=task.eval_kwargs) if task.mutable else task
  types = " and ".join(device_types)
  say(
    f"profile: every group is a modeled type ({types}), not the local device: tracing the ops, measuring nothing"
  )
  traced = traced_profile(probe_task, batch_per_device)
  say(f"profile: modeling {types} from the device catalog (roofline)")
  return {"cpu": traced, **{t: modeled_profile(traced, t) for t in device_types}}


def stage_plan(cluster, profiles, indicator, say, train_policy="fp32", int8_op="int8_fwd") -> dict[str, Any]:
  """The joint planner's candidates: ``{name: (Plan, Prediction, Candidate)}``, the joint
  plan under ``"joint"`` (with every alternative and the chosen plan's summary against the best
  baseline and the pool's bound, ``planners.allocator.summary``, in its predictions); the
  ``training`` group runs ``train_policy``, an op planned at int8 runs ``int8_op``
  (``planners.allocator.greedy``)."""
  from planners.allocator import joint_plan, make_problem, plan_of
  from planners.allocator.summary import summarize
  from planners.predictor import predict

  say(f"plan: joint batch × precision search (the training group runs {train_policy})")
  problem = make_problem(cluster, profiles, indicator, ["training"], train_policy, int8_op=int8_op)
  chosen, cands, search = joint_plan(problem)
  summary = summarize(chosen, cands, search, predict(cluster, profiles, plan_of(problem, chosen)))
  alternatives = [c.to_json(problem) for c in cands]
  kept = {}  # one candidate per name (the search tries each in every mode): the chosen, else the fastest
  for cand in cands:
    other = kept.get(cand.name)
    if other is not chosen and (
      cand is chosen or other is None or (cand.fits, cand.samples_per_s) > (other.fits, other.samples_per_s)
    ):
      kept[cand.name] = cand
  out = {}
  for cand in kept.values():
    extra = (
      {"chosen": chosen.name, "alternatives": alternatives, **summary.to_json()}
      if cand.name == "joint"
      else {}
    )
    plan = plan_of(problem, cand, {"accuracy_cost": cand.cost, "samples_per_s": cand.samples_per_s, **extra})
    out[cand.name] = (plan, predict(cluster, profiles, plan), cand)
  return out


def _why_same(planned) -> str:
  """Why the joint plan found nothing better than a plain alternative, in one clause."""
  low = planned.get("uniform low precision")
  full = planned.get("equal batches, training precision")
  if low and full and low[2].step_ms >= full[2].step_ms:
    return (
      f"lower precision does not pay on the inference group here (uniform low precision's step is "
      f"{low[2].step_ms / full[2].step_ms:.2f}× the training precision's at the same batches: the "
      "model's ops are too small for the saved GEMM time to cover the casts)"
    )
  return "no batch or precision change predicts a faster step at less cost"


def accuracy_cost_scale(planned) -> tuple[str, Any]:
  """``(header, format)`` of the accuracy cost column: the planner's ``Σ share·Ω`` relative to
  uniform low precision's (= 1; 0 where every op keeps the training precision), or, where
  that plan is missing or costs nothing, the raw sum."""
  low = planned.get("uniform low precision")
  base = low[2].cost if low else 0.0
  if base > 0 and math.isfinite(base):
    return "acc. cost (uniform low = 1)", lambda cost: f"{cost / base:.3g}"
  return "acc. cost (Σ share·Ω)", lambda cost: f"{cost:.3g}"


def why_not_beaten(planned) -> list[str]:
  """One line per alternative whose predicted throughput is not below the joint plan's."""
  _, _, joint = planned["joint"]
  header, cost = accuracy_cost_scale(planned)
  scale = header.partition("(")[2].rstrip(")")
  lines = []
  for name, (_, _, cand) in planned.items():
    if name == "joint" or not cand.fits or cand.samples_per_s < joint.samples_per_s * (1 - 1e-9):
      continue
    if cand.batches == joint.batches and cand.rows == joint.rows:
      lines.append(f"joint = {name}: {_why_same(planned)}")
    else:
      lines.append(
        f"{name} is predicted {100 * (cand.samples_per_s / joint.samples_per_s - 1):.1f} % faster (within the "
        f"slack) at accuracy cost {cost(cand.cost)} against the joint plan's {cost(joint.cost)} ({scale})"
      )
  return lines


def cpu_plan(plan, pool, cpu):
  """``plan`` (per-device batches for the ``pool`` cluster) with its batches scaled to ``cpu``'s
  global batch, shares kept as closely as integers allow (a group out stays out)."""
  import dataclasses as dc

  factor = cpu.global_batch / pool.global_batch
  groups = pool.groups
  batches = {g.name: plan.batch_per_device.get(g.name, g.batch_per_device) for g in groups}
  scaled = {n: (max(1, round(b * factor)) if b else 0) for n, b in batches.items()}
  for _ in range(cpu.global_batch):  # move one example per device at a time toward the target
    missing = cpu.global_batch - sum(g.count * scaled[g.name] for g in groups)
    fits = [g for g in groups if scaled[g.name] and g.count <= abs(missing)]
    if not missing or not fits:
      break
    g = max(fits, key=lambda g: scaled[g.name])
    scaled[g.name] += 1 if missing > 0 else -1
  if sum(g.count * scaled[g.name] for g in groups) != cpu.global_batch:
    raise QsyncError(
      f"the plan's batches {batches} do not scale to the CPU's global batch {cpu.global_batch}. Fix: "
      "choose --batch-per-device so that the global batch divides over the groups' devices."
    )
  return dc.replace(plan, batch_per_device=scaled)


def stage_train(
  task,
  cluster,
  plans,
  devices,
  steps,
  optimizer,
  seeds,
  say,
  eval_max_batches=None,
  log_every=None,
  on_seed=None,
):
  """Trains each plan with the hybrid data-parallel step (``qsync_jax.train.train_step``) and
  ``optimizer`` once per seed; returns ``{config: [metrics per seed]}`` with held-out metrics
  of the fp32 weights. Seed ``s`` gives every plan the same initial weights and batches.
  With ``log_every``, the training loss is said every that many steps, and a seed whose loss
  is not finite there stops (its row records the steps it ran). ``on_seed(config, row)``, when
  given, is called with each seed's metrics as soon as they exist.

  One compiled step per configuration serves every seed (only the state is re-initialized).
  """
  import jax

  from examples.train_loop import Runner
  from qsync_jax.train.train_step import make_train_step

  evaluator = Runner(task, None, optimizer)
  on_cpu = devices[0].platform == "cpu"
  results: dict[str, list[dict[str, float]]] = {}
  for name, plan in plans.items():
    program = make_train_step(task, cluster, plan, optimizer, devices=devices)
    results[name] = []
    for seed in seeds:
      say(
        f"train [{name}] seed {seed}: {steps} steps on {len(devices)} device{'' if len(devices) == 1 else 's'}"
      )
      t0 = time.perf_counter()
      batches = task.train_batches(program.global_batch, seed)
      state = program.init(seed, next(task.train_batches(program.global_batch, seed)))
      ran = 0
      for ran in range(1, steps + 1):
        state, metrics = program(state, program.shard(next(batches)))
        # On the CPU, one step in flight at a time: on a host with fewer cores than simulated devices, a
        # second step dispatched early can take the XLA:CPU pool threads that the first one's
        # all-reduce still needs (seen on 2 cores: "Termination timeout for all reduce").
        if on_cpu:
          jax.block_until_ready(metrics)
        if log_every and ran % log_every == 0:
          loss = float(metrics["loss"])
          say(f"train [{name}] seed {seed}: step {ran}, loss {loss:.4f}")
          if not math.isfinite(loss):
            say(f"train [{name}] seed {seed}: stopped at step {ran}: the loss is not finite")
            break
      carry = {"params": state.params, "state": state.model_state}
      held_out = evaluator.evaluate(carry, 256, eval_max_batches)
      row = {
        "seed": seed,
        "train_loss": float(metrics["loss"]),
        "eval_loss": held_out.get("loss", float("nan")),
        "eval_accuracy": held_out.get("accuracy", float("nan")),
        "cpu_seconds": time.perf_counter() - t0,
        "steps_run": ran,
      }
      results[name].append(row)
      if on_seed:
        on_seed(name, row)
      say(
        f"train [{name}] seed {seed}: loss {row['train_loss']:.4f}, held-out loss {row['eval_loss']:.4f}, "
        f"accuracy {row['eval_accuracy']:.4f} ({row['cpu_seconds']:.0f}s)"
      )
  return results


# -- outputs --------------------------------------------------------------------------------


def save_sensitivity_png(indicator: dict, path: str) -> None:
  """Horizontal bars of Ω per op (log scale), one colour per precision, ops in forward order."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  ops = indicator["ops"]
  precisions = [p for p in indicator["precisions"] if p != "fp32"]
  fig, ax = plt.subplots(figsize=(9, 1 + 0.35 * len(ops)))
  height = 0.8 / max(len(precisions), 1)
  y = np.arange(len(ops))
  for i, p in enumerate(precisions):
    values = [max(indicator["omega"][op][p], 1e-30) for op in ops]
    ax.barh(y + i * height, values, height, label=p)
  ax.set_yticks(y + 0.4 - height / 2, ops, fontsize="small")
  ax.invert_yaxis()
  ax.set_xscale("log")
  ax.set_xlabel(f"Ω ({indicator['method']} indicator): expected loss change when the op alone is quantized")
  ax.legend()
  ax.set_title("per-op sensitivity (larger = more sensitive)")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def precision_mix(plan, group: str, op_names) -> str:
  """``"int8×5, fp32×4"``: how many of ``op_names`` run their forward at each precision."""
  counts: dict[str, int] = {}
  policy = plan.policy_for(group)
  for op in policy.resolve(op_names).values():
    p = "fp32" if op is None else op.fwd
    counts[p] = counts.get(p, 0) + 1
  return ", ".join(f"{p}×{n}" for p, n in sorted(counts.items()))


MODELED_NOTE = (
  "modeled: the replay's predictions for the V100 / T4 pool from the device catalog, not CPU times; "
  "CPU batch: the per-device batches the plan's shares give the CPU run; vs best baseline: over the fastest "
  "of dynamic batching and the training group alone (each also at 8-bit auto policies and every gradient "
  "payload); acc. cost: the planner's Σ share·Ω, relative to "
  "uniform low precision on the T4s (1; 0: every op at the training precision)"
)
ACCURACY_NOTE = (
  "held-out accuracy is not compared here: one seed moves it more between plans of equal precision than "
  "precision does (on the default VGG, a BatchNorm model); each plan's is in results.json, and over seeds: "
  "python -m benchmarks.accuracy (docs/results.md)"
)


POOLS_NOTE = (
  "modeled: the replay's predictions from the device catalog; best baseline: the fastest of equal batches, "
  "dynamic batching and the training group alone (each also at 8-bit auto policies and every gradient payload); bound: every device at its fastest precision, the batch split by speed "
  "(fractional), no communication; headroom: (plan − best baseline) / (bound − best baseline); limited by: "
  "the group whose backward ends last, the all-reduce time its compute does not overlap, its optimizer update"
)


def pools_table(pools) -> str:
  """One row per ``(pool label, training precision, planned)`` (``planned`` from ``stage_plan``): the chosen
  plan against its best baseline and the pool's bound (``planners.allocator.summary``, from the
  joint plan's predictions); every figure modeled (``POOLS_NOTE``)."""
  from planners.report import table

  rows = []
  for label, train_policy, planned in pools:
    preds = planned["joint"][0].predictions
    chosen = planned[preds["chosen"]][2]
    base, lim = preds["best_baseline"], preds["limited_by"]
    headroom = preds["headroom_captured"]
    rows.append(
      [
        label,
        train_policy,
        f"{preds['chosen']} ({'/'.join(str(b) for b in chosen.batches)})",
        f"{preds['samples_per_s']:.0f}",
        f"{base['name']} ({base['samples_per_s']:.0f})" if base else "-",
        f"{preds['gain_vs_best_baseline']:.2f}×" if base else "-",
        f"{preds['bound_samples_per_s']:.0f}",
        f"{100 * headroom:.0f} %" if headroom is not None else "-",
        f"{lim['straggler']}; all-reduce {lim['exposed_comm_ms']:.2f} ms, "
        f"optimizer {lim['optimizer_ms']:.2f} ms",
      ]
    )
  headers = [
    "pool",
    "training at",
    "plan (batch per device)",
    "samples/s (modeled)",
    "best baseline (modeled)",
    "gain (modeled)",
    "bound (modeled)",
    "headroom (modeled)",
    "limited by (modeled)",
  ]
  return table(headers, rows)


def results_table(cluster, planned, trained, op_names) -> str:
  """The plans side by side: what each runs, and what the replay predicts for the modeled pool
  (every such column says so); no held-out metric (``ACCURACY_NOTE``)."""
  from planners.allocator.bound import best_baseline
  from planners.report import table

  base = best_baseline([cand for _, _, cand in planned.values()])
  cost_header, cost = accuracy_cost_scale(planned)
  rows = []
  for name, (plan, pred, cand) in planned.items():
    t4 = precision_mix(plan, "inference", op_names) if cand.batches[1] else "(sits out)"
    cpu_batches = trained.get(name, {}).get("cpu_batch_per_device")
    rows.append(
      [
        name,
        "/".join(str(b) for b in cand.batches),
        "/".join(str(cpu_batches[g.name]) for g in cluster.groups) if cpu_batches else "-",
        t4,
        pred.step_ms,
        f"{cand.samples_per_s:.0f}",
        f"{cand.samples_per_s / base.samples_per_s:.2f}×" if base else "-",
        cost(cand.cost),
        "yes" if cand.fits else "NO",
      ]
    )
  headers = [
    "config",
    "batch V100/T4",
    "CPU batch",
    "T4 fwd precisions",
    "step ms (modeled)",
    "samples/s (modeled)",
    "vs best baseline (modeled)",
    cost_header,
    "fits (modeled)",
  ]
  return table(headers, rows)


def write_outputs(out, cluster, indicator, profiles, planned, trained, say) -> None:
  os.makedirs(os.path.join(out, "plans"), exist_ok=True)
  cluster.save(os.path.join(out, "cluster.json"))
  from planners.indicator import save
  from planners.predictor import save_chrome_trace, save_png
  from qsync_cli.predict import save_png_atomic
  from qsync_jax.jsonio import write_text_atomic

  save(indicator, os.path.join(out, "indicator.json"))
  save_png_atomic(save_sensitivity_png, indicator, os.path.join(out, "sensitivity.png"), "sensitivity image")
  for device_type, prof in profiles.items():
    prof.save(os.path.join(out, f"profile_{device_type}.json"))
  for name, (plan, pred, _) in planned.items():
    plan = dataclasses.replace(plan, predictions={**plan.predictions, **pred.to_json()})
    plan.save(os.path.join(out, "plans", file_name(name) + ".json"))
    if name == "joint":
      plan.save(os.path.join(out, "plan.json"))
  shown = planned["joint"][1]
  save_chrome_trace(shown, os.path.join(out, "trace.json"))
  save_png_atomic(save_png, shown, os.path.join(out, "timeline.png"), "timeline image")
  summary = {
    name: {
      "predicted": {**pred.to_json(), "samples_per_s": cand.samples_per_s, "accuracy_cost": cand.cost},
      "batch_per_device": dict(zip(cluster.group_names, cand.batches)),
      **trained.get(name, {}),
    }
    for name, (_, pred, cand) in planned.items()
  }
  text = json.dumps(summary, indent=1, default=float) + "\n"
  write_text_atomic(os.path.join(out, "results.json"), text, "results file", QsyncError)
  say(f"wrote {out}/: plan.json, plans/, cluster.json, indicator.json, profile_*.json, trace.json, PNGs")


def file_name(config: str) -> str:
  """``"QSync (precision only)"`` → ``"qsync_precision_only"``."""
  return "_".join("".join(c if c.isalnum() else " " for c in config.lower()).split())


# -- entry point ----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
  say = Progress()
  configs = [c.strip() for c in args.configs.split(",") if c.strip()]
  unknown = [c for c in configs if c not in CONFIGS]
  if unknown:
    raise QsyncError(f"--configs: unknown configuration(s) {unknown}. Fix: choose from {list(CONFIGS)}.")
  if not (math.isfinite(args.lr) and args.lr > 0):
    raise QsyncError(
      f"--lr {args.lr} is not a learning rate: it must be a finite number above 0. Fix: pass e.g. --lr 3e-3."
    )
  devices = simulated_devices(NUM_DEVICES)
  import optax

  from qsync_jax.train.task import load_task

  task = load_task(args.model)
  cluster = demo_cluster(args.pool_batch_per_device)
  cpu = demo_cluster(args.batch_per_device)
  say(
    f"{task.name}: a 2 × V100 (training) + 2 × T4 (inference) pool planned at {args.pool_batch_per_device} "
    f"per device; its plans trained on {len(devices)} simulated CPU devices at {cpu.global_batch} per step; "
    "a 1 × A100 + 7 × T4 pool planned (modeled) next to it"
  )
  modern = modern_cluster(args.pool_batch_per_device)
  indicator = stage_indicator(task, args, say)
  profiles = stage_profile(task, args.pool_batch_per_device, say, ("V100", "T4", "A100"))
  policies = {c.name: training_precision(c) for c in (cluster, modern)}
  planned = stage_plan(cluster, profiles, indicator, say, policies[cluster.name])
  planned_modern = stage_plan(modern, profiles, indicator, say, policies[modern.name])
  to_train = {
    name: cpu_plan(plan, cluster, cpu)
    for name, (plan, _, cand) in planned.items()
    if name in configs and cand.fits
  }
  trained = {
    k: {**v[0], "cpu_batch_per_device": to_train[k].batch_per_device}
    for k, v in stage_train(
      task, cpu, to_train, devices, args.steps, optax.adam(args.lr), [args.seed], say
    ).items()
  }
  print(results_table(cluster, planned, trained, profiles["cpu"].op_names))
  for line in why_not_beaten(planned):
    print(line)
  print(MODELED_NOTE)
  print(ACCURACY_NOTE)
  pools = [("2 × V100 + 2 × T4", cluster, planned), ("1 × A100 + 7 × T4", modern, planned_modern)]
  print("\nthe chosen plan of each pool against its best baseline and its bound (modeled; not trained here):")
  print(pools_table([(label, policies[c.name], p) for label, c, p in pools]))
  print(POOLS_NOTE)
  write_outputs(args.out, cluster, indicator, profiles, planned, trained, say)
  return 0
