"""``qsync train``: run a plan on a cluster (hybrid synchronous data parallel).

  qsync train --model resnet --cluster cluster.json --plan plan.json --steps 200 --out runs/a
  qsync train --model mypkg.tasks:make_task --cluster c.yaml --steps 50 --out runs/b --resume

``--sync NAME`` picks a strategy of ``qsync_jax.sync`` (fp32, bf16, fp16, global_qsgd, selsync,
qsdp), ``--sync-option KEY=VALUE`` (repeatable, JSON values, checked against the types the
strategy declares before anything starts) sets its options, e.g.
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
import contextlib
import json
import math
import sys

from planners.allocator.frontier import DEFAULT_BUDGET
from qsync_cli.auto_plan import AUTO, auto_plan, write_auto_plan
from qsync_cli.common import add_model_argument
from qsync_jax.errors import Interrupted, PlanError, QsyncError
from qsync_jax.train.optimizers import OPTIMIZERS, SCHEDULES

HELP = "train a model on a hybrid cluster under a plan (synchronous data parallel)"

OPTIMIZER_SETTINGS = ("optimizer", "lr", "schedule", "warmup_steps", "weight_decay", "clip_norm")
"""The options a checkpoint records of the optimizer: a ``--resume`` with other values says which."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
  _add_model_arguments(parser)
  _add_optimizer_arguments(parser)
  _add_run_arguments(parser)
  _add_multi_process_arguments(parser)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
  """What is trained, on what, under which plan."""
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
    "default: every group at its 16-bit training precision (bf16; fp16 with loss scaling on a V100 or T4), "
    "as `qsync plan` defaults training groups",
  )
  parser.add_argument(
    "--accuracy-budget",
    metavar="FRACTION|speed",
    help="with --plan auto: how much accuracy cost the 8-bit ops may spend, as a fraction in [0, 1] of the "
    "sensitivity indicator's Ω of the speed-only choice (0: every op bf16; default "
    f"{DEFAULT_BUDGET:g}, calibrated on the accuracy testbed; docs/results.md), or 'speed': the fastest "
    "measured policy whatever its Ω (no indicator)",
  )
  parser.add_argument(
    "--no-fused-attention",
    action="store_true",
    help="run attention with Flax's own einsums even where its products are one 16-bit type "
    "(default on a GPU: jax.nn.dot_product_attention, cuDNN's fused kernel; a CPU runs Flax's einsums)",
  )
  parser.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="task config override (JSON value), repeatable",
  )


