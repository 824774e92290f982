"""The trainer's re-planning mode: one default for ``Trainer`` and ``qsync train``
(``default_replan``), and the checks of a mode against the step it would re-balance."""

from __future__ import annotations

from qsync_jax.errors import QsyncError
from qsync_jax.sync import get_strategy
from qsync_jax.train.replan.replanner import Replanner


def default_replan(program, grad_sync=None) -> str:
  """``"once"`` where re-planning can change something — the hybrid step (not a step-builder
  strategy's) on accelerators, over more than one device group, without gradient accumulation —
  else ``"off"`` (simulated CPU devices share one host's cores: their speeds say nothing)."""
  builds_own = isinstance(grad_sync, str) and get_strategy(grad_sync).kind == "train_step"
  accumulates = any(k != 1 for k in program.plan.micro_steps.values())
  cpu = program.mesh.devices.flat[0].platform == "cpu"
  return "off" if builds_own or accumulates or cpu or len(program.cluster.groups) < 2 else "once"


def trainer_replanner(replan: str | Replanner | None, program, grad_sync) -> Replanner:
  """The trainer's ``Replanner`` for ``replan`` (None: ``default_replan``), checked against what it
  would re-balance."""
  if replan is None:
    replan = default_replan(program, grad_sync)
  replanner = replan if isinstance(replan, Replanner) else Replanner(mode=replan)
  if replanner.mode != "off" and isinstance(grad_sync, str) and get_strategy(grad_sync).kind == "train_step":
    raise QsyncError(
      f"replan={replanner.mode!r}: sync strategy {grad_sync!r} builds its own step, which cannot be "
      "re-balanced. Fix: use replan='off', or a gradient-hook strategy (fp32, bf16, fp16, global_qsgd)."
    )
  accumulating = sorted(g for g, k in program.plan.micro_steps.items() if k != 1)
  if replanner.mode != "off" and accumulating:
    raise QsyncError(
      f"replan={replanner.mode!r}: the plan accumulates gradients on {accumulating} (micro_steps), "
      "whose per-device batches re-planning would change. Fix: use replan='off', or remove micro_steps "
      "from the plan."
    )
  return replanner
