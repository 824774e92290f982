"""Sensitivity tables Ω[op][precision]: compute with any method, save / load as JSON.

A table is plain JSON::

  {"format": "qsync-indicator/1", "method": "gradient",
   "precisions": ["fp32", "int8", "fp8", "fp16", "bf16"],
   "ops": ["Dense_0:dense", ...],                  # forward order
   "omega": {"Dense_0:dense": {"fp32": 0.0, "int8": 1.2e-4, ...}, ...},
   "metadata": {"task": ..., "batches": ..., "depth": {op: d}, "jax_version": ..., "date": ...}}

Larger Ω = more sensitive (a bigger expected loss change). Values of different methods are
in different units: compare rankings, not numbers, across methods.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax

from planners.indicator.gradient import gradient_omega
from planners.indicator.gvar import GvarConfig, gvar_omega
from planners.indicator.hessian import hessian_omega, hutchinson_traces
from planners.indicator.payload_cost import check_payload
from planners.indicator.probes import (
  GRADIENT_STATS,
  PROBED_PRECISIONS,
  collect,
  forward_op_policy,
  mean_over_batches,
  op_order,
)
from planners.indicator.random_ind import random_omega
from planners.indicator.wvar import wvar_omega
from planners.ops import grouped_conv
from qsync_jax.errors import QsyncError
from qsync_jax.jsonio import parse_json, read_text, write_text_atomic
from qsync_jax.precision import QUANTIZED_PRECISIONS, OpPolicy
from qsync_jax.train.task import Task

FORMAT = "qsync-indicator/1"
METHODS = ("gradient", "gvar", "wvar", "hessian", "random")
"""``gradient`` is ours (``gradient.py``); the others are QSync's GVAR and the baselines."""


def _check(methods: Sequence[str], precisions: Sequence[str]) -> None:
  for m in methods:
    if m not in METHODS:
      raise QsyncError(f"indicator method {m!r} is unknown. Fix: use one of {list(METHODS)}.")
  for p in precisions:
    if p not in PROBED_PRECISIONS:
      raise QsyncError(
        f"indicator precision {p!r} cannot be scored. Fix: use some of {list(PROBED_PRECISIONS)} (fp32 is 0)."
      )


def compute(
  task: Task,
  variables,
  batches: Iterable[Any],
  methods: Sequence[str] = ("gradient",),
  precisions: Sequence[str] = PROBED_PRECISIONS,
  seed: int = 0,
  hutchinson_samples: int = 2,
  op_policy_for: Callable[[str], OpPolicy] = forward_op_policy,
  gvar_config: GvarConfig = GvarConfig(),
  gradient_estimator: str = "moments",
  loss_batch_size: int | None = None,
  progress: Callable[[int, int], None] | None = None,
) -> dict[str, dict[str, Any]]:
  """``{method: table}`` for each of ``methods`` from one probing pass over ``batches``.

  Args:
    task: the training task (its model runs unmodified; its training loss is probed).
    variables: the model's variables (``{"params": ..., "batch_stats": ...}``), ideally of a
      model trained for a while in fp32 (gradients of a fresh init say little).
    batches: training batches (~4-10); every method averages over them.
    methods: names from ``METHODS``.
    precisions: precisions to score (fp32 is always 0).
    seed: seeds the Hessian's Rademacher vectors, the training RNG streams and ``random``.
    hutchinson_samples: Hessian-vector products per batch for ``hessian``.
    op_policy_for: precision → the op policy whose measured δY ``gradient`` scores
      (default: that precision in the forward product only).
    gvar_config: GVAR's constants and documented choices.
    gradient_estimator: ``moments`` (default: E[ΔL²] of a batch), ``sample``, ``batch`` or
      ``signed``; see ``gradient.py``.
    loss_batch_size: for ``moments``, the batch size B whose loss change Ω predicts
      (default: the size of ``batches``). Use many batches (~16-32): the mean loss change is
      estimated from all probed samples together, and its noise falls as 1/√samples.
    progress: ``progress(done, total)`` after each probed batch.
  """
  precisions = tuple(precisions)
  _check(methods, precisions)
  batches = list(batches)
  # the gradient indicator alone reads three stats: the others (weight probes, quantized weights) are not traced
  stats = GRADIENT_STATS if set(methods) <= {"gradient"} else None
  calls, per_batch = collect(task, variables, batches, precisions, op_policy_for, seed, progress, stats)
  order = op_order(calls)
  float_only = {c.name for c in calls if grouped_conv(c.kind, c.lhs_shape, c.rhs_shape)}
  tables = {}
  for method in methods:
    if method == "gradient":
      omega = gradient_omega(calls, per_batch, precisions, gradient_estimator, loss_batch_size)
    elif method == "gvar":
      omega = gvar_omega(calls, per_batch, precisions, gvar_config)
    elif method == "wvar":
      omega = wvar_omega(calls, per_batch, precisions)
    elif method == "hessian":
      traces = hutchinson_traces(task, variables, batches, calls, hutchinson_samples, seed)
      omega = hessian_omega(calls, traces, mean_over_batches(per_batch), precisions)
    else:
      omega = random_omega(calls, per_batch, precisions, seed)
    tables[method] = make_table(method, omega, order, precisions, task.name, len(batches), float_only)
    if method == "gradient":
      tables[method]["metadata"]["estimator"] = gradient_estimator
      tables[method]["metadata"]["loss_batch_size"] = loss_batch_size
  return tables


