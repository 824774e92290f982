"""``qsync train``: run a plan on a cluster (hybrid synchronous data parallel).

  qsync train --model resnet --cluster cluster.json --plan plan.json --steps 200 --out runs/a
  qsync train --model mypkg.tasks:make_task --cluster c.yaml --steps 50 --out runs/b --resume

``--sync NAME`` picks a strategy of ``qsync_jax.sync`` (fp32, bf16, fp16, global_qsgd, selsync,
qsdp), ``--sync-option KEY=VALUE`` (repeatable, JSON values) sets its options, e.g.
``--sync selsync --sync-option delta=0.2 --sync-option warmup=10``.

``--model`` is a registered task name (``qsync_jax.train.task``: the examples' ``vgg``, ``resnet``,
``lm`` …) or ``package.module:attr`` naming a ``Task`` or a function returning one. Without
``--cluster`` every local device forms one ``cpu`` group. Progress (steps/s, loss, ETA) goes
to stderr; metrics to ``OUT/metrics.jsonl``; checkpoints to ``OUT/checkpoints``. Multi-process:
start one process per host (or several on one CPU host) with the same arguments plus
``--coordinator HOST:PORT --num-processes N --process-id I``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from qsync_cli.common import add_model_argument
from qsync_jax.errors import Interrupted, PlanError, QsyncError

HELP = "train a model on a hybrid cluster under a plan (synchronous data parallel)"

OPTIMIZERS = ("adam", "adamw", "sgd", "momentum")


def add_arguments(parser: argparse.ArgumentParser) -> None:
  add_model_argument(parser)
  parser.add_argument(
    "--cluster", help="cluster spec (JSON, or YAML); default: all local devices, one 'cpu' group"
  )
  parser.add_argument(
    "--batch-per-device", type=int, default=8, help="per-device batch without --cluster (default 8)"
  )
  parser.add_argument(
    "--plan",
    help="plan JSON (one precision policy per group), or 'auto': measure on this host's GPU which ops "
    "are faster in 8-bit inside the step and run those 8-bit, the rest bf16 (fp16 where the GPU has no "
    "bf16), on every group (one device type; written to OUT/plan.json and OUT/auto_policy.json); "
    "default: fp32 everywhere",
  )
  parser.add_argument(
    "--no-fused-attention",
    action="store_true",
    help="run attention with Flax's own einsums even where its products are one 16-bit type "
    "(default on a GPU: jax.nn.dot_product_attention, cuDNN's fused kernel; a CPU runs Flax's einsums)",
  )
  parser.add_argument("--steps", type=int, required=True, help="train until this many steps in total")
  parser.add_argument(
    "--out",
    required=True,
    help="run directory: metrics.jsonl, checkpoints/ and tensorboard/ when tensorboardX is installed",
  )
  parser.add_argument(
    "--sync",
    default=None,
    help="sync strategy (qsync_jax.sync: fp32, bf16, fp16, global_qsgd, selsync, qsdp); default: the plan's "
    "sync (`qsync plan --sync`), else fp32 psum; one the plan contradicts is refused",
  )
  parser.add_argument(
    "--sync-option",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="option of the --sync strategy (JSON value, e.g. delta=0.2, bucket_size=256), repeatable",
  )
  parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
  parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
  parser.add_argument(
    "--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end)"
  )
  parser.add_argument("--log-every", type=int, default=1, help="steps between metrics lines (default 1)")
  parser.add_argument(
    "--replan",
    choices=("off", "once", "auto"),
    help="re-balance the groups' batches from their measured speeds: once after the first steps "
    "(the default on GPUs), auto (also when the step time drifts, and every 10 windows of 20 steps), "
    "or off (the default on simulated CPU devices, which share one host's cores, and with selsync "
    "and qsdp, which build their own step)",
  )
  parser.add_argument("--eval", action="store_true", help="evaluate on the task's held-out set at the end")
  parser.add_argument(
    "--compilation-cache",
    metavar="DIR",
    help="JAX's persistent compilation cache in DIR (as JAX_COMPILATION_CACHE_DIR=DIR): a run that "
    "compiles a step already compiled there loads it instead",
  )
  parser.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="task config override (JSON value), repeatable",
  )
  dist = parser.add_argument_group("multi-process")
  dist.add_argument("--coordinator", help="HOST:PORT of process 0 (enables jax.distributed)")
  dist.add_argument("--num-processes", type=int, default=1)
  dist.add_argument("--process-id", type=int, default=0)
  dist.add_argument("--local-devices", type=int, help="simulated CPU devices per process")
  dist.add_argument(
    "--simulate-device-types",
    action="store_true",
    help="let GPUs run groups of another device_type (simulation); without it a GPU whose kind differs "
    "from its group's device_type is refused (CPU devices always simulate)",
  )
  dist.add_argument(
    "--step-timeout", type=float, help="seconds a step may take before a process gives up (default 120)"
  )
  dist.add_argument(
    "--heartbeat-timeout",
    type=int,
    default=30,
    help="seconds without a peer's heartbeat before all stop (default 30)",
  )


def _overrides(items: list[str], flag: str = "--set", example: str = "hidden=64") -> dict:
  out = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise QsyncError(f"{flag} {item!r} is not KEY=VALUE. Fix: write e.g. {flag} {example}.")
    try:
      out[key] = json.loads(value)
    except json.JSONDecodeError:
      out[key] = value
  return out


def _optimizer(name: str, lr: float):
  import optax

  return {
    "adam": lambda: optax.adam(lr),
    "adamw": lambda: optax.adamw(lr),
    "sgd": lambda: optax.sgd(lr),
    "momentum": lambda: optax.sgd(lr, momentum=0.9),
  }[name]()


def _default_replan(sync: str | None, plan=None) -> str:
  """``once`` on GPUs; ``off`` on CPU devices, for step-builder strategies and for a plan that
  accumulates gradients (its micro-batches fix its batches)."""
  import jax

  from qsync_jax.sync import get_strategy

  if jax.devices()[0].platform == "cpu" or (sync and get_strategy(sync).kind == "train_step"):
    return "off"
  if plan is not None and any(k != 1 for k in plan.micro_steps.values()):
    return "off"
  return "once"


def _sync(name: str | None, items: list[str]) -> tuple[str | None, dict]:
  """(strategy name or None for the default fp32 psum, its options) from --sync / --sync-option."""
  options = _overrides(items, "--sync-option", "delta=0.2")
  if name is None and options:
    raise QsyncError("--sync-option needs a --sync strategy. Fix: add e.g. --sync selsync.")
  if name in (None, "psum", "fp32") and not options:
    return None, {}
  return ("fp32" if name == "psum" else name), options


def check_memory(task, cluster, plan, optimizer) -> None:
  """Raises ``PlanError`` when a group's devices cannot hold ``plan``'s training step: the need of
  ``qsync plan``'s memory model (``planners.predictor.memory_model``) for the model's traced ops, parameters,
  ``optimizer`` state and batch, without the XLA buffers ``qsync profile`` fits — a lower bound
  of the planner's estimate, so a plan the planner accepted passes. Traces the model; runs nothing."""
  from planners.predictor import memory_bytes
  from planners.profile import GroupCost, Profile
  from planners.profiler import memory_sizes, task_ops

  cluster = plan.apply_to(cluster)
  batch_per_device = cluster.max_batch_per_device
  batch, variables, ops = task_ops(task, batch_per_device)
  memory = memory_sizes(variables["params"], optimizer.init(variables["params"]), batch)
  for g in cluster.groups:
    prof = Profile(task.name, g.device_type, "traced", batch_per_device, ops, {}, {}, 0.0, {}, memory)
    need = memory_bytes(
      GroupCost(g.name, prof, plan.policy_for(g.name).resolve(prof.op_names), g.batch_per_device)
    )
    if need > g.memory_gb * 1e9:
      gb = math.ceil(need / 1e7) / 100
      raise PlanError(
        f"device group {g.name!r} ({g.device_type}, {g.batch_per_device} per device) needs at least {gb:.2f} GB "
        f"per device for this plan's step (parameters, optimizer state, batch and saved activations), but "
        f"the cluster spec gives it memory_gb={g.memory_gb:g}. Fix: set memory_gb ≥ {gb:.2f} if the device "
        "has it, lower its batch_per_device, or plan it (`qsync plan`) to a precision that stores less."
      )