def _add_optimizer_arguments(parser: argparse.ArgumentParser) -> None:
  """The optimizer and its learning rate over the run."""
  optimizer = parser.add_argument_group("optimizer")
  optimizer.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
  optimizer.add_argument(
    "--lr", type=float, default=1e-3, help="learning rate (default 1e-3; the peak of --schedule)"
  )
  optimizer.add_argument(
    "--schedule",
    choices=SCHEDULES,
    default="constant",
    help="learning rate over the run: constant (default), cosine or linear decay to 0 at --steps, each after "
    "--warmup-steps of linear warmup from 0; logged as the metric lr",
  )
  optimizer.add_argument(
    "--warmup-steps", type=int, default=0, help="steps of linear warmup from 0 to --lr (default 0)"
  )
  optimizer.add_argument(
    "--clip-norm",
    type=float,
    help="clip the gradient to this global L2 norm before the optimizer (default: no clipping); its norm "
    "before clipping is logged as grad_norm",
  )
  optimizer.add_argument(
    "--weight-decay", type=float, help="adamw's decoupled weight decay (default: optax's 1e-4)"
  )


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
  """The run: its length, outputs, gradient sync, checkpoints, logs and evaluation."""
  parser.add_argument("--steps", type=int, required=True, help="train until this many steps in total")
  parser.add_argument(
    "--out",
    required=True,
    help="run directory: metrics.jsonl, checkpoints/ and tensorboard/ (TensorBoard events)",
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
  parser.add_argument(
    "--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end)"
  )
  parser.add_argument("--log-every", type=int, default=1, help="steps between metrics lines (default 1)")
  parser.add_argument(
    "--replan",
    choices=("off", "once", "auto"),
    help="re-balance the groups' batches from their measured speeds: once after the first steps, auto "
    "(also when the step time drifts, and every 10 windows of 20 steps), or off. Default (as the Python "
    "Trainer's): once on GPUs with two or more device groups, off on simulated CPU devices (which "
    "share one host's cores), with selsync and qsdp (which build their own step) and for a plan that "
    "accumulates gradients. One group is never measured (nothing to balance); a resumed run keeps "
    "its checkpoint's decisions",
  )
  parser.add_argument("--eval", action="store_true", help="evaluate on the task's held-out set at the end")
  parser.add_argument(
    "--eval-every",
    type=int,
    default=0,
    metavar="N",
    help="also evaluate on the held-out set every N steps (0: never; results in metrics.jsonl and "
    "TensorBoard's eval/ tags; the time it takes is left out of the printed rates)",
  )
  parser.add_argument(
    "--compilation-cache",
    metavar="DIR",
    help="JAX's persistent compilation cache in DIR (as JAX_COMPILATION_CACHE_DIR=DIR): a run that "
    "compiles a step already compiled there loads it instead",
  )


def _add_multi_process_arguments(parser: argparse.ArgumentParser) -> None:
  """Several processes (hosts), and simulated devices."""
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
    "--step-timeout",
    type=float,
    help="seconds a step may take before the process gives up (default 120 with several processes; 0: no "
    "watchdog, the default of a one-process run)",
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


def _optimizer_options(args: argparse.Namespace) -> dict:
  """The arguments of ``make_optimizer`` / ``check_optimizer_options`` the flags give."""
  return dict(
    name=args.optimizer,
    lr=args.lr,
    schedule=args.schedule,
    warmup_steps=args.warmup_steps,
    total_steps=args.steps,
    weight_decay=args.weight_decay,
  )


def _optimizer(args: argparse.Namespace):
  from qsync_jax.train.optimizers import make_optimizer

  return make_optimizer(**_optimizer_options(args))


def _sync(name: str | None, items: list[str]) -> tuple[str | None, dict]:
  """(strategy name or None for the default fp32 psum, its options) from --sync / --sync-option,
  the options checked against the strategy's (names and types)."""
  from qsync_jax.sync import check_options

  options = _overrides(items, "--sync-option", "delta=0.2")
  if name is None and options:
    raise QsyncError("--sync-option needs a --sync strategy. Fix: add e.g. --sync selsync.")
  if name in (None, "psum", "fp32") and not options:
    return None, {}
  name = "fp32" if name == "psum" else name
  check_options(name, options)
  return name, options


def check_memory(task, cluster, plan, optimizer) -> tuple:
  """The model's quantizable ops (``planners.ops.OpShape``s); raises ``PlanError`` when a group's
  devices cannot hold ``plan``'s training step: the need of
  ``qsync plan``'s memory model (``planners.predictor.memory_model``) for the model's traced ops, parameters,
  ``optimizer`` state and batch — every device holding every group's branch
  (``program_memory_bytes``) — without the XLA buffers ``qsync profile`` fits: a lower bound
  of the planner's estimate, so a plan the planner accepted passes. Traces the model's shapes
  (``planners.profiler.task_shapes``): runs nothing and allocates no batch."""
  import jax

  from planners.predictor import program_memory_bytes
  from planners.profile import GroupCost, Profile
  from planners.profiler import memory_sizes, task_shapes

  cluster = plan.apply_to(cluster)
  batch_per_device = cluster.max_batch_per_device
  batch, variables, ops = task_shapes(task, batch_per_device)
  memory = memory_sizes(variables["params"], jax.eval_shape(optimizer.init, variables["params"]), batch)
  groups = []
  for g in cluster.groups:
    prof = Profile(task.name, g.device_type, "traced", batch_per_device, ops, {}, {}, 0.0, {}, memory)
    policies = prof.policies(plan.policy_on(g))
    groups.append(GroupCost(g.name, prof, policies, g.batch_per_device))
  needs = program_memory_bytes(groups)
  for g in cluster.groups:
    if needs[g.name] > g.memory_gb * 1e9:
      gb = math.ceil(needs[g.name] / 1e7) / 100
      raise PlanError(
        f"device group {g.name!r} ({g.device_type}, {g.batch_per_device} per device) needs at least {gb:.2f} GB "
        f"per device for this plan's step (parameters, optimizer state, the batch padded to the largest "
        f"per-device batch, {batch_per_device}, and the saved activations of the costliest group's branch, which "
        f"every device of the step holds), but the cluster spec gives it memory_gb={g.memory_gb:g}. Fix: lower "
        f"the largest per-device batch (--batch-per-device, or the --cluster spec's), set memory_gb ≥ {gb:.2f} in "
        "a --cluster spec if the device has it, or plan it (`qsync plan`) to a precision that stores less."
      )
  return ops


def default_plan(cluster, sync: str | None):
  """The plan of a run without ``--plan``: every group at its device type's training precision
  (``qsync_jax.devices.training_precision``, as ``qsync plan`` defaults training groups: bf16,
  else fp16 with dynamic loss scaling, else fp32); unmodified (fp32) where that is fp16 and the
  ``--sync`` strategy builds its own step, which has no loss scaling."""
  from qsync_jax.devices import training_precision
  from qsync_jax.plan import Plan
  from qsync_jax.policy import PrecisionPolicy
  from qsync_jax.sync import get_strategy

  no_loss_scaling = sync is not None and get_strategy(sync).kind == "train_step"
  presets = {g.name: training_precision([g.device_type]) for g in cluster.groups}
  skip = ("fp32", "fp16") if no_loss_scaling else ("fp32",)
  return Plan(policies={g: PrecisionPolicy.uniform(p) for g, p in presets.items() if p not in skip})


def _policy_name(policy) -> str:
  """A group's policy in a word: its preset, ``float`` (unmodified) or ``per op``."""
  from qsync_jax.precision import PRESETS

  if policy.rules:
    return "per op"
  if policy.default is None:
    return "float"
  return next((name for name, p in PRESETS.items() if p == policy.default), "per op")


def say_start(task_name: str, cluster, plan, plan_arg: str | None) -> None:
  """The run's first line on stderr, printed before the training state is built: the model, each
  group and its policy, and where the plan comes from."""
  groups = ", ".join(
    f"group {g.name!r} {g.count} × {g.device_type} at {g.batch_per_device} per device, "
    f"{_policy_name(plan.policy_for(g.name))}"
    for g in plan.apply_to(cluster).groups
  )
  source = {AUTO: "measured on this device (--plan auto)", None: "each group's 16-bit default (no --plan)"}
  print(
    f"training {task_name}: {groups}; plan: {source.get(plan_arg, plan_arg)}; building the training state…",
    file=sys.stderr,
    flush=True,
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
  from planners.allocator.frontier import parse_budget
  from qsync_jax.sync import STRATEGIES
  from qsync_jax.train.optimizers import check_optimizer_options

  if args.steps <= 0:
    raise QsyncError(f"--steps {args.steps} must be positive. Fix: pass --steps 1 or more.")
  if args.eval_every < 0:
    raise QsyncError(
      f"--eval-every {args.eval_every} must be 0 (never) or a number of steps. Fix: pass e.g. --eval-every 100."
    )
  if args.checkpoint_every < 0:
    raise QsyncError(
      f"--checkpoint-every {args.checkpoint_every} must be 0 (a checkpoint at the end only) or a number of "
      "steps. Fix: pass e.g. --checkpoint-every 100."
    )
  if args.step_timeout is not None and not args.step_timeout >= 0:
    raise QsyncError(
      f"--step-timeout {args.step_timeout:g} must be a number of seconds (0: no watchdog). Fix: pass e.g. "
      "--step-timeout 600, or leave it out."
    )
  if args.local_devices is not None and args.local_devices < 1:
    raise QsyncError(
      f"--local-devices {args.local_devices} must be at least 1. Fix: pass e.g. --local-devices 8."
    )
  if args.sync is not None and args.sync != "psum" and args.sync not in STRATEGIES:
    raise QsyncError(f"--sync {args.sync!r} is not a sync strategy. Fix: use one of {sorted(STRATEGIES)}.")
  if args.accuracy_budget is not None:
    if args.plan != AUTO:
      raise QsyncError(
        "--accuracy-budget applies to --plan auto alone. Fix: pass --plan auto, or leave --accuracy-budget out."
      )
    parse_budget(args.accuracy_budget, "--accuracy-budget")
  check_optimizer_options(**_optimizer_options(args))
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


def _say_changed_settings(trainer, settings: dict) -> None:
  """Records the optimizer ``settings`` in the run's checkpoints; a resumed run whose settings
  differ from its checkpoint's says so (a line on stderr and one in ``metrics.jsonl``) and runs with
  the new ones from the next step — the optimizer's state (its moments, its step count) is the
  checkpoint's."""
  import jax

  changed = trainer.set_run_settings(settings)
  if not changed or jax.process_index() != 0:
    return
  flags = ", ".join(f"--{k.replace('_', '-')} {old} -> {new}" for k, (old, new) in changed.items())
  print(
    f"qsync train: resuming with other optimizer settings than checkpoint {trainer.step}: {flags}; they "
    f"apply from step {trainer.step + 1} on (the optimizer state is the checkpoint's)",
    file=sys.stderr,
  )
  trainer.log.write(
    {"step": trainer.step, "resumed_with": {k: {"checkpoint": a, "now": b} for k, (a, b) in changed.items()}},
    {},
  )


def run(args: argparse.Namespace) -> int:
  from qsync_jax.ops.qattention import fused_attention

  with contextlib.ExitStack() as held:
    held.enter_context(fused_attention(False if args.no_fused_attention else None))  # traced at compile
    return _run(args, held)


def _hold_out_dir(args: argparse.Namespace, held: contextlib.ExitStack) -> None:
  """Holds ``--out`` for this run (process 0; released when ``held`` closes) and refuses a
  ``--resume --steps`` below the checkpoint it would continue from, before any work."""
  from qsync_jax.train.outputs import checkpoint_steps, lock_run_dir

  if args.process_id == 0:
    lock = lock_run_dir("--out", args.out)
    held.callback(lock.release)
    if lock.note:
      print(f"qsync train: {lock.note}", file=sys.stderr)
      lock.note = None
  latest = max(checkpoint_steps(args.out), default=None) if args.resume else None
  if latest is not None and args.steps < latest:
    raise QsyncError(
      f"--steps {args.steps} is below step {latest}, where --resume continues {args.out!r} from: --steps is "
      f"the total number of steps to train until. Fix: pass --steps {latest} or more (e.g. --steps "
      f"{latest + args.steps} for {args.steps} more)."
    )


def _run(args: argparse.Namespace, held: contextlib.ExitStack) -> int:
  from qsync_jax.cluster import ClusterSpec
  from qsync_jax.plan import Plan
  from qsync_jax.train.step_plan import check_step_plan

  # Arguments and input files first: a bad one is named before JAX starts and the model is built.
  _check_arguments(args)
  overrides = _overrides(args.set)
  cluster = ClusterSpec.load(args.cluster) if args.cluster else None
  plan = Plan.load(args.plan) if args.plan and args.plan != AUTO else Plan()
  sync, sync_options = _sync(plan.sync_for(args.sync), args.sync_option)  # a plan's sync, unless told
  if cluster is not None:
    plan.validate_for(cluster)
  check_step_plan(plan, sync, clip_norm=args.clip_norm, cluster=cluster)  # before the model is built
  _hold_out_dir(args, held)

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
  if jax.process_index() == 0:  # building a user's model (an nnx one is built eagerly) may take a while
    print(f"loading --model {args.model}…", file=sys.stderr, flush=True)
  task = load_task(args.model, **overrides)
  if (args.eval or args.eval_every) and task.eval_batches is None:
    flag = "--eval-every" if args.eval_every else "--eval"
    raise QsyncError(
      f"{flag}: task {task.name!r} has no held-out set (its eval_batches is None). Fix: drop {flag}, or "
      "give the task eval_batches."
    )
  measured = None
  if args.plan == AUTO:
    plan, measured = auto_plan(args, task, cluster)
  optimizer = _optimizer(args)
  if args.plan is None:
    plan = default_plan(cluster, sync)
  if not check_memory(task, cluster, plan, optimizer) and args.plan is None:
    plan = Plan()  # a model without quantizable ops runs as written
  if jax.process_index() == 0:
    say_start(task.name, cluster, plan, args.plan)
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
    replan=args.replan,
    clip_norm=args.clip_norm,
  )
  if measured is not None:  # the run directory exists (and is checked) now
    write_auto_plan(args.out, plan, measured)
  if trainer.step and jax.process_index() == 0:
    print(f"resumed {args.out} at step {trainer.step}", file=sys.stderr)
  _say_changed_settings(trainer, {k: getattr(args, k) for k in OPTIMIZER_SETTINGS})
  try:
    last = trainer.run(args.steps, eval_every=args.eval_every)
    record = {"step": trainer.step, **last}
    if args.eval:
      record["eval"] = trainer.evaluate_and_log()
  except Interrupted as e:
    raise Interrupted(f"{e}. Resume with the same command and --resume.") from None
  finally:
    trainer.close()
  if jax.process_index() == 0:
    print(json.dumps(record))
  return 0