NO_8BIT_REASON = "a grouped (depthwise) convolution, which no 8-bit kernel runs"
"""Why a table's op has no 8-bit entries (8-bit convolutions are GEMMs over ungrouped patches)."""


def make_table(
  method: str, omega, order: Sequence[str], precisions, task_name: str, n_batches: int, float_only=()
) -> dict:
  """The JSON table of ``omega`` ({op: {precision: value}}), fp32 = 0 added, ops in ``order``; the
  ops of ``float_only`` (grouped convolutions: no 8-bit leg runs them) without 8-bit entries."""
  return {
    "format": FORMAT,
    "method": method,
    "precisions": ["fp32", *precisions],
    "ops": list(order),
    "omega": {
      op: {
        "fp32": 0.0,
        **{
          p: float(omega[op][p]) for p in precisions if op not in float_only or p not in QUANTIZED_PRECISIONS
        },
      }
      for op in order
    },
    "metadata": {
      "task": task_name,
      "batches": n_batches,
      "no_8bit": {op: NO_8BIT_REASON for op in order if op in float_only},
      "depth": {op: i for i, op in enumerate(order)},
      "jax_version": jax.__version__,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    },
  }


def unreached_ops(table: Mapping[str, Any]) -> list[str]:
  """The ops of ``table`` whose Ω is exactly 0 at every precision but fp32: at the probed parameters
  their output does not reach the loss (a residual branch whose last norm starts at scale 0, say),
  so the table says nothing of them. Equivalent to::

    [op for op in table["ops"] if all(v == 0 for p, v in table["omega"][op].items() if p != "fp32")]
  """
  return [
    op
    for op in table["ops"]
    if all(v == 0 for p, v in table["omega"][op].items() if p != "fp32") and len(table["omega"][op]) > 1
  ]


def unreached_note(table: Mapping[str, Any], train_steps: int) -> str | None:
  """One line on ``unreached_ops`` (None where there are none), with the fix where the table was
  probed at the initial parameters (``train_steps`` 0)."""
  ops = unreached_ops(table)
  if not ops:
    return None
  fix = (
    " Fix: probe after training, e.g. --train-steps 40 (at initialisation a zero-initialised norm scale "
    "cuts a residual branch off the loss)."
    if train_steps == 0
    else ""
  )
  return (
    f"{len(ops)} of {len(table['ops'])} ops score Ω = 0 at every precision ({', '.join(ops[:3])}"
    f"{', …' if len(ops) > 3 else ''}): their output does not reach the loss at the probed parameters, so "
    f"the table cannot rank them.{fix}"
  )


