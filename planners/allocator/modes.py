"""The trainer's modes a plan can be in: how the step combines gradients, where the optimizer
runs, and which gradient sync runs (``qsync_jax.plan``: ``reduction``, ``optimizer_update``,
``sync``), and which of them are worth searching on a cluster."""

from __future__ import annotations

from qsync_jax.cluster import ClusterSpec
from qsync_jax.errors import PlanError

MODES = (("flat", "replicated"), ("flat", "sharded"), ("two_level", "replicated"))
"""The (reduction, optimizer_update) pairs the trainer runs (``qsync_jax.plan``)."""
OPTIMIZER_UPDATES = ("auto", "replicated", "sharded")
"""``modes_for``'s choices of where the optimizer runs: ``auto`` searches both."""


def check_mode(optimizer_update: str, sync: str) -> None:
  """``PlanError`` unless ``optimizer_update`` is one of ``OPTIMIZER_UPDATES`` that the trainer runs
  with ``sync`` (the sharded update with the fp32 sync only)."""
  if optimizer_update not in OPTIMIZER_UPDATES:
    raise PlanError(
      f"optimizer_update={optimizer_update!r} is not one of {list(OPTIMIZER_UPDATES)}. Fix: use one of them."
    )
  if sync != "fp32" and optimizer_update == "sharded":
    raise PlanError(
      f"--optimizer-update sharded with --sync {sync}: the trainer's sharded update replaces the default "
      "fp32 reduction by a reduce-scatter, so it runs with the fp32 sync only. Fix: pass --optimizer-update "
      f"replicated (or auto) for --sync {sync}, or --sync fp32 for the sharded update."
    )


def modes_for(
  cluster: ClusterSpec, optimizer_update: str = "auto", sync: str = "fp32"
) -> list[tuple[str, str]]:
  """The modes worth searching on ``cluster`` for ``optimizer_update`` (``OPTIMIZER_UPDATES``) and
  the gradient ``sync``: the flat all-reduce with the optimizer replicated; sharded, where the job
  has more than one device (or where asked for); two-level, where more than one group runs and
  some group of several devices has a link inside it faster than its link out. A sync other than
  fp32 runs flat with the replicated update only (the trainer's sharded update and two-level sum
  replace the default fp32 reduction); ``PlanError`` for it with ``optimizer_update="sharded"``."""
  check_mode(optimizer_update, sync)
  if sync != "fp32":
    return [MODES[0]]
  if optimizer_update == "sharded":
    return [MODES[1]]
  modes = [MODES[0]] + [MODES[1]] * (cluster.num_devices > 1 and optimizer_update == "auto")
  if len(cluster.groups) > 1 and any(
    g.count > 1 and g.intra_group_gbps > g.link_gbps for g in cluster.groups
  ):
    modes.append(MODES[2])
  return modes
