"""What a plan may ask of the training step, checked in one place before anything is built.

``check_step_plan(plan, grad_sync, clip_norm=..., cluster=...)`` raises a ``QsyncError`` (a
``PlanError`` for what only a plan change fixes) naming the plan field, the constraint and the fix
when the hybrid step (``make_train_step``) or a step-builder strategy (``make_strategy_step``:
selsync, qsdp) cannot run ``plan`` with that sync. It reads only the plan, the sync's name or
object and the cluster's device types — no model, no devices — so ``qsync train`` calls it as
soon as its inputs are read, and both step builders call it first.
"""

from __future__ import annotations

import math

from qsync_jax.cluster import ClusterSpec
from qsync_jax.devices import DEVICES
from qsync_jax.errors import PlanError, QsyncError
from qsync_jax.plan import Plan
from qsync_jax.sync import STRATEGIES
from qsync_jax.sync.two_level import check_two_level_sync

HOOKS = "fp32, bf16, fp16, global_qsgd"
"""The gradient-hook strategies (run in the hybrid step), as error messages list them."""


def sync_name(grad_sync) -> str:
  """How messages name a sync: a strategy name as is, else the callable's or object's name."""
  if isinstance(grad_sync, str):
    return grad_sync
  return getattr(grad_sync, "__name__", type(grad_sync).__name__)


def check_clip_norm(clip_norm) -> None:
  """``QsyncError`` unless ``clip_norm`` is None (no clipping) or a finite number > 0."""
  if clip_norm is None:
    return
  if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)) or not math.isfinite(clip_norm):
    raise QsyncError(
      f"clip_norm={clip_norm!r} must be a finite number > 0 (the largest global gradient norm) or None. "
      "Fix: pass e.g. clip_norm=1.0 (qsync train --clip-norm 1.0), or leave it unset for no clipping."
    )
  if clip_norm <= 0:
    raise QsyncError(
      f"clip_norm={clip_norm!r} must be > 0: the gradient is scaled to at most this global norm, and a "
      "norm ≤ 0 leaves no update. Fix: pass a positive value (e.g. 1.0), or leave it unset for no clipping."
    )


def check_step_plan(
  plan: Plan, grad_sync=None, *, clip_norm: float | None = None, cluster: ClusterSpec | None = None
) -> None:
  """Raises when ``plan`` cannot run with ``grad_sync`` (None: the hybrid step's default fp32
  reduction; a strategy name; a ``SyncFn`` or ``GradSync``):

  * ``clip_norm`` not None and not > 0 (``check_clip_norm``);
  * ``optimizer_update="sharded"`` with ``reduction="two_level"`` or with any sync but the
    default (the sharded update's reduce-scatter replaces the default reduction; a step-builder
    strategy keeps its own parameter and optimizer layout);
  * ``reduction="two_level"`` with a sync of its own (``check_two_level_sync``);
  * a step-builder strategy (selsync, qsdp) with ``micro_steps``, with fp16 legs (its step has no
    loss scaling; with ``cluster`` the fix names, per group, the precision its device can run) or
    with ``clip_norm``.
  """
  check_clip_norm(clip_norm)
  _check_optimizer_update(plan, grad_sync)
  check_two_level_sync(plan.reduction, grad_sync)
  if isinstance(grad_sync, str) and grad_sync in STRATEGIES and STRATEGIES[grad_sync].kind == "train_step":
    _check_step_builder(plan, grad_sync, clip_norm, cluster)


def _check_optimizer_update(plan: Plan, grad_sync) -> None:
  if plan.optimizer_update != "sharded":
    return
  if plan.reduction != "flat":
    raise PlanError(
      f"plan: optimizer_update='sharded' with reduction={plan.reduction!r}: the sharded update "
      "reduce-scatters the gradients over every device at once, not in two levels. Fix: set the "
      "plan's reduction to 'flat', or its optimizer_update to 'replicated'."
    )
  if grad_sync is not None:
    raise PlanError(
      f"plan: optimizer_update='sharded' with sync {sync_name(grad_sync)!r}: the sharded update runs in "
      "the hybrid step in place of its default fp32 gradient reduction (a reduce-scatter, then an "
      "all-gather of the updated params); a gradient hook would replace that reduction and a "
      "step-builder strategy (selsync, qsdp) keeps its own parameter and optimizer layout. Fix: leave "
      "the sync unset (no grad_sync, no --sync), or set the plan's optimizer_update to 'replicated'."
    )


def _check_step_builder(plan: Plan, name: str, clip_norm, cluster: ClusterSpec | None) -> None:
  if any(k != 1 for k in plan.micro_steps.values()):
    raise PlanError(
      f"plan: micro_steps {dict(plan.micro_steps)} with sync strategy {name!r}: it builds its own step, "
      f"which does not accumulate gradients. Fix: remove micro_steps from the plan, or use a gradient-hook "
      f"strategy ({HOOKS})."
    )
  if clip_norm is not None:
    raise QsyncError(
      f"clip_norm={clip_norm!r} with sync strategy {name!r}: it builds its own step, which does not clip. "
      f"Fix: leave clip_norm unset (no --clip-norm), or use a gradient-hook strategy ({HOOKS})."
    )
  if plan.needs_fp16_loss_scaling:
    raise PlanError(
      f"the plan runs fp16 legs, which need dynamic loss scaling, and sync strategy {name!r} builds a step "
      f"without it. Fix: {_fp16_fix(plan, cluster)}, or keep the fp16 legs with a gradient-hook strategy "
      f"({HOOKS}), whose step scales the loss."
    )


def _fp16_fix(plan: Plan, cluster: ClusterSpec | None) -> str:
  """Per group running fp16 legs: bf16 where its device has bf16, else fp32."""
  if cluster is None:
    return (
      "run those legs in bf16 on devices that have it (A100, H100…), in fp32 on those that do not (V100, T4)"
    )
  fixes = []
  for g in cluster.groups:
    if not plan.runs_fp16(g.name):
      continue
    has_bf16 = g.device_type in DEVICES and "bf16" in DEVICES[g.device_type].precisions
    fixes.append(f"group {g.name!r} ({g.device_type}) in {'bf16' if has_bf16 else 'fp32, as it has no bf16'}")
  return "run the fp16 legs of " + "; ".join(fixes)