def save(table: dict, path: str | os.PathLike) -> None:
  """Writes ``table`` to ``path`` atomically (``write_text_atomic``)."""
  write_text_atomic(path, json.dumps(table, indent=1) + "\n", "indicator table", QsyncError)


def load(path: str | os.PathLike) -> dict:
  """A table saved by ``save``; raises ``QsyncError`` naming what is wrong with the file."""
  path = os.fspath(path)
  table = parse_json(read_text(path, "indicator table", QsyncError), path, QsyncError)
  if not isinstance(table, dict) or table.get("format") != FORMAT or not isinstance(table.get("omega"), dict):
    raise QsyncError(
      f"indicator table {str(path)!r} is not a {FORMAT} table (needs keys format, omega). "
      "Fix: write it with `qsync indicator --out FILE`."
    )
  check_values(table, str(path))
  return table


def check_values(table: Mapping[str, Any], source: str) -> None:
  """Raises ``QsyncError`` naming ``source`` unless every Ω of ``table`` (a table of ``save``, or a
  bare ``{op: {precision: Ω}}``) is a finite number, and some Ω other than fp32's is at least 0.
  A NaN or infinite Ω (the probed loss was not finite: a diverged or broken model) would make
  every plan's accuracy cost NaN and the ranking of precisions meaningless; so would a table whose
  every Ω is negative (the planners count Ω above 0). A ``payload`` section (the gradient syncs'
  measured accuracy costs) must be one ``planners.indicator.payload_cost`` writes."""
  omega = table.get("omega", table) if isinstance(table, Mapping) else None
  bad = []
  for op, row in omega.items() if isinstance(omega, Mapping) else ():
    for precision, value in row.items() if isinstance(row, Mapping) else ():
      number = isinstance(value, (int, float)) and not isinstance(value, bool)
      if not number or not math.isfinite(value):
        bad.append(f"{op}[{precision}]={value!r}")
  if bad:
    listed = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    raise QsyncError(
      f"indicator table {source!r} has Ω that are not finite numbers: {listed}. The loss probed to score "
      "them was not finite (a diverged model, or a loss that overflows at its initial parameters). Fix: "
      "run `qsync indicator` again on a model whose fp32 training loss is finite (fewer --train-steps, "
      "another --seed, or a fixed model)."
    )
  scores = [
    value
    for row in (omega.values() if isinstance(omega, Mapping) else ())
    if isinstance(row, Mapping)
    for precision, value in row.items()
    if precision != "fp32"
  ]
  if isinstance(table, Mapping) and "payload" in table:
    check_payload(table["payload"], source)
  if scores and max(scores) < 0:
    raise QsyncError(
      f"indicator table {source!r}: every Ω is below 0 (from {min(scores):.3g} to {max(scores):.3g}), as if "
      "every precision lowered the loss; a planner counts only Ω above 0, so every plan would cost nothing "
      "and no op would rank above another. The signed estimator gives such tables on a model still "
      "training. Fix: score sensitivities with `qsync indicator --estimator moments` (the default), or "
      "score a trained model (--train-steps N)."
    )


def initial_variables(task, seed: int, train_steps: int, batch_size: int, optimizer=None):
  """The variables the indicator scores: ``qsync_jax.Trainer``'s initial ones for ``seed``, after
  ``train_steps`` fp32 steps on one device (global batch ``batch_size``, ``optimizer``: by default
  AdamW with learning rate 3e-3 and weight decay 1e-4); ``train_steps=0`` gives the initial ones."""
  import jax
  import optax

  from qsync_jax.cluster import ClusterSpec
  from qsync_jax.train.trainer import Trainer

  # The group's device type only bounds the precisions a plan may use; this fp32 plan runs anywhere.
  cluster = ClusterSpec.uniform("cpu", 1, batch_size)
  optimizer = optimizer if optimizer is not None else optax.adamw(3e-3, weight_decay=1e-4)
  trainer = Trainer(task, cluster, optimizer=optimizer, seed=seed, devices=jax.devices()[:1])
  trainer.run(train_steps)
  return trainer.program.variables_of(trainer.state)