def check_device_count(cluster, devices, num_processes: int) -> None:
  """Raises ``ClusterSpecError`` when the job's ``devices`` (all processes') are not as many as
  ``cluster``'s. On CPU devices the fix it names first is the command's ``--local-devices N``
  (simulated CPU devices per process); on GPUs, running on as many GPUs."""
  from qsync_jax.errors import ClusterSpecError

  need, have = cluster.num_devices, len(devices)
  if need == have:
    return
  counts = ", ".join(f"{g.name}={g.count}" for g in cluster.groups)
  per_process, rest = divmod(need, num_processes)
  if devices[0].platform == "cpu" and rest == 0:
    each = f" in each of the {num_processes} processes" if num_processes > 1 else ""
    fix = (
      f"pass --local-devices {per_process} (simulated CPU devices{each}), or change the group counts to sum "
      f"to {have}."
    )
  elif devices[0].platform == "cpu":
    fix = (
      f"change the group counts to a multiple of --num-processes {num_processes} (then pass --local-devices "
      f"COUNT/{num_processes}), or to sum to {have}."
    )
  else:
    fix = (
      f"run on {need} GPUs (e.g. CUDA_VISIBLE_DEVICES), or change the group counts to sum to {have}; to "
      f"simulate the cluster on the CPU instead, set JAX_PLATFORMS=cpu and pass --local-devices {need}."
    )
  raise ClusterSpecError(
    f"cluster spec {cluster.name!r} has {need} devices ({counts}) but the job has {have}. Fix: {fix}"
  )


