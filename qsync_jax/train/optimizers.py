"""The optimizers ``qsync train`` offers by name, with a learning-rate schedule, as optax builds them.

``make_optimizer(name, lr, schedule=..., warmup_steps=..., total_steps=..., weight_decay=...)``
is ``<name>`` of optax — ``adam``, ``adamw`` (``weight_decay``, optax's default 1e-4 when None),
``sgd``, ``momentum`` (sgd with momentum 0.9) — at the learning rate of the schedule, equivalent
to::

  optax.<name>(lr)                                    # constant, no warmup
  optax.inject_hyperparams(optax.<name>)(learning_rate=learning_rate_schedule(lr, schedule, ...))

A constant rate without warmup is the plain optax optimizer, so its state (and a checkpoint) is
the one ``optax.<name>(lr)`` makes in Python. Any other schedule goes through
``optax.inject_hyperparams``, which keeps the rate of the last update in the optimizer state;
the training step reads it there (``learning_rate_of``) and logs it as the metric ``lr`` — the
value the optimizer used, from its one schedule object. The schedule is a callable, so the
state's copy is only a record: a resumed run recomputes the rate from its own arguments.

Schedules (``learning_rate_schedule``; steps count the optimizer's updates, from 0):

* ``constant``: ``lr``, after a linear warmup from 0 over ``warmup_steps`` when > 0;
* ``cosine``: linear warmup from 0 to ``lr`` over ``warmup_steps``, then cosine decay to 0 at
  ``total_steps`` (``optax.warmup_cosine_decay_schedule``);
* ``linear``: linear warmup, then linear decay to 0 at ``total_steps``.
"""

from __future__ import annotations

import math

import jax
import optax

from qsync_jax.errors import QsyncError

OPTIMIZERS = ("adam", "adamw", "sgd", "momentum")
SCHEDULES = ("constant", "cosine", "linear")


def check_optimizer_options(
  name: str,
  lr: float,
  schedule: str = "constant",
  *,
  warmup_steps: int = 0,
  total_steps: int | None = None,
  weight_decay: float | None = None,
) -> None:
  """``QsyncError`` naming the option (as the CLI flag and the argument), the constraint and the fix
  for options ``make_optimizer`` cannot build."""
  if name not in OPTIMIZERS:
    raise QsyncError(f"optimizer {name!r} is not one of {list(OPTIMIZERS)}. Fix: use one of them.")
  if schedule not in SCHEDULES:
    raise QsyncError(f"schedule {schedule!r} is not one of {list(SCHEDULES)}. Fix: use one of them.")
  if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
    raise QsyncError(
      f"--lr {lr} is not a learning rate: it must be a finite number above 0. Fix: pass e.g. --lr 1e-3."
    )
  if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
    raise QsyncError(
      f"--warmup-steps / warmup_steps={warmup_steps!r} must be an integer ≥ 0. Fix: pass 0 (no warmup) or more."
    )
  if total_steps is not None and schedule != "constant" and warmup_steps >= total_steps:
    raise QsyncError(
      f"--warmup-steps {warmup_steps} with --schedule {schedule} over {total_steps} steps: the warmup must "
      f"end before the decay to 0 at step {total_steps}. Fix: pass --warmup-steps below {total_steps} "
      "(e.g. a tenth of the steps), or more --steps."
    )
  if total_steps is not None and warmup_steps > total_steps:
    raise QsyncError(
      f"--warmup-steps {warmup_steps} is longer than the run ({total_steps} steps), so the learning rate "
      f"never reaches --lr. Fix: pass --warmup-steps {total_steps} or fewer."
    )
  if schedule != "constant" and total_steps is None:
    raise QsyncError(
      f"schedule {schedule!r} decays to 0 at total_steps. Fix: pass total_steps (the run's steps)."
    )
  if weight_decay is not None:
    if name != "adamw":
      raise QsyncError(
        f"--weight-decay / weight_decay with optimizer {name!r}: decoupled weight decay is adamw's. "
        "Fix: use --optimizer adamw, or drop --weight-decay."
      )
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not weight_decay >= 0:
      raise QsyncError(
        f"--weight-decay / weight_decay={weight_decay!r} must be a number ≥ 0. Fix: pass e.g. --weight-decay 0.01."
      )


def learning_rate_schedule(
  lr: float, schedule: str = "constant", *, warmup_steps: int = 0, total_steps: int | None = None
) -> optax.Schedule:
  """The optax schedule of ``schedule`` (module doc) peaking at ``lr``."""
  check_optimizer_options("adam", lr, schedule, warmup_steps=warmup_steps, total_steps=total_steps)
  if schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, total_steps, end_value=0.0)
  after = (
    optax.constant_schedule(lr)
    if schedule == "constant"
    else optax.linear_schedule(lr, 0.0, total_steps - warmup_steps)
  )
  if not warmup_steps:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup_steps), after], [warmup_steps])


def make_optimizer(
  name: str,
  lr: float,
  schedule: str = "constant",
  *,
  warmup_steps: int = 0,
  total_steps: int | None = None,
  weight_decay: float | None = None,
) -> optax.GradientTransformation:
  """The optimizer ``name`` at the learning rate of ``schedule`` (module doc)."""
  check_optimizer_options(
    name, lr, schedule, warmup_steps=warmup_steps, total_steps=total_steps, weight_decay=weight_decay
  )
  schedule_fn = learning_rate_schedule(lr, schedule, warmup_steps=warmup_steps, total_steps=total_steps)

  def inner(learning_rate):
    if name == "adamw":
      return optax.adamw(learning_rate, **({} if weight_decay is None else {"weight_decay": weight_decay}))
    if name == "momentum":
      return optax.sgd(learning_rate, momentum=0.9)
    return {"adam": optax.adam, "sgd": optax.sgd}[name](learning_rate)

  if schedule == "constant" and not warmup_steps:
    return inner(lr)
  return optax.inject_hyperparams(inner)(learning_rate=schedule_fn)


def learning_rate_of(opt_state) -> jax.Array | None:
  """The learning rate of the last update, read from the one ``optax.inject_hyperparams`` state
  in ``opt_state`` that has a ``"learning_rate"`` (None when there is no such state, or several)."""
  found = [
    s.hyperparams["learning_rate"]
    for s in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "hyperparams"))
    if hasattr(s, "hyperparams") and "learning_rate" in s.hyperparams
  ]
  return found[0] if len(found) == 1 else None
