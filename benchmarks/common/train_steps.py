"""Trainer steps of ``benchmarks.multigpu`` built and run outside the ``Trainer``: the program of
a plan on the first local devices (``build_program``) and a closure that takes its steps one
after another (``stepper``), timed each waited for (``time_steps``) or back to back
(``pipelined_step_s``)."""

from __future__ import annotations

import jax
import numpy as np

from planners.profiler.timing import PIPELINED_CLOCK, timed_ms
from qsync_jax.cluster import ClusterSpec
from qsync_jax.plan import Plan
from qsync_jax.train.train_step import make_train_step


def stepper(step, state, batches, key=None):
  """``(run, current)``: ``run()`` takes the next training step — batch ``i % len(batches)``, and
  with ``key`` its ``fold_in(key, i)`` — on the state the previous one returned, and returns
  the new state; ``current()`` is the latest state."""
  box = {"state": state, "i": 0}

  def run():
    i = box["i"]
    args = (box["state"], batches[i % len(batches)]) + (() if key is None else (jax.random.fold_in(key, i),))
    box["state"], _ = step(*args)
    box["i"] = i + 1
    return box["state"]

  return run, lambda: box["state"]


def build_program(task, cluster: ClusterSpec, plan: Plan, optimizer, grad_sync=None, leaf_order="auto"):
  """``(train step, first state, 3 sharded batches)`` of the trainer on the first
  ``cluster.num_devices`` devices under ``plan``."""
  ts = make_train_step(
    task,
    cluster,
    plan,
    optimizer,
    grad_sync,
    devices=jax.devices()[: cluster.num_devices],
    sync_leaf_order=leaf_order,
  )
  host = task.train_batches(cluster.global_batch, 0)
  batches = [ts.shard(next(host)) for _ in range(3)]
  return ts, ts.init(0, next(task.train_batches(cluster.global_batch, 0))), batches


def time_steps(step, state, batches, steps: int, key=None):
  """Median and IQR (s) of ``steps`` steps after two warm-up steps, each waited for
  (``stepper``); returns the last state."""
  run, current = stepper(step, state, batches, key)
  med, samples = timed_ms(run, steps, warmup=2)
  q1, q3 = np.percentile(samples, [25, 75])
  return med / 1e3, float(q3 - q1) / 1e3, current()


def pipelined_step_s(step, state, batches, steps: int):
  """``(s per step, last state)`` of ``steps`` steps dispatched back to back and waited for
  once, as a training loop runs them (``planners.profiler.timing.PIPELINED_CLOCK``): the host's dispatch
  of one step overlaps the devices' work on the one before, which ``time_steps`` (one wait per
  step) does not allow."""
  run, current = stepper(step, state, batches)
  ms, _ = timed_ms(run, steps, warmup=1, clock=PIPELINED_CLOCK)
  return ms / 1e3, current()