def _check_arguments(args: argparse.Namespace) -> None:
  """The options' own constraints, checked before JAX starts and the model is built."""
  from qsync_jax.sync import STRATEGIES

  if args.steps <= 0:
    raise QsyncError(f"--steps {args.steps} must be positive. Fix: pass --steps 1 or more.")
  if args.local_devices is not None and args.local_devices < 1:
    raise QsyncError(
      f"--local-devices {args.local_devices} must be at least 1. Fix: pass e.g. --local-devices 8."
    )
  if args.sync is not None and args.sync != "psum" and args.sync not in STRATEGIES:
    raise QsyncError(f"--sync {args.sync!r} is not a sync strategy. Fix: use one of {sorted(STRATEGIES)}.")
  if args.plan == AUTO and args.num_processes > 1:
    raise QsyncError(
      "--plan auto measures one host's device and cannot run in a multi-process job (each process would "
      "measure its own). Fix: run it once in one process (it writes OUT/plan.json), then pass that file "
      "as --plan to every process."
    )


def _take_back_sigterm() -> None:
  """``jax.distributed`` installs its own SIGTERM handler (its preemption notifier, which only
  records the signal) in place of Python's; this installs Python's again, so that SIGTERM stops
  the run as Ctrl-C does (``qsync_cli.main``). Main thread only."""
  import signal
  import threading

  on_sigterm = signal.getsignal(signal.SIGTERM)
  if callable(on_sigterm) and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, on_sigterm)


AUTO = "auto"
"""``--plan auto``: ``auto_plan``."""


def auto_plan(args: argparse.Namespace, task, cluster):
  """``(plan, measurements or None)`` of ``--plan auto``: ``OUT/plan.json`` when resuming a run
  that wrote it; else every group runs the policy ``planners.allocator.auto_policy`` measures on
  the local device (8-bit only on the ops it measures faster inside the step; the rest at bf16, or
  fp16 on a device without bf16). ``write_auto_plan`` writes both into the run directory."""
  import jax

  from planners.allocator import auto_policy
  from qsync_jax.devices import device_type_of, supported_precisions
  from qsync_jax.plan import Plan

  path = os.path.join(args.out, "plan.json")
  if args.resume and os.path.exists(path):
    return Plan.load(path), None
  local = device_type_of(jax.devices()[0])
  types = sorted({g.device_type for g in cluster.groups})
  if types != [local]:
    raise PlanError(
      f"--plan auto measures this host's device ({local}), but cluster {cluster.name!r} has device types "
      f"{types}. Fix: plan a pool of several types with `qsync plan`, or give a cluster of {local} groups."
    )
  runs = supported_precisions(local)
  base = next((p for p in ("bf16", "fp16") if p in runs), "fp32")
  say = (
    (lambda msg: print(f"auto policy: {msg}", file=sys.stderr, flush=True))
    if jax.process_index() == 0
    else None
  )
  result = auto_policy(task, cluster.max_batch_per_device, base=base, progress=say, seed=args.seed)
  if say:
    for line in result.summary():
      print(line, file=sys.stderr, flush=True)
  return Plan.uniform(cluster, result.policy), result


