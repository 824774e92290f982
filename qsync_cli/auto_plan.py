"""``qsync train --plan auto``: the plan measured on this host's device (``auto_plan``) and the files
it leaves in the run directory (``write_auto_plan``)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from planners.allocator.frontier import DEFAULT_BUDGET
from qsync_jax.errors import PlanError

AUTO = "auto"
"""``--plan auto``: ``auto_plan``."""


def auto_plan(args: argparse.Namespace, task, cluster):
  """``(plan, measurements or None)`` of ``--plan auto``: ``OUT/plan.json`` when resuming a run
  that wrote it; else every group runs the policy ``planners.allocator.auto_policy`` measures on
  the local device (8-bit only on the ops it measures faster inside the step, within
  ``--accuracy-budget``; the rest at bf16, or fp16 on a device without bf16), loaded from the
  cache (``planners.allocator.auto_cache.default_dir``) where the same search ran before.
  ``write_auto_plan`` writes both into the run directory."""
  import jax

  from planners.allocator import auto_cache, auto_policy
  from planners.allocator.frontier import parse_budget
  from qsync_jax.devices import device_type_of, training_precision
  from qsync_jax.plan import Plan

  path = os.path.join(args.out, "plan.json")
  if args.resume and os.path.exists(path):
    if jax.process_index() == 0:
      print(
        f"auto policy: resuming with {path} (chosen when the run started; not measured again)",
        file=sys.stderr,
      )
    return Plan.load(path), None
  local = device_type_of(jax.devices()[0])
  types = sorted({g.device_type for g in cluster.groups})
  if types != [local]:
    raise PlanError(
      f"--plan auto measures this host's device ({local}), but cluster {cluster.name!r} has device types "
      f"{types}. Fix: plan a pool of several types with `qsync plan`, or give a cluster of {local} groups."
    )
  base = training_precision([local])
  say = (
    (lambda msg: print(f"auto policy: {msg}", file=sys.stderr, flush=True))
    if jax.process_index() == 0
    else None
  )
  if say and jax.devices()[0].platform == "cpu":
    say(
      "measuring on this CPU: these timings say which ops pay on this CPU and nothing about a GPU. "
      "For a GPU's plan run --plan auto on that GPU, or plan it with `qsync plan`."
    )
  budget = DEFAULT_BUDGET if args.accuracy_budget is None else parse_budget(args.accuracy_budget)
  result = auto_policy(
    task,
    cluster.max_batch_per_device,
    base=base,
    budget=budget,
    progress=say,
    seed=args.seed,
    cache_dir=auto_cache.default_dir(),
  )
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