def write_auto_plan(out: str, plan, result) -> None:
  """``OUT/plan.json`` (the plan a ``--resume`` reuses) and ``OUT/auto_policy.json`` (what was
  measured), each written atomically."""
  from qsync_jax.jsonio import write_text_atomic

  text = json.dumps(result.to_json(), indent=1) + "\n"
  os.makedirs(out, exist_ok=True)
  write_text_atomic(os.path.join(out, "auto_policy.json"), text, "auto policy", PlanError)
  plan.save(os.path.join(out, "plan.json"))


def run(args: argparse.Namespace) -> int:
  from qsync_jax.ops.qattention import fused_attention

  with fused_attention(False if args.no_fused_attention else None):  # traced when the step compiles
    return _run(args)


def _run(args: argparse.Namespace) -> int:
  from qsync_jax.cluster import ClusterSpec
  from qsync_jax.plan import Plan

  # Arguments and input files first: a bad one is named before JAX starts and the model is built.
  _check_arguments(args)
  overrides = _overrides(args.set)
  cluster = ClusterSpec.load(args.cluster) if args.cluster else None
  plan = Plan.load(args.plan) if args.plan and args.plan != AUTO else Plan()
  sync, sync_options = _sync(plan.sync_for(args.sync), args.sync_option)  # a plan's sync, unless told
  if cluster is not None:
    plan.validate_for(cluster)

  if args.coordinator:
    from qsync_jax.train.distributed import initialize

    initialize(
      args.coordinator,
      args.num_processes,
      args.process_id,
      local_device_count=args.local_devices,
      heartbeat_timeout_s=args.heartbeat_timeout,
    )
    _take_back_sigterm()
  elif args.local_devices:
    import jax

    jax.config.update("jax_num_cpu_devices", args.local_devices)

  import jax

  if args.compilation_cache:
    jax.config.update("jax_compilation_cache_dir", args.compilation_cache)

  from qsync_jax.devices import device_type_of
  from qsync_jax.train.distributed import check_device_types
  from qsync_jax.train.task import load_task
  from qsync_jax.train.trainer import Trainer

  if cluster is None:
    cluster = ClusterSpec.uniform(device_type_of(jax.devices()[0]), jax.device_count(), args.batch_per_device)
    plan.validate_for(cluster)
  check_device_count(cluster, jax.devices(), args.num_processes)
  check_device_types(cluster, jax.devices(), args.simulate_device_types)
  task = load_task(args.model, **overrides)
  measured = None
  if args.plan == AUTO:
    plan, measured = auto_plan(args, task, cluster)
  optimizer = _optimizer(args.optimizer, args.lr)
  check_memory(task, cluster, plan, optimizer)
  trainer = Trainer(
    task,
    cluster,
    plan,
    optimizer,
    grad_sync=sync,
    sync_options=sync_options,
    seed=args.seed,
    out_dir=args.out,
    checkpoint_every=args.checkpoint_every,
    resume=args.resume,
    log_every=args.log_every,
    progress=sys.stderr,
    step_timeout_s=args.step_timeout,
    replan=args.replan or _default_replan(sync, plan),
  )
  if measured is not None:  # the run directory exists (and is checked) now
    write_auto_plan(args.out, plan, measured)
  if trainer.step and jax.process_index() == 0:
    print(f"resumed {args.out} at step {trainer.step}", file=sys.stderr)
  try:
    last = trainer.run(args.steps)
  except Interrupted as e:
    raise Interrupted(f"{e}. Resume with the same command and --resume.") from None
  finally:
    trainer.close()
  record = {"step": trainer.step, **last}
  if args.eval:
    record["eval"] = trainer.evaluate()
    if jax.process_index() == 0:
      with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": trainer.step, "eval": record["eval"]}) + "\n")
  if jax.process_index() == 0:
    print(json.dumps(record))
  return 0
